"""Serve a Python scoring function over HTTP(S) for the `remote` reward.

    python launch/reward_server.py --score_fn=my_package.ocr:score --port=18085

The protocol, its limits and its security are described in `digen_jax/reward_server.py`, whose
docstring `--help` prints. The flags are argparse's, not absl's: the server runs in the scoring
model's environment, which needs only numpy, Pillow and uvicorn.
"""
from __future__ import annotations

import argparse
import os
import sys

from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digen_jax import reward_server  # noqa: E402
from digen_jax.reward_server import (  # noqa: E402
    MAX_BODY_MB,
    MAX_PIXELS,
    QUEUE,
    REQUEST_TIMEOUT,
    TOKEN_ENV,
    WORKERS,
    check_token,
    exposure_warning,
    load_function,
    make_server,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=reward_server.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--score_fn", required=True, help="the scoring function, as module:function")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback only; 0.0.0.0 is every interface: use --token)")
    parser.add_argument("--port", type=int, default=18085, help="port to listen on (0: any free port)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"shared secret clients must send as 'Authorization: Bearer <token>' "
                             f"(default: ${TOKEN_ENV}, which keeps it out of the process list; unset: no check)")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help="threads decoding requests (and calling the function with --concurrent) "
                             "(default %(default)s)")
    parser.add_argument("--queue", type=int, default=QUEUE,
                        help="requests that may wait for a worker; beyond --workers + --queue requests in "
                             "progress, more are answered 503 (busy) at once (default %(default)s)")
    parser.add_argument("--max_body_mb", type=int, default=MAX_BODY_MB,
                        help="largest request body in MiB; larger ones are answered 413 (default %(default)s)")
    parser.add_argument("--max_pixels", type=int, default=MAX_PIXELS,
                        help="decoded pixels allowed per request (sum of width*height of its images, checked "
                             "from the image headers before decoding); more are answered 413 (default %(default)s)")
    parser.add_argument("--request_timeout", type=float, default=REQUEST_TIMEOUT,
                        help="seconds a connection has to send a request's headers (else it is closed), and "
                             "as long again for its body (else 408) (default %(default)s)")
    parser.add_argument("--ssl_certfile", help="serve https with this certificate (PEM, with the chain; clients "
                                               "check it against their CA file or the system's)")
    parser.add_argument("--ssl_keyfile", help="the certificate's private key (PEM; default: in --ssl_certfile)")
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
                             ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, access_log=not args.quiet)
    except (ValueError, ImportError, AttributeError, OSError) as e:
        parser.exit(2, f"reward_server: {e}\n")
    # PIL's own bomb check agrees with the budget: no single image may exceed a whole request's.
    Image.MAX_IMAGE_PIXELS = args.max_pixels
    host, port = server.server_address[:2]
    warning = exposure_warning(host, args.token, tls=args.ssl_certfile is not None)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    scheme = "http" if args.ssl_certfile is None else "https"
    print(f"serving {args.score_fn} on {scheme}://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
