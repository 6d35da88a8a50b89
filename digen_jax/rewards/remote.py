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
`timeout` bounds each attempt as a whole (connect, TLS handshake, send, every byte of the
answer), not each socket operation, so a server that trickles its bytes cannot hold an
attempt longer. A batch is sent as requests of at most `batch_size` images, at most
`max_concurrency` of them in flight per reward (also across calls from several threads).

Credentials go only where the options send them. The token (`Authorization: Bearer
<token>`, which `launch/reward_server.py --token` checks) comes from the option `token` or
from the environment variable the option `token_env` names, never implicitly from the
environment (the server's own REWARD_SERVER_TOKEN is not read unless named). A token is sent
over https, or over plain http only to a loopback host (localhost, 127.0.0.0/8, ::1) unless
`allow_insecure=True`. Redirects are never followed: a 3xx answer fails the call, naming
where it pointed. Proxy settings from the environment are not used.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import ipaddress
import json
import math
import os
import ssl
import time
from typing import Any, Callable, Mapping, Sequence

import httpx
import numpy as np
from PIL import Image

from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

PROTOCOL_VERSION = 1
IMAGE_FORMATS = ("png", "jpeg")
# Answers that a retry cannot fix: redirects (never followed) and client errors but 408
# (timeout) and 429 (busy).
_FATAL_STATUS = frozenset(range(300, 500)) - {408, 429}
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


def is_loopback(host: str) -> bool:
    """Whether `host` (a URL's host, without brackets) names this machine: localhost or a
    loopback address. Other names are not resolved: a name is loopback only if it says so."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _failure(error: BaseException) -> str:
    """One line for a failed attempt, ending with the innermost cause (the connection library
    wraps the socket's error, e.g. a refused connection, in its own)."""
    if isinstance(error, TimeoutError) and not str(error):
        return "TimeoutError: timed out (no whole answer within the attempt's timeout)"
    line, cause = f"{type(error).__name__}: {error}", error
    while (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__
        if isinstance(cause, BaseExceptionGroup):
            cause = cause.exceptions[0]
    return line if cause is error else f"{line} ({type(cause).__name__}: {cause})"


class _HTTPStatus(Exception):
    """An answer whose status is not 200."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk
        if len(data) >= limit:
            break
    return bytes(data[:limit])


class RemoteScorer:
    """HTTP client for one reward server (module docstring).

    Args:
      url: the server's scoring endpoint, e.g. 'http://127.0.0.1:18085/score'.
      timeout: seconds one attempt may take in all (connect, TLS handshake, send, read the whole answer).
      retries: retries after the first attempt of each request.
      backoff: seconds before the first retry; doubled after each, capped by max_backoff.
      batch_size: images per request.
      max_concurrency: requests in flight at once.
      image_format: 'png' (lossless) or 'jpeg' (smaller; `jpeg_quality`).
      max_answer_bytes: a longer answer is malformed (default 4 KiB per image of a request + 64 KiB).
      token: shared secret sent as `Authorization: Bearer <token>`.
      token_env: name of an environment variable holding the token instead (keeps it out of configs).
      allow_insecure: send the token over plain http to a host that is not loopback.
      ca_file: PEM file of the certificate authorities that https servers are checked against
        (default: the system's).
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
        token_env: str | None = None,
        allow_insecure: bool = False,
        ca_file: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        try:
            parsed = httpx.URL(url) if isinstance(url, str) else None
        except httpx.InvalidURL:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"remote reward option url must be http://HOST[:PORT]/PATH or https://..., got {url!r}")
        if parsed.userinfo:
            raise ValueError("remote reward option url must not hold a user or password; "
                             "pass the secret as the option token (or token_env)")
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
        source = "token"
        if token_env is not None:
            if token is not None:
                raise ValueError("remote reward options token and token_env are exclusive; set one")
            token, source = os.environ.get(token_env) or None, f"token_env (${token_env})"
            if token is None:
                raise ValueError(f"remote reward option token_env names ${token_env}, which is not set; "
                                 "export it or drop the option")
        if token is not None and (not isinstance(token, str) or not token or not token.isascii()
                                  or not token.isprintable() or " " in token):
            raise ValueError(f"remote reward option {source} must be a non-empty string of printable ASCII "
                             "characters without spaces")
        if not isinstance(allow_insecure, bool):
            raise ValueError(f"remote reward option allow_insecure must be True or False, got {allow_insecure!r}")
        insecure = parsed.scheme == "http" and not is_loopback(parsed.host)
        if token is not None and insecure and not allow_insecure:
            raise ValueError(f"remote reward: url {url} is plain http to a host that is not loopback, so the "
                             "token would cross the network unencrypted; use https:// (reward_server.py "
                             "--ssl_certfile, or a TLS proxy) or set the option allow_insecure=True")
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        self.max_answer_bytes = max_answer_bytes
        self.url, self.timeout, self.retries = url, float(timeout), retries
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.batch_size, self.image_format, self.jpeg_quality = batch_size, image_format, jpeg_quality
        self.sleep = sleep
        # Loading the system's authorities takes about 0.1 s, so plain http gets a context that
        # trusts no one (it never makes a TLS connection: redirects are not followed).
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if parsed.scheme == "https" or ca_file is not None:
            try:
                self._tls = ssl.create_default_context(cafile=ca_file)
            except OSError as e:
                raise ValueError(f"remote reward option ca_file={ca_file!r} cannot be read: {e}") from None
        # One pool per reward: at most max_concurrency requests in flight, whichever thread calls.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="remote-reward")

    async def _attempt(self, body: bytes, expected: int) -> np.ndarray:
        """One request; the deadline covers everything from connecting to the answer's last byte."""
        limit = self.max_answer_bytes
        async with asyncio.timeout(self.timeout):
            async with httpx.AsyncClient(verify=self._tls, timeout=None, follow_redirects=False,
                                         trust_env=False) as client:
                async with client.stream("POST", self.url, content=body, headers=self.headers) as response:
                    if response.is_redirect:
                        where = response.headers.get("Location", "?")[:200]
                        raise _HTTPStatus(response.status_code,
                                          f"redirect to {where} (not followed: set url to the final address)")
                    if response.status_code != 200:
                        detail = (await _read_at_most(response, 300)).decode("utf-8", "replace")
                        raise _HTTPStatus(response.status_code, detail)
                    declared = response.headers.get("Content-Length", "")
                    if declared.isascii() and declared.isdigit() and int(declared) > limit:
                        raise RemoteRewardError(
                            f"malformed answer: Content-Length {declared} over max_answer_bytes={limit}")
                    answer = await _read_at_most(response, limit + 1)
        if len(answer) > limit:
            raise RemoteRewardError(f"malformed answer: longer than max_answer_bytes={limit}")
        try:
            return self.parse_answer(answer, expected)
        except ValueError as e:
            raise RemoteRewardError(f"malformed answer: {e}") from None

    def parse_answer(self, answer: bytes, expected: int) -> np.ndarray:
        """(expected,) float32 scores from an answer's body; ValueError describing any defect."""
        return parse_scores(answer, expected)

    def request_bodies(self, pixels: np.ndarray, prompts: Sequence[str],
                       metadata: Sequence[Mapping[str, Any]]) -> list[tuple[bytes, int]]:
        """The requests scoring (B, H, W, 3) uint8 `pixels`: (body, images it scores) pairs, in order."""
        batch = len(pixels)
        return [
            (request_body(pixels[s : s + self.batch_size], prompts[s : s + self.batch_size],
                          metadata[s : s + self.batch_size], image_format=self.image_format,
                          jpeg_quality=self.jpeg_quality), min(self.batch_size, batch - s))
            for s in range(0, batch, self.batch_size)
        ]

    def _post(self, body: bytes, expected: int) -> np.ndarray:
        delay, failures = self.backoff, []
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(delay)
                delay = min(2 * delay, self.max_backoff)
            try:
                return asyncio.run(self._attempt(body, expected))
            except _HTTPStatus as e:
                failures.append(str(e))
                if e.status in _FATAL_STATUS:
                    break
            except RemoteRewardError as e:
                failures.append(str(e))
            except (httpx.HTTPError, OSError) as e:  # refused, reset, timed out (TimeoutError), not HTTP
                failures.append(_failure(e))
        raise RemoteRewardError(
            f"reward server {self.url} gave no valid scores after {len(failures)} attempt(s) "
            f"(timeout {self.timeout}s, retries {self.retries}); last failure: {failures[-1]}"
        )

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        pixels = to_uint8_images(images)
        batch = len(pixels)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata entries")
        futures = [self._pool.submit(self._post, body, n) for body, n in self.request_bodies(pixels, prompts, metadata)]
        return np.concatenate([f.result() for f in futures]) if futures else np.zeros((0,), np.float32)


@register_reward("remote")
def remote(url: str | None = None, **options: Any) -> RewardFn:
    """A reward computed by an HTTP server (module docstring for the protocol).

    Options: url (required), timeout, retries, backoff, max_backoff, batch_size,
    max_concurrency, image_format, jpeg_quality, max_answer_bytes, token, token_env,
    allow_insecure, ca_file (see `RemoteScorer`).
    """
    if url is None:
        raise ValueError(
            "reward 'remote' needs the option url, e.g. reward options {'remote': {'url': 'http://host:port/score'}}; "
            "serve a scoring function with `python launch/reward_server.py --score_fn=module:function`"
        )
    return RemoteScorer(url, **options)
