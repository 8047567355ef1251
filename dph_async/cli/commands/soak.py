"""`dph-async soak`: train the default workload continuously and check that resources stay flat."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, add_output_argument, fail
from dph_async.config import load_config
from dph_async.progress import console
from dph_async.tools.soak import run_soak, write_report

DESCRIPTION = """\
Run the default workload (or a preset with overrides) as one long RL run, the data cycled, until
--minutes after the first learner step. Every --interval-s it samples each process's RSS, open file
descriptors, threads and CPU time (from its /metrics; the services' gate processes from /proc), the
/dev/shm files the processes hold, the write-ahead log's and the checkpoints' size, and the learner's
throughput. After the warm-up it checks: RSS within ±5%, fds and /dev/shm bounded, the WAL within its
compaction bound, checkpoints within learner.keep_checkpoints, throughput within ±10% of the median;
and over the whole soak, no gate process started again. Exit status 0 when every check passes.

Beside the throughput it reports each process's CPU-seconds per learner step. Every step is the same
work, so if throughput falls while those rise in every process at once, the machine ran slower (a
shared host); if one process's rises alone, that process does more per step.

Report: <output>/soak/soak.json, soak.md, soak.png. Examples:

    nice dph-async soak --minutes 60
    dph-async soak --minutes 20 -o runs/soak-grpo learner.loss.objective=grpo
    dph-async soak --minutes 2 --interval-s 15 --warmup-s 30 learner.loss.objective=grpo
    dph-async soak --minutes 10 actors.num_actors=4 learner.keep_checkpoints=2

The soak's own defaults (before your overrides): its run directory runs/soak, learner.steps out of reach,
learner.checkpoint_every=20, replay.wal_segment_mb=1 and replay.wal_compact_mb=4 (so that log
compaction and segment deletion happen many times), wandb off.
"""

SOAK_DEFAULTS = ("output_dir=runs/soak", "learner.steps=1000000000", "learner.checkpoint_every=20",
                 "replay.wal_segment_mb=1", "replay.wal_compact_mb=4", "logging.wandb_mode=disabled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "config overrides")
    add_output_argument(parser, "run directory (default: runs/soak, or output_dir=...); the report goes in its soak/")
    parser.add_argument("--minutes", type=float, default=60.0, help="soak length after the first step (default: 60)")
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples (default: 60)")
    parser.add_argument("--warmup-s", type=float,
                        help="samples before this are not judged (default: a fifth of the soak, at least one interval)")


def main(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.interval_s <= 0:
        return fail("--minutes and --interval-s must be positive")
    output = [f"output_dir={args.output}"] if args.output else []
    cfg = load_config(args.preset, [*SOAK_DEFAULTS, *args.overrides, *output])

    warmup = args.warmup_s if args.warmup_s is not None else max(args.interval_s, args.minutes * 60 / 5)

    def show(sample) -> None:
        rss = ", ".join(f"{n} {p.rss_bytes / 2**20:.0f} MB" for n, p in sorted(sample.processes.items()))
        console.print(f"soak t={sample.t / 60:5.1f} min  version {sample.learner_version:.0f}  {rss}  "
                      f"shm {sample.shm_files}  WAL {sample.wal_bytes / 2**20:.1f} MB  ckpts {sample.checkpoints}")

    try:
        result = run_soak(cfg, args.minutes, args.interval_s, warmup, on_sample=show)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: no report")
        return 130
    out = Path(cfg.output_dir) / "soak"
    write_report(result, out)
    for c in result.checks:
        console.print(f"{'[green]ok  ' if c.ok else '[red]FAIL'}[/] {c.name}: {c.detail}")
    console.print(f"report: {out / 'soak.md'}")
    return 0 if result.passed else 1
