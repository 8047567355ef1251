"""Singular-value statistics of a weight update, in float64.

For a base matrix B, a trained matrix T and their difference D = T - B, with the thin SVDs
B = U_b S_b V_b^T and T = U_t S_t V_t^T (singular values descending) and k <= min(m, n):

- principal angles between the top-k left subspaces span(U_b[:, :k]) and span(U_t[:, :k]) (and the
  right ones, V): theta_i = arccos(sigma_i(U_b,k^T U_t,k)), ascending;
- the relative change of each top-k singular value: (s_t,i - s_b,i) / s_b,i;
- where D lies in the base's top-k singular basis: C = U_b,k^T D V_b,k; ||C||_F^2 / ||D||_F^2 is the
  share of the update inside the base's top-k subspaces, ||diag(C)||^2 / ||D||_F^2 the share that only
  rescales the base's top-k directions (the rest of ||C||^2 rotates them into each other);
- the stable rank of D, ||D||_F^2 / sigma_1(D)^2 (1 for a rank-one update), and the share of ||D||_F^2
  in its own top-k singular directions.

The recovery experiment (`replace_top_k`) swaps the trained matrix's top-k singular triplets, or only
their directions or only their values, for the base's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dph_async.errors import UserError

REPLACEMENTS = ("directions", "values", "triplets")
Replacement = Literal["directions", "values", "triplets"]


@dataclass
class SVD:
    """A thin SVD in float64: w = u @ diag(s) @ v.T, s descending."""

    u: torch.Tensor  # [m, r]
    s: torch.Tensor  # [r]
    v: torch.Tensor  # [n, r]

    def top(self, k: int) -> SVD:
        return SVD(self.u[:, :k], self.s[:k], self.v[:, :k])

    def matrix(self) -> torch.Tensor:
        return (self.u * self.s) @ self.v.T


class NonFiniteWeights(UserError):
    """A matrix holding NaN or an infinity: its singular values are undefined (a diverged model)."""


def svd64(w: torch.Tensor, what: str = "a weight matrix") -> SVD:
    """The thin SVD of w, computed in float64 whatever w's dtype; `what` names w in the error raised
    when it holds a NaN or an infinity (torch's LinAlgError would not say which matrix of which model)."""
    w64 = w.detach().to("cpu", torch.float64)
    if not torch.isfinite(w64).all():
        raise NonFiniteWeights(f"{what} holds NaN or infinite values (a diverged model?): its singular values "
                               "are undefined")
    u, s, vh = torch.linalg.svd(w64, full_matrices=False)
    return SVD(u, s, vh.T)


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending) between span(a) and span(b), a and b with orthonormal
    columns of the same count k.

    cos theta_i are the singular values of a^T b. Near 0 arccos loses half the digits, so, as in
    Bjorck and Golub (1973), angles below 45 degrees come from their sines instead: sin theta_i are the
    singular values of b - a a^T b, the part of span(b) outside span(a).
    """
    if a.shape != b.shape:
        raise ValueError(f"principal angles need bases of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.to(torch.float64), b.to(torch.float64)
    m = a.T @ b
    cos = torch.linalg.svdvals(m).clamp(0.0, 1.0)  # descending: angles ascending
    sin = torch.linalg.svdvals(b - a @ m).flip(0).clamp(0.0, 1.0)  # ascending with the angles
    return torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos))


@dataclass
class MatrixStats:
    """How one trained matrix differs from its base matrix (see the module docstring)."""

    k: int
    rel_change: float  # ||D||_F / ||B||_F
    angles_left: list[float]  # degrees, ascending, k of them
    angles_right: list[float]
    sv_rel_change: list[float]  # (s_t,i - s_b,i) / s_b,i for i < k
    delta_in_base_topk: float  # ||U_b,k^T D V_b,k||_F^2 / ||D||_F^2
    delta_diag_base_topk: float  # ||diag(U_b,k^T D V_b,k)||^2 / ||D||_F^2
    delta_stable_rank: float  # ||D||_F^2 / sigma_1(D)^2 (0 when D = 0)
    delta_topk_share: float  # sum_{i<k} sigma_i(D)^2 / ||D||_F^2


def compare(base: torch.Tensor, base_svd: SVD, trained: torch.Tensor, trained_svd: SVD, delta_s: torch.Tensor,
            k: int) -> MatrixStats:
    """The statistics of one matrix; base_svd and trained_svd hold at least the top k triplets, delta_s
    all singular values of trained - base."""
    b, t = base.to(torch.float64), trained.to(torch.float64)
    d = t - b
    bk, tk = base_svd.top(k), trained_svd.top(k)
    d2 = float((d**2).sum())
    c = bk.u.T @ d @ bk.v

    def share(x: torch.Tensor) -> float:  # of ||D||_F^2; 0 for an unchanged matrix
        return float(x) / d2 if d2 > 0 else 0.0

    degrees = 180.0 / torch.pi
    return MatrixStats(
        k=k,
        rel_change=float(d.norm() / b.norm()) if float(b.norm()) > 0 else float("inf"),
        angles_left=(principal_angles(bk.u, tk.u) * degrees).tolist(),
        angles_right=(principal_angles(bk.v, tk.v) * degrees).tolist(),
        sv_rel_change=((tk.s - bk.s) / bk.s).tolist(),
        delta_in_base_topk=share((c**2).sum()),
        delta_diag_base_topk=share((torch.diagonal(c) ** 2).sum()),
        delta_stable_rank=d2 / float(delta_s[0] ** 2) if d2 > 0 else 0.0,
        delta_topk_share=share((delta_s[:k] ** 2).sum()),
    )


def replace_top_k(base_svd: SVD, trained: torch.Tensor, trained_svd: SVD, k: int, what: Replacement) -> torch.Tensor:
    """The trained matrix with its top-k singular part U_t,k S_t,k V_t,k^T replaced (float64):

        directions: U_b,k S_t,k V_b,k^T   (the base's directions, the trained singular values)
        values:     U_t,k S_b,k V_t,k^T   (the trained directions, the base's singular values)
        triplets:   U_b,k S_b,k V_b,k^T   (the base's top-k part: directions and values)

    The rest of the trained matrix, T - U_t,k S_t,k V_t,k^T, is kept. k = 0 gives T; triplets with
    k = rank give B.
    """
    if what not in REPLACEMENTS:
        raise ValueError(f"unknown replacement {what!r}; choose from {', '.join(REPLACEMENTS)}")
    bk, tk = base_svd.top(k), trained_svd.top(k)
    dirs = bk if what in ("directions", "triplets") else tk
    values = bk.s if what in ("values", "triplets") else tk.s
    return trained.to(torch.float64) - tk.matrix() + SVD(dirs.u, values, dirs.v).matrix()
