"""How far each weight matrix of one or more checkpoints moved from the base: the statistics of
`svd.compare` for every matrix of every checkpoint, the full singular value spectra of base, trained and
difference, and their means per checkpoint and matrix type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dph_async.progress import progress
from dph_async.tools.analyze.checkpoints import Checkpoint, MatrixInfo, WeightReader, common_matrices, type_rank
from dph_async.tools.analyze.svd import SVD, MatrixStats, compare, svd64


@dataclass
class MatrixResult:
    checkpoint: str
    info: MatrixInfo
    shape: list[int]
    stats: MatrixStats

    def row(self) -> dict:
        """One flat JSON record."""
        return {"checkpoint": self.checkpoint, **asdict(self.info), "shape": self.shape, **asdict(self.stats)}


@dataclass
class TypeSummary:
    """Means over the matrices of one type (all layers) in one checkpoint."""

    checkpoint: str
    type: str
    group: str
    matrices: int
    rel_change: float
    angle_left: float  # mean top-k principal angle (degrees)
    angle_right: float
    angle_max: float  # the largest top-k angle of any of these matrices, either side
    sv_rel_change: float  # mean relative change of the top-k singular values (signed)
    delta_in_base_topk: float
    delta_diag_base_topk: float
    delta_stable_rank: float
    delta_topk_share: float


@dataclass
class Analysis:
    base: Checkpoint
    checkpoints: list[Checkpoint]
    top_k: int
    matrices: list[MatrixResult]
    # "base::<name>", "<checkpoint>::<name>::trained" and "<checkpoint>::<name>::delta": all singular values
    spectra: dict[str, np.ndarray] = field(default_factory=dict)

    def by_type(self) -> list[TypeSummary]:
        return summarize(self.matrices)

    def last(self) -> list[MatrixResult]:
        """The matrices of the last checkpoint (the end of a trajectory)."""
        return [m for m in self.matrices if m.checkpoint == self.checkpoints[-1].label]


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def summarize(matrices: list[MatrixResult]) -> list[TypeSummary]:
    """One TypeSummary per (checkpoint, type), checkpoints in order, types in model order."""
    groups: dict[tuple[str, str], list[MatrixResult]] = {}
    for m in matrices:
        groups.setdefault((m.checkpoint, m.info.type), []).append(m)
    order = list(dict.fromkeys(m.checkpoint for m in matrices))
    out = []
    for (ckpt, type_), ms in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), type_rank(kv[0][1]))):
        s = [m.stats for m in ms]
        out.append(TypeSummary(
            checkpoint=ckpt, type=type_, group=ms[0].info.group, matrices=len(ms),
            rel_change=_mean([x.rel_change for x in s]),
            angle_left=_mean([a for x in s for a in x.angles_left]),
            angle_right=_mean([a for x in s for a in x.angles_right]),
            angle_max=max(a for x in s for a in [*x.angles_left, *x.angles_right, 0.0]),
            sv_rel_change=_mean([c for x in s for c in x.sv_rel_change]),
            delta_in_base_topk=_mean([x.delta_in_base_topk for x in s]),
            delta_diag_base_topk=_mean([x.delta_diag_base_topk for x in s]),
            delta_stable_rank=_mean([x.delta_stable_rank for x in s]),
            delta_topk_share=_mean([x.delta_topk_share for x in s]),
        ))
    return out


def analyze(base: Checkpoint, checkpoints: list[Checkpoint], top_k: int) -> Analysis:
    """Compare every matrix of every checkpoint with the base's (float64 SVDs; the base's once)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    result = Analysis(base, checkpoints, top_k, [])
    base_svds: dict[str, SVD] = {}
    with WeightReader(base) as b, progress() as bar:
        task = None
        for ckpt in checkpoints:
            with WeightReader(ckpt) as t:
                infos = list(common_matrices(b, [t]))
                if task is None:
                    task = bar.add_task("SVDs", total=len(infos) * len(checkpoints))
                for info in infos:
                    wb, wt = b.get(info.name), t.get(info.name)
                    k = min(top_k, *wb.shape)
                    if info.name not in base_svds:
                        full = svd64(wb, f"{base.label}: {info.name}")
                        result.spectra[f"base::{info.name}"] = full.s.numpy()
                        base_svds[info.name] = full.top(k)
                    t_svd = svd64(wt, f"{ckpt.label}: {info.name}")
                    delta_s = torch.linalg.svdvals(wt.to(torch.float64) - wb.to(torch.float64))
                    result.spectra[f"{ckpt.label}::{info.name}::trained"] = t_svd.s.numpy()
                    result.spectra[f"{ckpt.label}::{info.name}::delta"] = delta_s.numpy()
                    stats = compare(wb, base_svds[info.name], wt, t_svd, delta_s, k)
                    result.matrices.append(MatrixResult(ckpt.label, info, list(wb.shape), stats))
                    bar.update(task, advance=1)
    return result
