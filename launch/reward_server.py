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
      200 {"scores": [float, ...]}       one number per image, finite in float32
      400 {"error": "..."}               a malformed request
      401 {"error": "..."}               --token is set and the request lacks
                                         `Authorization: Bearer <token>`
      408, 411, 413 {"error": "..."}     the request arrived too slowly, without a
                                         Content-Length, or over --max_body_mb / --max_pixels
      500 {"error": "..."}               the function raised or returned bad scores (the
                                         details go to the server's log, never to the client)
      503 {"error": "..."}               every worker busy and the queue full: retry later
    GET /health  200 {"status": "ok"}        (no token needed)

Requests are handled by --workers threads; up to --queue more connections wait for one,
and further ones are answered 503 at once. Each connection has --request_timeout seconds
to deliver its whole request (headers and body), however slowly its bytes trickle in.
Calls of the function are serialised (one batch at a time, which suits a model on one
GPU); `--concurrent` lets the workers call it in parallel when it is thread-safe.

Security: the protocol is plain HTTP. The default binds to loopback only; to serve other
machines, bind a trusted network's address and set a shared secret with --token or, kept
out of the process list, the environment variable REWARD_SERVER_TOKEN (clients: reward
option token, or the same variable).

Clients: `digen_jax.rewards.remote` (reward name `remote`, option url=http://HOST:PORT/score).
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import http.client
import importlib
import io
import ipaddress
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable

import numpy as np
from PIL import Image

PROTOCOL_VERSION = 1
TOKEN_ENV = "REWARD_SERVER_TOKEN"
MAX_BODY_MB = 64  # about 128 base64 PNGs of 512x512 noise, far more of real images
MAX_PIXELS = 1 << 25  # decoded pixels per request: 32 images of 1024x1024 (96 MiB as RGB)
WORKERS = 4
QUEUE = 128
REQUEST_TIMEOUT = 30.0
LISTEN_BACKLOG = 128
_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
_BUSY_QUEUE = 64  # refusals waiting to be answered 503
_LINGER_SECONDS = 2.0  # time a refused client has to finish sending its request
_LINGER_BYTES = 1 << 28  # and the most of it that is read
_MAX_LINE = 1 << 16
_BUSY_BODY = b'{"error": "server busy (queue full); retry in a moment"}'
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class BadRequest(ValueError):
    """The request does not follow the protocol or exceeds a limit (answered with `status`)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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


def _open_images(images: list, max_pixels: int) -> list[Image.Image]:
    """The request's images opened lazily (headers only), within the decoded-pixel budget."""
    opened, pixels = [], 0
    try:
        for i, item in enumerate(images):
            if (not isinstance(item, dict) or item.get("format") not in _FORMATS
                    or not isinstance(item.get("data"), str)):
                raise BadRequest(f"image {i} must be {{'format': 'png'|'jpeg', 'data': base64}}")
            try:
                im = Image.open(io.BytesIO(base64.b64decode(item["data"], validate=True)),
                                formats=[_FORMATS[item["format"]]])
            except Image.DecompressionBombError as e:
                raise BadRequest(f"image {i} is too large to decode: {e}", 413) from None
            except (binascii.Error, OSError, ValueError, SyntaxError) as e:
                raise BadRequest(f"image {i} does not decode as {item['format']}: {str(e)[:200]}") from None
            opened.append(im)
            width, height = im.size
            pixels += width * height
            if pixels > max_pixels:
                raise BadRequest(f"images 0..{i} hold {pixels} pixels, over the server's --max_pixels={max_pixels}",
                                 413)
        if len({im.size for im in opened}) != 1:
            raise BadRequest(f"images in one request must share a size, got {sorted({im.size for im in opened})}")
    except BaseException:
        for im in opened:
            im.close()
        raise
    return opened


def decode_request(body: bytes, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, list[str], list[dict]]:
    """(images (B, H, W, 3) uint8, prompts, metadata) from a request body; BadRequest otherwise.

    Image sizes are read from the files' headers and checked against `max_pixels` (summed
    over the request) before any pixel is decoded."""
    try:
        payload = json.loads(body)
    except ValueError as e:  # not JSON, or not UTF-8
        raise BadRequest(f"body is not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise BadRequest("body is JSON nested too deeply") from None
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
    opened, arrays = _open_images(images, max_pixels), []
    try:
        for i, im in enumerate(opened):
            try:
                arrays.append(np.asarray(im.convert("RGB")))
            except (OSError, ValueError, SyntaxError, EOFError) as e:
                raise BadRequest(f"image {i} does not decode: {str(e)[:200]}") from None
    finally:
        for im in opened:
            im.close()
    return np.stack(arrays), [str(p) for p in prompts], list(metadata)


def checked_scores(scores: Any, expected: int) -> list[float]:
    """The function's output as `expected` floats finite in float32; ValueError otherwise."""
    try:
        values = np.asarray(scores, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != (expected,):
        raise ValueError(f"score function did not return {expected} numbers (one per image)")
    with np.errstate(over="ignore"):
        if not np.isfinite(values.astype(np.float32)).all():
            raise ValueError("score function returned non-finite scores (checked in float32)")
    return [float(v) for v in values]


def check_token(token: str | None, name: str = "--token") -> None:
    """A token must fit an HTTP header: printable ASCII without spaces."""
    if token is not None and (not token or not token.isascii() or not token.isprintable() or " " in token):
        raise ValueError(f"{name} must be a non-empty string of printable ASCII characters without spaces")


def exposure_warning(host: str, token: str | None) -> str | None:
    """What to tell the operator when `host` (the bound address) is reachable beyond this machine."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    warning = (f"WARNING: listening on {host}, reachable from other machines; the protocol is plain HTTP "
               "(no encryption), so bind only on a trusted network")
    if token is None:
        warning += (f". No --token (or ${TOKEN_ENV}) is set: ANYONE who can reach this port can run the "
                    "score function; set a shared secret")
    return warning


class _DeadlineReader(io.RawIOBase):
    """Reads a socket until one monotonic deadline: a socket timeout restarts at every read,
    so a client trickling a byte at a time would never trip it."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class RewardServer(HTTPServer):
    """An HTTPServer with a fixed pool of worker threads fed by a bounded queue of connections.

    The accept loop only queues connections. When the queue is full, one more thread answers
    503: it sends the answer at once, then reads the client's request to its end (briefly)
    before closing, so that the client, still sending, is not reset and reads the 503. When
    even that thread is backed up, connections are closed unanswered.
    """

    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address, handler, *, workers: int, queue_size: int, errors: Callable[[str], None]):
        super().__init__(address, handler)
        self.errors = errors
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._busy: queue.Queue = queue.Queue(_BUSY_QUEUE)
        self._workers = [threading.Thread(target=self._work, name=f"reward-server-{i}", daemon=True)
                         for i in range(workers)]
        self._refuser = threading.Thread(target=self._refuse_busy, name="reward-server-busy", daemon=True)
        for thread in (*self._workers, self._refuser):
            thread.start()

    def process_request(self, request, client_address):
        try:
            self._queue.put_nowait((request, client_address))
        except queue.Full:
            try:
                self._busy.put_nowait((request, client_address))
            except queue.Full:
                self.shutdown_request(request)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 (a worker outlives any one connection)
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def _refuse_busy(self) -> None:
        while (item := self._busy.get()) is not None:
            request = item[0]
            try:
                request.settimeout(_LINGER_SECONDS)
                request.sendall(_BUSY)
                request.shutdown(socket.SHUT_WR)
                rfile = io.BufferedReader(_DeadlineReader(request, time.monotonic() + _LINGER_SECONDS))
                rfile.readline(_MAX_LINE)
                discard(rfile, http.client.parse_headers(rfile).get("Content-Length"))
            except (OSError, http.client.HTTPException):  # the deadline, or not HTTP: close anyway
                pass
            except Exception:  # noqa: BLE001 (this thread outlives any one connection)
                self.handle_error(request, item[1])
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        kind, error, _ = sys.exc_info()
        self.errors(f"{client_address[0]}: connection failed: {kind.__name__}: {error}")

    def server_close(self) -> None:
        super().server_close()
        # Connections still waiting are closed; each thread ends after its current connection.
        for waiting, threads in ((self._queue, self._workers), (self._busy, [self._refuser])):
            while True:
                try:
                    item = waiting.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.shutdown_request(item[0])
            for _ in threads:
                waiting.put(None)


def discard(rfile: io.BufferedReader, content_length: str | None) -> None:
    """Read and drop a request body of `content_length` bytes (at most _LINGER_BYTES), so that
    closing the connection does not reset a client that is still sending and lose it the answer."""
    digits = content_length is not None and content_length.isascii() and content_length.isdigit()
    left = min(int(content_length), _LINGER_BYTES) if digits else 0
    while left > 0 and (chunk := rfile.read(min(left, 1 << 16))):
        left -= len(chunk)


def make_server(score_fn: Callable, host: str = "127.0.0.1", port: int = 0, *, concurrent: bool = False,
                token: str | None = None, workers: int = WORKERS, queue_size: int = QUEUE,
                max_body_bytes: int = MAX_BODY_MB << 20, max_pixels: int = MAX_PIXELS,
                request_timeout: float = REQUEST_TIMEOUT, log: Callable[[str], None] | None = None,
                errors: Callable[[str], None] | None = None) -> RewardServer:
    """A `RewardServer` answering the protocol with `score_fn`; port 0 picks a free port
    (read it from `server.server_address`). Call `serve_forever()` to run it.

    `log` receives one line per request (None: silent); `errors` receives failures with
    their tracebacks (default: stderr), which clients never see."""
    for name, value in (("workers", workers), ("queue_size", queue_size), ("max_body_bytes", max_body_bytes),
                        ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"reward server {name} must be an integer >= 1, got {value!r}")
    if not request_timeout > 0:
        raise ValueError(f"reward server request_timeout must be > 0 seconds, got {request_timeout!r}")
    check_token(token)
    if errors is None:
        errors = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    lock = threading.Lock() if not concurrent else None
    expected_auth = None if token is None else f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout  # each send of the answer

        def setup(self):
            super().setup()
            self.rfile.close()
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + request_timeout))

        def _answer(self, status: int, payload: dict, headers: dict | None = None) -> None:
            body = json.dumps(payload, allow_nan=False).encode("utf-8")
            try:
                self.connection.settimeout(request_timeout)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                # The client gave up (its timeout) and will retry; nothing to answer.
                self.log_message("client gone before the answer (status %d)", status)

        def send_error(self, code, message=None, explain=None):
            # http.server's own refusals (bad request line, too many headers) as protocol JSON.
            self.close_connection = True
            self._answer(code, {"error": message or self.responses.get(code, ("error",))[0]})

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok"})
            else:
                self._answer(404, {"error": "unknown path; POST /score or GET /health"})

        def do_POST(self):  # noqa: N802
            try:
                self._score()
            except Exception:  # noqa: BLE001 (any failure is answered; its details stay here)
                errors(f"{self.address_string()}: internal error\n{traceback.format_exc()}")
                self._answer(500, {"error": "internal server error (details in the server log)"})

        def _refuse(self, status: int, message: str, headers: dict | None = None) -> None:
            """Answer before reading the body, then read what the client still sends (briefly)."""
            self._answer(status, {"error": message}, headers)
            self.rfile.raw.deadline = time.monotonic() + _LINGER_SECONDS
            try:
                self.connection.shutdown(socket.SHUT_WR)  # the answer is complete
                discard(self.rfile, self.headers.get("Content-Length"))
            except OSError:  # the deadline, or the client is gone: close anyway
                pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding") is not None:
                raise BadRequest("send the body with a Content-Length, not Transfer-Encoding", 411)
            declared = self.headers.get("Content-Length")
            if declared is None:
                raise BadRequest("a Content-Length header is required", 411)
            if not declared.isascii() or not declared.strip().isdigit():
                raise BadRequest(f"Content-Length must be a number of bytes, got {declared[:40]!r}")
            length = int(declared)
            if length > max_body_bytes:
                raise BadRequest(f"body of {length} bytes is over the server's limit of {max_body_bytes}", 413)
            if length == 0:
                raise BadRequest("empty body")
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                raise BadRequest(f"the body did not arrive within {request_timeout:g} s", 408) from None
            if len(body) != length:
                raise BadRequest(f"the body ended after {len(body)} of {length} bytes")
            return body

        def _score(self) -> None:
            if self.path.rstrip("/") != "/score":
                self._refuse(404, "unknown path; POST /score")
                return
            authorization = self.headers.get("Authorization", "").encode("utf-8", "replace")
            if expected_auth is not None and not hmac.compare_digest(authorization, expected_auth):
                self._refuse(401, "missing or wrong token (Authorization: Bearer <token>)",
                             {"WWW-Authenticate": "Bearer"})
                return
            try:
                body = self._body()
            except BadRequest as e:
                self._refuse(e.status, str(e))
                return
            try:
                images, prompts, metadata = decode_request(body, max_pixels)
            except BadRequest as e:
                self._answer(e.status, {"error": str(e)})
                return
            try:
                if lock is None:
                    raw = score_fn(images, prompts, metadata)
                else:
                    with lock:
                        raw = score_fn(images, prompts, metadata)
            except Exception:  # noqa: BLE001 (user code; the client learns only that it failed)
                errors(f"{self.address_string()}: the score function raised\n{traceback.format_exc()}")
                self._answer(500, {"error": "the score function failed (details in the server log)"})
                return
            try:
                scores = checked_scores(raw, len(images))
            except ValueError as e:
                errors(f"{self.address_string()}: {e}: {str(raw)[:200]}")
                self._answer(500, {"error": str(e)})
                return
            self._answer(200, {"scores": scores})

        def log_message(self, fmt, *args):
            if log is not None:
                log(f"{self.address_string()} {fmt % args}")

    return RewardServer((host, port), Handler, workers=workers, queue_size=queue_size, errors=errors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--score_fn", required=True, help="the scoring function, as module:function")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback only; 0.0.0.0 is every interface: use --token)")
    parser.add_argument("--port", type=int, default=18085, help="port to listen on (0: any free port)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"shared secret clients must send as 'Authorization: Bearer <token>' "
                             f"(default: ${TOKEN_ENV}, which keeps it out of the process list; unset: no check)")
    parser.add_argument("--workers", type=int, default=WORKERS, help="threads handling requests (default %(default)s)")
    parser.add_argument("--queue", type=int, default=QUEUE,
                        help="connections waiting for a worker; more are answered 503 (busy) at once "
                             "(default %(default)s)")
    parser.add_argument("--max_body_mb", type=int, default=MAX_BODY_MB,
                        help="largest request body in MiB; larger ones are answered 413 (default %(default)s)")
    parser.add_argument("--max_pixels", type=int, default=MAX_PIXELS,
                        help="decoded pixels allowed per request (sum of width*height of its images, checked "
                             "from the image headers before decoding); more are answered 413 (default %(default)s)")
    parser.add_argument("--request_timeout", type=float, default=REQUEST_TIMEOUT,
                        help="seconds a connection has to deliver its whole request; slower ones are closed "
                             "(default %(default)s)")
    parser.add_argument("--concurrent", action="store_true", help="call the function from several workers at once")
    parser.add_argument("--quiet", action="store_true", help="do not log requests (errors are still logged)")
    args = parser.parse_args(argv)
    try:
        check_token(args.token, f"--token (or ${TOKEN_ENV})")
        if args.max_body_mb < 1:
            raise ValueError(f"--max_body_mb must be >= 1, got {args.max_body_mb}")
        score_fn = load_function(args.score_fn)
        server = make_server(score_fn, args.host, args.port, concurrent=args.concurrent, token=args.token,
                             workers=args.workers, queue_size=args.queue, max_body_bytes=args.max_body_mb << 20,
                             max_pixels=args.max_pixels, request_timeout=args.request_timeout,
                             log=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, ImportError, AttributeError, OSError) as e:
        parser.exit(2, f"reward_server: {e}\n")
    # PIL's own bomb check agrees with the budget: no single image may exceed a whole request's.
    Image.MAX_IMAGE_PIXELS = args.max_pixels
    host, port = server.server_address[:2]
    warning = exposure_warning(host, args.token)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(f"serving {args.score_fn} on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
