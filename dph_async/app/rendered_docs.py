"""Tables and figures of the docs, rendered from the result data committed beside them (docs/data/).

A markdown file marks each rendered part as a block:

    <!-- rendered: KIND ARG ... -->
    (what RENDERERS[KIND] makes of the arguments; never edited by hand)
    <!-- end rendered -->

ARGs are paths relative to the repository's root (a task's name where a renderer says so). `make docs`
rewrites every block of every file in DOCS from its data; `make docs CHECK=1` (and the test suite)
only compares, and names each block whose text differs from what its data gives, so a figure pasted
by hand or data changed without its doc fails CI. Figures are written by a render, not compared (a
PNG's bytes follow the plotting library's version); the check asks that the file exist.

    python -m dph_async.app.rendered_docs [--check] [FILE ...]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dph_async.app.ablate import confirm, confirm_plot
from dph_async.app.ablate.results import stat
from dph_async.app.ablate.seeds import BASE, read_seeds
from dph_async.app.report import markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/ablations.md")
# A block's lines start at the line's start: the markers quoted inside prose (as here) are no block.
BLOCK = re.compile(r"^<!-- rendered: (?P<spec>[^\n]*?) -->\n(?P<body>.*?)^<!-- end rendered -->", re.S | re.M)
OPEN = re.compile(r"^<!-- rendered:", re.M)


@dataclass(frozen=True)
class Context:
    root: Path  # the ARGs' base
    doc: Path  # the file the block is in (a figure's link is relative to it)
    write: bool  # False under --check: no file is written

    def path(self, arg: str) -> Path:
        """An ARG as a path inside the root: a doc is text from anyone who edits it, and rendering it must
        not read or write outside the repository (`../`, an absolute path, a link leading out)."""
        root = self.root.resolve()
        path = (root / arg).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"{arg}: outside the repository")
        return path


Renderer = Callable[[list[str], Context], str]


def _percent(x: str) -> str:
    return f"{100 * float(x):.1f}"


def ood_calibration(args: list[str], ctx: Context) -> str:
    """`ood-calibration CSV`: pi_0's figures per task and `task.ood_warm_share` (the rows of
    `dph-async run task.ood_warm_share=s learner.steps=2 eval.max_prompts=100`, %)."""
    (path,) = _exactly(args, 1, "ood-calibration CSV")
    with ctx.path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    return markdown_table(
        ["task", "s", "in-domain P@1 / P@16", "OOD greedy", "OOD P@1", "OOD P@16"],
        [[r["task"], r["ood_warm_share"], f"{_percent(r['in_domain/pass@1'])} / {_percent(r['in_domain/pass@16'])}",
          _percent(r["ood/greedy"]), _percent(r["ood/pass@1"]), _percent(r["ood/pass@16"])] for r in rows])


def splits(args: list[str], ctx: Context) -> str:
    """`splits SEEDS_CSV`: pi_0 and every group of a sweep, in-domain and OOD Pass@1 / Pass@16, mean ± s.e.
    over its seeds (%), groups in the order the sweep ran them."""
    (path,) = _exactly(args, 1, "splits SEEDS_CSV")
    rows = read_seeds(ctx.path(path))
    groups = list(dict.fromkeys(r.group for r in rows if r.group != BASE))
    base = next((r.metrics for r in rows if r.group == BASE), {})
    table = [["π₀", "1", *(" / ".join(_percent(str(base[f"{s}/pass@{k}"])) for k in (1, 16))
                           for s in ("in_domain", "ood"))]]
    for g in groups:
        cells = [r for r in rows if r.group == g]
        table.append([g, str(len(cells)), *(" / ".join(stat([r.metrics[f"{s}/pass@{k}"] for r in cells]).fmt(100, 1)
                                                      for k in (1, 16)) for s in ("in_domain", "ood"))])
    return markdown_table(["model", "seeds", "in-domain P@1 / P@16", "OOD P@1 / P@16"], table)


def _tasks(args: list[str], ctx: Context, usage: str) -> dict[str, confirm.Sweeps]:
    """TASK CSV CSV triples: a task's name, its first and its as-run sweep (checked as the design asks)."""
    if not args or len(args) % 3:
        raise ValueError(f"{usage}: give TASK FIRST_CSV AS_RUN_CSV per task, got {len(args)} argument(s)")
    tasks = {args[i]: (read_seeds(ctx.path(args[i + 1])), read_seeds(ctx.path(args[i + 2])))
             for i in range(0, len(args), 3)}
    for name, sweeps in tasks.items():
        confirm.check_task(name, sweeps)
    return tasks


def confirm_tables(args: list[str], ctx: Context) -> str:
    """`confirm TASK FIRST_CSV AS_RUN_CSV ...`: design 1's family, verdicts, secondary and descriptive
    tables (`dph-async ablate confirm`)."""
    tasks = _tasks(args, ctx, "confirm")
    return confirm.markdown(confirm.family(tasks), tasks)


def confirm_figure(args: list[str], ctx: Context) -> str:
    """`confirm-figure PNG TASK FIRST_CSV AS_RUN_CSV ...`: design 1's Pass@16 against Pass@1 per task,
    drawn to PNG; the block holds its link."""
    if not args:
        raise ValueError("confirm-figure: give PNG, then TASK FIRST_CSV AS_RUN_CSV per task")
    png, rest = ctx.path(args[0]), args[1:]
    if png.suffix != ".png":
        raise ValueError(f"{args[0]}: a figure is a .png file")
    tasks = _tasks(rest, ctx, "confirm-figure")
    if ctx.write:
        confirm_plot.plot(tasks, png)
    elif not png.is_file():
        raise ValueError(f"{args[0]}: no such figure (render it: make docs)")
    return f"![Pass@16 against Pass@1 per task: {', '.join(tasks)}]({os.path.relpath(png, ctx.doc.parent)})"


RENDERERS: dict[str, Renderer] = {"ood-calibration": ood_calibration, "splits": splits,
                                  "confirm": confirm_tables, "confirm-figure": confirm_figure}


def _exactly(args: list[str], n: int, usage: str) -> list[str]:
    if len(args) != n:
        raise ValueError(f"{usage}: {n} argument(s), got {len(args)}")
    return args


@dataclass(frozen=True)
class Stale:
    doc: Path
    line: int
    spec: str


def render(text: str, ctx: Context) -> tuple[str, list[tuple[int, str]]]:
    """`text` with every block re-rendered, and the (line, spec) of each block whose body changed. A
    block that is not closed, or an unknown KIND, or a renderer's complaint, is a ValueError naming the
    line."""
    out, changed, end = [], [], 0
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        _unclosed(text[end:m.start()], text.count("\n", 0, end) + 1)
        if OPEN.search(m["body"]):
            raise ValueError(f"line {line}: a block without `<!-- end rendered -->` before the next block")
        kind, *args = m["spec"].split() or [""]
        if kind not in RENDERERS:
            raise ValueError(f"line {line}: no renderer {kind!r} (known: {', '.join(sorted(RENDERERS))})")
        try:
            body = RENDERERS[kind](args, ctx).rstrip("\n") + "\n"
        except (ValueError, OSError) as e:
            raise ValueError(f"line {line}: {m['spec']}: {e}") from None
        if body != m["body"]:
            changed.append((line, m["spec"]))
        out += [text[end:m.start()], f"<!-- rendered: {m['spec']} -->\n", body, "<!-- end rendered -->"]
        end = m.end()
    _unclosed(text[end:], text.count("\n", 0, end) + 1)
    return "".join([*out, text[end:]]), changed


def _unclosed(part: str, first_line: int) -> None:
    if m := OPEN.search(part):
        raise ValueError(f"line {first_line + part.count(chr(10), 0, m.start())}: a block without "
                         "`<!-- end rendered -->`")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dph_async.app.rendered_docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming every stale block")
    p.add_argument("files", nargs="*", type=Path, help=f"markdown files (default: {' '.join(DOCS)})")
    args = p.parse_args(argv)
    stale: list[Stale] = []
    for doc in args.files or [ROOT / d for d in DOCS]:
        try:
            text = doc.read_text(encoding="utf-8")
            new, changed = render(text, Context(ROOT, doc.resolve(), write=not args.check))
        except (OSError, ValueError) as e:
            print(f"error: {doc}: {e}", file=sys.stderr)
            return 2
        stale += [Stale(doc, line, spec) for line, spec in changed]
        if not args.check and new != text:
            doc.write_text(new, encoding="utf-8")
    for s in stale:
        print(f"{s.doc}:{s.line}: {'stale' if args.check else 'rendered'}: {s.spec}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
