"""Benchmark of the fused log-prob kernels against the naive materialised-logits path.

One measurement = forward + backward of sum(g * log p(target)) for hidden [N, H], weight [V, H].

CPU: each path runs in its own fresh process (`python -m dph_async.tools.bench.kernels worker ...`), so
neither inherits the other's heap. Peak extra memory is the resident-set high-water mark during the
first forward + backward minus the resident set just before it (inputs allocated and touched): the
kernel resets the high-water mark when "5" is written to /proc/self/clear_refs; where that is not
allowed, ru_maxrss after minus the resident set before. tracemalloc would not see torch's
allocations. Time is wall-clock per forward + backward; rounds alternate the two paths' order so that
load from other processes spreads over both; the ratio uses the medians.

GPU (when present): in one process, the Triton kernel, the naive path and torch.compile of the naive
path; peak memory from torch.cuda's allocator counters, time with synchronisation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dph_async.kernels import fused_logprobs
from dph_async.kernels.reference import naive_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, grad


def _step_fn(path: str, hidden, weight, targets, grad, block_v: int | None):
    naive = torch.compile(naive_logprobs) if path == "compiled" else naive_logprobs

    def step():
        if path in ("naive", "compiled"):
            logp = naive(hidden, weight, targets)
        else:
            logp, _ = fused_logprobs(hidden, weight, targets, impl=path, block_v=block_v)
        d_hidden, _ = torch.autograd.grad(logp, (hidden, weight), grad)
        return logp.detach(), d_hidden

    return step


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(path: str, n: int, h: int, v: int, dtype: str, iters: int, block_v: int | None, save: str) -> dict:
    """One path, in this (fresh) process: peak extra memory of the first step, time of every step."""
    _step_fn(path, *_inputs(8, h, 300, DTYPES[dtype]), block_v)()  # one-time library set-up, not measured
    hidden, weight, targets, grad = _inputs(n, h, v, DTYPES[dtype])
    step = _step_fn(path, hidden, weight, targets, grad, block_v)
    threads = torch.get_num_threads()
    times, cpu_times, loads = [], [], []

    def timed():
        loads.append(os.getloadavg()[0])
        wall, cpu = time.perf_counter(), time.process_time()
        out = step()
        times.append(time.perf_counter() - wall)
        cpu_times.append(time.process_time() - cpu)
        return out

    base = _rss()
    hwm_reset = _reset_peak()
    logp, d_hidden = timed()
    peak = _peak_rss() - base
    save_file({"logp": logp.detach().contiguous(), "d_hidden": d_hidden.detach().contiguous()}, str(save))
    del logp, d_hidden
    for _ in range(iters - 1):
        timed()
    return {
        "peak_extra_bytes": peak,
        "times_s": times,
        "cpu_s": cpu_times,
        # Share of its threads' time this process got: below 1 when other processes took the cores.
        "cpu_share": [c / (t * threads) for c, t in zip(cpu_times, times, strict=True)],
        "load_1min": loads,
        "hwm_reset": hwm_reset,
        "threads": threads,
    }


def _spawn(path: str, args: argparse.Namespace, save: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "dph_async.tools.bench.kernels",
        "worker",
        path,
        str(args.n),
        str(args.hidden),
        str(args.vocab),
        args.dtype,
        str(args.iters),
        str(args.block_v or 0),
        str(save),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker for {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def naive_bytes_estimate(n: int, h: int, v: int) -> int:
    """What the naive path holds at its peak: ~3 fp32 [N, V] tensors and d weight, plus the inputs."""
    return 3 * n * v * 4 + 2 * v * h * 4


def bench_cpu(args: argparse.Namespace, on_run=None) -> dict:
    runs: dict[str, list[dict]] = {"naive": [], "torch": []}
    with tempfile.TemporaryDirectory() as tmp:
        saved = {}
        for r in range(args.rounds):
            for path in ("naive", "torch") if r % 2 == 0 else ("torch", "naive"):
                saved[path] = Path(tmp) / f"{path}.safetensors"
                runs[path].append(_spawn(path, args, saved[path]))
                if on_run:
                    on_run(path, runs[path][-1])
        ref, fused = load_file(saved["naive"]), load_file(saved["torch"])
    logp_diff = (ref["logp"] - fused["logp"]).abs().max().item()
    dh_diff = (
        (ref["d_hidden"].float() - fused["d_hidden"].float()).abs().max() / ref["d_hidden"].float().abs().max()
    ).item()
    paths = {}
    for path, rs in runs.items():
        times = [t for run in rs for t in run["times_s"]]
        paths[path] = {
            "time_median_s": statistics.median(times),
            "time_min_s": min(times),
            "times_s": times,
            "cpu_s_median": statistics.median(c for run in rs for c in run["cpu_s"]),
            "peak_extra_bytes": max(run["peak_extra_bytes"] for run in rs),
            "cpu_share": [s for run in rs for s in run["cpu_share"]],
            "load_1min": [x for run in rs for x in run["load_1min"]],
            "hwm_reset": all(run["hwm_reset"] for run in rs),
        }
    return {
        "paths": paths,
        "time_ratio": paths["torch"]["time_median_s"] / paths["naive"]["time_median_s"],
        "time_ratio_min": paths["torch"]["time_min_s"] / paths["naive"]["time_min_s"],
        "cpu_time_ratio": paths["torch"]["cpu_s_median"] / paths["naive"]["cpu_s_median"],
        "memory_ratio": paths["torch"]["peak_extra_bytes"] / paths["naive"]["peak_extra_bytes"],
        "max_abs_diff_logp": logp_diff,
        "max_rel_diff_d_hidden": dh_diff,
        "threads": runs["torch"][0]["threads"],
    }


def bench_gpu(args: argparse.Namespace, dtype: str) -> dict:
    hidden, weight, targets, grad = _inputs(args.n, args.hidden, args.vocab, DTYPES[dtype], "cuda")
    paths = {}
    for path in ("naive", "compiled", "triton"):
        step = _step_fn(path, hidden, weight, targets, grad, args.block_v)
        for _ in range(3):  # warm-up: compilation, autotuning, allocator
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(max(args.iters, 5)):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        paths[path] = {
            "time_median_s": statistics.median(times),
            "time_min_s": min(times),
            "times_s": times,
            "peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
        }
    naive, compiled, triton = paths["naive"], paths["compiled"], paths["triton"]
    return {
        "device": torch.cuda.get_device_name(),
        "paths": paths,
        "time_ratio_vs_naive": triton["time_median_s"] / naive["time_median_s"],
        "memory_ratio_vs_naive": triton["peak_extra_bytes"] / naive["peak_extra_bytes"],
        "time_ratio_vs_compiled": triton["time_median_s"] / compiled["time_median_s"],
        "memory_ratio_vs_compiled": triton["peak_extra_bytes"] / compiled["peak_extra_bytes"],
    }


if __name__ == "__main__":
    if len(sys.argv) == 10 and sys.argv[1] == "worker":
        path, n, h, v, dtype, iters, block_v, save = sys.argv[2:]
        result = worker(path, int(n), int(h), int(v), dtype, int(iters), int(block_v) or None, save)
        print(json.dumps(result))
    else:
        sys.exit(
            "usage: python -m dph_async.tools.bench.kernels worker PATH N H V DTYPE ITERS BLOCK_V SAVE "
            "(internal; run `dph-async bench kernels`)"
        )
