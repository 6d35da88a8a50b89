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
error or malformed answer (not JSON, wrong length, a non-number, NaN or inf) is retried
with exponential backoff, and after `retries` retries the call raises `RemoteRewardError`
naming the server and the last failure, so the iteration fails loudly and nothing is
trained on missing rewards. A batch is sent as requests of at most `batch_size` images,
at most `max_concurrency` of them in flight per reward (also across calls from several
threads).
"""
from __future__ import annotations

import base64
import concurrent.futures
import http.client
import io
import json
import math
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
    return np.asarray(scores, np.float32)


class RemoteScorer:
    """HTTP client for one reward server (module docstring).

    Args:
      url: the server's scoring endpoint, e.g. 'http://127.0.0.1:18085/score'.
      timeout: seconds to wait for one answer (connect + read).
      retries: retries after the first attempt of each request.
      backoff: seconds before the first retry; doubled after each, capped by max_backoff.
      batch_size: images per request.
      max_concurrency: requests in flight at once.
      image_format: 'png' (lossless) or 'jpeg' (smaller; `jpeg_quality`).
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
        self.url, self.timeout, self.retries = url, float(timeout), retries
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.batch_size, self.image_format, self.jpeg_quality = batch_size, image_format, jpeg_quality
        self.sleep = sleep
        # One pool per reward: at most max_concurrency requests in flight, whichever thread calls.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="remote-reward")

    def _post_once(self, body: bytes, expected: int) -> np.ndarray:
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            answer = response.read()
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
                detail = e.read()[:300].decode("utf-8", "replace")
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
    max_concurrency, image_format, jpeg_quality (see `RemoteScorer`).
    """
    if url is None:
        raise ValueError(
            "reward 'remote' needs the option url, e.g. reward options {'remote': {'url': 'http://host:port/score'}}; "
            "serve a scoring function with `python launch/reward_server.py --score_fn=module:function`"
        )
    return RemoteScorer(url, **options)
