"""`dph-async status`: one table of every process's health and key metrics."""

from __future__ import annotations

import argparse

NAME = "status"
HELP = "health and key metrics of a run's processes (replay, learner, actors, scorers)"
DESCRIPTION = """\
Read GET /health and /metrics of every long-running process and print one table: up or down, pid,
RSS, open files, threads, policy version, throughput (learner tokens/s, actor tokens/s, replay
ingest), the staleness bound eta (with replay.max_staleness=auto, the learner's too, with the mean ESS
it last decided on), replay occupancy and drops, admission tickets, checkpoints kept, and the
restarts of a service's gate process (a peer flooding its port) when there were any.

Processes announce their endpoints in <run>/rl/<mode>/endpoints/*.json (serve replay: in
<output_dir>/endpoints/); give a run directory to read them all, or URLs. Examples:

    dph-async status                                  # runs/default, every mode
    dph-async status runs/soak
    dph-async status http://127.0.0.1:40123 http://10.0.0.5:5001
    dph-async status runs/default --json              # the raw readings, for scripts

A process that does not answer is shown as down (an announce file of a stopped run says where it was).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="*", metavar="RUN_DIR|URL", default=["runs/default"],
                        help="run directories and/or endpoint URLs (default: runs/default)")
    parser.add_argument("--json", action="store_true", help="print the readings as JSON instead of a table")


def _mb(x: float | None) -> str:
    return "" if x is None else f"{x / 2**20:.0f}"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "" if x is None else fmt.format(x)


def row(r) -> list[str]:
    """The table cells of one Reading."""
    if not r.up:
        return [r.endpoint.name, "[red]down", str(r.endpoint.pid or ""), "", "", "", "", "", r.error[:60]]
    version = r.value("dph_learner_version") or r.value("dph_replay_version") or r.value("dph_actor_weights_version")
    notes: list[str] = []
    if (rate := r.value("dph_learner_tokens_per_second")) is not None:
        notes.append(f"{rate:.0f} tok/s, {r.value('dph_learner_checkpoints', 0):.0f} ckpt")
    if (eta := r.value("dph_learner_staleness_bound")) is not None:  # replay.max_staleness=auto
        signal = r.value("dph_learner_staleness_signal")
        notes.append(f"eta {eta:.0f} (auto" + (f", ESS {signal:.3f})" if signal is not None else ")"))
    if (rate := r.value("dph_actor_tokens_per_second")) is not None:
        notes.append(f"{rate:.0f} tok/s, {r.value('dph_actor_groups_sent', 0):.0f} groups")
    if (ingest := r.value("dph_replay_ingest_groups_per_second")) is not None:
        drops = {k: int(v) for k, v in r.by_label("dph_replay_drops_total", "reason").items() if v}
        notes.append(f"ingest {ingest:.1f} groups/s, eta {r.value('dph_replay_max_staleness', 0):.0f}, "
                     f"holds {r.value('dph_replay_occupancy', 0, what='groups'):.0f}, "
                     f"tickets {r.value('dph_replay_tickets_granted_total', 0):.0f} granted "
                     f"{r.value('dph_replay_tickets_parked', 0):.0f} parked, drops {drops or 0}")
    refused = {k: int(v) for k, v in r.by_label("dph_replay_rejected_total", "reason").items() if v}
    if refused:  # records a peer sent that the learner must not see, by reason (docs/data_plane.md)
        notes.append(f"[yellow]refused {refused}")
    # A gate started again means a peer flooded the port (docs/operating.md, "Gate processes").
    restarts = r.value("dph_replay_gate_restarts_total", 0) + r.value("dph_weights_gate_restarts_total", 0)
    if restarts:
        notes.append(f"[red]gate restarted {restarts:.0f}x")
    for service in ("replay", "weights"):  # honest actors sending or fetching at once would be dropped
        needed = r.value(f"dph_{service}_gate_memory_megabytes", 0, what="needed")
        if needed > r.value(f"dph_{service}_gate_memory_megabytes", 0, what="limit"):
            notes.append(f"[red]{service} gate memory short: needs {needed:.0f} MB (net.gate_memory_mb)")
    if (items := r.value("dph_scorer_items_total")) is not None:
        notes.append(f"{items:.0f} scored, {r.value('dph_scorer_in_flight', 0):.0f} in flight")
    return [r.endpoint.name, "[green]up", str(r.health.get("pid", r.endpoint.pid or "")),
            _mb(r.value("process_resident_memory_bytes")), _num(r.value("process_open_fds")),
            _num(r.value("process_threads")), _num(version), r.endpoint.url, "; ".join(notes)]


def main(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from dph_async.app.commands.common import fail
    from dph_async.app.endpoints import find_endpoints, scrape
    from dph_async.app.progress import console

    try:
        endpoints = find_endpoints(args.targets)
    except FileNotFoundError as e:
        return fail(str(e))
    if not endpoints:
        console.print(f"no endpoints announced under {', '.join(args.targets)} (is a run going, with net.metrics on?)")
        return 1
    readings = [scrape(ep) for ep in endpoints]
    if args.json:
        print(json.dumps([{"name": r.endpoint.name, "url": r.endpoint.url, "up": r.up, "error": r.error,
                           "health": r.health,
                           "metrics": {f"{n}{dict(ls) or ''}": v for (n, ls), v in r.samples.items()}}
                          for r in readings], indent=1))
    else:
        table = Table(title="dph-async status")
        for column in ("process", "state", "pid", "RSS MB", "fds", "threads", "version", "url", "activity"):
            table.add_column(column)
        for r in readings:
            table.add_row(*row(r))
        Console().print(table)  # the table is the output: stdout
    return 0 if all(r.up for r in readings) else 1
