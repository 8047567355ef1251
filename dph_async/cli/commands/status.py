"""`dph-async status`: the health and key metrics of a run's processes, or a finished run's result."""

from __future__ import annotations

import argparse
import json
import math
import re
from datetime import datetime
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape as escape_markup
from rich.table import Table

from dph_async.cli.commands.common import fail
from dph_async.pipeline.run_outcome import RLOutcome, RunFileError, RunOutcome, finished_rl, finished_run
from dph_async.progress import console as progress_console
from dph_async.runtime.endpoints import TIMEOUT_S, Endpoint, Reading, find_endpoints, scrape_all

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape(text: str) -> str:
    """A peer's text (a name, a label, a pid, a mode read from a stranger's files) as plain text: rich's
    markup escaped, and control characters shown as \\xNN, so that an ESC sequence cannot clear the
    screen, set the terminal's title or colour what follows."""
    return escape_markup(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


DESCRIPTION = """\
Read GET /health and /metrics of every long-running process and print a table of those that answer:
pid, RSS, open files, threads, policy version, throughput (learner tokens/s, actor tokens/s, replay
ingest), the staleness bound eta (with replay.max_staleness=auto, the learner's too, with the mean ESS
and data wait it last decided on), replay occupancy and drops, admission tickets, checkpoints kept,
and the restarts of a service's gate process (a peer flooding its port) when there were any.

Processes announce their endpoints in <run>/rl/<mode>/endpoints/*.json (serve replay: in
<output_dir>/endpoints/); give a run directory to read them all, or URLs. Examples:

    dph-async status                                  # runs/default, every mode
    dph-async status runs/soak
    dph-async status http://127.0.0.1:40123 http://10.0.0.5:5001
    dph-async status runs/default --json              # the raw readings, for scripts

A process that does not answer within 3 s (for /health and /metrics together), or answers what is
not health JSON and Prometheus text within their sizes, is shown as down, with the reason in a few
words (--json has the whole error); an announce file that cannot be read is shown as unreadable. The
processes of an RL run that finished (rl/<mode>/result.json) are not asked: the run is one line. A run
that finished (its summary.json written) with none of its processes answering is shown as finished,
with its key figures: every RL run's steps and time, and each model's greedy accuracy and Pass@k on
each test set (summary.md has the rest).

Exit status: 0 when every process asked answers, or the run finished; 1 otherwise; 2 with one error
line when the run's summary.json cannot be read.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="*", metavar="RUN_DIR|URL", default=["runs/default"],
                        help="run directories and/or endpoint URLs (default: runs/default)")
    parser.add_argument("--json", action="store_true", help="print the readings as JSON instead of a table")


def _mb(x: float | None) -> str:
    return "" if x is None else f"{x / 2**20:.0f}"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "" if x is None else fmt.format(x)


def _count(x: float) -> int | float:
    """A counter as a whole number; a peer's NaN or infinity as it is."""
    return int(x) if math.isfinite(x) else x


def reason(r: Reading) -> str:
    """Why a process counts as down, in a few words."""
    if not r.error:
        return f"health {r.health.get('status')!r}"[:60]
    if "Connection refused" in r.error:
        return "connection refused"
    if ": timeout:" in r.error:
        return f"no complete answer in {TIMEOUT_S:.0f} s"
    return " ".join(r.error.split())[:100]


def down_line(r: Reading) -> str:
    pid = f" (pid {r.endpoint.pid})" if r.endpoint.pid else ""
    return f"[red]down[/] {escape(r.endpoint.name)}{pid}: {escape(reason(r))}"


def row(r: Reading) -> list[str]:
    """The table cells of a Reading of a process that answered."""
    versions = (r.value(name) for name in ("dph_learner_version", "dph_replay_version", "dph_actor_weights_version"))
    version = next((v for v in versions if v is not None), None)  # version 0 is a version
    notes: list[str] = []
    if (rate := r.value("dph_learner_tokens_per_second")) is not None:
        notes.append(f"{rate:.0f} tok/s, {r.value('dph_learner_checkpoints', 0):.0f} ckpt")
    if (eta := r.value("dph_learner_staleness_bound")) is not None:  # replay.max_staleness=auto
        signal, wait = r.value("dph_learner_staleness_signal"), r.value("dph_learner_staleness_wait")
        notes.append(f"eta {eta:.0f} (auto" + (f", ESS {signal:.3f}" if signal is not None else "")
                     + (f", wait {wait:.3f}" if wait is not None else "") + ")")
    if (rate := r.value("dph_actor_tokens_per_second")) is not None:
        notes.append(f"{rate:.0f} tok/s, {r.value('dph_actor_groups_sent', 0):.0f} groups")
    if (ingest := r.value("dph_replay_ingest_groups_per_second")) is not None:
        drops = {k: _count(v) for k, v in r.by_label("dph_replay_drops_total", "reason").items() if v}
        notes.append(f"ingest {ingest:.1f} groups/s, eta {r.value('dph_replay_max_staleness', 0):.0f}, "
                     f"holds {r.value('dph_replay_occupancy', 0, what='groups'):.0f}, "
                     f"tickets {r.value('dph_replay_tickets_granted_total', 0):.0f} granted "
                     f"{r.value('dph_replay_tickets_parked', 0):.0f} parked, drops {escape(str(drops or 0))}")
    refused = {k: _count(v) for k, v in r.by_label("dph_replay_rejected_total", "reason").items() if v}
    if refused:  # records a peer sent that the learner must not see, by reason (docs/data_plane.md)
        notes.append(f"[yellow]refused {escape(str(refused))}")
    # A gate started again means a peer flooded the port (docs/operating.md, "Gate processes").
    restarts = r.value("dph_replay_gate_restarts_total", 0) + r.value("dph_weights_gate_restarts_total", 0)
    if restarts:
        notes.append(f"[red]gate restarted {restarts:.0f}x")
    if damaged := r.value("dph_replay_wal_damaged_records_total", 0):  # their groups are generated again
        notes.append(f"[red]log damaged: {damaged:.0f} records lost at recovery")
    for service in ("replay", "weights"):  # honest actors sending or fetching at once would be dropped
        needed = r.value(f"dph_{service}_gate_memory_megabytes", 0, what="needed")
        if needed > r.value(f"dph_{service}_gate_memory_megabytes", 0, what="limit"):
            notes.append(f"[red]{service} gate memory short: needs {needed:.0f} MB (net.gate_memory_mb)")
    if (items := r.value("dph_scorer_items_total")) is not None:
        notes.append(f"{items:.0f} scored, {r.value('dph_scorer_in_flight', 0):.0f} in flight")
    # Names, labels and the pid come from the peer: escaped, so that "[/]" in them is text, not markup.
    return [escape(r.endpoint.name), "[green]up", escape(str(r.health.get("pid", r.endpoint.pid or ""))[:20]),
            _mb(r.value("process_resident_memory_bytes")), _num(r.value("process_open_fds")),
            _num(r.value("process_threads")), _num(version), escape(r.endpoint.url.removeprefix("http://")),
            "; ".join(notes)]


def show_finished(outcome: RunOutcome, console: Console) -> None:
    """A finished run's key figures, in a few lines."""
    m, sec = divmod(round(outcome.wall_s), 60)
    when = datetime.fromtimestamp(outcome.finished_at).strftime("%Y-%m-%d %H:%M")
    console.print(f"[green]{escape(str(outcome.root))}: finished[/] {when}, in {m} min {sec} s; no process running")
    console.print("stages: " + ", ".join(f"{escape(k)} {v:.0f} s" for k, v in outcome.stages.items()))
    for run in outcome.runs:
        console.print(f"  {rl_line(run)}")
    splits = list(dict.fromkeys(s.test_set for s in outcome.scores))
    if splits:
        k = max(s.k for s in outcome.scores)
        table = Table(title="greedy accuracy and Pass@k (%)", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("model", no_wrap=True)
        for split in splits:
            table.add_column(f"{split} greedy", justify="right")
            table.add_column(f"{split} P@{k}", justify="right")
        for model in dict.fromkeys(s.model for s in outcome.scores):
            scores = {s.test_set: s for s in outcome.scores if s.model == model}
            cells = []
            for split in splits:
                score = scores.get(split)
                cells += [f"{100 * score.greedy:.1f}", f"{100 * score.pass_at_k:.1f}"] if score else ["-", "-"]
            table.add_row(escape(model), *cells)
        console.print(table)
    console.print(f"report: {escape(str(outcome.root / 'summary.md'))}")


def rl_line(run: RLOutcome) -> str:
    line = f"rl/{escape(run.name)}: finished, {run.steps} steps in {run.wall_s:.0f} s"
    counts = ((run.dropped, "groups dropped"), (run.actor_restarts, "actor restarts"))
    return line + "".join(f", {n} {what}" for n, what in counts if n)


def live_table(readings: list[Reading], done: dict[str, RLOutcome], console: Console) -> None:
    """A table of the processes that answered, a line per process that did not and per RL run that
    finished."""
    for run in done.values():
        console.print(rl_line(run))
    if up := [r for r in readings if r.up]:
        table = Table(title="dph-async status", box=box.SIMPLE_HEAD)
        for column in ("process", "state", "pid", "MB", "fds", "thr", "ver", "url"):  # narrow: activity wraps
            table.add_column(column, no_wrap=True, overflow="ellipsis")
        table.add_column("activity", ratio=1, overflow="fold")
        for r in up:
            table.add_row(*row(r))
        console.print(table)
    for r in readings:
        if not r.up:
            console.print(down_line(r), overflow="ellipsis", no_wrap=True)


def finished_modes(endpoints: list[Endpoint]) -> tuple[dict[str, RLOutcome], list[str]]:
    """{announce file: its RL run} for the modes that finished (rl/<mode>/result.json), and a line per
    result.json that cannot be read (its processes are asked as if it were not there)."""
    outcomes: dict[Path, RLOutcome | None] = {}
    problems: list[str] = []
    for ep in endpoints:
        rl_dir = Path(ep.source).parent.parent  # an announce file under rl/<mode>/endpoints
        if ep.source and rl_dir not in outcomes:
            try:
                outcomes[rl_dir] = finished_rl(rl_dir)
            except RunFileError as e:
                outcomes[rl_dir] = None
                problems.append(f"[yellow]unreadable[/] {escape(str(e))}")
    done = {ep.source: run for ep in endpoints if ep.source and (run := outcomes[Path(ep.source).parent.parent])}
    return done, problems


def main(args: argparse.Namespace) -> int:
    try:
        endpoints = find_endpoints(args.targets)
    except FileNotFoundError as e:
        return fail(str(e))
    if args.json:
        readings = scrape_all(endpoints)
        print(json.dumps([{"name": r.endpoint.name, "url": r.endpoint.url, "up": r.up, "error": r.error,
                           "health": r.health,
                           "metrics": {f"{n}{dict(ls) or ''}": v for (n, ls), v in r.samples.items()}}
                          for r in readings], indent=1))
        return 0 if all(r.up for r in readings) else 1
    # An announce file under rl/<mode>/endpoints of a mode that finished is where a process was.
    done, problems = finished_modes(endpoints)
    readings = scrape_all([ep for ep in endpoints if ep.source not in done])
    console = Console()  # the report is the output: stdout
    if not any(r.up for r in readings):  # summary.json matters only then: it may be an earlier invocation's
        try:
            finished = [o for t in args.targets
                        if not t.startswith(("http://", "https://")) and (o := finished_run(Path(t)))]
        except RunFileError as e:
            return fail(str(e))
        if finished:
            for outcome in finished:
                show_finished(outcome, console)
            return 0
    if not endpoints:
        progress_console.print(f"no endpoints announced under {', '.join(args.targets)} "
                               "(is a run going, with net.metrics on?)")
        return 1
    for line in problems:
        console.print(line, overflow="ellipsis", no_wrap=True)
    live_table(readings, {run.name: run for run in done.values()}, console)
    if not readings:
        console.print(f"no process of {', '.join(args.targets)} is running, and it has not finished")
        return 1
    return 0 if all(r.up for r in readings) else 1
