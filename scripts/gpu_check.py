"""The GPU check: the fused log-prob kernel and the loss library on a CUDA device, with torch and triton only.

    scripts/gpu_check.sh                 # a CUDA machine: about 2 minutes on one H100
    scripts/gpu_check.sh --tiny          # the CPU, under Triton's interpreter, at tiny shapes (the suite runs it)

Three parts, each on fresh random inputs (the seed is printed; --seed repeats a run):
 1. Correctness: the Triton kernel's log-probs, entropy, d hidden and d weight against float64, in fp32
    and bf16, with V not a multiple of the tile, a mask and a temperature other than 1.
 2. Cost: the Triton kernel, the chunked torch path and the naive materialised-logits path, forward +
    backward at V = 151,936, H = 4,096, bf16, N = 4,096 and 8,192 (Liger-Kernel's published point:
    2.64 GiB fused against 7.22 GiB naive): median time, peak memory, and a float64 check of sampled rows.
 3. The loss library (learner/losses.py) on the device against float64 on the CPU: values and gradients.

Needs no vLLM, DeepSpeed or Ray: it imports kernels/ and learner/losses.py (whose config type needs
pydantic; scripts/gpu_check.sh installs it from a folder of wheels where the image lacks it). Prints a
table last, writes everything to --json, and exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing

# The checkout's code, installed or not: a card's machine may have only torch and triton, so where the
# project is not installed its design-card directories are mapped into the `dph_async` namespace here,
# as pyproject.toml's package-dir mapping does for an install.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import dph_async  # noqa: E402

if importlib.util.find_spec("dph_async.kernels") is None:
    dph_async.__path__.append(str(ROOT))

from dph_async.config.loss import LossConfig  # noqa: E402
from dph_async.kernels import default_block_v, fused_logprobs  # noqa: E402
from dph_async.kernels.reference import naive_logprobs, reference_with_grads, rel_error  # noqa: E402
from dph_async.learner import losses as L  # noqa: E402

GIB = 1 << 30
# Liger-Kernel's published peak memory at N = 8,192 (Qwen-size V and H, bf16), for the record beside ours.
LIGER_GIB = {"fused": 2.64, "naive": 7.22}


@dataclass
class Check:
    part: str
    name: str
    value: float
    limit: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.value) and self.value <= self.limit


@dataclass
class Report:
    seed: int
    device: dict
    checks: list[Check] = field(default_factory=list)
    cost: list[dict] = field(default_factory=list)
    tiles: list[dict] = field(default_factory=list)

    def check(self, part: str, name: str, value: float | torch.Tensor, limit: float) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().item()
        self.checks.append(Check(part, name, float(value), limit))


# --- 1. correctness against float64 -------------------------------------------------------------------


def _random_case(n: int, h: int, v: int, dtype: torch.dtype, device: str, g: torch.Generator) -> dict:
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    mask = (torch.rand(n, generator=g) >= 0.2).to(device)
    targets[~mask] = -100  # ignored ids must never be read
    return {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask,
            "g_lp": torch.randn(n, generator=g).to(device), "g_h": torch.randn(n, generator=g).to(device)}


def check_kernel(report: Report, device: str, tiny: bool, g: torch.Generator) -> None:
    n, h, v = (37, 24, 1_001) if tiny else (1_000, 320, 32_003)
    for dtype, temperature, grad_tol, logp_tol in ((torch.float32, 0.7, 1e-4, 5e-5),
                                                   (torch.bfloat16, 1.3, 2e-2, 5e-4)):
        case = _random_case(n, h, v, dtype, device, g)
        hidden = case["hidden"].clone().requires_grad_()
        weight = case["weight"].clone().requires_grad_()
        logp, entropy = fused_logprobs(hidden, weight, case["targets"], temperature, case["mask"],
                                       with_entropy=True, impl="triton")
        d_hidden, d_weight = torch.autograd.grad((case["g_lp"] * logp).sum() + (case["g_h"] * entropy).sum(),
                                                 (hidden, weight))
        ref_logp, ref_ent, ref_dh, ref_dw = reference_with_grads(
            case["hidden"], case["weight"], case["targets"], temperature, case["mask"], case["g_lp"], case["g_h"])
        tag = f"{str(dtype).removeprefix('torch.')} N={n} V={v} T={temperature}"
        report.check("kernel", f"{tag} logp max abs err", (logp.double() - ref_logp).abs().max(), logp_tol)
        report.check("kernel", f"{tag} entropy max abs err", (entropy.double() - ref_ent).abs().max(), logp_tol)
        report.check("kernel", f"{tag} d hidden rel err", rel_error(d_hidden, ref_dh), grad_tol)
        report.check("kernel", f"{tag} d weight rel err", rel_error(d_weight, ref_dw), grad_tol)
        report.check("kernel", f"{tag} max logp (<= 0)", logp.max(), 0.0)
        masked = ~case["mask"]
        report.check("kernel", f"{tag} masked |logp| + |d hidden|",
                     logp[masked].abs().sum() + d_hidden[masked].abs().sum(), 0.0)


# --- 2. cost against the naive path -------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], object], device: str, tiny: bool) -> float:
    if device == "cuda":
        return float(triton.testing.do_bench(fn, warmup=100, rep=600, return_mode="median"))
    times = []
    for _ in range(3 if tiny else 5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _step(path: str, hidden, weight, targets, grad) -> Callable[[], tuple]:
    def step():
        if path == "naive":
            logp = naive_logprobs(hidden, weight, targets)
        else:
            logp, _ = fused_logprobs(hidden, weight, targets, impl=path)
        d_hidden, _ = torch.autograd.grad(logp, (hidden, weight), grad)
        return logp.detach(), d_hidden

    return step


def _peak_gib(step: Callable[[], tuple], device: str) -> tuple[float, float]:
    """(peak allocated during one forward + backward, in GiB; the part above what was allocated before)."""
    if device != "cuda":
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / GIB, (peak - before) / GIB


def _cost_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str, g: torch.Generator) -> tuple:
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad = torch.randn(n, generator=g).to(device)
    # Rows are independent: log p and d hidden of sampled rows have a float64 reference of their own.
    rows = torch.randperm(n, generator=g)[: min(n, 128)].to(device)
    ref_logp, _, ref_dh, ref_dw = reference_with_grads(hidden[rows], weight, targets[rows], 1.0, None, grad[rows], None)
    del ref_dw  # float64 [V, H]: gigabytes that would sit under every peak measured after it
    return hidden, weight, targets, grad, rows, ref_logp, ref_dh


def check_cost(report: Report, device: str, tiny: bool, g: torch.Generator) -> None:
    h, v, sizes, dtype = (64, 2_000, (64, 128), torch.float32) if tiny else (4_096, 151_936, (4_096, 8_192),
                                                                          torch.bfloat16)
    for n in sizes:
        hidden, weight, targets, grad, rows, ref_logp, ref_dh = _cost_inputs(n, h, v, dtype, device, g)
        inputs_gib = (hidden.nbytes + weight.nbytes) / GIB
        useful_flop = 6.0 * n * v * h  # forward 2NVH, backward 4NVH: what any path must compute
        for path in ("triton", "torch", "naive"):
            step = _step(path, hidden, weight, targets, grad)
            logp, d_hidden = step()  # warm-up and compilation
            _sync(device)
            peak, above = _peak_gib(step, device)
            ms = _median_ms(step, device, tiny)
            row = {"n": n, "v": v, "h": h, "dtype": str(dtype).removeprefix("torch."), "path": path, "ms": ms,
                   "tflops": useful_flop / (ms * 1e-3) / 1e12, "peak_gib": peak, "above_inputs_gib": above,
                   "inputs_gib": inputs_gib, "logp_err": float((logp[rows].double() - ref_logp).abs().max()),
                   "d_hidden_rel_err": rel_error(d_hidden[rows], ref_dh)}
            report.cost.append(row)
            if path != "naive":  # the naive path's bf16 logits round log p by ~5e-3: reported, not checked
                tol_logp, tol_grad = (5e-5, 1e-4) if dtype == torch.float32 else (2e-3, 3e-2)
                report.check("cost", f"{path} N={n} sampled logp max abs err", row["logp_err"], tol_logp)
                report.check("cost", f"{path} N={n} sampled d hidden rel err", row["d_hidden_rel_err"], tol_grad)
            del logp, d_hidden, step
        if device == "cuda":
            fused = next(r for r in report.cost if r["n"] == n and r["path"] == "triton")
            naive = next(r for r in report.cost if r["n"] == n and r["path"] == "naive")
            # The kernel's promise is memory: its peak above the inputs must stay under the naive path's.
            report.check("cost", f"N={n} triton / naive peak above inputs",
                         fused["above_inputs_gib"] / naive["above_inputs_gib"], 1.0)
        del hidden, weight


# Candidate tiles for a Hopper card: the default, and wider tiles with more warps and pipeline stages.
CANDIDATE_TILES = [(64, 128, 64, 4, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4),
                   (256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (256, 256, 64, 8, 2)]


def sweep_tiles(report: Report, device: str, tiny: bool, g: torch.Generator) -> None:
    """Forward and backward of the Triton kernel, separately, per candidate tile at N = 8,192, bf16."""
    # Defines the Triton kernels, so only here, after main's TRITON_INTERPRET check: Triton takes its
    # interpreter or the GPU when they are defined (kernels/fused.py imports it as late).
    from dph_async.kernels import triton_logprob as tk

    n, h, v = (100, 72, 1_500) if tiny else (8_192, 4_096, 151_936)
    hidden, weight, targets, grad, rows, ref_logp, ref_dh = _cost_inputs(n, h, v, torch.bfloat16, device, g)
    hidden, weight = hidden.detach(), weight.detach()
    block_v = default_block_v(n, v)
    for spec in CANDIDATE_TILES[:2] if tiny else CANDIDATE_TILES:
        tiles = tk.Tiles(*spec)
        row = {"tiles": spec}
        try:
            logp, lse, _ = tk.forward(hidden, weight, targets, 1.0, False, block_v, tiles)
            d_hidden, _ = tk.backward(hidden, weight, targets, 1.0, lse, None, grad, None, block_v, True, True,
                                      tiles)
            row["logp_err"] = float((logp[rows].double() - ref_logp).abs().max())
            row["d_hidden_rel_err"] = rel_error(d_hidden[rows], ref_dh)
            fwd = partial(tk.forward, hidden, weight, targets, 1.0, False, block_v, tiles)
            bwd = partial(tk.backward, hidden, weight, targets, 1.0, lse, None, grad, None, block_v, True, True, tiles)
            row["forward_ms"] = _median_ms(fwd, device, tiny)
            row["backward_ms"] = _median_ms(bwd, device, tiny)
            report.check("tiles", f"{spec} sampled logp max abs err", row["logp_err"], 2e-3)
            report.check("tiles", f"{spec} sampled d hidden rel err", row["d_hidden_rel_err"], 3e-2)
        except Exception as exc:  # a tile may not fit the card (shared memory, registers): record and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report.tiles.append(row)
        print(f"tiles {spec}: {row}", flush=True)


# --- 3. the loss library on the device against float64 on the CPU ------------------------------------


def _loss_cases() -> dict[str, Callable[[dict], torch.Tensor]]:
    def policy(correction: str, mask_level: str = "token") -> Callable[[dict], torch.Tensor]:
        cfg = LossConfig(correction=correction, mask_level=mask_level)

        def f(x: dict) -> torch.Tensor:
            out = L.policy_loss(x["logp"], x["logp_mu"], x["adv"], x["mask"], cfg, logp_prox=x["logp_prox"])
            return L.aggregate(out.loss, out.mask, "seq-mean-token-mean")

        return f

    def divergence(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[dict], torch.Tensor]:
        return lambda x: L.aggregate(fn(x["logp"], x["logp_ref"]), x["mask"], "token-mean")

    def critic(x: dict) -> torch.Tensor:
        adv, returns = L.gae(x["rewards_tok"], x["values_old"], x["mask"], gamma=0.99, lam=0.95)
        value = L.aggregate(L.value_loss(x["logp"], x["values_old"], returns, 0.2), x["mask"], "token-mean")
        return value + L.whiten(adv, x["mask"]).sum() * 1e-3

    cases = {f"policy_loss {c}": policy(c) for c in ("behavior", "decoupled", "masked", "areal", "areal_sequence")}
    cases["policy_loss masked sequence"] = policy("masked", "sequence")
    cases.update({
        "forward_kl": divergence(L.forward_kl),
        "js_low_var": divergence(L.js_low_var),
        "alpha 0.2": divergence(lambda a, b: L.alpha_divergence(a, b, 0.2)),
        "reverse_kl": divergence(L.reverse_kl),
        "js halves": divergence(lambda a, b: L.js_reference_half(a, b) + L.js_online_half(a, b)),
        "gae + value_loss": critic,
        "grpo_advantages": lambda x: (L.grpo_advantages(x["rewards"]) * x["rewards"]).sum() + 0 * x["logp"].sum(),
    })
    return cases


def check_losses(report: Report, device: str, g: torch.Generator) -> None:
    b, t = 16, 48
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    x64 = {
        "logp": -torch.rand(b, t, generator=g, dtype=torch.float64) * 3,
        "adv": torch.randn(b, generator=g, dtype=torch.float64),
        "mask": torch.arange(t)[None, :] < lengths[:, None],
        "rewards": torch.randint(0, 2, (4, 8), generator=g).double(),
        "rewards_tok": torch.randn(b, t, generator=g, dtype=torch.float64),
        "values_old": torch.randn(b, t, generator=g, dtype=torch.float64),
    }
    for key, scale in (("logp_mu", 0.4), ("logp_prox", 0.2), ("logp_ref", 0.8)):
        x64[key] = x64["logp"] + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    for name, fn in _loss_cases().items():
        ref_in = {k: v.clone() for k, v in x64.items()}
        ref_in["logp"].requires_grad_()
        ref = fn(ref_in)
        (ref_grad,) = torch.autograd.grad(ref, ref_in["logp"])
        dev_in = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in x64.items()}
        dev_in["logp"].requires_grad_()
        out = fn(dev_in)
        (grad,) = torch.autograd.grad(out, dev_in["logp"])
        scale = max(abs(ref.item()), 1e-12)
        report.check("losses", f"{name} value rel err", abs(out.item() - ref.item()) / scale, 1e-4)
        report.check("losses", f"{name} grad rel err", rel_error(grad.cpu(), ref_grad), 1e-5)


# --- the run ------------------------------------------------------------------------------------------


def _device_info(device: str) -> dict:
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": device, "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / GIB, 1))
        # The card's ceilings as found, on random data: a bf16 matrix product and a device-to-device copy.
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        info["bf16_matmul_tflops"] = round(2 * 8192**3 / (ms * 1e-3) / 1e12)
        src = torch.randn(1 << 29, device="cuda")  # 2 GiB
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
        info["copy_tb_s"] = round(2 * src.numel() * 4 / (ms * 1e-3) / 1e12, 2)
        del a, b, src, dst
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _print(report: Report, seconds: float) -> None:
    print(f"\ndevice: {json.dumps(report.device)}; seed {report.seed}; {seconds:.0f} s")
    if report.cost:
        print("\n| N | V | H | dtype | path | ms (fwd+bwd) | useful TFLOP/s | peak GiB | above inputs GiB "
              "| sampled logp err |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in report.cost:
            print(f"| {r['n']} | {r['v']} | {r['h']} | {r['dtype']} | {r['path']} | {r['ms']:.2f} | "
                  f"{r['tflops']:.1f} | {r['peak_gib']:.2f} | {r['above_inputs_gib']:.2f} | {r['logp_err']:.1e} |")
        print(f"(Liger-Kernel's published peak at N=8192: fused {LIGER_GIB['fused']} GiB, "
              f"naive {LIGER_GIB['naive']} GiB)")
    if report.tiles:
        print("\n| tiles (n, v, h, warps, stages) | forward ms | backward ms | sum |\n|---|---|---|---|")
        for r in report.tiles:
            f, b = r.get("forward_ms", float("nan")), r.get("backward_ms", float("nan"))
            print(f"| {r['tiles']} | {f:.2f} | {b:.2f} | {f + b:.2f} | {r.get('error', '')}")
    print("\n| part | check | value | limit | |\n|---|---|---|---|---|")
    for c in report.checks:
        print(f"| {c.part} | {c.name} | {c.value:.3g} | {c.limit:.3g} | {'ok' if c.ok else 'FAIL'} |")
    failed = [c for c in report.checks if not c.ok]
    print(f"\n{len(report.checks) - len(failed)} of {len(report.checks)} checks pass" +
          ("" if not failed else f"; FAILED: {', '.join(c.name for c in failed)}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (set before triton is imported)")
    parser.add_argument("--seed", type=int, default=None, help="repeat a run's inputs (default: a fresh seed)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and checks here")
    parser.add_argument("--skip", choices=("kernel", "cost", "tiles", "losses"), action="append", default=[],
                        help="leave a part out (repeatable)")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run with --tiny (Triton's interpreter)", file=sys.stderr)
        return 2
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: --tiny needs TRITON_INTERPRET=1 in the environment (scripts/gpu_check.sh sets it)",
              file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    report = Report(seed=seed, device=_device_info(device))
    start = time.perf_counter()
    parts = {"kernel": lambda: check_kernel(report, device, args.tiny, g),
             "cost": lambda: check_cost(report, device, args.tiny, g),
             "tiles": lambda: sweep_tiles(report, device, args.tiny, g),
             "losses": lambda: check_losses(report, device, g)}
    for name, run in parts.items():
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            run()
        except Exception:  # one part's failure must not hide the others' figures
            traceback.print_exc()
            report.check(name, "raised (traceback above)", float("nan"), 0.0)
        print(f"{name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"seed": seed, "device": report.device, "cost": report.cost,
                                         "tiles": report.tiles,
                                         "checks": [{**asdict(c), "ok": c.ok} for c in report.checks]}, indent=1))
    _print(report, time.perf_counter() - start)
    return 0 if all(c.ok for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
