"""Reference reward server: serve any Python scoring function over HTTP.

Usage:
    python launch/reward_server.py --score_fn=my_package.ocr:score --port=18085

`--score_fn=module:function` names a function
    score(images: (B, H, W, 3) uint8 numpy array, prompts: list[str], metadata: list[dict])
        -> B numbers
(the signature of the reward registry's functions, so a registered reward's function
works too). The server depends only on the standard library, numpy and Pillow, so it
runs in whatever environment the scoring model needs; it does not import digen_jax.

Protocol (version 1, JSON, no pickle):
    POST /score  {"version": 1, "images": [{"format": "png"|"jpeg", "data": <base64>}],
                  "prompts": [...], "metadata": [{...}]}
      200 {"scores": [float, ...]}       one finite number per image
      400 {"error": "..."}               a malformed request
      500 {"error": "..."}               the function raised or returned bad scores
    GET /health  200 {"status": "ok"}

Calls of the function are serialised (one batch at a time, which suits a model on one
GPU); `--concurrent` lets threads call it in parallel when it is thread-safe. Clients:
`digen_jax.rewards.remote` (reward name `remote`, option url=http://HOST:PORT/score).
"""
from __future__ import annotations

import argparse
import base64
import binascii
import importlib
import io
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np
from PIL import Image

PROTOCOL_VERSION = 1
MAX_BODY_BYTES = 1 << 30


class BadRequest(ValueError):
    """The request does not follow the protocol (answered 400)."""


def load_function(spec: str) -> Callable:
    """The function named by 'module:function' (the module must be importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--score_fn must look like 'module:function', got {spec!r}")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"--score_fn {spec!r} is not callable")
    return fn


def decode_request(body: bytes) -> tuple[np.ndarray, list[str], list[dict]]:
    """(images (B, H, W, 3) uint8, prompts, metadata) from a request body; BadRequest otherwise."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    if not isinstance(payload, dict) or payload.get("version") != PROTOCOL_VERSION:
        raise BadRequest(f"expected a JSON object with version {PROTOCOL_VERSION}")
    images, prompts = payload.get("images"), payload.get("prompts")
    if not isinstance(images, list) or not images:
        raise BadRequest("'images' must be a non-empty list")
    metadata = payload.get("metadata", [{} for _ in images])
    if not isinstance(prompts, list) or len(prompts) != len(images):
        raise BadRequest(f"need one prompt per image ({len(images)} images)")
    if not isinstance(metadata, list) or len(metadata) != len(images) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest(f"'metadata' must be a list of one JSON object per image ({len(images)} images)")
    arrays = []
    for i, item in enumerate(images):
        if not isinstance(item, dict) or item.get("format") not in ("png", "jpeg"):
            raise BadRequest(f"image {i} must be {{'format': 'png'|'jpeg', 'data': base64}}")
        try:
            with Image.open(io.BytesIO(base64.b64decode(item["data"], validate=True))) as im:
                arrays.append(np.asarray(im.convert("RGB")))
        except (binascii.Error, OSError, KeyError, TypeError) as e:
            raise BadRequest(f"image {i} does not decode: {e}") from None
    if len({a.shape for a in arrays}) != 1:
        raise BadRequest(f"images in one request must share a size, got {sorted({a.shape for a in arrays})}")
    return np.stack(arrays), [str(p) for p in prompts], list(metadata)


def checked_scores(scores: Any, expected: int) -> list[float]:
    """The function's output as `expected` finite floats; ValueError otherwise."""
    try:
        values = np.asarray(scores, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != (expected,):
        raise ValueError(f"score function returned {str(scores)[:100]} for {expected} images")
    if not np.isfinite(values).all():
        raise ValueError(f"score function returned non-finite scores {values.tolist()}")
    return [float(v) for v in values]


def make_server(score_fn: Callable, host: str = "127.0.0.1", port: int = 0, *, concurrent: bool = False,
                log: Callable[[str], None] | None = None) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer answering the protocol with `score_fn`; port 0 picks a free port
    (read it from `server.server_address`). Call `serve_forever()` to run it."""
    lock = threading.Lock() if not concurrent else None

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload, allow_nan=False).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                # The client gave up (its timeout) and will retry; nothing to answer.
                self.log_message("client hung up before the answer (status %d)", status)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok"})
            else:
                self._answer(404, {"error": f"unknown path {self.path}; POST /score or GET /health"})

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/score":
                self._answer(404, {"error": f"unknown path {self.path}; POST /score"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                self._answer(400, {"error": f"Content-Length must be in (0, {MAX_BODY_BYTES}], got {length}"})
                return
            try:
                images, prompts, metadata = decode_request(self.rfile.read(length))
            except BadRequest as e:
                self._answer(400, {"error": str(e)})
                return
            try:
                if lock is None:
                    raw = score_fn(images, prompts, metadata)
                else:
                    with lock:
                        raw = score_fn(images, prompts, metadata)
                scores = checked_scores(raw, len(images))
            except Exception as e:  # noqa: BLE001 (any failure of user code is reported to the client)
                self._answer(500, {"error": f"{type(e).__name__}: {e}"})
                return
            self._answer(200, {"scores": scores})

        def log_message(self, fmt, *args):
            if log is not None:
                log(f"{self.address_string()} {fmt % args}")

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--score_fn", required=True, help="the scoring function, as module:function")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=18085, help="port to listen on (0: any free port)")
    parser.add_argument("--concurrent", action="store_true", help="call the function from several threads at once")
    parser.add_argument("--quiet", action="store_true", help="do not log requests")
    args = parser.parse_args(argv)
    score_fn = load_function(args.score_fn)
    server = make_server(score_fn, args.host, args.port, concurrent=args.concurrent,
                         log=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True))
    host, port = server.server_address[:2]
    print(f"serving {args.score_fn} on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
