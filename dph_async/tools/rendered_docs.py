"""Tables and figures of the docs, rendered from the result data committed beside them (docs/data/).

A markdown file marks each rendered part as a block, its markers each on a line of its own:

    <!-- rendered: KIND ARG ... -->
    (what RENDERERS[KIND] makes of the arguments; never edited by hand)
    <!-- end rendered -->

ARGs are paths inside the repository (a task's name where a renderer says so). `make docs` rewrites
every block of README.md and docs/**/*.md from its data; `make docs CHECK=1` (and the test suite)
only compares, and names each block whose text differs from what its data gives, so a number pasted
by hand or data changed without its doc fails CI. A figure is a PNG that carries a digest of what it
shows (its `Source` text chunk: every panel's titles, labels, and each line's, bar's and text's data
and colour, not its pixels, which follow the plotting library's version): the check draws the figure
again and compares, so a figure drawn from other data or other plotting code, or put there by hand,
is stale too. A render writes nothing unless every block of every file rendered, and never
overwrites a PNG it did not draw. Markers are found line by line (a doc's lines end in LF or CRLF).

    python -m dph_async.tools.rendered_docs [--check] [FILE ...]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dph_async.pipeline.report import markdown_table
from dph_async.tools.ablate import confirm, confirm_forgetting, confirm_plot, confirm_staleness
from dph_async.tools.ablate.results import stat
from dph_async.tools.ablate.seeds import BASE, SeedRow, read_seeds, repeated_seed
from dph_async.tools.bench import scale_data, scale_report, tta_data, tta_report

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/**/*.md")
OPEN = re.compile(r"<!-- rendered: (?P<spec>.*?) -->")  # the whole line
END = "<!-- end rendered -->"
# Anything at a line's start that looks like a marker: what is not exactly one is misspelt or stray.
MARKER = re.compile(r"[ \t]*<!--[ \t]*(end[ \t]+)?rendered\b", re.I)
SOURCE = "dph-async rendered "  # a rendered PNG's Source text chunk: this, then its fingerprint


@dataclass
class Context:
    root: Path  # the ARGs' base
    doc: Path  # the file the block is in (a figure's link is relative to it)
    write: bool  # False under --check: no file is written
    figures: list[Callable[[], tuple[Path, Path]]] = field(default_factory=list)  # drafts, drawn once all rendered
    stale_figures: list[str] = field(default_factory=list)  # under --check: figures not drawn from their data
    figure_paths: set[Path] = field(default_factory=set)  # every figure a block draws: one block each

    def path(self, arg: str) -> Path:
        """An ARG as a path inside the root: a doc is text from anyone who edits it, and rendering it must
        not read or write outside the repository (`../`, an absolute path, a link leading out)."""
        root = self.root.resolve()
        path = (root / arg).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"{arg}: outside the repository")
        return path


Renderer = Callable[[list[str], Context], str]


def _cell(text: str) -> str:
    """A table cell from data: `|` escaped; a line break (which would end the row, or the block) refused."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"{text!r}: a line break in a table cell")
    return text.replace("|", "\\|")


CALIBRATION = ("task", "ood_warm_share", "in_domain/pass@1", "in_domain/pass@16", "ood/greedy", "ood/pass@1",
               "ood/pass@16")


def _share(row: dict[str, str], column: str, line: int) -> float:
    try:
        x = float(row[column])
    except ValueError:
        raise ValueError(f"line {line}: {column} {row[column]!r} is not a number") from None
    if not 0.0 <= x <= 1.0:  # NaN fails this too
        raise ValueError(f"line {line}: {column} {x!r} is not a share in [0, 1]")
    return x


def ood_calibration(args: list[str], ctx: Context) -> str:
    """`ood-calibration CSV`: pi_0's figures per task and `task.ood_warm_share` (the rows of
    `dph-async run task.ood_warm_share=s learner.steps=2 eval.max_prompts=100`, %)."""
    (path,) = _exactly(args, 1, "ood-calibration CSV")
    table = []
    with ctx.path(path).open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames or []
            if twice := sorted({c for c in header if header.count(c) > 1}):
                raise ValueError(f"{path}: column {', '.join(twice)} given twice")
            if missing := [c for c in CALIBRATION if c not in header]:
                raise ValueError(f"{path}: no column {', '.join(missing)}")
            for line, r in enumerate(reader, start=2):
                if None in r or None in r.values():
                    raise ValueError(f"{path}, line {line}: {len(header)} fields in the header, not here")
                p = {c: 100 * _share(r, c, line) for c in CALIBRATION[1:]}
                table.append([_cell(r["task"]), _cell(r["ood_warm_share"]),
                              f"{p['in_domain/pass@1']:.1f} / {p['in_domain/pass@16']:.1f}",
                              *(f"{p[c]:.1f}" for c in CALIBRATION[4:])])
        except (csv.Error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a CSV file of UTF-8 text ({e})") from None
    if not table:
        raise ValueError(f"{path}: no rows")
    return markdown_table(["task", "s", "in-domain P@1 / P@16", "OOD greedy", "OOD P@1", "OOD P@16"], table)


SPLIT_COLUMNS = tuple(f"{s}/pass@{k}" for s in ("in_domain", "ood") for k in (1, 16))


def _one_sweep(path: str, rows: list[SeedRow]) -> None:
    """The rows of one sweep: pi_0's, one task and step count, each seed of a group once, every figure."""
    if not any(r.group == BASE for r in rows):
        raise ValueError(f"{path}: no {BASE} row (not a sweep's seeds.csv)")
    if len({(r.task, r.steps) for r in rows}) > 1:
        raise ValueError(f"{path}: rows of more than one task or step count")
    if twice := repeated_seed(rows):
        raise ValueError(f"{path}: group {twice[0]} has seed {twice[1]} twice")
    for r in rows:
        if missing := [c for c in SPLIT_COLUMNS if c not in r.metrics]:
            raise ValueError(f"{path}, cell {r.cell}: no {', '.join(missing)}")


def splits(args: list[str], ctx: Context) -> str:
    """`splits SEEDS_CSV`: pi_0 and every group of a sweep, in-domain and OOD Pass@1 / Pass@16, mean ± s.e.
    over its seeds (%), groups in the order the sweep ran them."""
    (path,) = _exactly(args, 1, "splits SEEDS_CSV")
    rows = read_seeds(ctx.path(path))
    _one_sweep(path, rows)
    base = next(r.metrics for r in rows if r.group == BASE)
    table = [["π₀", "1", *(f"{100 * base[a]:.1f} / {100 * base[b]:.1f}" for a, b in (SPLIT_COLUMNS[:2],
                                                                                   SPLIT_COLUMNS[2:]))]]
    for g in dict.fromkeys(r.group for r in rows if r.group != BASE):
        cells = [r for r in rows if r.group == g]
        table.append([_cell(g), str(len(cells)), *(" / ".join(stat([r.metrics[c] for r in cells]).fmt(100, 1)
                                                              for c in pair)
                                                   for pair in (SPLIT_COLUMNS[:2], SPLIT_COLUMNS[2:]))])
    return markdown_table(["model", "seeds", "in-domain P@1 / P@16", "OOD P@1 / P@16"], table)


def cells(args: list[str], ctx: Context) -> str:
    """`cells SEEDS_CSV COLUMN ...`: one row per cell of a sweep (pi_0's left out), its commit and date and
    the named columns as recorded (a blank where a cell has none)."""
    if len(args) < 2:
        raise ValueError(f"cells SEEDS_CSV COLUMN ...: give a file and at least one column, got {len(args)} "
                         "argument(s)")
    path, columns = args[0], args[1:]
    rows = [r for r in read_seeds(ctx.path(path)) if r.group != BASE]
    if not rows:
        raise ValueError(f"{path}: no cell")
    if unknown := [c for c in columns if all(c not in r.metrics for r in rows)]:
        raise ValueError(f"{path}: no cell has {', '.join(unknown)}")
    return markdown_table(["cell", "commit", "date", *columns],
                          [[_cell(r.cell), _cell(r.commit), _cell(r.date),
                            *(f"{r.metrics[c]:.6g}" if c in r.metrics else "" for c in columns)] for r in rows])


RESULT_COLUMNS = ("benchmark", "figure", "date", "commit", "machine", "command", "load")
DATE = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2})(?: ([0-9]{2}:[0-9]{2})(?:–([0-9]{2}:[0-9]{2}))?)?")
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?( (to|/) [0-9a-f]{7,40}(\+dirty)?)?")


def _a_date(text: str) -> bool:
    """YYYY-MM-DD, then HH:MM or HH:MM–HH:MM (UTC), each a real date and time."""
    if (m := DATE.fullmatch(text)) is None:
        return False
    try:
        datetime.date.fromisoformat(m[1])
        for t in m.groups()[1:]:
            if t is not None:
                datetime.time.fromisoformat(t)
    except ValueError:
        return False
    return True


def results(args: list[str], ctx: Context) -> str:
    """`results CSV`: a table of current figures, one row per result as recorded, with the columns
    RESULT_COLUMNS (a figure with its date, commit, machine, the command that measured it and the
    machine's load then; `-` where a load was not recorded). A row without a figure, a date that is no
    date or a commit that is no hash is refused by line: the table is the record."""
    name = _exactly(args, 1, "results CSV")[0]
    try:
        with ctx.path(name).open(newline="", encoding="utf-8-sig") as f:
            return _results(name, csv.reader(f))
    except (csv.Error, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: not a CSV file of UTF-8 text ({e})") from None


def tta_tables(args: list[str], ctx: Context) -> str:
    """`tta JSON`: a time-to-accuracy bench's tables (bench/tta_report.py) from its tta.json, at its
    default target (pi_0's held-out Pass@1 + tta_data.DEFAULT_GAIN, fixed before its runs)."""
    name = _exactly(args, 1, "tta JSON")[0]
    res = tta_data.load(ctx.path(name))
    target = tta_report.default_target(res, tta_data.DEFAULT_GAIN)
    return f"Target: held-out Pass@1 >= {target:.3f} (pi_0's {res.base_pass1:.3f} + {tta_data.DEFAULT_GAIN:g}).\n\n" \
        + tta_report.tables(res, target).rstrip("\n").replace("## ", "#### ")


def scale_tables(args: list[str], ctx: Context) -> str:
    """`scale JSON TABLE`: one table of a `bench scale` grid's bench.json (bench/scale_report.py), after
    when, at which commit and how often each system ran. TABLE: ratios (dph-async's to each peer per
    cell, with the repeats' intervals), cpu (CPU-seconds per step by part, the bounds they set),
    memory (peak resident set per process) or projection (the scaling model on more cores)."""
    name, table = _exactly(args, 2, "scale JSON TABLE")
    if table not in SCALE_TABLES:
        raise ValueError(f"scale: table {table!r} (known: {', '.join(SCALE_TABLES)})")
    res = scale_data.load(ctx.path(name))
    return f"{_cell(scale_report.provenance(res))}\n\n{SCALE_TABLES[table](res)}"


SCALE_TABLES: dict[str, Callable[[scale_data.ScaleBench], str]] = {
    "ratios": lambda res: scale_report.ratio_table(res.cells),
    "cpu": lambda res: scale_report.cpu_table(res.cells, res.machine.get("cores") or 2),
    "memory": lambda res: scale_report.memory_table(res.cells),
    "projection": lambda res: scale_report.projection_table(res.cells)}


def _results(name: str, reader) -> str:
    header = next(reader, [])
    if tuple(header) != RESULT_COLUMNS:
        raise ValueError(f"{name}: columns {', '.join(header) or 'none'}; want {', '.join(RESULT_COLUMNS)}")
    rows = []
    for values in reader:
        where = f"{name}, line {reader.line_num}"
        if len(values) != len(header):
            raise ValueError(f"{where}: {len(values)} fields, the header has {len(header)}")
        r = {k: v.strip() for k, v in zip(header, values, strict=True)}
        if lacking := [c for c in ("benchmark", "figure", "machine", "command") if not r[c]]:
            raise ValueError(f"{where}: no {', '.join(lacking)}")
        if not _a_date(r["date"]):
            raise ValueError(f"{where}: date {r['date'][:40]!r} is not YYYY-MM-DD [HH:MM[–HH:MM]]")
        if not COMMIT.fullmatch(r["commit"]):
            raise ValueError(f"{where}: commit {r['commit'][:40]!r} is not a hash")
        try:
            rows.append([_cell(r[c]) if r[c] else "-" for c in RESULT_COLUMNS])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not rows:
        raise ValueError(f"{name}: no result")
    return markdown_table(list(RESULT_COLUMNS), rows)


def _tasks(args: list[str], ctx: Context, usage: str) -> dict[str, confirm.Sweeps]:
    """TASK CSV CSV triples: a task's name, its first and its as-run sweep (checked as the design asks)."""
    if not args or len(args) % 3:
        raise ValueError(f"{usage}: give TASK FIRST_CSV AS_RUN_CSV per task, got {len(args)} argument(s)")
    names = args[::3]
    if len(set(names)) < len(names):
        raise ValueError(f"{usage}: a task given twice ({', '.join(names)})")
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


def _task_sweeps(args: list[str], usage: str, ctx: Context) -> dict[str, list[SeedRow]]:
    """TASK CSV pairs: each task's name and its one sweep's seeds.csv."""
    if not args or len(args) % 2:
        raise ValueError(f"{usage}: give TASK CSV per task, got {len(args)} argument(s)")
    names = args[::2]
    if len(set(names)) < len(names):
        raise ValueError(f"{usage}: a task given twice ({', '.join(names)})")
    return {args[i]: read_seeds(ctx.path(args[i + 1])) for i in range(0, len(args), 2)}


def confirm_forgetting_tables(args: list[str], ctx: Context) -> str:
    """`confirm-forgetting TASK CSV ...`: design 3's family, bound and verdicts, each task from its
    sweep (`dph-async ablate confirm --design forgetting`)."""
    return confirm_forgetting.markdown(_task_sweeps(args, "confirm-forgetting", ctx))


def confirm_staleness_tables(args: list[str], ctx: Context) -> str:
    """`confirm-staleness [mini_batches=N] TASK CSV ...`: a staleness design's readings and verdicts per
    task, each from its sweep (`dph-async ablate confirm --design staleness`; N = 4: design 4's
    `staleness-trust`)."""
    mini_batches = 1
    if args and args[0].startswith("mini_batches="):
        text, args = args[0].removeprefix("mini_batches="), args[1:]
        if not re.fullmatch(r"[1-9][0-9]{0,3}", text):
            raise ValueError(f"confirm-staleness: mini_batches={text!r} is not a whole number of at least 1")
        mini_batches = int(text)
    return confirm_staleness.markdown(_task_sweeps(args, "confirm-staleness", ctx), mini_batches)


def source_of(png: Path) -> str | None:
    """The Source text chunk of a PNG, read chunk by chunk without decoding the image (None: no such
    chunk, or not a PNG)."""
    with png.open("rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return None
        while len(header := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", header)
            if kind == b"tEXt" and length <= 4096:
                key, _, value = f.read(length).partition(b"\0")
                if key == b"Source":
                    return value.decode("latin-1")
                f.seek(4, os.SEEK_CUR)  # the chunk's CRC
            elif kind == b"IEND":
                return None
            else:
                f.seek(length + 4, os.SEEK_CUR)
    return None


def fingerprint(fig) -> str:
    """A digest of what a matplotlib figure shows: every panel's title and axis labels, each line's
    label, style, colour and data, each collection's (error bars') segments and colours, each text and
    the legend's entries. Not its pixels, which follow matplotlib's version."""
    from matplotlib.colors import to_hex  # with the figure's own import of matplotlib

    h = hashlib.sha256()
    for ax in fig.axes:
        parts: list[object] = [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        parts += [(line.get_label(), line.get_marker(), line.get_linestyle(), to_hex(line.get_color()),
                   line.get_xydata().round(9).tolist()) for line in ax.lines]
        parts += [([s.round(9).tolist() for s in c.get_segments()], [to_hex(x) for x in c.get_colors()])
                  for c in ax.collections if hasattr(c, "get_segments")]
        # An annotation's point is its xy (its position is the text's offset from it).
        parts += [(t.get_text(), tuple(round(v, 9) for v in getattr(t, "xy", t.get_position()))) for t in ax.texts]
        legend = ax.get_legend()
        parts += [[t.get_text() for t in legend.get_texts()] if legend else []]
        h.update(repr(parts).encode())
    return h.hexdigest()[:16]


def _figure_path(arg: str, ctx: Context) -> Path:
    png = ctx.path(arg)
    if png.suffix != ".png":
        raise ValueError(f"{arg}: a figure is a .png file")
    if png.is_dir() or any(p.exists() and not p.is_dir() for p in png.parents):
        raise ValueError(f"{arg}: a directory, or under a file")
    if png in ctx.figure_paths:
        raise ValueError(f"{arg}: drawn by another block too (one block per figure)")
    ctx.figure_paths.add(png)
    return png


def confirm_figure(args: list[str], ctx: Context) -> str:
    """`confirm-figure PNG TASK FIRST_CSV AS_RUN_CSV ...`: design 1's Pass@16 against Pass@1 per task,
    drawn to PNG (docs/figures/); the block holds its link."""
    if not args:
        raise ValueError("confirm-figure: give PNG, then TASK FIRST_CSV AS_RUN_CSV per task")
    png = _figure_path(args[0], ctx)
    tasks = _tasks(args[1:], ctx, "confirm-figure")
    return _figure(args[0], png, confirm_plot.figure(tasks), ctx,
                   f"Pass@16 against Pass@1 per task: {', '.join(tasks)}")


def scale_figure(args: list[str], ctx: Context) -> str:
    """`scale-figure PNG JSON`: a `bench scale` grid's ratios per cell with their intervals, and each
    system's completions/s (bench/scale_report.py), drawn to PNG; the block holds its link."""
    png_arg, name = _exactly(args, 2, "scale-figure PNG JSON")
    png = _figure_path(png_arg, ctx)
    return _figure(png_arg, png, scale_report.figure(scale_data.load(ctx.path(name))), ctx,
                   "completions/s against TRL and the in-repo loop over the grid")


def _figure(arg: str, png: Path, fig, ctx: Context, alt: str) -> str:
    """The block's link to `png`, drawn from `fig` unless it already shows the same (under --check: only
    compared, a stale one named)."""
    want = SOURCE + fingerprint(fig)
    have = source_of(png) if png.exists() else None
    if have == want or not ctx.write:
        confirm_plot.pyplot().close(fig)
        if have != want:
            ctx.stale_figures.append(arg)
    elif png.exists() and not (have or "").startswith(SOURCE):
        confirm_plot.pyplot().close(fig)
        raise ValueError(f"{arg}: a figure this command did not draw; it would be overwritten")
    else:
        ctx.figures.append(lambda: _draft(fig, png, want))
    return f"![{alt}]({os.path.relpath(png, ctx.doc.parent)})"


def _draft(fig, png: Path, source: str) -> tuple[Path, Path]:
    """Draw to a file beside the figure, to be moved over it once every figure is drawn."""
    draft = png.with_name(png.name + ".draft")
    confirm_plot.save(fig, draft, source)
    return draft, png


RENDERERS: dict[str, Renderer] = {"ood-calibration": ood_calibration, "splits": splits, "cells": cells,
                                  "confirm": confirm_tables, "confirm-figure": confirm_figure,
                                  "confirm-staleness": confirm_staleness_tables,
                                  "confirm-forgetting": confirm_forgetting_tables, "results": results,
                                  "tta": tta_tables, "scale": scale_tables, "scale-figure": scale_figure}


def _exactly(args: list[str], n: int, usage: str) -> list[str]:
    if len(args) != n:
        raise ValueError(f"{usage}: {n} argument(s), got {len(args)}")
    return args


@dataclass(frozen=True)
class Block:
    line: int  # of its opening marker
    spec: str
    body: tuple[int, int]  # offsets of its body in the text: from after the opening line to the end marker


def blocks(text: str) -> list[Block]:
    """The blocks of a doc, line by line (linear in its length). A marker that is not exactly one, an
    end without an opening, an opening without an end, or a lone CR, is a ValueError naming the line."""
    if m := re.search(r"\r(?!\n)", text):
        raise ValueError(f"line {text.count(chr(10), 0, m.start()) + 1}: a carriage return that ends no line "
                         "(lines end in LF or CRLF)")
    found, opened = [], None
    for n, m in enumerate(re.finditer(r"[^\n]*\n|[^\n]+\Z", text), start=1):
        line = m.group().rstrip("\n").removesuffix("\r")
        if not MARKER.match(line):
            continue
        if (o := OPEN.fullmatch(line)) is not None and opened is None:
            opened = (n, o["spec"], m.end())
        elif line == END and opened is not None:
            found.append(Block(opened[0], opened[1], (opened[2], m.start())))
            opened = None
        elif opened is not None:
            raise ValueError(f"line {opened[0]}: a block without `{END}` (line {n} comes first)")
        elif line.startswith("<!-- rendered: "):
            raise ValueError(f"line {n}: a block's opening marker not alone on its line")
        else:
            raise ValueError(f"line {n}: a marker outside a block (a block is `<!-- rendered: KIND ARGS -->` … "
                             f"`{END}`, each marker on a line of its own)")
    if opened is not None:
        raise ValueError(f"line {opened[0]}: a block without `{END}`")
    return found


def render(text: str, ctx: Context) -> tuple[str, list[tuple[int, str]]]:
    """`text` with every block's body re-rendered (every other byte kept), and the (line, spec) of each
    block whose body or figure changed. A bad marker (`blocks`), an unknown KIND or a renderer's
    complaint is a ValueError naming the line."""
    out, changed, end = [], [], 0
    for b in blocks(text):
        kind, *args = b.spec.split() or [""]
        if kind not in RENDERERS:
            raise ValueError(f"line {b.line}: no renderer {kind!r} (known: {', '.join(sorted(RENDERERS))})")
        stale = len(ctx.stale_figures)
        try:
            body = RENDERERS[kind](args, ctx).rstrip("\n") + "\n"
        except (ValueError, OSError) as e:
            raise ValueError(f"line {b.line}: {b.spec}: {e}") from None
        if any(MARKER.match(line) for line in body.splitlines()):  # data that would end the block early
            raise ValueError(f"line {b.line}: {b.spec}: its data holds a block marker")
        if body != text[b.body[0]:b.body[1]] or len(ctx.stale_figures) > stale:
            changed.append((b.line, b.spec))
        out += [text[end:b.body[0]], body]
        end = b.body[1]
    return "".join([*out, text[end:]]), changed


def docs(root: Path) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return sorted({p for pattern in DOCS for p in root.glob(pattern) if p.is_file()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dph_async.tools.rendered_docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming every stale block")
    p.add_argument("files", nargs="*", type=Path, help=f"markdown files (default: {' '.join(DOCS)})")
    args = p.parse_args(argv)
    results: list[tuple[Path, str, str, list[tuple[int, str]]]] = []
    figures: list[Callable[[], tuple[Path, Path]]] = []
    drawn: set[Path] = set()  # one block per figure, over every file
    for doc in args.files or docs(ROOT):
        try:
            if not doc.resolve().is_relative_to(ROOT.resolve()):
                raise ValueError("outside the repository (a link leading out?)")
            with doc.open(encoding="utf-8", newline="") as f:  # line ends kept as they are
                text = f.read()
            ctx = Context(ROOT, doc.resolve(), write=not args.check, figure_paths=drawn)
            new, changed = render(text, ctx)
        except (OSError, ValueError) as e:  # nothing written yet: a render is all or nothing
            print(f"error: {doc}: {e}", file=sys.stderr)
            return 2
        results.append((doc, text, new, changed))
        figures += ctx.figures
    drafts: list[tuple[Path, Path]] = []
    try:
        for draw in figures:
            drafts.append(draw())
    except (OSError, ValueError) as e:
        for draft, _ in drafts:
            draft.unlink(missing_ok=True)
        print(f"error: a figure cannot be drawn ({e}); nothing written", file=sys.stderr)
        return 2
    for draft, png in drafts:
        os.replace(draft, png)
        print(f"{png}: drawn")
    for doc, text, new, changed in results:
        if not args.check and new != text:
            with doc.open("w", encoding="utf-8", newline="") as f:
                f.write(new)
        for line, spec in changed:
            print(f"{doc}:{line}: {'stale' if args.check else 'rendered'}: {spec}")
    return 1 if args.check and any(changed for *_, changed in results) else 0


if __name__ == "__main__":
    sys.exit(main())
