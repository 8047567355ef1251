"""`dph-async bench scale`: `bench peer` over model sizes x completion lengths."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.bench_peer import add_run_arguments
from dph_async.cli.commands.common import add_output_argument, fail, guarded
from dph_async.pipeline.report import rate
from dph_async.progress import console
from dph_async.safe_files import write_output
from dph_async.tasks.bpe import VOCAB
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
The comparison of `bench peer` in every cell of a grid: model sizes (random-init Llamas over a 32k
byte-level BPE vocabulary made here: 2m = hidden 32 x 2 layers, 12m = 160 x 4, 52m = 512 x 6, or
HIDDENxLAYERS) x completion lengths (every completion exactly that long). Per cell: --n completions
per prompt and --tokens-per-step / (n x length) prompts per step (at least one); --repeats runs of
each system of --steps steps, the order rotating each repeat, the steady state after --skip.
Reported per cell: completions/s and tokens/s of each system (medians) and dph-async's ratio to each
peer with its 95% interval (the repeats' paired ratios: runs side by side share the machine's
drift); dph-async's CPU-seconds per step by part, the peers', and the bound they set on the
machine's cores; each process's peak resident set; and the scaling model's projection to more cores
against the peers' best there.

Output in --output: bench.json, bench.md, scale.png, cells/<cell>/ (each a `bench peer` directory with
its own bench.md, and cell.json once finished), inputs/ (the tokenizer, the prompts, the models).
Finished cells are kept: the same command again runs only the cells not finished (--fresh starts
over); a cell recorded with other work is refused.

examples:
  dph-async bench scale                                 # 3 sizes x lengths 16, 64, 256, 3 repeats
  dph-async bench scale --repeats 1                     # one run a system: a third of the time, no interval
  dph-async bench scale --sizes 2m 52m --lengths 64
  dph-async bench scale --systems dph-async trl --set actors.compile=false
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_argument(p, "output directory (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/scale"))
    p.add_argument("--sizes", nargs="+", default=["2m", "12m", "52m"], help="model sizes: 2m, 12m, 52m or "
                   "HIDDENxLAYERS (default: %(default)s)")
    p.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256], help="completion lengths in tokens "
                   "(default: %(default)s)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="completion tokens per step a cell aims at "
                   "(default: %(default)s)")
    p.add_argument("--n", type=int, default=4, help="completions per prompt (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="tokens of the BPE vocabulary (default: %(default)s)")
    add_run_arguments(p, steps=5, skip=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of every system per cell, order rotating; an "
                   "interval needs 2 (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="delete the grid in --output (its cells, inputs and "
                   "reports; only a directory a grid made) and measure again")


def main(args: argparse.Namespace) -> int:
    # heavy (torch, transformers: about 4 s): on running, so that --help is quick
    from dph_async.tools.bench import scale, scale_report
    try:
        sizes = [scale.parse_size(s) for s in args.sizes]
        scale.plan_grid(sizes, args.lengths, args.tokens_per_step, args.n)
    except scale.GridError as e:
        return fail(str(e))
    if args.steps <= args.skip:
        return fail(f"--steps ({args.steps}) must be more than --skip ({args.skip})")
    if args.repeats < 1:
        return fail(f"--repeats ({args.repeats}) must be at least 1")
    if args.n < 2 or args.tokens_per_step < 1 or args.vocab < 512:
        return fail("--n must be at least 2 (a group's advantages need two completions), --tokens-per-step at "
                    "least 1 and --vocab at least 512 (a byte-level BPE starts from 256 byte tokens)")

    def work() -> None:
        res = scale.run_grid(sizes, args.lengths, args.output, preset=args.preset, overrides=args.overrides,
                             tokens_per_step=args.tokens_per_step, n=args.n, steps=args.steps, skip=args.skip,
                             systems=args.systems, cache=args.cache, machine=machine(), repeats=args.repeats,
                             vocab=args.vocab, fresh=args.fresh,
                             log=lambda m: console.print(m, highlight=False))
        write_output(args.output / "bench.md", scale_report.markdown(res))
        scale_report.plot(res, args.output / "scale.png")
        for c in res.cells:
            ratios = ", ".join(f"/ {p} {c.intervals[p].fmt() if p in c.intervals else f'{r:.2f}x'}"
                               for p, r in c.ratios.items())
            console.print(f"{c.key}: dph-async {rate(c.systems['dph-async'].completions_per_s)} completions/s "
                          f"({ratios})" if "dph-async" in c.systems else c.key, highlight=False)
        console.print(f"report: {args.output / 'bench.md'}, plot: {args.output / 'scale.png'}")

    return guarded(work, "finished cells are kept; the same command goes on from there")
