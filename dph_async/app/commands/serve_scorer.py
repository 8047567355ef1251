"""`dph-async serve scorer`: the reward worker pool as an HTTP service."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

NAME = "serve scorer"
HELP = "serve rewards over HTTP (a worker pool behind POST /v1/score)"
DESCRIPTION = """\
Serve the verifiable rewards over HTTP, so actors on other machines can score with
`rewards.scorer_urls=[http://HOST:PORT]`. Endpoints: POST /v1/score, GET /health, GET /metrics
(see docs/rewards.md). Reward settings come from the config (a preset or YAML file) and key=value
overrides, e.g.

    dph-async serve scorer --port 5001 rewards.workers=4 rewards.sql.db_root=data/bird/databases

The service binds 127.0.0.1. Another address needs a shared token in $DPH_SCORER_TOKEN (clients send
the same variable's value) or --insecure.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (rewards.*)")
    parser.add_argument("--config", default="default", help="preset name or YAML file (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=5001, help="port (default: %(default)s)")
    parser.add_argument("--max-queued", type=int, default=4096,
                        help="requests admitted at once before answering 503 (default: %(default)s)")
    parser.add_argument("--max-budget-s", type=float, default=600.0,
                        help="longest time one batch may take (default: %(default)s)")
    parser.add_argument("--max-body-mb", type=float, default=64.0,
                        help="largest request body accepted (default: %(default)s)")
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
    from dph_async.config import ConfigError, load_config
    from dph_async.rewards.wire import TOKEN_ENV

    try:
        cfg = load_config(args.config, args.overrides).rewards
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    if not _loopback(args.host) and token is None and not args.insecure:
        print(f"error: binding {args.host} exposes the scorer beyond this machine; set {TOKEN_ENV} "
              "(a shared token) or pass --insecure", file=sys.stderr)
        return 2

    import uvicorn

    from dph_async.rewards.service import ServiceSettings, make_app

    settings = ServiceSettings(max_queued=args.max_queued, max_budget_s=args.max_budget_s,
                               max_body_bytes=int(args.max_body_mb * 2**20), token=token)
    print(f"scorer: {cfg.workers} workers, http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(make_app(cfg, settings), host=args.host, port=args.port, log_level="warning")
    return 0
