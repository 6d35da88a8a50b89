"""Remote (HTTP) rewards against real servers on loopback: `launch/reward_server.py` wrapping
Python scoring functions, plus raw servers that misbehave (slow, dead, garbage answers).

Contract (DESIGN.md section 9): a server that does not answer, or answers garbage, is retried
with exponential backoff and then fails the call loudly; no reward is ever made up.
"""
import base64
import importlib.util
import io
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from digen_jax.rewards import RemoteRewardError, RemoteScorer, get_reward, remote

_spec = importlib.util.spec_from_file_location(
    "reward_server", os.path.join(os.path.dirname(__file__), "..", "launch", "reward_server.py"))
reward_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reward_server)


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
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
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


def test_server_cli_help_and_function_loading(capsys):
    with pytest.raises(SystemExit):
        reward_server.main(["--help"])
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
