"""`dph-async serve scorer`: the reward worker pool as an HTTP service."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from dph_async.cli.commands.common import add_config_arguments, fail
from dph_async.config import load_config
from dph_async.rewards.service import ServiceSettings, make_app
from dph_async.rewards.service_http import bind, serve
from dph_async.rewards.wire import TOKEN_ENV

DESCRIPTION = """\
Serve the verifiable rewards over HTTP, so actors on other machines can score with
`rewards.scorer_urls=[http://HOST:PORT]`. Endpoints: POST /v1/score, GET /health, GET /metrics
(see docs/rewards.md). Reward settings come from the config (a preset or YAML file) and key=value
overrides, e.g.

    dph-async serve scorer --port 5001 rewards.workers=4 rewards.sql.db_root=data/bird/databases
    dph-async serve scorer --port 0 --max-body-mb 16 --header-timeout-s 5   # the OS picks the port

Limits against hostile or broken clients (docs/operating.md, "Admission"): request headers
within --header-timeout-s, bodies within --body-timeout-s and --max-body-mb, at most --max-items
requests per batch, at most --max-queued-mb of bodies in the service at once, counted as they
arrive, one request holding at most what it leaves free (503 beyond; --max-queued-mb must be at
least twice --max-body-mb). Connections are admitted per connection, never per address: 1,024 open,
64 of them kept for requests with the token; anonymous requests beyond the rest get 503.

The service binds 127.0.0.1. Another address needs a shared token in $DPH_SCORER_TOKEN (clients send
the same variable's value) or --insecure.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "config overrides (rewards.*)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=5001, help="port; 0 lets the OS choose (default: %(default)s)")
    parser.add_argument("--max-queued-mb", type=float, default=256.0,
                        help="request bodies admitted at once, in MB, before answering 503 (default: %(default)s)")
    parser.add_argument("--max-body-mb", type=float, default=64.0,
                        help="largest request body accepted (default: %(default)s)")
    parser.add_argument("--max-items", type=int, default=4096,
                        help="most requests in one batch (default: %(default)s)")
    parser.add_argument("--max-budget-s", type=float, default=600.0,
                        help="longest time one batch may take (default: %(default)s)")
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="a connection must send its request headers within this long (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=60.0,
                        help="a request body must arrive within this long (default: %(default)s)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback bind without a shared token")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides).rewards
    if not 0 <= args.port <= 65535:  # else socket's OverflowError, after the reward workers had started
        return fail(f"--port {args.port}: a TCP port is 0-65535 (0: the OS chooses)")
    token = os.environ.get(TOKEN_ENV) or None
    if not _loopback(args.host) and token is None and not args.insecure:
        return fail(f"binding {args.host} exposes the scorer beyond this machine; set {TOKEN_ENV} (a shared token) "
                    "or pass --insecure")

    try:
        settings = ServiceSettings(max_queued_bytes=int(args.max_queued_mb * 2**20),
                                   max_body_bytes=int(args.max_body_mb * 2**20), max_items=args.max_items,
                                   max_budget_s=args.max_budget_s, body_timeout_s=args.body_timeout_s, token=token)
    except ValueError as e:
        return fail(f"--max-queued-mb / --max-body-mb: {e}")
    app = make_app(cfg, settings)  # loads the reward plugins: a broken one stops the service before it listens
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        return fail(f"cannot bind {args.host}:{args.port}: {e}")
    port = sock.getsockname()[1]
    print(f"scorer: {cfg.workers} workers, http://{args.host}:{port}", file=sys.stderr, flush=True)
    serve(app, sock, header_timeout_s=args.header_timeout_s, token=token)
    return 0
