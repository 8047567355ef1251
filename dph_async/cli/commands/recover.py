"""`dph-async recover`: the SVD recovery experiment (which singular directions carry the ID/OOD change)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dph_async.cli.commands.common import add_output_argument, fail
from dph_async.config import ConfigError, load_config
from dph_async.paths import RunPaths
from dph_async.pipeline.report import print_tables
from dph_async.pipeline.stages import StageTimer, prepare
from dph_async.progress import console
from dph_async.tools.analyze.checkpoints import default_out, run_dir_of
from dph_async.tools.analyze.recover import Recovery, run_recovery
from dph_async.tools.analyze.svd import REPLACEMENTS

if TYPE_CHECKING:
    from dph_async.config import RunConfig

DESCRIPTION = """\
The recovery experiment of "RL heals OOD forgetting in SFT": every selected weight matrix of TRAINED
gets its top-k singular part replaced by BASE's, and each recovered model is written as a Hugging Face
directory and evaluated on the test sets (greedy accuracy and unbiased Pass@k, as `dph-async eval`):
  directions  U_base,k S_trained,k V_base,k^T   (the base's directions, the trained singular values)
  values      U_trained,k S_base,k V_trained,k^T (the trained directions, the base's singular values)
  triplets    U_base,k S_base,k V_base,k^T       (both)
If restoring the base's top-k directions moves OOD accuracy back to the base's, those directions carry
the OOD change. The table (recover.md, recover.json) lists base, trained and every recovery, with the
share of the update trained - base each keeps; plots/recover.png shows accuracy against k.

Test sets and the evaluation config come from the run directory holding TRAINED (its config.yaml; for
the embedded default its in_domain and ood splits), or --run; --data replaces the test sets. --set
overrides apply to that config (e.g. --set eval.max_prompts=50). Finished models and evaluations in --output are
kept: the same command again only does what is missing.

examples:
  dph-async recover runs/default/base_model runs/default/rl/js_low_var/final_model
  dph-async recover runs/default/base_model runs/default/rl/grpo/final_model --replace directions --k 1 8 32
  dph-async recover base trained --types attention --data ood=ood.parquet --set eval.k_max=8 -o runs/rec
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", type=Path, help="the base model (a Hugging Face directory)")
    p.add_argument("trained", type=Path, help="the trained model (a Hugging Face directory)")
    p.add_argument("--replace", default="directions,values,triplets",
                   help="comma-separated replacements: directions, values, triplets (default: %(default)s)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64], metavar="K",
                   help="numbers of top singular triplets replaced, capped per matrix at its rank "
                   "(default: 1 4 16 64)")
    p.add_argument("--types", nargs="+", metavar="TYPE", help="replace only these matrix types or groups "
                   "(q k v o gate up down embed head, or attention mlp embedding head; default: every matrix)")
    p.add_argument("--run", type=Path, help="run directory for the config and test sets (default: the one "
                   "holding TRAINED)")
    p.add_argument("--data", action="append", metavar="[NAME=]PATH", help="a test set (parquet, verl rows); "
                   "repeat for several; replaces the run's")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override, repeatable (e.g. --set eval.max_prompts=50)")
    p.add_argument("--preset", default="default", help="config preset when there is no run directory")
    add_output_argument(p, "output directory (default: <run>/recover/<name>)", out_alias=True, type=Path)
    p.add_argument("--discard-models", action="store_true", help="delete each recovered model once evaluated")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the SVDs (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    what = [w.strip() for w in args.replace.split(",") if w.strip()]
    if not what or any(w not in REPLACEMENTS for w in what):
        return fail(f"--replace {args.replace!r}: choose from {', '.join(REPLACEMENTS)}")
    if any(k < 1 for k in args.k):
        return fail(f"--k: every k must be >= 1, got {args.k}")
    run = args.run or run_dir_of(args.trained)
    if args.run is not None and not (args.run / "config.yaml").is_file():
        return fail(f"--run {args.run}: no config.yaml (not a run directory)")
    cfg = load_config(str(run / "config.yaml") if run else args.preset, args.overrides)  # errors: one line
    try:
        tests = resolve_test_sets(cfg, run, args.data)
    except (ConfigError, FileNotFoundError) as e:
        return fail(str(e))
    out = args.output or default_out([args.trained], "recover")
    torch.set_num_threads(max(1, args.threads))
    ks = sorted(set(args.k))
    recoveries = [Recovery(w, k) for w in what for k in ks]
    console.print(f"recovery: {len(recoveries)} models ({', '.join(what)} x k = {', '.join(map(str, ks))}), "
                  f"test sets {', '.join(tests)}; output in {out}")
    try:
        result = run_recovery(cfg, args.base, args.trained, tests, out, recoveries, args.types,
                              keep_models=not args.discard_models)
    except (FileNotFoundError, ValueError, KeyError, ConfigError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: run the same command again to go on")
        return 130
    print_tables(result.evals)
    console.print(f"report: {out / 'recover.md'} (plots in {out / 'plots'})")
    return 0


def resolve_test_sets(cfg: RunConfig, run: Path | None, data: list[str] | None) -> dict[str, Path]:
    """--data if given; else the run's test sets (the embedded default's in_domain and ood splits, or
    task.test_data)."""
    if data:
        tests = {}
        for item in data:
            name, _, path = item.rpartition("=")
            tests[name or Path(path).stem] = Path(path)
    elif cfg.model.path is None:
        if run is None:
            raise ConfigError("no run directory holds TRAINED: give --run DIR or --data NAME=PATH")

        paths = RunPaths(run)
        if not (paths.base_model / "config.json").is_file():
            raise ConfigError(f"{run} has no base_model: not a finished embedded-default run")
        tests = prepare(cfg, paths, StageTimer(), need_presample=False).tests  # rewrites the same splits
    else:
        tests = {k: Path(v) for k, v in cfg.task.test_data.items()}
    missing = [f"{k}={v}" for k, v in tests.items() if not v.is_file()]
    if missing or not tests:
        raise FileNotFoundError(f"test sets missing: {', '.join(missing) or 'none given'}")
    return tests
