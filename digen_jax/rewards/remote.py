"""Remote rewards: score images with a model served over HTTP (OCR, detectors, VLM judges).

Protocol (version 1; JSON both ways, never pickle):

    POST <url>   Content-Type: application/json
    {"version": 1,
     "images":   [{"format": "png" | "jpeg", "data": "<base64 of the encoded file>"}, ...],
     "prompts":  ["...", ...],            # one per image
     "metadata": [{...}, ...]}            # one JSON object per image
    200 -> {"scores": [float, ...]}       # exactly one finite number per image
    other status -> {"error": "..."}      # the client retries, then fails

`launch/reward_server.py` serves any Python scoring function this way.

The client never turns a failure into a reward: a timeout, refused connection, HTTP
error or malformed answer (not JSON, wrong length, a non-number, a number that is not
finite in float32, an answer over `max_answer_bytes`) is retried with exponential backoff,
and after `retries` retries the call raises `RemoteRewardError` naming the server and the
last failure, so the iteration fails loudly and nothing is trained on missing rewards.
`timeout` bounds each attempt as a whole (connect, send, every byte of the answer), not
each socket operation, so a server that trickles its answer cannot hold an attempt longer.
A batch is sent as requests of at most `batch_size` images, at most `max_concurrency` of
them in flight per reward (also across calls from several threads). With a `token` (or
the environment variable REWARD_SERVER_TOKEN) every request carries
`Authorization: Bearer <token>`, which `launch/reward_server.py --token` checks.
"""
from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.client
import io
import json
import math
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

PROTOCOL_VERSION = 1
IMAGE_FORMATS = ("png", "jpeg")
# Client errors that a retry cannot fix; 408 (timeout) and 429 (busy) are retried.
_FATAL_STATUS = frozenset(range(400, 500)) - {408, 429}
TOKEN_ENV = "REWARD_SERVER_TOKEN"
# Default answer cap: room for one score per image many times over, plus headers-sized slack.
_ANSWER_BYTES_PER_IMAGE = 4096
_ANSWER_SLACK_BYTES = 64 * 1024


class RemoteRewardError(RuntimeError):
    """A reward server did not deliver valid scores within the retry budget."""


def encode_image(image: np.ndarray, image_format: str = "png", jpeg_quality: int = 95) -> dict:
    """One (H, W, 3) uint8 image as a protocol image object (lossless PNG or JPEG)."""
    buffer = io.BytesIO()
    if image_format == "png":
        Image.fromarray(image).save(buffer, format="PNG")
    elif image_format == "jpeg":
        Image.fromarray(image).save(buffer, format="JPEG", quality=jpeg_quality)
    else:
        raise ValueError(f"remote reward option image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    return {"format": image_format, "data": base64.b64encode(buffer.getvalue()).decode("ascii")}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metadata value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def request_body(images: np.ndarray, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]], *,
                 image_format: str = "png", jpeg_quality: int = 95) -> bytes:
    """The JSON request for a batch of (B, H, W, 3) uint8 images."""
    payload = {
        "version": PROTOCOL_VERSION,
        "images": [encode_image(im, image_format, jpeg_quality) for im in images],
        "prompts": [str(p) for p in prompts],
        "metadata": [dict(m) for m in metadata],
    }
    try:
        return json.dumps(payload, default=_json_default, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"remote reward: metadata must be JSON-serialisable (no NaN): {e}") from None


def parse_scores(body: bytes, expected: int) -> np.ndarray:
    """(expected,) float32 scores from a response body; ValueError describing any defect."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"answer is not JSON ({e}): {body[:200]!r}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("scores"), list):
        raise ValueError(f"answer has no 'scores' list: {str(payload)[:200]}")
    scores = payload["scores"]
    if len(scores) != expected:
        raise ValueError(f"answer has {len(scores)} scores for {expected} images")
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ValueError(f"score {i} is {s!r}, not a number")
        try:
            finite = math.isfinite(s)
        except OverflowError:  # an integer beyond float range
            finite = False
        if not finite:
            raise ValueError(f"score {i} is {s}, not finite")
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(s)))
        if not finite:  # rewards are float32: 1e308 would arrive as inf
            raise ValueError(f"score {i} is {s}, not finite in float32")
    return np.asarray(scores, np.float32)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out (deadline of the attempt passed)")
    return left


class _DeadlineSocket:
    """A connected socket whose sends and receives all end by one monotonic deadline.

    A socket timeout restarts at every read, so a server sending a byte a second would never
    trip it; here each operation gets only the time left to the deadline. `makefile` readers
    keep the socket open until they close, like `socket.socket.makefile`.
    """

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline
        self._readers, self._closed = 0, False

    def sendall(self, data, *flags):
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.sendall(data, *flags)  # the timeout bounds the whole sendall

    def recv_into(self, buffer, *args):
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.recv_into(buffer, *args)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError(f"deadline socket files are read-only binary, got mode {mode!r}")
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def _reader_closed(self) -> None:
        self._readers -= 1
        if self._closed and not self._readers:
            self._sock.close()

    def close(self) -> None:
        self._closed = True
        if not self._readers:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket):
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._owner.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._owner._reader_closed()
        super().close()


class _DeadlineConnection:
    """Connects within the time left to `deadline`, then hands http.client a `_DeadlineSocket`."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = _remaining(self._deadline)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self._deadline)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineRequest(urllib.request.Request):
    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=req.deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=req.deadline), req,
                            context=self._context)


class _DeadlineRedirectHandler(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, *args, **kwargs):
        new = super().redirect_request(req, *args, **kwargs)
        if new is not None:  # the redirected request spends what is left of the same deadline
            new.deadline = req.deadline
        return new


class RemoteScorer:
    """HTTP client for one reward server (module docstring).

    Args:
      url: the server's scoring endpoint, e.g. 'http://127.0.0.1:18085/score'.
      timeout: seconds one attempt may take in all (connect, send, read the whole answer).
      retries: retries after the first attempt of each request.
      backoff: seconds before the first retry; doubled after each, capped by max_backoff.
      batch_size: images per request.
      max_concurrency: requests in flight at once.
      image_format: 'png' (lossless) or 'jpeg' (smaller; `jpeg_quality`).
      max_answer_bytes: a longer answer is malformed (default 4 KiB per image of a request + 64 KiB).
      token: shared secret sent as `Authorization: Bearer <token>` (default: the environment
        variable REWARD_SERVER_TOKEN, if set).
      sleep: the backoff wait (tests pass a recorder).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        batch_size: int = 16,
        max_concurrency: int = 4,
        image_format: str = "png",
        jpeg_quality: int = 95,
        max_answer_bytes: int | None = None,
        token: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward option url must start with http:// or https://, got {url!r}")
        if not timeout > 0:
            raise ValueError(f"remote reward option timeout must be > 0 seconds, got {timeout!r}")
        if not (backoff >= 0 and max_backoff >= 0):
            raise ValueError(f"remote reward options backoff, max_backoff must be >= 0, got {backoff!r}, {max_backoff!r}")
        counts = (("retries", retries, 0), ("batch_size", batch_size, 1), ("max_concurrency", max_concurrency, 1))
        for name, value, low in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"remote reward option {name} must be an integer >= {low}, got {value!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"remote reward option image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if max_answer_bytes is None:
            max_answer_bytes = _ANSWER_BYTES_PER_IMAGE * batch_size + _ANSWER_SLACK_BYTES
        if isinstance(max_answer_bytes, bool) or not isinstance(max_answer_bytes, int) or max_answer_bytes < 1:
            raise ValueError(f"remote reward option max_answer_bytes must be an integer >= 1, got {max_answer_bytes!r}")
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        if token is not None and (not isinstance(token, str) or not token or not token.isascii()
                                  or not token.isprintable() or " " in token):
            raise ValueError(f"remote reward option token (or ${TOKEN_ENV}) must be a non-empty string of "
                             "printable ASCII characters without spaces")
        self.headers = {"Content-Type": "application/json"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        self.max_answer_bytes = max_answer_bytes
        self.url, self.timeout, self.retries = url, float(timeout), retries
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.batch_size, self.image_format, self.jpeg_quality = batch_size, image_format, jpeg_quality
        self.sleep = sleep
        # One pool per reward: at most max_concurrency requests in flight, whichever thread calls.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="remote-reward")
        self._opener = urllib.request.build_opener(
            _DeadlineHTTPHandler, _DeadlineHTTPSHandler, _DeadlineRedirectHandler)

    def _open(self, body: bytes, deadline: float):
        request = _DeadlineRequest(self.url, data=body, headers=self.headers, method="POST", deadline=deadline)
        return self._opener.open(request, timeout=_remaining(deadline))

    def _post_once(self, body: bytes, expected: int) -> np.ndarray:
        limit = self.max_answer_bytes
        with self._open(body, time.monotonic() + self.timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > limit:
                raise RemoteRewardError(f"malformed answer: Content-Length {declared} over max_answer_bytes={limit}")
            answer = response.read(limit + 1)
        if len(answer) > limit:
            raise RemoteRewardError(f"malformed answer: longer than max_answer_bytes={limit}")
        try:
            return parse_scores(answer, expected)
        except ValueError as e:
            raise RemoteRewardError(f"malformed answer: {e}") from None

    def _post(self, body: bytes, expected: int) -> np.ndarray:
        delay, failures = self.backoff, []
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(delay)
                delay = min(2 * delay, self.max_backoff)
            try:
                return self._post_once(body, expected)
            except urllib.error.HTTPError as e:
                try:
                    detail = e.read(300).decode("utf-8", "replace")
                except (OSError, http.client.HTTPException):  # the deadline passed while reading it
                    detail = "(no readable body)"
                failures.append(f"HTTP {e.code}: {detail}")
                if e.code in _FATAL_STATUS:
                    break
            except (urllib.error.URLError, OSError, http.client.HTTPException, RemoteRewardError) as e:
                # URLError wraps refused connections; socket timeouts arrive as TimeoutError (an OSError);
                # HTTPException is a reply that is not HTTP at all.
                reason = getattr(e, "reason", e)
                failures.append(f"{type(reason).__name__}: {reason}")
        raise RemoteRewardError(
            f"reward server {self.url} gave no valid scores after {len(failures)} attempt(s) "
            f"(timeout {self.timeout}s, retries {self.retries}); last failure: {failures[-1]}"
        )

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        pixels = to_uint8_images(images)
        batch = len(pixels)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata entries")
        starts = range(0, batch, self.batch_size)
        bodies = [
            request_body(pixels[s : s + self.batch_size], prompts[s : s + self.batch_size],
                         metadata[s : s + self.batch_size], image_format=self.image_format,
                         jpeg_quality=self.jpeg_quality)
            for s in starts
        ]
        sizes = [min(self.batch_size, batch - s) for s in starts]
        futures = [self._pool.submit(self._post, body, n) for body, n in zip(bodies, sizes)]
        return np.concatenate([f.result() for f in futures]) if futures else np.zeros((0,), np.float32)


@register_reward("remote")
def remote(url: str | None = None, **options: Any) -> RewardFn:
    """A reward computed by an HTTP server (module docstring for the protocol).

    Options: url (required), timeout, retries, backoff, max_backoff, batch_size,
    max_concurrency, image_format, jpeg_quality, max_answer_bytes, token (see `RemoteScorer`).
    """
    if url is None:
        raise ValueError(
            "reward 'remote' needs the option url, e.g. reward options {'remote': {'url': 'http://host:port/score'}}; "
            "serve a scoring function with `python launch/reward_server.py --score_fn=module:function`"
        )
    return RemoteScorer(url, **options)
