"""``relay``: serve a stream directory over HTTP (range requests, optional bearer token, /metrics)."""

from __future__ import annotations

import argparse
import sys

from ..errors import EXIT_OK
from ..relay import RELAY_TOKEN_ENV
from .options import SecretOption, UsageError, add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "relay", run_relay, "serve a stream directory over HTTP to followers of this site "
                    "(read-only; range requests; Prometheus /metrics)", """
        ckptstream relay /srv/mirror/run1 --port 8700                  # http://127.0.0.1:8700
        CKPTSTREAM_RELAY_TOKEN=t ckptstream relay /srv/mirror/run1 --host 0.0.0.0 --port 8700
        CKPTSTREAM_HTTP_TOKEN=t ckptstream follow http://relay-host:8700 --vllm-url http://127.0.0.1:8000
        ckptstream mirror s3://bucket/run1 /srv/mirror/run1 --follow &  # keep the relayed copy current
        """, with_common=False)
    p.add_argument("directory", help="the stream's root directory (e.g. the target of `mirror --follow`)")
    p.add_argument("--port", type=int, default=8700, help="TCP port (default 8700; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: give 0.0.0.0 or an interface to serve other hosts)")
    p.add_argument("--token", action=SecretOption, env=RELAY_TOKEN_ENV,
                   help="require `Authorization: Bearer TOKEN` (none: open, with a warning when --host is not "
                        "loopback; empty: refused; given here, other users of the host can read it)")


def run_relay(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from ..relay import Relay

    if args.token == "":  # it used to serve without authentication, silently
        raise UsageError(f"the relay's token (--token or ${RELAY_TOKEN_ENV}) is empty",
                         hint=f"Give a token, or unset {RELAY_TOKEN_ENV} to serve without one")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a service manager's stop: exit 0
    # Ctrl-C raises KeyboardInterrupt (exit 130) also where the parent ignored SIGINT: Python keeps an
    # inherited SIG_IGN (a shell's background job, a test runner some library set so), and the relay never stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with Relay(args.directory, host=args.host, port=args.port, token=args.token) as relay:
        print(relay.url, flush=True)  # the result: where followers read (scripts capture it)
        while not stop.wait(3600):  # Ctrl-C raises KeyboardInterrupt here: exit 130
            pass
    return EXIT_OK
