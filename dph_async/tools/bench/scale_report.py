"""The report of `dph-async bench scale`: bench.md's tables and scale.png."""

from __future__ import annotations

from pathlib import Path

from dph_async.pipeline.plot_colours import pyplot
from dph_async.pipeline.report import markdown_table, rate
from dph_async.safe_files import open_output
from dph_async.tools.bench.peer_limit import TARGET
from dph_async.tools.bench.scale_data import ScaleBench, ScaleCell

PEERS = ("trl", "loop")
CELL_LIMIT_S = 120  # what a cell should take at most


def _f(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _cps(cell: ScaleCell, system: str) -> str:
    s = cell.systems.get(system)
    return rate(s.completions_per_s) if s else "-"


def _ratio(cell: ScaleCell, peer: str) -> str:
    """The ratio (ScaleCell.ratio), bold where it meets TARGET against TRL, and the repeats' interval."""
    r = cell.ratio(peer)
    if r is None:
        return "-"
    bold = "**" if peer == "trl" and r >= TARGET else ""
    ci = cell.intervals.get(peer)
    return f"{bold}{r:.2f}x{bold}" + (f" [{ci.low:.2f}-{ci.high:.2f}]" if ci else "")


def _cell_name(c: ScaleCell) -> str:
    return f"{c.params / 1e6:.1f} M, {c.length}"


def throughput_table(cells: list[ScaleCell]) -> str:
    return markdown_table(
        ["model, tokens", "prompts x n", "dph-async c/s", "loop c/s", "TRL c/s", "/ TRL", "/ loop",
         "tokens/s: dph-async, loop, TRL", "cell s", "load start -> end", "others' cores"],
        [[_cell_name(c), f"{c.prompts_per_step} x {c.n}", _cps(c, "dph-async"), _cps(c, "loop"), _cps(c, "trl"),
          _ratio(c, "trl"), _ratio(c, "loop"),
          ", ".join(rate(c.systems[s].tokens_per_s) if s in c.systems else "-" for s in ("dph-async", "loop", "trl")),
          f"{c.wall_s:.0f}{' (over)' if c.wall_s > CELL_LIMIT_S else ''}",
          f"{c.load_avg[0]:.1f} -> {c.load_avg[1]:.1f}", _f(c.outside_cores, ".2f")] for c in cells])


def ratio_table(cells: list[ScaleCell]) -> str:
    """dph-async's ratio to TRL (to the loop) per cell: model sizes as rows, lengths as columns."""
    lengths = sorted({c.length for c in cells})
    by = {(c.size, c.length): c for c in cells}
    first: dict[str, ScaleCell] = {}  # a size's row, named by its first cell
    for c in cells:
        first.setdefault(c.size, c)

    def at(size: str, length: int) -> str:
        c = by.get((size, length))
        return "-" if c is None else f"{_ratio(c, 'trl')} ({_ratio(c, 'loop')})"

    return markdown_table(["dph-async / TRL (/ loop)", *(f"{n} tokens" for n in lengths)],
                          [[f"{c.params / 1e6:.1f} M ({size})", *(at(size, n) for n in lengths)]
                           for size, c in first.items()])


PART_NAMES = {"learner: training": "train", "actors: the model's forward": "fwd",
              "actors: vLLM's bookkeeping": "vLLM", "learner: the rest": "l. rest", "actors: the rest": "a. rest",
              "Ray": "Ray"}


def cpu_table(cells: list[ScaleCell], cores: int) -> str:
    def ceiling(c: ScaleCell, name: str) -> str:
        return _f(c.ceilings.get("trl", {}).get(name), ".2f") + "x" if "trl" in c.ceilings else "-"

    return markdown_table(
        ["model, tokens", "dph-async CPU-s/step", *PART_NAMES.values(), "loop", "TRL",
         f"at most / TRL on {cores} cores", "at most / TRL by the actor's thread"],
        [[_cell_name(c), _f(sum(c.parts.values()) if c.parts else None, ".3f"),
          *(_f(c.parts.get(k), ".3f") for k in PART_NAMES),
          *(_f(c.systems[s].cpu_s_per_step if s in c.systems else None, ".3f") for s in ("loop", "trl")),
          ceiling(c, "every part, as measured"), ceiling(c, "the busiest actor's thread, as measured")]
         for c in cells])


def memory_table(cells: list[ScaleCell]) -> str:
    def mib(c: ScaleCell, system: str, name: str) -> str:
        s = c.systems.get(system)
        return _f(s.peak_rss_mb.get(name) if s else None)

    return markdown_table(
        ["model, tokens", "dph-async learner", "dph-async actor", "Ray and the driver", "loop", "TRL"],
        [[_cell_name(c), mib(c, "dph-async", "learner"), mib(c, "dph-async", "actor"),
          mib(c, "dph-async", "Ray and the driver"), mib(c, "loop", "loop"), mib(c, "trl", "trl")] for c in cells])


def projection_table(cells: list[ScaleCell]) -> str:
    counts = sorted({row["cores"] for c in cells for row in c.projection})

    def at(c: ScaleCell, n: int) -> str:
        row = next((r for r in c.projection if r["cores"] == n), None)
        if row is None:
            return "-"
        vs = f", {row['dph-async'] / row['trl']:.2f}x" if row.get("trl") else ""
        return f"{rate(row['dph-async'])} ({int(row['actors'])} act.{vs})"

    return markdown_table(["model, tokens", *(f"{n:g} cores: c/s (actors, / TRL's best)" for n in counts)],
                          [[_cell_name(c), *(at(c, n) for n in counts)] for c in cells])


def provenance(res: ScaleBench) -> str:
    """When, at which commit and on what the grid's cells ran, and how often each system ran."""
    dates = sorted(c.date for c in res.cells)
    if not dates:
        return "No cell recorded."
    commits = ", ".join(dict.fromkeys(c.commit or "not recorded" for c in res.cells))
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return (f"Cells finished {span} at commit {commits}; {res.machine.get('cpu', '?')}, "
            f"{res.machine.get('cores', '?')} cores; {_repeats(res.settings)}")


def _repeats(settings: dict) -> str:
    n = settings.get("repeats", 1)  # a grid recorded before repeats ran each system once
    return "One run per system per cell: no interval." if n == 1 else \
        f"{n} runs per system per cell, the order rotating each repeat."


def markdown(res: ScaleBench) -> str:
    s, cells = res.settings, res.cells
    cores = res.machine.get("cores") or 2
    lines = [
        f"# dph-async bench scale ({res.date})", "",
        f"Machine: {res.machine.get('cpu', '?')}, {cores} cores; load average at start "
        f"{res.machine.get('load_avg')}, at end {res.machine.get('load_avg_end')}.",
        f"Work per cell: random-init Llamas over a byte-level BPE vocabulary of {s.get('vocab', '?')} tokens, the "
        "embedded task's prompts "
        f"in a chat template (8 tokens), completions of exactly the cell's length, n = {s['n']} completions per "
        f"prompt, prompts per step = completion tokens per step ({s['tokens_per_step']}) / (n x length), at least "
        f"one; {s['steps']} steps per system, steady state after {s['skip']}; preset {s['preset']}"
        + (f", settings {', '.join(s['overrides'])}" if s["overrides"] else "") + f". {_repeats(s)}",
        "", "## Completions per second", "",
        "c/s: completions per second over the steady state (medians over the repeats); / TRL, / loop: "
        "dph-async's completions/s over the peer's, the geometric mean of the repeats' paired ratios with its "
        f"95% interval in brackets (one run: the two runs' ratio; bold: at least {TARGET:g}x TRL); cell s: the "
        "cell's wall time, its runs with their start-ups; others' cores: cores other jobs used during "
        "dph-async's steady state.", "",
        throughput_table(cells), "",
        f"## CPU-seconds per step, and the bound they set on {cores} cores", "",
        "dph-async's CPU-seconds per step by part (train: the learner's forward, loss, backward and optimizer; "
        "fwd: the engine's model forward; vLLM: the rest of its engine steps; l. rest and a. rest: the rest "
        "of the learner's and the actors' processes; Ray), the peers' CPU-seconds per step, and what dph-async's "
        f"costs allow against TRL: no schedule runs a step in less than its CPU-seconds / {cores}, nor in less "
        "than the actor's rollout thread's CPU-seconds (bench/peer_limit.py).", "",
        cpu_table(cells, cores), "",
        "## Peak resident set per process (MiB)", "",
        memory_table(cells), "",
        "## More cores, by the scaling model", "",
        "dph-async's completions/s projected with its costs from the cell (dph_async/tools/scaling.py, async at "
        "the run's eta, the best number of actors, one learner rank), against TRL's best on the same cores: "
        "its CPU-seconds per step spread over every core without loss, a bound in TRL's favour.", "",
        projection_table(cells), "",
    ]
    notes = sorted({n for c in cells for n in c.notes})
    if notes:
        lines += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def _ends(cell: ScaleCell, peer: str) -> tuple[float, float]:
    """The ratio's 95% interval, or the ratio twice where the cell ran once (no bar)."""
    ci = cell.intervals.get(peer)
    point = cell.ratio(peer) or 0.0
    return (ci.low, ci.high) if ci else (point, point)


def plot(res: ScaleBench, out: Path) -> None:
    """scale.png: `figure` saved (not through a link)."""
    fig = figure(res)
    try:
        with open_output(out, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        pyplot().close(fig)


def figure(res: ScaleBench):
    """dph-async / TRL (and / the loop) per cell with the repeats' intervals, and every system's
    completions/s (the caller saves and closes it)."""
    plt = pyplot()
    sizes = list(dict.fromkeys(c.size for c in res.cells))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, size in enumerate(sizes):
        cells = [c for c in res.cells if c.size == size]
        color = f"C{i}"
        label = f"{cells[0].params / 1e6:.1f} M"
        xs = [c.length for c in cells]
        for peer, style in (("trl", "-o"), ("loop", "--s")):
            pts = [(x, c) for x, c in zip(xs, cells, strict=True) if c.ratio(peer) is not None]
            if pts:
                ys = [c.ratio(peer) for _, c in pts]
                ends = [_ends(c, peer) for _, c in pts]  # a cell run once: no bar
                err = [[y - lo for y, (lo, _) in zip(ys, ends, strict=True)],
                       [hi - y for y, (_, hi) in zip(ys, ends, strict=True)]]
                left.errorbar([x for x, _ in pts], ys, yerr=err, fmt=style, color=color, capsize=3,
                              label=f"{label} / {peer}")
        for system, style in (("dph-async", "-o"), ("loop", "--s"), ("trl", ":^")):
            pts = [(x, c.systems[system].completions_per_s) for x, c in zip(xs, cells, strict=True)
                   if system in c.systems]
            if pts:
                right.plot(*zip(*pts, strict=True), style, color=color, label=f"{label} {system}")
    left.axhline(TARGET, color="grey", lw=0.8, ls=":")
    left.axhline(1.0, color="grey", lw=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion tokens")
        ax.legend(fontsize=7)
    left.set_ylabel("dph-async completions/s / peer's")
    left.set_title(f"ratio per cell ({TARGET:g}x dotted)")
    right.set_yscale("log")
    right.set_ylabel("completions/s")
    right.set_title("absolute")
    fig.tight_layout()
    return fig
