"""`dph-async bench weights`: published weights into a vLLM actor, GB/s against memcpy."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, fail, guarded
from dph_async.progress import console
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
Make a model of >= 100 M parameters (random init, a Llama config; kept in --models for the next
run), publish versions of it through the learner's weight servers, and load each into a vLLM actor
in a child process, in three variants one after the other: "shm" (the actor reads the version from the
learner's shared-memory slot), "tcp" (its buckets over the weight socket), both loaded in place,
and "tcp+reload" (vLLM's reload path). Reports GB/s of every stage (snapshot, transfer, checksum,
load into the engine, publish -> loaded) against memcpy of the same bytes on this machine, per
variant. Target: the actor's fetch + verify + load at >= 50% of memcpy. --cpu-gemm torch runs the
actor's linear layers as actors.cpu_gemm=torch does (F.linear on the weights as loaded: no oneDNN
packing on a load, slower generation). Needs ~5 GB of memory and
~1.1 GB of /dev/shm at the default size. Output: --output/bench.json and bench.md.

examples:
  dph-async bench weights                              # 134 M parameters, 9 rounds (3 per variant)
  dph-async bench weights --layers 24 --rounds 12      # 248 M parameters
  dph-async bench weights --bucket-mb 128 -o runs/bench/weights-128
  dph-async bench weights --cpu-gemm torch -o runs/bench/weights-torch
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_argument(p, "output directory (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/weights"))
    p.add_argument("--models", type=Path, default=Path(".cache/bench-models"), help="where the made model "
                   "is kept (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="versions published after the warm-ups, split "
                   "between shm, tcp and tcp+reload (default: %(default)s)")
    p.add_argument("--cpu-gemm", choices=("onednn", "torch"), default="onednn", help="the actor engine's CPU "
                   "linear layers, as actors.cpu_gemm (default: %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=32.0, help="weight bucket size in MiB, as "
                   "learner.weight_bucket_mb (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    # heavy (vLLM, torch, transformers: about 7 s): on running, so that --help is quick
    from dph_async.tools.bench import weights as bench
    if args.hidden % 64:
        return fail("--hidden must be a multiple of 64 (heads of 64)")
    shape = bench.ModelShape(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                             intermediate=args.hidden * 8 // 3 // 64 * 64, vocab=args.vocab)

    def show(r: bench.Round, nbytes: int) -> None:
        console.print(f"  {r.path:10s} memcpy {r.memcpy_s * 1e3:5.0f} ms, snapshot {r.snapshot_s * 1e3:5.0f}, transfer "
                      f"{r.transfer_s * 1e3:5.0f}, checksum {r.checksum_s * 1e3:5.0f}, load {r.load_s * 1e3:5.0f}: "
                      f"actor {nbytes / r.actor_s / 1e9:.2f} GB/s ({r.memcpy_s / r.actor_s:.0%} of memcpy), "
                      f"publish -> loaded {r.publish_to_loaded_s * 1e3:.0f} ms", highlight=False)

    def work() -> None:
        args.models.mkdir(parents=True, exist_ok=True)
        console.print(f"{shape.name}: making it (once) and starting the actor's engine")
        res = bench.run(shape, args.models, args.rounds, args.bucket_mb, machine(), on_round=show,
                        cpu_gemm=args.cpu_gemm)
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "bench.json").write_text(res.to_json())
        (args.output / "bench.md").write_text(bench.markdown(res))
        for path, s in res.summary.items():
            console.print(f"{path}: actor fetch+verify+load {s['actor']:.2f} GB/s = {s['actor_of_memcpy']:.0%} of "
                          f"memcpy ({s['memcpy']:.2f} GB/s), in CPU-seconds {s['cpu_actor_of_memcpy']:.0%}; "
                          f"publish -> loaded {s['publish_to_loaded']:.2f} GB/s", highlight=False)
        console.print(f"report: {args.output / 'bench.md'}")

    return guarded(work, "nothing is kept but the made model")
