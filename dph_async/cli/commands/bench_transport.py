"""`dph-async bench transport`: the rollout wire protocol against bare ZeroMQ, pickle and memcpy."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dph_async.cli.commands.common import add_output_argument
from dph_async.tools.bench import transport as bench
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
Groups/s and GB/s of rollout groups (n completions x T tokens of token ids, log-probs and versions)
between two processes over ipc:// and tcp://127.0.0.1: the wire protocol (encode, send, receive,
decode) against bare ZeroMQ moving the same arrays as raw frames, pickle through
multiprocessing.Queue (the group with numpy arrays, and as Python lists the way TRL's async GRPO
holds rollouts), and memcpy of the same bytes. Every repeat runs each mode once in rotating order
and ratios are taken within a repeat, so other load on the machine shifts both sides alike. Then the
whole ingest path into a replay process (RolloutSender to acknowledgement, write-ahead log off and
on, each with the replay's gate process and without, alternating) and the replay's insert+sample
rate in-process with 100k groups held. Targets for groups of 1 MiB and more: protocol >= 80% of
bare ZeroMQ and >= 10x the pickle queue. Prints tables, writes JSON (docs/benchmarks.md, Transport).

    dph-async bench transport -o runs/bench/transport.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=8, help="completions per group (default: %(default)s)")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[512, 2048, 8192, 16384, 32768],
        help="tokens per completion, one row each (default: %(default)s)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default: %(default)s)")
    parser.add_argument("--transports", nargs="+", choices=["ipc", "tcp"], default=["ipc", "tcp"])
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of every mode per cell, in rotating order; medians reported (default: %(default)s)",
    )
    parser.add_argument(
        "--mb", type=float, default=600.0, help="megabytes moved per run (200 to 20,000 groups) (default: %(default)s)"
    )
    parser.add_argument(
        "--ingest-tokens",
        type=int,
        nargs="*",
        default=[16, 512, 16384],
        help="tokens per completion of the ingest-path rows; none skips them (default: %(default)s)",
    )
    parser.add_argument(
        "--replay-held",
        type=int,
        default=100_000,
        help="groups held for the replay rate; 0 skips it (default: %(default)s)",
    )
    parser.add_argument("--replay-batch", type=int, default=64, help="groups per batch (default: %(default)s)")
    parser.add_argument("--replay-seconds", type=float, default=2.0, help="per replay measurement")
    add_output_argument(parser, "JSON results (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/transport.json"))


TRANSPORT_COLUMNS = ("n x T", "MiB/group", "via", "zmq GB/s", "protocol GB/s", "groups/s", "protocol/zmq",
                     "CPU us/group zmq", "protocol", "protocol CPU/zmq", "pickle GB/s", "protocol/pickle",
                     "pickle lists GB/s", "protocol/lists", "memcpy GB/s")


def _transport(args: argparse.Namespace, console: Console) -> dict:
    """Rollout groups between two processes: the protocol against bare ZeroMQ, pickle and memcpy."""

    def progress(cell: bench.Cell) -> None:
        console.print(f"  {cell.transport} n={cell.n} T={cell.tokens} {cell.mode}: "
                      f"{cell.groups_per_s:,.0f} groups/s, {cell.gb_per_s:.2f} GB/s", highlight=False)

    shapes = [(args.n, t) for t in args.tokens]
    rows = bench.bench_transport(shapes, args.transports, args.repeats, args.mb, args.prompt_tokens, progress)
    table = Table(title="rollout transport between two processes (medians; ratios: median of per-repeat ratios)")
    for col in TRANSPORT_COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['n']} x {r['tokens']}", f"{r['group_bytes'] / 2**20:.2f}", r["transport"],
            f"{r['zmq']['gb_per_s']:.2f}", f"{r['protocol']['gb_per_s']:.2f}", f"{r['protocol']['groups_per_s']:,.0f}",
            f"{r['protocol_vs_zmq']:.0%}", f"{r['zmq']['cpu_us_per_group']:,.0f}",
            f"{r['protocol']['cpu_us_per_group']:,.0f}", f"{r['protocol_cpu_vs_zmq']:.2f}x",
            f"{r['pickle']['gb_per_s']:.2f}", f"{r['protocol_vs_pickle']:.1f}x", f"{r['pickle_lists']['gb_per_s']:.3f}",
            f"{r['protocol_vs_pickle_lists']:.0f}x", f"{r['memcpy_gb_per_s']:.1f}")
    console.print(table)
    out: dict = {"transport": rows}
    big = [r for r in rows if r["group_bytes"] >= 2**20]
    if big:
        targets = {
            "protocol_vs_zmq": min(r["protocol_vs_zmq"] for r in big),
            "protocol_vs_pickle": min(r["protocol_vs_pickle"] for r in big),
            "protocol_vs_pickle_lists": min(r["protocol_vs_pickle_lists"] for r in big),
            "protocol_cpu_vs_zmq": max(r["protocol_cpu_vs_zmq"] for r in big),
        }
        out["targets_1mib_and_more"] = targets
        console.print(
            f"groups >= 1 MiB, worst row: protocol/zmq {targets['protocol_vs_zmq']:.0%} (target >= 80%); "
            f"protocol/pickle of numpy arrays {targets['protocol_vs_pickle']:.1f}x, of Python lists "
            f"(TRL's rollout form) {targets['protocol_vs_pickle_lists']:.0f}x (target >= 10x); CPU per group "
            f"{targets['protocol_cpu_vs_zmq']:.2f}x bare ZeroMQ's", highlight=False)
    return out


def _ingest(args: argparse.Namespace, console: Console) -> list[dict]:
    """The whole ingest path into a replay process, with and without its gate and write-ahead log."""
    rows: list[dict] = []
    for tokens in args.ingest_tokens:
        count = bench.count_for(args.n * tokens * 12, args.mb * 1e6)
        for wal in (False, True):
            pair = {gate: bench.bench_ingest(args.n, tokens, count, args.prompt_tokens, wal, gate)
                    for gate in ((True, False) if len(rows) % 4 == 0 else (False, True))}  # fmt: skip
            pair[True]["vs_no_gate"] = pair[True]["groups_per_s"] / pair[False]["groups_per_s"]
            rows += [pair[True], pair[False]]
    table = Table(title="ingest path: RolloutSender -> replay process (decode, validate, log, ack)")
    for col in ("n x T", "MiB/group", "write-ahead log", "gate", "groups/s", "GB/s", "gate / none", "all acked"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['n']} x {r['tokens']}", f"{r['group_bytes'] / 2**20:.2f}", "on" if r["wal"] else "off",
                      "on" if r["gate"] else "off", f"{r['groups_per_s']:,.0f}", f"{r['gb_per_s']:.2f}",
                      f"{r['vs_no_gate']:.2f}" if "vs_no_gate" in r else "", str(r["all_acknowledged"]))
    console.print(table)
    return rows


def _replay(args: argparse.Namespace, console: Console) -> list[dict]:
    """The replay's own insert and sample rates in-process, with and without its write-ahead log."""
    rows = [bench.bench_replay(args.replay_held, args.replay_batch, args.replay_seconds)]
    with tempfile.TemporaryDirectory(prefix="dph-bench-wal-") as wal:
        rows.append(bench.bench_replay(args.replay_held, args.replay_batch, args.replay_seconds, wal))
    table = Table(title=f"replay in-process, ~{args.replay_held:,} groups held, batches of {args.replay_batch}")
    for col in ("write-ahead log", "insert groups/s", "sample groups/s", "insert+sample pairs/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row("on" if r["wal"] else "off", f"{r['insert_groups_per_s']:,.0f}",
                      f"{r['sample_groups_per_s']:,.0f}", f"{r['insert_plus_sample_per_s']:,.0f}")
    console.print(table)
    return rows


def main(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the tables
        console = Console(width=240)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
    }
    result |= _transport(args, console)
    if args.ingest_tokens:
        result["ingest"] = _ingest(args, console)
    if args.replay_held:
        result["replay"] = _replay(args, console)
    result["machine"]["load_avg_after"] = list(os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.output}")
    return 0
