"""`dph-async bench scale`: `bench peer` over a grid of model sizes x completion lengths.

Every cell is the same GRPO work through dph-async, the in-repo loop and TRL's GRPOTrainer
(bench/peer.py runs them, `repeats` runs each, the order rotating per repeat): a random-init Llama
of the cell's size over a 32k byte-level BPE vocabulary (tasks/bpe.py, made here), the embedded
task's prompts in chat format, completions of exactly the cell's length (a random model over 32k
tokens almost never samples EOS), `n` completions per prompt and as many prompts per step as keep
the completion tokens of a step near `tokens_per_step` (at least one). A random model scores 0
everywhere, so every group's advantages are 0: dph-async is told to train on those sequences anyway
(`learner.skip_zero_advantage=false`), as the peers do, so that every system does the same training
work.

    <out>/inputs/tokenizer, inputs/<size>/, inputs/train.parquet   made once, shared by the cells
    <out>/inputs/inputs.json    the vocabulary and seed they were made with
    <out>/cells/<key>/          the cell's `bench peer` directory (rl/, peers/, bench.json, bench.md)
    <out>/cells/<key>/cell.json the cell's figures (scale_data.ScaleCell), written last: a finished cell
    <out>/bench.json, bench.md, scale.png                           the grid

A cell whose cell.json exists is not run again, so an interrupted grid goes on where it stopped and
a grown grid (another size or length) runs only the new cells; a cell recorded with other work (its
size, length, prompts, n, steps, repeats, preset, overrides, systems, vocabulary) is refused rather
than mixed in, and a cell stopped midway starts over. The grid's own files (its records, reports and
the inputs' records) are handled as a shared directory's: no link followed, reads bounded, records
type-checked (safe_files.read_json); the runs' files inside a cell are `bench peer`'s. Cells run size
by size: the dph-async actor's process (its vLLM engine built) serves every length of a size, and
the learner's process every cell (`launcher.reuse_actors`, `reuse_learner`); Ray starts once for the
grid.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from dph_async.config import ModelConfig, RunConfig, load_config
from dph_async.errors import UserError
from dph_async.pipeline.stages import validate
from dph_async.runtime.cluster import ray_cluster
from dph_async.safe_files import UnsafeFile, output_dir, read_json, read_regular, write_output
from dph_async.tasks.bpe import VOCAB, build_bpe
from dph_async.tasks.dataset import verl_row, write_rows
from dph_async.tasks.embedded import make_splits
from dph_async.tasks.tiny_model import build_tiny_llama, save_model
from dph_async.tools import scaling
from dph_async.tools.bench import peer
from dph_async.tools.bench.machine import commit
from dph_async.tools.bench.pipeline import BENCH_DEFAULTS
from dph_async.tools.bench.scale_data import MAX_BYTES, ScaleBench, ScaleCell, SystemFigures

PROMPT_TOKENS = 16  # the embedded task's prompts in the chat template: 8 BPE tokens, room to spare
MAX_POSITIONS = 2048  # the models' max_position_embeddings: any length a grid asks for up to that


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int

    @property
    def heads(self) -> int:
        """Heads of 64 dimensions from a hidden size of 256, of 32 below (vLLM's CPU attention has
        kernels for 32 and up, none for 16)."""
        return self.hidden // (64 if self.hidden >= 256 and self.hidden % 64 == 0 else 32)


# About 2 M, 12 M and 52 M parameters over the 32k vocabulary (the embeddings and the LM head, untied,
# are 2 x 32768 x hidden of them).
SIZES = {"2m": Size("2m", 32, 2), "12m": Size("12m", 160, 4), "52m": Size("52m", 512, 6)}


class GridError(UserError):
    """A size or length the grid cannot run, or a finished cell recorded with other work."""


def parse_size(text: str) -> Size:
    """A size by name (SIZES) or as HIDDENxLAYERS (hidden a multiple of 32)."""
    if text in SIZES:
        return SIZES[text]
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m[1]) < 32 or int(m[1]) % 32 or int(m[2]) < 1:
        raise GridError(f"size {text!r}: a name ({', '.join(SIZES)}) or HIDDENxLAYERS with the hidden size a "
                         "multiple of 32 (vLLM's CPU attention needs heads of 32 dimensions at least)")
    return Size(text, int(m[1]), int(m[2]))


@dataclass(frozen=True)
class CellPlan:
    key: str
    size: Size
    length: int  # sampling.max_tokens: every completion's length
    prompts_per_step: int
    n: int


def plan_grid(sizes: Sequence[Size], lengths: Sequence[int], tokens_per_step: int, n: int) -> list[CellPlan]:
    """The cells, size by size (a size's cells share an actor's engine), lengths ascending."""
    for length in lengths:
        if not 1 <= length <= MAX_POSITIONS - PROMPT_TOKENS:
            raise GridError(f"length {length}: between 1 and {MAX_POSITIONS - PROMPT_TOKENS}")
    return [CellPlan(f"{s.name}-L{length}", s, length, max(1, tokens_per_step // (n * length)), n)
            for s in dict.fromkeys(sizes) for length in sorted(set(lengths))]


@dataclass(frozen=True)
class SizeRecord:
    params: int  # what size.json holds that the grid reads back


@dataclass(frozen=True)
class Inputs:
    train: Path
    models: dict[str, Path]  # size name -> model directory
    params: dict[str, int]


def make_inputs(root: Path, sizes: Sequence[Size], seed: int, log: Callable[[str], None], vocab: int = VOCAB) -> Inputs:
    """The tokenizer (a BPE of `vocab` tokens), the prompts and a model per size under `root` (what is
    there already is kept; inputs made with another vocabulary or seed are refused)."""
    output_dir(root.parent, root)
    made, want = root / "inputs.json", json.dumps({"vocab": vocab, "seed": seed})
    tok_dir, train = output_dir(root, root / "tokenizer"), root / "train.parquet"
    if made.is_file() and read_regular(made, MAX_BYTES).decode(errors="replace") != want:
        raise GridError(f"{root} holds inputs made with other settings ({made}) than asked ({want}): give another "
                        "--out, or --fresh to make them again")
    if not made.is_file() and any(tok_dir.iterdir()):
        raise GridError(f"{root} holds inputs without the record of their settings ({made}): --fresh makes them "
                        "again")
    if train.is_symlink():
        raise UnsafeFile(f"{train}: a symbolic link, not followed")
    write_output(made, want)
    if not (tok_dir / "tokenizer.json").is_file():
        log(f"building the BPE tokenizer of {vocab} tokens")
        build_bpe(seed, vocab).save_pretrained(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if not train.is_file():
        rows = [verl_row(p.prompt, p.data_source, p.ground_truth, i, "train")
                for i, p in enumerate(make_splits(seed, 256, 8)["train"])]
        write_rows(rows, train)
    models, params = {}, {}
    for s in sizes:
        d, info = output_dir(root, root / s.name), root / s.name / "size.json"
        if not info.is_file():
            log(f"building the {s.name} model (hidden {s.hidden}, {s.layers} layers, {s.heads} heads)")
            cfg = ModelConfig(tiny_hidden=s.hidden, tiny_layers=s.layers, tiny_heads=s.heads,
                              max_model_len=MAX_POSITIONS)
            model = build_tiny_llama(cfg, len(tok), seed)
            save_model(model, tok, d)
            write_output(info, json.dumps({**asdict(s), "heads": s.heads,
                                           "params": sum(p.numel() for p in model.parameters())}))
        try:
            params[s.name] = read_json(info, SizeRecord, MAX_BYTES).params
        except msgspec.MsgspecError as e:
            raise GridError(f"{info}: not a model's size record ({e}): --fresh makes the inputs again") from e
        models[s.name] = d
    return Inputs(train, models, params)


def cell_config(preset: str, overrides: Sequence[str], plan: CellPlan, inputs: Inputs, steps: int, out: Path,
                longest: int) -> RunConfig:
    """The cell's run config. model.max_model_len is the grid's longest length's (not the cell's), so
    that every cell of a size fits one engine."""
    work = [f"model.path={inputs.models[plan.size.name]}", f"task.data={inputs.train}",
            f"sampling.max_tokens={plan.length}", f"sampling.n={plan.n}",
            f"learner.groups_per_step={plan.prompts_per_step}", f"model.max_model_len={PROMPT_TOKENS + longest}",
            f"learner.steps={steps}", f"output_dir={out}"]
    return validate(load_config(preset, [*BENCH_DEFAULTS, *peer.SAME_WORK, *overrides, *work]), [])


def projection(res: peer.PeerBench, cores: Sequence[int]) -> list[dict[str, float]]:
    """dph-async's completions/s on `cores` cores by the scaling model (dph_async/tools/scaling.py), with
    its costs from this cell's run and the best number of actors (1 to cores - 1, batches split
    evenly where the prompts allow), against each peer's best on those cores: its CPU-seconds per step
    spread over every core without loss (a bound in the peer's favour). Each system's costs are those of
    its median run (by completions/s) among the runs that kept them. Empty without the figures."""
    dph = median_run([r for r in res.runs if r.system == "dph-async" and r.detail.get("cpu_cores")])
    if dph is None:
        return []
    used, b = dph.detail["cpu_cores"], dph.completions_per_s * dph.step_s
    costs = scaling.Costs(samples_per_step=b, actor_cpu_s_per_sample=used.get("actors", 0.0) * dph.step_s / b,
                          learner_cpu_s_per_step=used.get("learner", 0.0) * dph.step_s,
                          weight_latency_s=dph.detail["weights"]["delay_s"], sync_latency_s=0.0,
                          other_cores=used.get("ray", 0.0), grad_bytes=dph.detail["weights"]["publish_bytes"])
    q, eta = res.workload["prompts_per_step"], res.workload["eta"]
    rows = []
    def at(n: int, c: int) -> float:
        lay = scaling.Layout(n, 1, cores=c, eta=eta, groups_per_step=q, inflight_prompts=math.ceil(q / n))
        return scaling.samples_per_s(costs, "async", lay)

    for c in cores:
        actors = max(range(1, max(2, c)), key=lambda n: at(n, c))
        row = {"cores": c, "actors": actors, "dph-async": at(actors, c)}
        for system in dict.fromkeys(r.system for r in res.runs if r.system != "dph-async"):
            if (r := median_run([x for x in res.runs if x.system == system and x.cpu_s_per_step])) is not None:
                row[system] = r.completions_per_s * r.step_s / (r.cpu_s_per_step / c)
        rows.append(row)
    return rows


def median_run(runs: list[peer.PeerRun]) -> peer.PeerRun | None:
    """The run whose completions/s is the median (the lower of the middle two), None if no run."""
    ranked = sorted(runs, key=lambda r: r.completions_per_s)
    return ranked[(len(ranked) - 1) // 2] if ranked else None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def system_figures(runs: list[peer.PeerRun]) -> SystemFigures:
    """One system's runs in a cell as one row: medians, and each process's largest peak."""
    peaks: dict[str, float] = {}
    for r in runs:
        for name, mib in r.peak_rss_mb.items():
            peaks[name] = max(mib, peaks.get(name, mib))
    def median(key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs)

    return SystemFigures(median("step_s"), median("completions_per_s"), median("tokens_per_s"),
                         _median([r.cpu_s_per_step for r in runs]), _median([r.startup_s for r in runs]), peaks)


def summarise_cell(plan: CellPlan, params: int, res: peer.PeerBench, steps: int, skip: int, wall_s: float,
                   load_avg: tuple[float, float], repeats: int, setup: dict) -> ScaleCell:
    systems = {name: system_figures([r for r in res.runs if r.system == name])
               for name in dict.fromkeys(r.system for r in res.runs)}
    dph = [r.outside_cores for r in res.runs if r.system == "dph-async" and r.outside_cores is not None]
    lim = res.limit
    s = plan.size
    return ScaleCell(
        key=plan.key, size=s.name, params=params, hidden=s.hidden, layers=s.layers, heads=s.heads,
        length=plan.length, prompts_per_step=plan.prompts_per_step, n=plan.n, steps=steps, skip=skip,
        date=time.strftime("%Y-%m-%d %H:%M %Z"), wall_s=wall_s, load_avg=load_avg,
        outside_cores=statistics.median(dph) if dph else None, systems=systems, ratios=res.ratios,
        parts=lim.parts if lim else {}, threads=lim.threads if lim else {},
        ceilings={p: c.ceilings for p, c in lim.peers.items()} if lim else {},
        projection=projection(res, (2, 4, 8, 16)), notes=res.notes, repeats=repeats, intervals=res.intervals,
        commit=commit(), setup=setup)


def read_cell(path: Path) -> ScaleCell:
    """A finished cell's record; one this version did not write (damaged, mistyped, a link, too large)
    is refused."""
    try:
        return read_json(path, ScaleCell, MAX_BYTES)
    except (OSError, UnsafeFile, msgspec.MsgspecError, RecursionError) as e:
        raise GridError(f"{path} is not a cell this version of `bench scale` writes ({type(e).__name__}: {e}): "
                        "delete it to measure the cell again") from e


def check_recorded(cell: ScaleCell, plan: CellPlan, params: int, steps: int, skip: int, repeats: int,
                   setup: dict) -> None:
    want = {"key": plan.key, "params": params, "length": plan.length, "prompts_per_step": plan.prompts_per_step,
            "n": plan.n, "steps": steps, "skip": skip, "repeats": repeats, "setup": setup}
    if cell.work() != want:
        raise GridError(f"cell {plan.key} is recorded with other work ({cell.work()}) than asked ({want}): give "
                         "another --out, or --fresh to measure the grid again")


def run_grid(sizes: Sequence[Size], lengths: Sequence[int], out: Path, *, preset: str, overrides: Sequence[str],
             tokens_per_step: int, n: int, steps: int, skip: int, systems: list[str], cache: Path, machine: dict,
             repeats: int = 1, vocab: int = VOCAB, seed: int = 0, fresh: bool = False,
             log: Callable[[str], None] = print) -> ScaleBench:
    """Run the grid's unfinished cells in `out` (all of them with `fresh`, once the settings are known to
    be good) and write bench.json; return every cell's figures."""
    plans = plan_grid(sizes, lengths, tokens_per_step, n)
    settings = {"preset": preset, "overrides": list(overrides), "vocab": vocab, "tokens_per_step": tokens_per_step,
                "n": n, "steps": steps, "skip": skip, "systems": list(systems), "repeats": repeats}
    setup = {"preset": preset, "overrides": list(overrides), "systems": list(systems), "vocab": vocab}
    cells: list[ScaleCell] = []
    longest = max(lengths)
    base = validate(load_config(preset, [*BENCH_DEFAULTS, *peer.SAME_WORK, *overrides]), [])  # bad settings: here
    if fresh:
        clear(out)
    # Ray first: the first cell's learner and actor processes import beside the inputs being made.
    with ray_cluster(base, prestart=True):
        inputs = make_inputs(out / "inputs", sizes, seed, log, vocab)
        output_dir(out, out / "cells")
        finished = {}
        for plan in plans:  # every finished cell checked before any runs
            if (done := output_dir(out, out / "cells" / plan.key) / "cell.json").is_file():
                finished[plan.key] = read_cell(done)
                check_recorded(finished[plan.key], plan, inputs.params[plan.size.name], steps, skip, repeats,
                               setup)
        for i, plan in enumerate(plans):
            if plan.key in finished:
                cells.append(finished[plan.key])
                continue
            params, cell_dir = inputs.params[plan.size.name], out / "cells" / plan.key
            shutil.rmtree(cell_dir)  # a cell stopped midway starts over: its runs may be of other settings
            log(f"cell {i + 1}/{len(plans)}: {plan.key} ({params / 1e6:.1f} M parameters, {plan.prompts_per_step} "
                f"prompts x {plan.n} completions of {plan.length} tokens per step)")
            cfg = cell_config(preset, overrides, plan, inputs, steps, cell_dir, longest)
            load0, start = os.getloadavg()[0], time.time()
            res = peer.run(cfg, cell_dir, repeats, skip, machine, list(systems), cache, log=log,
                           settings=list(overrides))
            output_dir(out, cell_dir)  # still a directory of the grid's after the runs, not a link put there
            write_output(cell_dir / "bench.md", peer.markdown(res))
            cell = summarise_cell(plan, params, res, steps, skip, time.time() - start, (load0, os.getloadavg()[0]),
                                  repeats, setup)
            write_output(cell_dir / "cell.json", json.dumps(asdict(cell), indent=2))
            cells.append(cell)
            write_grid(out, machine, settings, cells)  # the cells so far, for a grid still running
    return write_grid(out, machine, settings, cells)


MADE = ("bench.json", "bench.md", "scale.png")  # the grid's files beside cells/ and inputs/


def clear(out: Path) -> None:
    """Delete a grid's cells, inputs and reports in `out`; a directory no grid made is refused, and a
    link where a grid's directory belongs is refused, never followed."""
    if not out.exists():
        return
    if not ((out / "bench.json").is_file() or (out / "inputs" / "inputs.json").is_file()):
        raise GridError(f"--fresh: {out} holds no bench.json nor inputs/inputs.json, so no grid made it: nothing "
                        "deleted")
    for name in ("cells", "inputs"):
        shutil.rmtree(output_dir(out, out / name))
    for name in MADE:
        (out / name).unlink(missing_ok=True)  # a link itself, never its target


def write_grid(out: Path, machine: dict, settings: dict, cells: list[ScaleCell]) -> ScaleBench:
    res = ScaleBench(date=time.strftime("%Y-%m-%d %H:%M %Z"), machine={**machine, "load_avg_end": os.getloadavg()},
                     settings=settings, cells=cells)
    write_output(out / "bench.json", res.to_json())
    return res
