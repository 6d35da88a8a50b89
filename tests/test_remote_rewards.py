"""Remote (HTTP) rewards against real servers on loopback: the reward server
(`digen_jax/reward_server.py`, run by `launch/reward_server.py`) wrapping Python scoring functions, plus raw servers that misbehave (slow, dead, garbage answers).

Contract (docs/design.md section 9): a server that does not answer, or answers garbage, is retried
with exponential backoff and then fails the call loudly; no reward is ever made up.
"""
import base64
import importlib.util
import io
import json
import os
import re
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from digen_jax.rewards import RemoteRewardError, RemoteScorer, get_reward, remote

try:
    from digen_jax import reward_server

    # The command line (`main`) lives in the launcher, a script rather than a module.
    _spec = importlib.util.spec_from_file_location(
        "reward_server_cli", os.path.join(os.path.dirname(__file__), "..", "launch", "reward_server.py"))
    reward_server_cli = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(reward_server_cli)
except ModuleNotFoundError as e:  # the server's uvicorn: in requirements.txt, not in every image
    if e.name != "uvicorn":
        raise
    reward_server = reward_server_cli = None
# The client's tests run without the server; these need it.
needs_server = pytest.mark.skipif(reward_server is None, reason="the reward server needs uvicorn (requirements.txt)")


def mean_pixel_score(images, prompts, metadata):
    """A scoring function to serve: mean pixel value plus the prompt length and a metadata bias."""
    return [float(im.mean()) + len(p) + m.get("bias", 0) for im, p, m in zip(images, prompts, metadata)]


class Serving:
    """Runs a server on a free loopback port in a thread for the duration of a `with`."""

    def __init__(self, server):
        self.server = server
        host, port = server.server_address[:2]
        self.url = f"http://{host}:{port}/score"

    def __enter__(self):
        poll = (0.05,) if isinstance(self.server, socketserver.BaseServer) else ()  # the raw servers' stop check
        self.thread = threading.Thread(target=self.server.serve_forever, args=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _raw_server(answer):
    """A server whose POST handler is `answer(handler)`: for faults the reference server never makes."""
    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            hits.append(time.monotonic())
            answer(self)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler), hits


def _send_json(handler, payload, status=200):
    body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client timed out first (the slow server's point)


def _images(batch=5):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(batch, 12, 20, 3), dtype=np.uint8)


@needs_server
def test_round_trip_through_reference_server():
    images = _images(5)
    prompts = ["a", "bb", "ccc", "", "dddd"]
    metadata = [{"bias": np.float32(i)} for i in range(5)]  # numpy scalars travel as JSON numbers
    with Serving(reward_server.make_server(mean_pixel_score)) as serving:
        fn = get_reward("remote", url=serving.url, batch_size=2, max_concurrency=2)  # 3 requests, 2 in flight
        got = fn(images, prompts, metadata)
        want = mean_pixel_score(images, prompts, [{"bias": i} for i in range(5)])
        np.testing.assert_allclose(got, want, rtol=1e-6)  # PNG is lossless
        assert got.dtype == np.float32 and got.shape == (5,)
        # Floats in [0, 1] quantise like every reward; JPEG is lossy but close.
        jpeg = RemoteScorer(serving.url, image_format="jpeg")(images / 255.0, prompts, metadata)
        np.testing.assert_allclose(jpeg, want, atol=3.0)
        with pytest.raises(ValueError, match="JSON-serialisable"):
            fn(images[:1], ["a"], [{"bad": object()}])


def test_concurrency_limit_holds():
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def answer(handler):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.1)
        with lock:
            state["now"] -= 1
        _send_json(handler, {"scores": [7.0]})

    server, hits = _raw_server(answer)
    with Serving(server) as serving:
        got = RemoteScorer(serving.url, batch_size=1, max_concurrency=2)(_images(6), ["p"] * 6, [{}] * 6)
    np.testing.assert_array_equal(got, [7.0] * 6)
    assert len(hits) == 6 and state["peak"] == 2  # parallel, never more than the limit


@needs_server
def test_reference_server_refuses_bad_requests_and_bad_scores():
    def nan_scores(images, prompts, metadata):
        return [float("nan")] * len(images)

    with Serving(reward_server.make_server(nan_scores)) as serving:
        request = lambda body: _post(serving.url, body)  # noqa: E731
        assert request(b"not json")[0] == 400
        gif = {"version": 1, "images": [{"format": "gif", "data": ""}], "prompts": [""]}
        assert request(json.dumps(gif).encode())[0] == 400
        status, answer = request(remote.request_body(_images(2), ["a", "b"], [{}, {}]))
        assert status == 500 and "non-finite" in answer["error"]
        with pytest.raises(RemoteRewardError, match="HTTP 500.*non-finite"):
            RemoteScorer(serving.url, retries=1, backoff=0)(_images(2), ["a", "b"], [{}, {}])


def _post(url, body):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_slow_server_times_out_retries_with_backoff_then_fails():
    server, hits = _raw_server(lambda h: (time.sleep(0.6), _send_json(h, {"scores": [1.0]})))
    waits = []
    with Serving(server) as serving:
        record = lambda s: (waits.append(s), time.sleep(s))  # noqa: E731
        fn = RemoteScorer(serving.url, timeout=0.2, retries=2, backoff=0.05, sleep=record)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"after 3 attempt\(s\).*timeout 0.2s.*(timed out|Timeout)"):
            fn(_images(1), ["a"], [{}])
        assert time.monotonic() - start < 0.6 * 3  # gave up on each attempt at the timeout
    assert len(hits) == 3 and waits == [0.05, 0.1]  # exponential backoff between attempts


def test_dead_server_fails_loudly():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = RemoteScorer(f"http://127.0.0.1:{port}/score", retries=2, backoff=0)
    with pytest.raises(RemoteRewardError, match=r"after 3 attempt\(s\).*(refused|ConnectionRefusedError)"):
        fn(_images(2), ["a", "b"], [{}, {}])


@pytest.mark.parametrize("payload,message", [
    ({"scores": [1.0]}, "1 scores for 2 images"),
    ({"scores": [1.0, "high"]}, "score 1 is 'high', not a number"),
    ('{"scores": [1.0, NaN]}', "score 1 is nan, not finite"),
    ({"scores": [1.0, 1e308]}, "score 1 is 1e+308, not finite in float32"),  # finite in float64 only
    ("<html>oops</html>", "not JSON"),
    ({"rewards": [1.0, 2.0]}, "no 'scores' list"),
])
def test_malformed_answers_are_retried_then_fail(payload, message):
    server, hits = _raw_server(lambda h: _send_json(h, payload))
    with Serving(server) as serving:
        with pytest.raises(RemoteRewardError, match=f"after 2 attempt.*malformed answer: .*{re.escape(message)}"):
            RemoteScorer(serving.url, retries=1, backoff=0)(_images(2), ["a", "b"], [{}, {}])
    assert len(hits) == 2


def test_flaky_server_recovers_within_budget():
    calls = []

    def answer(handler):
        calls.append(1)
        if len(calls) < 3:
            _send_json(handler, {"error": "warming up"}, status=503)
        else:
            _send_json(handler, {"scores": [0.5, 0.25]})

    server, _ = _raw_server(answer)
    with Serving(server) as serving:
        got = RemoteScorer(serving.url, retries=2, backoff=0)(_images(2), ["a", "b"], [{}, {}])
    np.testing.assert_array_equal(got, [0.5, 0.25])


def test_client_errors_are_not_retried_and_options_are_checked():
    server, hits = _raw_server(lambda h: _send_json(h, {"error": "bad image"}, status=400))
    with Serving(server) as serving:
        with pytest.raises(RemoteRewardError, match="HTTP 400: .*bad image"):
            RemoteScorer(serving.url, retries=3, backoff=0)(_images(1), ["a"], [{}])
    assert len(hits) == 1
    with pytest.raises(ValueError, match="needs the option url"):
        get_reward("remote")
    with pytest.raises(ValueError, match="option retries must be an integer >= 0"):
        get_reward("remote", url="http://127.0.0.1:1/score", retries=-1)
    with pytest.raises(ValueError, match="option timeout must be > 0"):
        RemoteScorer("http://127.0.0.1:1/score", timeout=0)


@needs_server
def test_server_cli_help_and_function_loading(capsys):
    with pytest.raises(SystemExit):
        reward_server_cli.main(["--help"])
    assert "module:function" in capsys.readouterr().out
    fn = reward_server.load_function("digen_jax.rewards.jpeg:jpeg_size_kb")
    assert callable(fn)
    with pytest.raises(ValueError, match="module:function"):
        reward_server.load_function("no_colon")
    # The decoder accepts what the client encodes, JPEG included.
    image = _images(1)
    body = remote.request_body(image, ["p"], [{"k": 1}], image_format="jpeg")
    decoded, prompts, metadata = reward_server.decode_request(body)
    assert decoded.shape == image.shape and prompts == ["p"] and metadata == [{"k": 1}]
    png = base64.b64decode(json.loads(remote.request_body(image, ["p"], [{}]))["images"][0]["data"])
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(png))), image[0])


class Trickler:
    """A raw TCP server that answers each connection with `answer`: `head` bytes at once, then the
    rest one byte every `interval` seconds (a socket timeout, reset by each byte, never trips)."""

    def __init__(self, answer: bytes, head: int = 0, interval: float = 0.05):
        self.answer, self.head, self.interval = answer, head, interval
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/score"
        self.stop, self.served = threading.Event(), []

    def _serve(self, conn):
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(1 << 16)  # the request (small; its content does not matter here)
                conn.sendall(self.answer[: self.head])
                for i in range(self.head, len(self.answer)):
                    if self.stop.wait(self.interval):
                        return
                    conn.sendall(self.answer[i : i + 1])
                self.served.append(time.monotonic())
            except OSError:
                pass  # the client gave up

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed by __exit__
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.listener.close()


_SCORES = b'{"scores": [1.5]}' + b" " * 60
_ANSWER = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_SCORES)


@pytest.mark.parametrize("head", [0, len(_ANSWER)], ids=["trickled-headers", "trickled-body"])
def test_timeout_is_a_deadline_for_the_whole_attempt(head):
    # The whole answer takes about 140 bytes * 0.05 s = 7 s (4 s from the body on), well past the
    # timeout, but no single read waits longer than 0.05 s.
    with Trickler(_ANSWER + _SCORES, head=head) as server:
        fn = RemoteScorer(server.url, timeout=0.5, retries=1, backoff=0)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"after 2 attempt\(s\).*timed out"):
            fn(_images(1), ["a"], [{}])
        elapsed = time.monotonic() - start
    assert elapsed < 2 * 0.5 + 3, elapsed  # two attempts of 0.5 s, with slack for a loaded machine
    assert not server.served
    # The same answer at full speed is fine: the deadline, not the trickle, is what fails.
    with Trickler(_ANSWER + _SCORES, head=len(_ANSWER) + len(_SCORES)) as server:
        np.testing.assert_array_equal(RemoteScorer(server.url, timeout=5)(_images(1), ["a"], [{}]), [1.5])


@pytest.mark.parametrize("declare_length", [True, False])
def test_oversized_answers_are_refused(declare_length):
    # A valid answer padded to 1 MB: far more than one score needs (default cap: 4 KiB per image of
    # a request of batch_size=16, plus 64 KiB).
    padded = json.dumps({"scores": [1.0], "padding": "x" * (1 << 20)})

    def answer(handler):
        body = padded.encode()
        handler.send_response(200)
        if declare_length:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        try:
            handler.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading at its cap

    server, hits = _raw_server(answer)
    with Serving(server) as serving:
        message = r"Content-Length \d+ over" if declare_length else "longer than"
        failure = f"after 2 attempt.*malformed answer: {message} max_answer_bytes=131072"
        with pytest.raises(RemoteRewardError, match=failure):
            RemoteScorer(serving.url, retries=1, backoff=0)(_images(1), ["a"], [{}])
        # The cap is an option, proportional to the batch by default.
        got = RemoteScorer(serving.url, max_answer_bytes=2 << 20)(_images(1), ["a"], [{}])
    np.testing.assert_array_equal(got, [1.0])
    assert len(hits) == 3
    assert RemoteScorer(serving.url, batch_size=64).max_answer_bytes == 64 * 4096 + 65536
    with pytest.raises(ValueError, match="option max_answer_bytes must be an integer >= 1"):
        RemoteScorer(serving.url, max_answer_bytes=0)


class Recorder:
    """A raw TCP listener that records what each connection sends (the request head and what
    arrived with it), answers `answer(port)` and closes."""

    def __init__(self, answer=lambda port: _ANSWER + _SCORES):
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/score"
        self.requests = []

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed by __exit__
            with conn:
                conn.settimeout(5)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(1 << 16)):
                        data += chunk
                    self.requests.append(data)
                    conn.sendall(self.answer(self.port))
                except OSError:
                    pass

    def headers(self, i: int) -> dict:
        head = self.requests[i].partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
        return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.listener.close()


def test_server_token_in_the_environment_is_not_sent(monkeypatch):
    # The server's own secret, exported where the client runs, stays unsent unless an option names it.
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "server-secret")
    with Recorder() as server:
        np.testing.assert_array_equal(RemoteScorer(server.url)(_images(1), ["a"], [{}]), [1.5])
        RemoteScorer(server.url, token_env="REWARD_SERVER_TOKEN")(_images(1), ["a"], [{}])
    assert "authorization" not in server.headers(0)
    assert server.headers(1)["authorization"] == "Bearer server-secret"


@pytest.mark.parametrize("url,options,refused", [
    ("http://10.1.2.3:18085/score", {"token": "t"}, True),
    ("http://scorer.example:18085/score", {"token": "t"}, True),
    ("http://10.1.2.3:18085/score", {"token": "t", "allow_insecure": True}, False),
    ("http://10.1.2.3:18085/score", {}, False),  # no credential to protect
    ("https://10.1.2.3:18085/score", {"token": "t"}, False),
    ("http://127.0.0.2:18085/score", {"token": "t"}, False),
    ("http://localhost:18085/score", {"token": "t"}, False),
    ("http://[::1]:18085/score", {"token": "t"}, False),
])
def test_token_goes_over_plain_http_only_to_loopback(url, options, refused):
    if refused:
        with pytest.raises(ValueError, match=r"plain http to a host that is not loopback.*use https://.*"
                                             r"allow_insecure=True"):
            RemoteScorer(url, **options)
    else:
        assert RemoteScorer(url, **options).url == url


def test_url_checks():
    with pytest.raises(ValueError, match="must not hold a user or password"):
        RemoteScorer("http://user:secret@127.0.0.1:1/score")
    for url in ("ftp://127.0.0.1/score", "127.0.0.1:18085/score", "http:///score"):
        with pytest.raises(ValueError, match="option url must be http://"):
            RemoteScorer(url)


def test_redirects_are_not_followed():
    # A 302 to another origin (another host name and port) on loopback: the second listener must
    # receive nothing, least of all the token; the call fails at once, naming where it pointed.
    with Recorder() as target:
        elsewhere = f"http://localhost:{target.port}/score"
        redirect = (b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % elsewhere.encode())
        with Recorder(lambda port: redirect) as server:
            with pytest.raises(RemoteRewardError, match=rf"after 1 attempt\(s\).*HTTP 302: redirect to {elsewhere}"):
                RemoteScorer(server.url, token="t", retries=2, backoff=0)(_images(1), ["a"], [{}])
            assert server.headers(0)["authorization"] == "Bearer t"
        time.sleep(0.1)
    assert target.requests == []


# A TLS record header announcing 16 KiB, then bytes that never complete it.
_TLS_RECORD = b"\x16\x03\x03\x40\x00" + b"\x00" * 100


@pytest.mark.parametrize("answer,head,interval", [(b"\x00", 0, 60.0), (_TLS_RECORD, 5, 0.05)],
                         ids=["silent", "trickled-handshake"])
def test_tls_handshake_is_within_the_deadline(answer, head, interval):
    # An https server that accepts TCP, then never completes the handshake: silent, or sending a
    # record byte every 0.05 s (no socket read waits long, the whole record takes 5 s).
    with Trickler(answer, head=head, interval=interval) as server:
        fn = RemoteScorer(server.url.replace("http://", "https://"), token="t", timeout=0.5, retries=0)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"after 1 attempt\(s\).*timed out"):
            fn(_images(1), ["a"], [{}])
        assert time.monotonic() - start < 0.5 + 2.0
