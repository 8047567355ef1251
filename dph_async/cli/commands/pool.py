"""`dph-async pool`: the actor processes kept on a cluster for later invocations (launcher.keep_actors_s)."""

from __future__ import annotations

import argparse
import json
import logging

import ray
from rich.console import Console
from rich.table import Table

from dph_async.runtime.actor_pool import describe_pool, end_idle

DESCRIPTION = """\
With launcher.keep_actors_s=N on a cluster that outlives its drivers (launcher.address), an actor
process stays on the cluster after `dph-async run` ends, for the next invocation with the same
engine settings; it ends itself once no driver has called it for N seconds. This lists those
processes: name (dph-actor-<hash of the engine settings>-<id>), node, pid, whether a run holds it,
seconds since a driver last called it, and N. --end ends those no run holds: their engines' memory
and their CPUs go back to the cluster. Examples:

    dph-async pool 10.0.0.1:6379
    dph-async pool auto --end          # the cluster `ray start` made on this machine
    scripts/cluster.sh pool            # the head cluster.sh started (with Ray's token)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the Ray cluster: host:port, or auto")
    parser.add_argument("--end", action="store_true", help="end the kept processes no run holds")
    parser.add_argument("--json", action="store_true", help="print the processes as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        rows = describe_pool()
        ended = end_idle() if args.end else []
    finally:
        ray.shutdown()
    for row in rows:
        row["ended"] = row["name"] in ended
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"kept actor processes ({len(rows)}{f', {len(ended)} ended' if args.end else ''})")
    for col in ("name", "node", "pid", "actor", "held by a run", "idle s", "keep s", "ended"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["node"], str(r["pid"]), str(r["actor_id"]), "yes" if r["held"] else "no",
                      f"{r['idle_s']:.0f}", f"{r['keep_s']:.0f}", "yes" if r["ended"] else "")
    Console().print(table)
    return 0
