"""`dph-async ablate confirm`: a pre-registered test (docs/preregistration.md), from sweeps' raw results."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from dph_async.cli.commands.common import fail
from dph_async.tools.ablate import confirm, confirm_forgetting, confirm_plot, confirm_staleness
from dph_async.tools.ablate.seeds import read_seeds

DESCRIPTION = f"""\
A pre-registered test of docs/preregistration.md, from the seeds.csv every sweep writes beside its
summary. Rows of another task, step count, objective or reference_pg_share, a seed twice, or (design
1) two sweeps from different pi_0s, are refused by name.

--design divergence (design 1, the default): per task, the first sweep (A grpo@d_exp, B
js_low_var:0.2) and the as-run sweep (run with learner.loss.reference_pg_share=0.375: C
js_low_var:0.2 as the official script trains it, D dpef_pg). Prints the family of paired t tests on
the final models' in-domain Pass@1 and Pass@16, Holm's decisions over all {confirm.FAMILY_SIZE}, the H1/H2
verdicts fixed before the runs, the secondary table (J, B, C, D against the reverse-KL frontier at
matched Pass@1) and every arm's in-domain and OOD figures. Only the seeds
{" ".join(map(str, confirm.SEEDS))} are analysed; a task whose arms lack some of them is incomplete (its
tests enter Holm as p = 1).

--design staleness (design 2): per task, one `ablate staleness` sweep (GRPO, seeds
{" ".join(map(str, confirm_staleness.SEEDS))}). Prints which (correction, eta) bind, each one's Pass@1
against eta = 0 with its reading, throughput ratios, and the S1 (AReaL's shape) and S2 (auto) verdicts.

--design staleness-trust (design 4): design 2 with learner.mini_batches=4 (decoupled PPO's clip acts
from the second update of a batch); the same computation, rows of another mini-batch count refused.

--design forgetting (design 3): per task, one `ablate divergence` sweep at the task's OOD share
(grpo@d_exp, js_low_var:0.2, reverse_kl:0.1; seeds {" ".join(map(str, confirm_forgetting.SEEDS))}).
Prints GRPO's OOD Pass@1 against pi_0's and each DPH arm's against GRPO's, Holm over all
{confirm_forgetting.FAMILY_SIZE}, the in-domain bound, and the F and K verdicts.

examples:
  dph-async ablate confirm --task embedded runs/prereg/embedded runs/prereg/embedded-asrun \\
      --task digit_sets runs/prereg/digit_sets runs/prereg/digit_sets-asrun -o confirm.md \\
      --figure confirm.png
  dph-async ablate confirm --design staleness --task embedded runs/prereg/staleness-embedded
  dph-async ablate confirm --design staleness-trust --task embedded runs/prereg/staleness4-embedded
  dph-async ablate confirm --design forgetting --task embedded runs/prereg/forgetting-embedded
"""

SWEEPS = {"divergence": 2, "staleness": 1, "staleness-trust": 1, "forgetting": 1}
MINI_BATCHES = {"staleness": 1, "staleness-trust": 4}  # the staleness designs' learner.mini_batches


def _seeds_file(text: str) -> Path:
    path = Path(text)
    return path / "seeds.csv" if path.is_dir() else path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--design", choices=list(SWEEPS), default="divergence",
                   help="which pre-registered design (default: %(default)s)")
    p.add_argument("--task", nargs="+", action="append", required=True, metavar="NAME SWEEP",
                   help="a task's name and its sweeps (directories or seeds.csv files): two for divergence (the "
                        "first, the as-run), one for the others")
    p.add_argument("-o", "--output", type=Path, help="also write the tables and verdicts to this markdown file")
    p.add_argument("--figure", type=Path, help="divergence: draw Pass@16 against Pass@1 per task to this PNG")


def _outputs(args: argparse.Namespace, inputs: list[Path]) -> str | None:
    """What is wrong with --output and --figure, checked before anything is computed (None: nothing)."""
    if args.figure is not None and args.design != "divergence":
        return f"--figure draws the divergence design's frontier; the {args.design} design has none"
    if args.figure is not None and args.figure.suffix.lower() != ".png":
        return f"--figure {args.figure}: give a .png file"
    for flag, path in (("--output", args.output), ("--figure", args.figure)):
        if path is None:
            continue
        if path.is_dir():
            return f"{flag} {path}: a directory; give a file"
        if any(path.resolve() == f.resolve() for f in inputs):
            return f"{flag} {path}: one of the inputs; it would be overwritten"
        if any(parent.exists() and not parent.is_dir() for parent in path.parents):
            return f"{flag} {path}: a parent is not a directory"
    return None


def _write(path: Path, write: Callable[[Path], object]) -> str | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except (OSError, ValueError) as e:
        return f"{path}: cannot be written ({e})"
    return None


def main(args: argparse.Namespace) -> int:
    tasks: dict = {}
    inputs: list[Path] = []
    for name, *sweeps in args.task:
        if name in tasks:
            return fail(f"--task {name} given twice")
        if len(sweeps) != SWEEPS[args.design]:
            return fail(f"--task {name}: the {args.design} design takes {SWEEPS[args.design]} sweep(s), got "
                        f"{len(sweeps)}")
        files = [_seeds_file(s) for s in sweeps]
        for f in files:
            if not f.exists():
                return fail(f"{f}: no such file (a sweep writes seeds.csv with its summary)")
            if not f.is_file():
                return fail(f"{f}: not a regular file")
        inputs += files
        try:
            rows = [read_seeds(f) for f in files]
        except (ValueError, OSError) as e:  # OSError: unreadable (permissions), named by its own message
            return fail(str(e))
        tasks[name] = tuple(rows) if args.design == "divergence" else rows[0]
    if (problem := _outputs(args, inputs)) is not None:
        return fail(problem)
    try:
        if args.design == "divergence":
            text = confirm.markdown(confirm.family(tasks), tasks)
        elif args.design in MINI_BATCHES:
            text = confirm_staleness.markdown(tasks, MINI_BATCHES[args.design])
        else:
            text = confirm_forgetting.markdown(tasks)
    except ValueError as e:
        return fail(str(e))
    # The files first: a reader of the printout that hangs up (`| head`) must not cost them.
    if args.output is not None and (problem := _write(args.output, lambda p: p.write_text(text + "\n"))):
        return fail(problem)
    if args.figure is not None and (problem := _write(args.figure, lambda p: confirm_plot.plot(tasks, p))):
        return fail(problem)
    print(text)
    return 0
