"""The reference reward server (`digen_jax/reward_server.py`, run by `launch/reward_server.py`) against hostile and heavy traffic on
loopback: requests too large to decode or to read, malformed HTTP, stalled and trickling
connections, more connections than workers, a scorer that fails, clients without the token.

Contract: every request gets a JSON answer with a 4xx/5xx status (never a dropped connection,
never the scorer's internal error text), memory and threads stay bounded per request, and a
burst of connections is queued and answered, not reset.
"""
import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile
from test_remote_rewards import Serving, _images, _post, mean_pixel_score, reward_server, reward_server_cli

from digen_jax.rewards import RemoteRewardError, RemoteScorer, remote

if reward_server is None:
    pytest.skip("the reward server needs uvicorn (requirements.txt)", allow_module_level=True)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _exchange(port: int, data: bytes, *, timeout: float = 10.0):
    """Send raw bytes and read one HTTP answer (as far as its Content-Length): (status, its JSON
    body, or its raw body when that is not JSON), or (None, raw bytes) when the server closed
    without an HTTP answer."""
    raw = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        try:
            while b"\r\n\r\n" not in raw and (chunk := s.recv(1 << 16)):
                raw += chunk
            head = raw.partition(b"\r\n\r\n")[0].lower()
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else None
            while (length is None or len(raw) - len(head) - 4 < length) and (chunk := s.recv(1 << 16)):  # or to EOF
                raw += chunk
        except ConnectionResetError:
            pass
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/"):
        return None, raw
    try:
        return int(head.split()[1]), json.loads(body)
    except ValueError:
        return int(head.split()[1]), body


def _request(body: bytes, *, headers: str = "") -> bytes:
    return (f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def _port(serving) -> int:
    return serving.server.server_address[1]


def _png(width: int, height: int) -> bytes:
    """A valid 1-bit grayscale PNG of zeros: 12000x12000 compresses to about 20 KB."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * height, 9))
            + chunk(b"IEND", b""))


def _body_with(pngs: list[bytes]) -> bytes:
    images = [{"format": "png", "data": base64.b64encode(p).decode()} for p in pngs]
    return json.dumps({"version": 1, "images": images, "prompts": [""] * len(pngs)}).encode()


def _recording(calls):
    def score(images, prompts, metadata):
        calls.append(images.shape)
        return mean_pixel_score(images, prompts, metadata)
    return score


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's own, at 89M pixels
def test_decoded_pixel_budget_refuses_a_small_bomb_before_decoding(monkeypatch):
    bomb = _png(12000, 12000)
    assert len(bomb) < 64 << 10  # a small request that would decode to 432 MB of RGB
    calls, decoded = [], []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: (decoded.append(im.size), load(im))[1])
    with Serving(reward_server.make_server(_recording(calls))) as serving:
        status, answer = _post(serving.url, _body_with([bomb]))
        assert status == 413 and "--max_pixels=33554432" in answer["error"]
        assert decoded == []  # refused from the PNG header alone
        # The budget is per request, summed over its images, and exact.
        two = remote.request_body(_images(2), ["a", "b"], [{}, {}])
    with Serving(reward_server.make_server(_recording(calls), max_pixels=2 * 12 * 20)) as serving:
        assert _post(serving.url, two)[0] == 200
    with Serving(reward_server.make_server(_recording(calls), max_pixels=2 * 12 * 20 - 1)) as serving:
        status, answer = _post(serving.url, two)
        assert status == 413 and "480 pixels" in answer["error"]
    assert calls == [(2, 12, 20, 3)]  # the scorer saw only the request within budget
    assert set(decoded) == {(20, 12)}  # only the images within budget were decoded


def test_pil_decompression_bomb_is_answered_not_dropped(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL refuses images over twice this
    with Serving(reward_server.make_server(mean_pixel_score)) as serving:
        status, answer = _exchange(_port(serving), _request(remote.request_body(_images(1), ["a"], [{}])))
    assert status == 413 and "too large to decode" in answer["error"]


def test_body_cap():
    with Serving(reward_server.make_server(mean_pixel_score)) as serving:
        # 1 GiB announced, nothing sent: refused at once instead of waiting for (and holding) it.
        start = time.monotonic()
        announced = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n"
        status, answer = _exchange(_port(serving), announced)
        assert status == 413 and "limit of 67108864" in answer["error"]
        assert time.monotonic() - start < 5
    with Serving(reward_server.make_server(mean_pixel_score, max_body_bytes=1000)) as serving:
        assert _exchange(_port(serving), _request(b"x" * 1001))[0] == 413
        # A client still sending a large body reads the answer instead of a reset connection.
        assert _exchange(_port(serving), _request(b"x" * (16 << 20)))[0] == 413
        status, answer = _exchange(_port(serving), _request(b"x" * 1000))  # read, then found not JSON
        assert status == 400 and "not JSON" in answer["error"]


@pytest.mark.parametrize("data,status,message", [
    (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, b"Invalid HTTP request"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400, b"Invalid HTTP request"),
    ("POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"), 400,
     b"Invalid HTTP request"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length header is required"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411, "not Transfer-Encoding"),
    (_request(b"[" * 100_000), 400, "nested too deeply"),
    (_request(b'{"version": 1, "images": [{"format": "png", "data": "AAAA"}], "prompts": [""]}'), 400,
     "image 0 does not decode as png"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\nX: " + b"y" * (20 << 10), 400, b"Invalid HTTP request"),  # never ends
    (b"BREW /score HTTP/1.1\r\nHost: x\r\n\r\n", 405, "BREW /score is not served; POST it"),
    (b"GET /score HTTP/1.1\r\nHost: x\r\n\r\n", 405, "GET /score is not served; POST it"),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "unknown path"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}", 408, "did not arrive within 0.5 s"),
    (b"GARBAGE\r\n\r\n", 400, b"Invalid HTTP request"),
    (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400, b"Invalid HTTP request"),  # TLS to plain HTTP
], ids=["length-abc", "length-negative", "length-superscript", "no-length", "chunked", "deep-nesting", "bad-png",
        "endless-header", "bad-method", "get-score", "bad-path", "short-body", "garbage-line", "tls-hello"])
def test_every_malformed_request_gets_an_http_answer(data, status, message):
    """The protocol's refusals are JSON; what is not HTTP at all gets the HTTP layer's 400, with a
    status line (a plain-text body)."""
    errors = []
    with Serving(reward_server.make_server(mean_pixel_score, request_timeout=0.5, errors=errors.append)) as serving:
        got, answer = _exchange(_port(serving), data)
        text = answer if isinstance(message, bytes) else answer["error"]
        assert (got, message in text) == (status, True), answer
        # The server is unharmed.
        assert _post(serving.url, remote.request_body(_images(1), ["a"], [{}]))[0] == 200
    assert not errors  # expected refusals, not internal errors


def test_scorer_failures_stay_in_the_server_log():
    def leaky(images, prompts, metadata):
        raise RuntimeError("cannot read /secret/models/ocr.bin")

    errors = []
    with Serving(reward_server.make_server(leaky, errors=errors.append)) as serving:
        status, answer = _post(serving.url, remote.request_body(_images(1), ["a"], [{}]))
    assert status == 500 and answer == {"error": "the score function failed (details in the server log)"}
    assert len(errors) == 1 and "Traceback" in errors[0] and "/secret/models/ocr.bin" in errors[0]
    # Scores finite in float64 but not in float32 (what the client trains on) are refused too.
    with Serving(reward_server.make_server(lambda im, p, m: [1e308], errors=errors.append)) as serving:
        status, answer = _post(serving.url, remote.request_body(_images(1), ["a"], [{}]))
    assert status == 500 and "non-finite" in answer["error"] and "1e+308" not in answer["error"]


def test_token(monkeypatch):
    token = "s3cret-Token_1"
    monkeypatch.delenv("REWARD_CLIENT_TOKEN", raising=False)
    with Serving(reward_server.make_server(mean_pixel_score, token=token)) as serving:
        body = remote.request_body(_images(1), ["a"], [{}])
        for headers in ("", "Authorization: Bearer wrong\r\n", f"Authorization: Basic {token}\r\n"):
            status, answer = _exchange(_port(serving), _request(body, headers=headers))
            assert status == 401 and "token" in answer["error"]
        assert _exchange(_port(serving), _request(body, headers=f"Authorization: Bearer {token}\r\n"))[0] == 200
        assert _exchange(_port(serving), _request(b"x" * (16 << 20)))[0] == 401  # read out, not reset
        # The client sends its token option, or the variable its token_env option names; a 401 is
        # not retried.
        want = mean_pixel_score(_images(1), ["a"], [{}])
        np.testing.assert_allclose(RemoteScorer(serving.url, token=token)(_images(1), ["a"], [{}]), want)
        with pytest.raises(RemoteRewardError, match=r"after 1 attempt\(s\).*HTTP 401"):
            RemoteScorer(serving.url, retries=2, backoff=0)(_images(1), ["a"], [{}])
        with pytest.raises(ValueError, match=r"token_env names \$REWARD_CLIENT_TOKEN, which is not set"):
            RemoteScorer(serving.url, token_env="REWARD_CLIENT_TOKEN")
        monkeypatch.setenv("REWARD_CLIENT_TOKEN", token)
        np.testing.assert_allclose(RemoteScorer(serving.url, token_env="REWARD_CLIENT_TOKEN")(_images(1), ["a"], [{}]),
                                   want)
        with urlopen_get(serving.url.replace("/score", "/health")) as r:  # health needs no token
            assert r.status == 200
    with pytest.raises(ValueError, match="option token must be"):
        RemoteScorer("http://127.0.0.1:1/score", token="two words")
    with pytest.raises(ValueError, match="token and token_env are exclusive"):
        RemoteScorer("http://127.0.0.1:1/score", token="t", token_env="REWARD_CLIENT_TOKEN")
    with pytest.raises(ValueError, match="--token must be"):
        reward_server.make_server(mean_pixel_score, token="")


def urlopen_get(url, timeout=10):
    import urllib.request

    return urllib.request.urlopen(url, timeout=timeout)


def test_exposure_warning_and_cli(capsys):
    assert reward_server.exposure_warning("127.0.0.1", None) is None
    with_token = reward_server.exposure_warning("0.0.0.0", "t")
    without = reward_server.exposure_warning("0.0.0.0", None)
    assert "plain HTTP" in with_token and "ANYONE" not in with_token and "ANYONE" in without
    assert reward_server.exposure_warning("0.0.0.0", "t", tls=True) is None
    assert "plain HTTP" not in reward_server.exposure_warning("0.0.0.0", None, tls=True)
    # The real command prints it when it binds every interface, before serving.
    env = {k: v for k, v in os.environ.items() if k != reward_server.TOKEN_ENV}
    command = [sys.executable, os.path.join(ROOT, "launch", "reward_server.py"), "--score_fn=builtins:len",
               "--host=0.0.0.0", "--port=0", "--quiet"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert "serving builtins:len on http://0.0.0.0:" in proc.stdout.readline()
        finally:
            proc.kill()
        assert "ANYONE who can reach this port" in proc.stderr.read()
    # --help exits 0 and documents the limits; bad options are one line, not a traceback.
    with pytest.raises(SystemExit) as exit_info:
        reward_server_cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--token", "--workers", "--queue", "--max_body_mb", "--max_pixels", "--request_timeout",
                   reward_server.TOKEN_ENV):
        assert option in text
    with pytest.raises(SystemExit) as exit_info:
        reward_server_cli.main(["--score_fn=builtins:len", "--workers=0"])
    assert exit_info.value.code == 2 and "workers must be an integer >= 1" in capsys.readouterr().err


def test_stalled_connections_are_closed_and_free_their_worker():
    server = reward_server.make_server(mean_pixel_score, workers=2, request_timeout=0.5)
    stop = threading.Event()
    with Serving(server) as serving:
        idle = socket.create_connection(("127.0.0.1", _port(serving)), timeout=10)
        trickling = socket.create_connection(("127.0.0.1", _port(serving)), timeout=10)

        def trickle():  # a header line one byte every 0.05 s: each read is quick, the request never ends
            for byte in b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 1000:
                if stop.wait(0.05):
                    return
                try:
                    trickling.send(bytes([byte]))
                except OSError:
                    return

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            # Both workers are taken by the stalled connections; a good request still gets through
            # once they are dropped at their deadline.
            start = time.monotonic()
            got = RemoteScorer(serving.url, timeout=10, retries=0)(_images(1), ["a"], [{}])
            np.testing.assert_allclose(got, mean_pixel_score(_images(1), ["a"], [{}]))
            for s in (idle, trickling):
                try:  # closed by the server, without waiting for our 10 s timeout
                    while s.recv(1 << 16):
                        pass
                except ConnectionResetError:
                    pass
            assert time.monotonic() - start < 6
        finally:
            stop.set()
            idle.close()
            trickling.close()
            thread.join(5)


def test_full_queue_answers_503_at_once():
    entered, release = threading.Event(), threading.Event()

    def blocking(images, prompts, metadata):
        entered.set()
        release.wait(10)
        return mean_pixel_score(images, prompts, metadata)

    server = reward_server.make_server(blocking, workers=1, queue_size=1)
    body = remote.request_body(_images(1), ["a"], [{}])
    results = []
    with Serving(server) as serving:
        def post():
            results.append(_post(serving.url, body)[0])

        threads = [threading.Thread(target=post) for _ in range(2)]
        threads[0].start()
        assert entered.wait(10)  # the only worker is busy
        threads[1].start()
        deadline = time.monotonic() + 10
        while server.app.requests < 2 and time.monotonic() < deadline:  # the second one waits for the worker
            time.sleep(0.01)
        try:
            start = time.monotonic()
            status, answer = _post(serving.url, body)
            assert status == 503 and "busy" in answer["error"] and time.monotonic() - start < 5
        finally:
            release.set()
            for t in threads:
                t.join(10)
    assert results == [200, 200]  # the busy one and the queued one were both answered


def test_load_100_concurrent_connections_all_answered():
    """100 connections at once against the default settings: all queued (listen backlog, queue),
    none reset, every one answered with its own score, within seconds."""
    n = 100
    server = reward_server.make_server(mean_pixel_score)
    image = _images(1)[:, :8, :8]
    prompts = ["p" * (i % 17) for i in range(n)]
    bodies = [_request(remote.request_body(image, [p], [{"bias": i}]), headers="Connection: close\r\n")
              for i, p in enumerate(prompts)]
    want = [mean_pixel_score(image, [p], [{"bias": i}])[0] for i, p in enumerate(prompts)]
    start = time.monotonic()
    # Every connection is opened (and its request sent) before the server accepts any: the kernel
    # holds them in the listen backlog.
    sockets = [socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=15) for _ in range(n)]
    try:
        for s, body in zip(sockets, bodies):
            s.sendall(body)
        with Serving(server):
            for i, s in enumerate(sockets):
                raw = b""
                while chunk := s.recv(1 << 16):
                    raw += chunk
                head, _, answer = raw.partition(b"\r\n\r\n")
                assert head.split()[1] == b"200", (i, raw[:200])
                np.testing.assert_allclose(json.loads(answer)["scores"], [want[i]], rtol=1e-6)
            # And 100 clients at once through the remote reward itself.
            scorer = RemoteScorer(f"http://127.0.0.1:{server.server_address[1]}/score", batch_size=1,
                                  max_concurrency=n, timeout=15, retries=0)
            images = np.repeat(image, n, axis=0)
            got = scorer(images, prompts, [{"bias": i} for i in range(n)])
            np.testing.assert_allclose(got, want, rtol=1e-6)
    finally:
        for s in sockets:
            s.close()
    assert time.monotonic() - start < 30


def _trickle_headers(port: int, stop: threading.Event, interval: float) -> None:
    """A client that sends a request's headers one byte per `interval`, without a token, until `stop`."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for byte in b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 1000:
            if stop.wait(interval):
                return
            try:
                s.send(bytes([byte]))
            except OSError:
                return


def _get_health(url: str, timeout: float) -> float:
    """Seconds /health took to answer 200."""
    start = time.monotonic()
    with urlopen_get(url.replace("/score", "/health"), timeout=timeout) as r:
        assert r.status == 200
    return time.monotonic() - start


def test_slow_clients_hold_neither_health_nor_fresh_requests():
    # Four unauthenticated connections trickling their headers (more than the workers), under the
    # default 30 s request timeout: /health and a client with the token are answered at once.
    token, stop = "t0ken", threading.Event()
    with Serving(reward_server.make_server(mean_pixel_score, token=token, workers=2)) as serving:
        threads = [threading.Thread(target=_trickle_headers, args=(_port(serving), stop, 0.2), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.6)  # every slow connection is inside its headers
            assert _get_health(serving.url, timeout=3) < 1.0
            start = time.monotonic()
            got = RemoteScorer(serving.url, token=token, timeout=3, retries=0)(_images(1), ["a"], [{}])
            np.testing.assert_allclose(got, mean_pixel_score(_images(1), ["a"], [{}]))
            assert time.monotonic() - start < 2.0
            assert all(t.is_alive() for t in threads)  # still trickling
        finally:
            stop.set()
            for t in threads:
                t.join(5)


def test_abandoned_requests_are_dropped_and_hold_nothing():
    # A scorer that hangs on its first call; a client gives up on four attempts (its timeout). The
    # three attempts still waiting when their client left are dropped unscored, /health answers
    # at once, and a fresh request is scored as soon as the hanging call returns.
    calls, release = [], threading.Event()

    def hanging_once(images, prompts, metadata):
        calls.append(len(images))
        if len(calls) == 1:
            release.wait(10)
        return mean_pixel_score(images, prompts, metadata)

    server = reward_server.make_server(hanging_once)
    with Serving(server) as serving:
        try:
            with pytest.raises(RemoteRewardError, match=r"after 4 attempt\(s\).*timed out"):
                RemoteScorer(serving.url, timeout=0.3, retries=3, backoff=0)(_images(1), ["a"], [{}])
            assert _get_health(serving.url, timeout=3) < 1.0
            deadline = time.monotonic() + 5
            while server.app.requests and time.monotonic() < deadline:  # each hang-up is seen
                time.sleep(0.01)
            assert server.app.requests == 0
            results = []
            fresh = threading.Thread(target=lambda: results.append(
                RemoteScorer(serving.url, timeout=10, retries=0)(_images(1), ["b"], [{}])))
            fresh.start()
            time.sleep(0.2)
            assert calls == [1]  # the first call still hangs; the fresh request waits for it
        finally:
            release.set()
        start = time.monotonic()
        fresh.join(10)
        assert time.monotonic() - start < 2.0
    np.testing.assert_allclose(results[0], mean_pixel_score(_images(1), ["b"], [{}]))
    assert calls == [1, 1]  # the hanging call and the fresh one: nothing abandoned was scored


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


def test_https_with_a_token(certificate, tmp_path):
    cert, key = certificate
    token = "tls-t0ken"
    server = reward_server.make_server(mean_pixel_score, token=token, ssl_certfile=cert, ssl_keyfile=key)
    with Serving(server) as serving:
        url = serving.url.replace("http://", "https://")
        got = RemoteScorer(url, token=token, ca_file=cert)(_images(2), ["a", "b"], [{}, {}])
        np.testing.assert_allclose(got, mean_pixel_score(_images(2), ["a", "b"], [{}, {}]))
        # The certificate is checked: unknown to the system's authorities, it is refused.
        with pytest.raises(RemoteRewardError, match="CERTIFICATE_VERIFY_FAILED"):
            RemoteScorer(url, token=token, retries=0)(_images(1), ["a"], [{}])
        assert _exchange(_port(serving), _request(b"{}"))[0] is None  # plain HTTP gets no answer
    with pytest.raises(ValueError, match="option ca_file=.*cannot be read"):
        RemoteScorer(url, ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="ssl_certfile/ssl_keyfile"):
        reward_server.make_server(mean_pixel_score, ssl_certfile=key, ssl_keyfile=key)


def test_server_imports_no_jax_and_no_other_digen_jax_module():
    # It runs in the scoring model's environment, which need not have JAX (nor digen_jax's other needs).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('s', sys.argv[1]); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'digen_jax')))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "launch", "reward_server.py")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['digen_jax', 'digen_jax.reward_server']"
