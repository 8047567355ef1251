"""The recovery experiment: which singular directions of the trained weights carry the change in
in-domain and out-of-domain accuracy?

For every replacement (directions, values or triplets; see svd.replace_top_k) and every k, each
selected matrix of the trained model gets its top-k singular part replaced by the base's; the result
is written as a Hugging Face directory and evaluated like any model (greedy accuracy and Pass@k on
each test set, in a fresh Ray worker as the pipeline does). If restoring the base's top-k directions
brings OOD accuracy back to the base's, those directions carry the OOD change.

    <out>/models/<what>-k<k>/      the recovered models (with recovery.json: what was replaced)
    <out>/eval/<name>.json         evaluations of base, trained and every recovered model
    <out>/recover.json, recover.md, plots/recover.png, plots/pass_at_k.png

Finished models and evaluations are kept, so a rerun only does what is missing.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from safetensors.torch import save_file

from dph_async.config import RunConfig
from dph_async.pipeline.report import (
    comparison_rows,
    difficulty_rows,
    markdown_table,
    plot_pass_at_k,
    tables_by_test_set,
)
from dph_async.pipeline.stages import evaluate_models
from dph_async.progress import console, progress
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.evaluate import EvalJob, SplitResult, load_results
from dph_async.tools.analyze.checkpoints import Checkpoint, MatrixInfo, WeightReader, common_matrices
from dph_async.tools.analyze.svd import REPLACEMENTS, SVD, Replacement, replace_top_k, svd64

# Files a model directory holds besides its weights (config, tokenizer, generation config): copied.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class Recovery:
    what: Replacement
    k: int

    @property
    def name(self) -> str:
        return f"{self.what}-k{self.k}"


@dataclass
class RecoveryRecord:
    """What one recovered model is: its replacement, and how much of the update trained - base remains."""
    name: str
    what: str
    k: int
    matrices: int
    # sqrt(sum ||W' - B||_F^2 / sum ||T - B||_F^2) over the replaced matrices: 1 keeps the whole update,
    # 0 is the base (triplets at full rank).
    update_kept: float


def select(matrices: list[MatrixInfo], types: list[str] | None) -> list[MatrixInfo]:
    """The matrices whose type or group is in `types` (all when None)."""
    if not types:
        return matrices
    chosen = [m for m in matrices if m.type in types or m.group in types]
    known = {m.type for m in matrices} | {m.group for m in matrices}
    unknown = [t for t in types if t not in known]
    if unknown:
        raise ValueError(f"--types: no matrix of type or group {', '.join(unknown)}; this model has types "
                         f"{', '.join(sorted({m.type for m in matrices}))} in groups "
                         f"{', '.join(sorted({m.group for m in matrices}))}")
    return chosen


def top_svds(base: WeightReader, trained: WeightReader, matrices: list[MatrixInfo], k: int
             ) -> dict[str, tuple[SVD, SVD]]:
    """The top-k singular triplets of base and trained for every matrix (float64), computed once."""
    out = {}
    with progress(transient=True) as bar:
        task = bar.add_task("SVDs", total=len(matrices))
        for m in matrices:
            out[m.name] = (svd64(base.get(m.name), f"the base's {m.name}").top(k),
                           svd64(trained.get(m.name), f"the trained model's {m.name}").top(k))
            bar.update(task, advance=1)
    return out


def write_recovered(base: WeightReader, trained: WeightReader, svds: dict[str, tuple[SVD, SVD]], rec: Recovery,
                    out: Path) -> RecoveryRecord:
    """The trained model with rec applied to every matrix in `svds`, as a Hugging Face directory."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(trained.ckpt.path, tmp, ignore=shutil.ignore_patterns(*WEIGHT_FILES, "*.safetensors"))
    tensors = {}
    kept = total = 0.0
    for name in trained.names():
        t = trained.get(name)
        if name in svds:
            b_svd, t_svd = svds[name]
            w = replace_top_k(b_svd, t, t_svd, min(rec.k, len(t_svd.s)), rec.what)
            b = base.get(name).to(torch.float64)
            kept += float(((w - b) ** 2).sum())
            total += float(((t.to(torch.float64) - b) ** 2).sum())
            t = w.to(t.dtype)
        tensors[name] = t.contiguous().clone()  # no shared storage: safetensors refuses tied tensors
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    record = RecoveryRecord(rec.name, rec.what, rec.k, len(svds), (kept / total) ** 0.5 if total > 0 else 0.0)
    (tmp / "recovery.json").write_text(json.dumps(asdict(record), indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return record


@dataclass
class RecoveryResult:
    base: str
    trained: str
    types: list[str] | None
    records: list[RecoveryRecord]
    evals: dict[str, dict[str, SplitResult]]  # model name (base, trained, <what>-k<k>) -> split -> result


def run_recovery(cfg: RunConfig, base: Path, trained: Path, tests: dict[str, Path], out: Path,
                 recoveries: list[Recovery], types: list[str] | None, keep_models: bool = True) -> RecoveryResult:
    """Build, evaluate and report every recovery (skipping what a previous run finished)."""
    for name, path in (("BASE", base), ("TRAINED", trained)):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{name} {path}: not a Hugging Face model directory (no config.json); the "
                                    "recovered models are evaluated like any model: give base_model or "
                                    "rl/<run>/final_model")
    evals: dict[str, Path] = {}
    records = []
    with WeightReader(Checkpoint("base", base)) as b, WeightReader(Checkpoint("trained", trained)) as t, \
            ray_cluster(cfg):
        matrices = select(list(common_matrices(b, [t])), types)
        svds: dict[str, tuple[SVD, SVD]] = {}
        evals.update(base=out / "eval" / "base.json", trained=out / "eval" / "trained.json")
        evaluate_models(cfg, [EvalJob(base, evals["base"], cfg.seed), EvalJob(trained, evals["trained"], cfg.seed)],
                        tests)
        for i, rec in enumerate(recoveries):
            model, result = out / "models" / rec.name, out / "eval" / f"{rec.name}.json"
            built = (model / "recovery.json").is_file() and (result.is_file() or (model / "config.json").is_file())
            if not built:
                svds = svds or top_svds(b, t, matrices, max(r.k for r in recoveries))
                with console.status(f"recovery {i + 1}/{len(recoveries)}: writing {rec.name}"):
                    write_recovered(b, t, svds, rec, model)
            records.append(RecoveryRecord(**json.loads((model / "recovery.json").read_text())))
            evaluate_models(cfg, [EvalJob(model, result, cfg.seed)], tests)
            evals[rec.name] = result
            if not keep_models:  # the record stays: the report needs it
                for f in model.iterdir():
                    if f.name != "recovery.json":
                        shutil.rmtree(f) if f.is_dir() else f.unlink()
    result = RecoveryResult(str(base), str(trained), types, records,
                            {name: load_results(path) for name, path in evals.items() if path.is_file()})
    write_report(result, out)
    return result


def recovery_rows(result: RecoveryResult) -> tuple[list[str], list[list[str]]]:
    """The comparison table (report.comparison_rows) with what was replaced and how much update is left."""
    header, rows = comparison_rows(result.evals)
    by_name = {r.name: r for r in result.records}
    out = []
    for row in rows:
        r = by_name.get(row[0])
        out.append([row[0], r.what if r else "-", str(r.k) if r else "-",
                    f"{r.update_kept:.3f}" if r else ("1" if row[0] == "trained" else "0"), *row[1:]])
    return ["model", "replaced", "k", "update kept", *header[1:]], out


def plot_recovery(result: RecoveryResult, out: Path) -> None:
    """Per test set: greedy accuracy (solid) and Pass@k_max (dashed) against k, a line per replacement;
    base and trained as horizontal lines."""
    splits = sorted({s for res in result.evals.values() for s in res})
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for ref, colour in (("base", "grey"), ("trained", "black")):
            if ref in result.evals:
                r = result.evals[ref][split]
                ax.axhline(100 * r.greedy_accuracy, color=colour, lw=1, label=f"{ref} greedy")
                ax.axhline(100 * r.pass_at_k[max(r.pass_at_k)], color=colour, lw=1, ls="--",
                           label=f"{ref} Pass@{max(r.pass_at_k)}")
        for i, what in enumerate(REPLACEMENTS):
            recs = sorted((r for r in result.records if r.what == what and r.name in result.evals), key=lambda r: r.k)
            if not recs:
                continue
            res = [result.evals[r.name][split] for r in recs]
            ks = [r.k for r in recs]
            ax.plot(ks, [100 * x.greedy_accuracy for x in res], marker="o", color=f"C{i}", label=f"{what} greedy")
            ax.plot(ks, [100 * x.pass_at_k[max(x.pass_at_k)] for x in res], marker="o", ls="--", color=f"C{i}",
                    label=f"{what} Pass@{max(res[0].pass_at_k)}")
        ax.set(xscale="log", xlabel="k (top singular directions replaced by the base's)", ylabel="%", title=split)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_report(result: RecoveryResult, out: Path) -> None:
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    header, rows = recovery_rows(result)
    d_header, d_rows = difficulty_rows(result.evals)
    (out / "recover.json").write_text(json.dumps({
        "base": result.base, "trained": result.trained, "types": result.types,
        "recoveries": [asdict(r) for r in result.records],
        "eval": {name: {s: asdict(r) for s, r in res.items()} for name, res in result.evals.items()},
        "table": {"header": header, "rows": rows},
        "by_base_difficulty": {"header": d_header, "rows": d_rows},
    }, indent=1))
    if result.evals:
        plot_recovery(result, plots / "recover.png")
        plot_pass_at_k(result.evals, plots / "pass_at_k.png")
    md = [f"# Recovery: `{result.trained}` with top-k singular parts from `{result.base}`", "",
          "Each selected matrix of the trained model gets its top-k singular part replaced by the base's: "
          "`directions` U_b,k S_t,k V_b,kᵀ, `values` U_t,k S_b,k V_t,kᵀ, `triplets` U_b,k S_b,k V_b,kᵀ. "
          "\"update kept\": ‖W′ − W_base‖ / ‖W_trained − W_base‖ over the replaced matrices. Greedy accuracy "
          "and unbiased Pass@k (%), distinct correct answers per prompt.", "",
          f"Matrices replaced: {', '.join(result.types) if result.types else 'all'}.", "",
          markdown_table(header, rows), ""]
    if d_rows:
        md += ["## By what the base model did on each test prompt", "",
               "Pass@k (%) and distinct correct answers on the test prompts, grouped by how often the base model "
               "was right on them: where a recovery restores or loses the base's diversity.", "",
               *tables_by_test_set(d_header, d_rows)]
    md += ["Plots: `plots/recover.png`, `plots/pass_at_k.png`.", ""]
    (out / "recover.md").write_text("\n".join(md))
