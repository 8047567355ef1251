"""Triton implementation of the fused linear -> log-prob (+ entropy): the GPU path.

Forward: one program per (block of rows, split of the vocabulary) computes logit tiles with
`tl.dot` (fp32 accumulation; IEEE fp32 for fp32 inputs, never TF32, since log-probs feed
importance ratios) and keeps the online log-sum-exp of kernels.torch_logprob in registers. The
splits give the GPU enough programs when N is small; their partial (max, sum, entropy sum, target
logit) are merged on the host, a few [splits, N] tensors.

Backward: one program per (block of rows, block of columns) of a vocabulary chunk recomputes its
logit tile from the saved lse and writes d loss / d logits into a [N, chunk] buffer; two library
matmuls per chunk then give d hidden (accumulated in fp32) and d weight. Like the torch path this
recomputes logits once and never holds more than one chunk of [N, V].

Importing this module imports triton; on a CPU, set TRITON_INTERPRET=1 before that import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from dph_async.kernels.torch_logprob import NEG_INIT, backward_setup

# The running max's start (see kernels.torch_logprob), as a constant the jitted code can read.
_NEG: tl.constexpr = tl.constexpr(NEG_INIT)


@dataclass(frozen=True)
class Tiles:
    """A program's tile: rows x vocabulary columns, K-step over H, and the launch's warps and stages."""

    n: int = 64
    v: int = 128
    h: int = 64
    warps: int = 4
    stages: int = 3


# The interpreter's and pre-Hopper cards' tile. On Hopper (9.x), scripts/gpu_check.py's sweep at
# N = 8,192, V = 151,936, H = 4,096, bf16 on an H200 chose 128 x 256 with 8 warps: forward 22.6 ms
# and backward 52.8 ms against 31.2 and 59.8 for the small tile (docs/benchmarks.md, GPU). Its
# 144 KiB of shared memory for three bf16 stages fits neither fp32 tiles nor a 100 KiB consumer card.
DEFAULT_TILES = Tiles()
HOPPER_BF16_TILES = Tiles(n=128, v=256, h=64, warps=8, stages=3)


def tiles_for(device: torch.device, dtype: torch.dtype) -> Tiles:
    if dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return HOPPER_BF16_TILES
    return DEFAULT_TILES


@triton.jit
def _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """z[rows, cols] = x[rows] . w[cols] * inv_temp, accumulated in fp32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * H
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * H
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc * inv_temp


@triton.jit
def _forward_kernel(x_ptr, w_ptr, t_ptr, m_ptr, s_ptr, e_ptr, zt_ptr, N, V, H, inv_temp, split_v,
                    WITH_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), _NEG, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    e = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = pid_s * split_v
    v_end = tl.minimum(v_start + split_v, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp,
                        BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
        # Columns past the end weigh exp(_NEG - m) = 0; a finite fill keeps 0 * z from being NaN.
        z = tl.where(col_ok[None, :], z, _NEG)
        z_t += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        z_c = z - m_new[:, None]
        p = tl.exp(z_c)
        scale = tl.exp(m - m_new)
        if WITH_ENTROPY:
            e = (e + (m - m_new) * s) * scale + tl.sum(p * z_c, axis=1)
        s = s * scale + tl.sum(p, axis=1)
        m = m_new
    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(zt_ptr + out, z_t, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(e_ptr + out, e, mask=row_ok)


@triton.jit
def _grad_logits_kernel(x_ptr, w_ptr, t_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, g_ptr, N, H, v_lo, v_hi,
                        chunk, inv_temp, WITH_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr):
    """g[n, j - v_lo] = d loss / d z[n, j] * inv_temp for j in [v_lo, v_hi)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v_lo + tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < v_hi
    z = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp,
                    BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_h = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        grad = -p * (g_lp[:, None] + g_h[:, None] * (logp + ent[:, None]))
    else:
        grad = -p * g_lp[:, None]
    grad += tl.where(cols[None, :] == tgt[:, None], g_lp[:, None], 0.0)
    offs = rows.to(tl.int64)[:, None] * chunk + (cols - v_lo)[None, :]
    tl.store(g_ptr + offs, grad.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _dot_options(dtype: torch.dtype) -> dict:
    """IEEE fp32 dots for fp32 inputs. The interpreter multiplies bf16 tiles as their raw uint16 bits,
    so there bf16 tiles are upcast first: bf16 products are exact in fp32, the same numbers a GPU's
    bf16 dot with fp32 accumulation gives."""
    upcast = dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else None, "UPCAST": upcast}


def _launch(t: Tiles, dtype: torch.dtype) -> dict:
    return {"BLOCK_N": t.n, "BLOCK_V": t.v, "BLOCK_H": t.h, "num_warps": t.warps, "num_stages": t.stages,
            **_dot_options(dtype)}


def _num_splits(n: int, v: int, device: torch.device, t: Tiles) -> int:
    """Vocabulary splits so that the forward grid has about two programs per multiprocessor."""
    row_blocks = triton.cdiv(n, t.n)
    if device.type != "cuda":
        return min(4, triton.cdiv(v, t.v))  # the interpreter: still several, to exercise the merge
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(programs, row_blocks), triton.cdiv(v, t.v)))


def forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool, block_v: int,
    tiles: Tiles | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Same contract as kernels.torch_logprob.forward (block_v is unused: the grid tiles V); tiles
    default to the device's (`tiles_for`)."""
    tiles = tiles or tiles_for(hidden.device, hidden.dtype)
    n, h = hidden.shape
    v = weight.shape[0]
    splits = _num_splits(n, v, hidden.device, tiles)
    split_v = triton.cdiv(triton.cdiv(v, splits), tiles.v) * tiles.v
    splits = triton.cdiv(v, split_v)
    m, s, e, z_t = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    if n:
        _forward_kernel[(triton.cdiv(n, tiles.n), splits)](
            hidden, weight, targets, m, s, e, z_t, n, v, h, 1.0 / temperature, split_v,
            WITH_ENTROPY=with_entropy, **_launch(tiles, hidden.dtype),
        )
    # Merge the splits' online states; the split holding the global max has sum >= 1, so s_tot >= 1.
    m_tot = m.amax(dim=0)
    scale = torch.exp(m - m_tot)
    s_tot = (s * scale).sum(dim=0)
    log_s = s_tot.log()
    lse = m_tot + log_s
    logp = (z_t.sum(dim=0) - lse).clamp_(max=0.0)
    entropy = None
    if with_entropy:
        e_tot = ((e + (m - m_tot) * s) * scale).sum(dim=0)
        entropy = (log_s - e_tot / s_tot).clamp_(min=0.0)
    return logp, lse, entropy


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with an fp32 result; bf16 inputs keep bf16 matmul speed where the backend allows it."""
    if a.dtype == torch.float32:
        return a @ b.float()
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    block_v: int,
    need_hidden: bool,
    need_weight: bool,
    tiles: Tiles | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Same contract as kernels.torch_logprob.backward; block_v is the vocabulary chunk per buffer."""
    tiles = tiles or tiles_for(hidden.device, hidden.dtype)
    n, h = hidden.shape
    v = weight.shape[0]
    g_lp, g_h, d_hidden, d_weight = backward_setup(
        hidden, weight, temperature, grad_logp, grad_entropy, need_hidden, need_weight
    )
    chunk = min(triton.cdiv(block_v, tiles.v) * tiles.v, triton.cdiv(v, tiles.v) * tiles.v)
    # d loss / d logits in the inputs' dtype, so the two matmuls run at that dtype's speed.
    grad_buf = torch.empty(n * chunk, dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, v, chunk):
        v1 = min(v0 + chunk, v)
        grad = grad_buf[: n * (v1 - v0)].view(n, v1 - v0)
        if n:
            _grad_logits_kernel[(triton.cdiv(n, tiles.n), triton.cdiv(v1 - v0, tiles.v))](
                hidden, weight, targets, lse, entropy if g_h is not None else lse, g_lp,
                g_h if g_h is not None else g_lp, grad, n, h, v0, v1, v1 - v0, 1.0 / temperature,
                WITH_ENTROPY=g_h is not None, **_launch(tiles, hidden.dtype),
            )
        if d_hidden is not None:
            d_hidden += _mm_f32(grad, weight[v0:v1])
        if d_weight is not None:
            d_weight[v0:v1] = grad.T @ hidden
    if d_hidden is not None:
        d_hidden = d_hidden.to(hidden.dtype)
    return d_hidden, d_weight
