"""`dph-async ablate confirm`: the pre-registered confirmatory test, from the sweeps' raw results."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.app.ablate import confirm
from dph_async.app.ablate.seeds import read_seeds
from dph_async.app.commands.common import fail

DESCRIPTION = f"""\
The confirmatory test of docs/preregistration.md: for each task, the first sweep (A grpo@d_exp, B
js_low_var:0.2) and the second (run with learner.loss.reference_pg_share=0.375: C js_low_var:0.2 as
the official script trains it, D dpef_pg), read from their seeds.csv (every sweep writes one beside
its summary). Prints the family of paired t tests on the final models' in-domain Pass@1 and Pass@16,
Holm's decisions over all {confirm.FAMILY_SIZE}, the H1/H2 verdicts fixed before the runs, the
secondary table (J, B, C, D against the reverse-KL frontier at matched Pass@1) and every arm's
in-domain and OOD figures. Only the seeds {" ".join(map(str, confirm.SEEDS))} are analysed; a task whose
arms lack some of them is reported as incomplete (its tests enter Holm as p = 1). Rows of another
task, step count or reference_pg_share, or two sweeps from different pi_0s, are refused by name.

example:
  dph-async ablate confirm --task embedded runs/prereg/embedded runs/prereg/embedded-asrun \\
      --task digit_sets runs/prereg/digits runs/prereg/digits-asrun -o docs/data/confirm.md \\
      --figure docs/figures/confirm.png
"""


def _seeds_file(text: str) -> Path:
    path = Path(text)
    return path / "seeds.csv" if path.is_dir() else path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", nargs=3, action="append", required=True, metavar=("NAME", "SWEEP", "AS_RUN_SWEEP"),
                   help="a task's name, its first sweep and its as-run sweep (directories or seeds.csv files)")
    p.add_argument("-o", "--output", type=Path, help="also write the table and verdicts to this markdown file")
    p.add_argument("--figure", type=Path, help="draw Pass@16 against Pass@1 per task to this PNG")


def main(args: argparse.Namespace) -> int:
    tasks = {}
    for name, first, second in args.task:
        if name in tasks:
            return fail(f"--task {name} given twice")
        files = (_seeds_file(first), _seeds_file(second))
        for f in files:
            if not f.is_file():
                return fail(f"{f}: no such file (a sweep writes seeds.csv with its summary)")
        try:
            tasks[name] = (read_seeds(files[0]), read_seeds(files[1]))
        except ValueError as e:
            return fail(str(e))
    try:
        tests = confirm.family(tasks)
    except ValueError as e:
        return fail(str(e))
    text = confirm.markdown(tests, tasks)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if args.figure is not None:
        confirm.plot(tasks, args.figure)
    return 0
