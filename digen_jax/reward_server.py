"""Reference reward server: serve any Python scoring function over HTTP.

Usage:
    python launch/reward_server.py --score_fn=my_package.ocr:score --port=18085

`--score_fn=module:function` names a function
    score(images: (B, H, W, 3) uint8 numpy array, prompts: list[str], metadata: list[dict])
        -> B numbers
(the signature of the reward registry's functions, so a registered reward's function
works too). The server needs numpy, Pillow and uvicorn (an ASGI server), so it runs in
whatever environment the scoring model needs; of digen_jax it imports only this module
(digen_jax/reward_server.py), and it does not import JAX.

Protocol (version 1, JSON, no pickle):
    POST /score  {"version": 1, "images": [{"format": "png"|"jpeg", "data": <base64>}],
                  "prompts": [...], "metadata": [{...}]}
      200 {"scores": [float, ...]}       one number per image, finite in float32
      400 {"error": "..."}               a malformed request (a request that is not HTTP at
                                         all is answered 400 with a plain-text body)
      401 {"error": "..."}               --token is set and the request lacks
                                         `Authorization: Bearer <token>`
      404, 405 {"error": "..."}          another path, or another method
      408, 411, 413 {"error": "..."}     the body arrived too slowly, without a
                                         Content-Length, or over --max_body_mb / --max_pixels
      500 {"error": "..."}               the function raised or returned bad scores (the
                                         details go to the server's log, never to the client)
      503 {"error": "..."}               --workers + --queue requests already in progress:
                                         retry later
    GET /health  200 {"status": "ok"}        (no token needed)

One event loop reads every connection, so slow or stalled clients hold no worker: /health
and new requests are answered while they trickle. A connection has --request_timeout
seconds to send a request's headers (else it is closed), and as long again for its body
(else 408). Up to --workers threads decode requests; calls of the function are serialised
(one batch at a time, which suits a model on one GPU) unless `--concurrent` lets the
workers call it in parallel when it is thread-safe. At most --workers + --queue requests
are in progress (each holding its body, at most --max_body_mb); more are answered 503 at
once. A request whose client hangs up while it waits is dropped unscored; a call already
running finishes (a Python function cannot be interrupted) and its answer is discarded.

Security: the server speaks plain HTTP, or https with --ssl_certfile (and --ssl_keyfile).
The default binds to loopback only; to serve other machines, set a shared secret with
--token or, kept out of the process list, the environment variable REWARD_SERVER_TOKEN, and
serve https (or bind only a trusted network's address). Clients send the token only when
their reward options name it (`token` or `token_env`), and only over https or to a loopback
address unless `allow_insecure` says otherwise.

Clients: `digen_jax.rewards.remote` (reward name `remote`, option url=http://HOST:PORT/score).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import importlib
import io
import ipaddress
import json
import socket
import ssl
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import uvicorn
from PIL import Image
from uvicorn.protocols.http.h11_impl import H11Protocol

PROTOCOL_VERSION = 1
TOKEN_ENV = "REWARD_SERVER_TOKEN"
MAX_BODY_MB = 64  # about 128 base64 PNGs of 512x512 noise, far more of real images
MAX_PIXELS = 1 << 25  # decoded pixels per request: 32 images of 1024x1024 (96 MiB as RGB)
WORKERS = 4
QUEUE = 128
REQUEST_TIMEOUT = 30.0
LISTEN_BACKLOG = 128
_SHUTDOWN_GRACE_SECONDS = 5  # requests still in progress at shutdown get this long to be answered
_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


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


def exposure_warning(host: str, token: str | None, tls: bool = False) -> str | None:
    """What to tell the operator when `host` (the bound address) is reachable beyond this machine."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    warnings = []
    if not tls:
        warnings.append("the protocol is plain HTTP (no encryption), so bind only on a trusted network or "
                        "serve https with --ssl_certfile and --ssl_keyfile")
    if token is None:
        warnings.append(f"no --token (or ${TOKEN_ENV}) is set: ANYONE who can reach this port can run the "
                        "score function; set a shared secret")
    if not warnings:
        return None
    return f"WARNING: listening on {host}, reachable from other machines; " + "; ".join(warnings)


def _header_deadline(request_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a request's headers within
    `request_timeout` of connecting or of its previous answer: uvicorn bounds only the idle time
    before the first byte, so a client sending a header byte a second would hold its socket forever."""

    class HeaderDeadline(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(request_timeout, self._expire)

        def _expire(self) -> None:
            # No request in progress: its headers (or the rest of a refused body) are late. A request
            # in progress bounds its own body (408) and is then scored for as long as that takes.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderDeadline


class _ClientGone(Exception):
    """The client closed its connection before the request was answered."""


async def _answer(send, status: int, payload: dict, headers: tuple = ()) -> None:
    body = json.dumps(payload, allow_nan=False).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ScoringApp:
    """The protocol (module docstring) as an ASGI application.

    `requests` counts the /score requests in progress (reading, waiting, decoding or scoring)."""

    def __init__(self, score_fn: Callable, *, concurrent: bool, token: str | None, workers: int, queue_size: int,
                 max_body_bytes: int, max_pixels: int, request_timeout: float, errors: Callable[[str], None]):
        self.score_fn, self.errors = score_fn, errors
        self.max_body_bytes, self.max_pixels, self.request_timeout = max_body_bytes, max_pixels, request_timeout
        self.capacity, self.requests = workers + queue_size, 0
        self._auth = None if token is None else f"Bearer {token}".encode()
        self._decoders = ThreadPoolExecutor(workers, thread_name_prefix="reward-server")
        # One thread serialises the calls; a call waiting for it can still be dropped.
        self._scorer = (self._decoders if concurrent
                        else ThreadPoolExecutor(1, thread_name_prefix="reward-server-score"))

    def close(self) -> None:
        """Stop the threads once their current call returns; calls not started are dropped."""
        for pool in {self._decoders, self._scorer}:
            pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"].rstrip("/"), scope["method"]
        if path not in ("/health", "/score"):
            await _answer(send, 404, {"error": "unknown path; POST /score or GET /health"})
        elif (path, method) not in (("/health", "GET"), ("/score", "POST")):
            allowed = "GET" if path == "/health" else "POST"
            await _answer(send, 405, {"error": f"{method} {path} is not served; {allowed} it"},
                          ((b"allow", allowed.encode()),))
        elif path == "/health":
            await _answer(send, 200, {"status": "ok"})
        else:
            headers = dict(scope["headers"])
            client = "%s:%s" % tuple(scope.get("client") or ("?", "?"))
            if self._auth is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self._auth):
                await _answer(send, 401, {"error": "missing or wrong token (Authorization: Bearer <token>)"},
                              ((b"www-authenticate", b"Bearer"),))
            elif self.requests >= self.capacity:
                await _answer(send, 503, {"error": "server busy (queue full); retry in a moment"},
                              ((b"retry-after", b"1"),))
            else:
                self.requests += 1
                try:
                    await self._score(headers, receive, send, client)
                except _ClientGone:
                    pass
                except Exception:  # noqa: BLE001 (any failure is answered; its details stay here)
                    self.errors(f"{client}: internal error\n{traceback.format_exc()}")
                    await _answer(send, 500, {"error": "internal server error (details in the server log)"})
                finally:
                    self.requests -= 1

    async def _score(self, headers: dict, receive, send, client: str) -> None:
        try:
            body = await self._body(headers, receive)
        except BadRequest as e:
            # A late body is not read further; any other refusal is answered before the body, which
            # the server then reads and drops, so that a client still sending sees the answer.
            close = ((b"connection", b"close"),) if e.status == 408 else ()
            await _answer(send, e.status, {"error": str(e)}, close)
            return
        # Once the body is in, the next receive() returns only when the client hangs up.
        gone = asyncio.ensure_future(receive())
        work = asyncio.ensure_future(self._process(body, client))
        try:
            await asyncio.wait((gone, work), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # if not done: the client is gone (or the server stops), so drop its request
        if not work.done():
            raise _ClientGone
        status, payload = work.result()
        await _answer(send, status, payload)

    async def _body(self, headers: dict, receive) -> bytes:
        if b"transfer-encoding" in headers:
            raise BadRequest("send the body with a Content-Length, not Transfer-Encoding", 411)
        declared = headers.get(b"content-length")
        if declared is None:
            raise BadRequest("a Content-Length header is required", 411)
        if not declared.isdigit():
            raise BadRequest(f"Content-Length must be a number of bytes, got {declared[:40].decode('latin-1')!r}")
        length = int(declared)
        if length > self.max_body_bytes:
            raise BadRequest(f"body of {length} bytes is over the server's limit of {self.max_body_bytes}", 413)
        if length == 0:
            raise BadRequest("empty body")
        body = bytearray()
        try:
            async with asyncio.timeout(self.request_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientGone
                    body += message.get("body", b"")
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise BadRequest(f"the body did not arrive within {self.request_timeout:g} s", 408) from None

    async def _process(self, body: bytes, client: str) -> tuple[int, dict]:
        """(status, answer) for a request body: decoded by a worker, scored by the function."""
        loop = asyncio.get_running_loop()
        try:
            images, prompts, metadata = await loop.run_in_executor(self._decoders, decode_request, body,
                                                                   self.max_pixels)
        except BadRequest as e:
            return e.status, {"error": str(e)}
        try:
            raw = await loop.run_in_executor(self._scorer, self.score_fn, images, prompts, metadata)
        except Exception:  # noqa: BLE001 (user code; the client learns only that it failed)
            self.errors(f"{client}: the score function raised\n{traceback.format_exc()}")
            return 500, {"error": "the score function failed (details in the server log)"}
        try:
            return 200, {"scores": checked_scores(raw, len(images))}
        except ValueError as e:
            self.errors(f"{client}: {e}: {str(raw)[:200]}")
            return 500, {"error": str(e)}


class RewardServer:
    """uvicorn serving a `ScoringApp` on a socket bound (and listening) at construction, so that
    port 0's pick is known at once: `server_address`. `serve_forever()` runs it; `shutdown()`,
    from another thread, stops it and waits; `server_close()` releases the socket and threads."""

    def __init__(self, app: ScoringApp, sock: socket.socket, config: uvicorn.Config):
        self.app, self.socket, self.server_address = app, sock, sock.getsockname()
        self._server = uvicorn.Server(config)
        self._started, self._stopped = threading.Event(), threading.Event()

    def serve_forever(self) -> None:
        self._started.set()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self._server.should_exit = True
        if self._started.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        self.app.close()


def make_server(score_fn: Callable, host: str = "127.0.0.1", port: int = 0, *, concurrent: bool = False,
                token: str | None = None, workers: int = WORKERS, queue_size: int = QUEUE,
                max_body_bytes: int = MAX_BODY_MB << 20, max_pixels: int = MAX_PIXELS,
                request_timeout: float = REQUEST_TIMEOUT, ssl_certfile: str | None = None,
                ssl_keyfile: str | None = None, access_log: bool = False,
                errors: Callable[[str], None] | None = None) -> RewardServer:
    """A `RewardServer` answering the protocol with `score_fn`; port 0 picks a free port.
    With `ssl_certfile` (PEM; and `ssl_keyfile` unless the key is in it) it serves https.

    `access_log` logs one line per request (uvicorn's log format); `errors` receives failures
    with their tracebacks (default: stderr), which clients never see."""
    for name, value in (("workers", workers), ("queue_size", queue_size), ("max_body_bytes", max_body_bytes),
                        ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"reward server {name} must be an integer >= 1, got {value!r}")
    if not request_timeout > 0:
        raise ValueError(f"reward server request_timeout must be > 0 seconds, got {request_timeout!r}")
    check_token(token)
    if ssl_keyfile is not None and ssl_certfile is None:
        raise ValueError("reward server ssl_keyfile needs ssl_certfile (the certificate) too")
    if errors is None:
        errors = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    app = ScoringApp(score_fn, concurrent=concurrent, token=token, workers=workers, queue_size=queue_size,
                     max_body_bytes=max_body_bytes, max_pixels=max_pixels, request_timeout=request_timeout,
                     errors=errors)
    config = uvicorn.Config(app, http=_header_deadline(request_timeout), interface="asgi3", lifespan="off",
                            loop="asyncio", backlog=LISTEN_BACKLOG, proxy_headers=False, server_header=False,
                            access_log=access_log, log_config=uvicorn.config.LOGGING_CONFIG if access_log else None,
                            timeout_graceful_shutdown=_SHUTDOWN_GRACE_SECONDS, ssl_certfile=ssl_certfile,
                            ssl_keyfile=ssl_keyfile)
    try:
        config.load()  # reads the certificate now, so that a bad one is an error before serving
    except (OSError, ssl.SSLError) as e:
        sock.close()
        raise ValueError(f"reward server ssl_certfile/ssl_keyfile {ssl_certfile}, {ssl_keyfile}: {e}") from None
    return RewardServer(app, sock, config)

