"""One module per command-line command, and the helpers they share (common.py).

COMMANDS is the table of the commands: each command's name ("run", or "bench kernels" for a
subcommand) and its one-line help, the line `dph-async --help` lists. The command's module is named
after it ("bench kernels": bench_kernels.py) and defines DESCRIPTION (its --help text),
`add_arguments(parser)` and `main(args) -> int`. Adding a command is adding its module and its line
here (tests/test_cli.py checks that the two agree). `dph_async.cli.main` imports only the module of
the command a command line names, so a module imports its implementation at its top; `serve`,
`config` and `status` still carry no torch, vLLM or DeepSpeed (tests/test_cli.py runs them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

COMMANDS: dict[str, str] = {
    "ablate confirm": ("a pre-registered test (docs/preregistration.md: divergence or staleness) from the "
                       "sweeps' seeds.csv: paired t, Holm, the verdicts fixed before the runs"),
    "ablate divergence": ("sweep training objectives x their coefficients x seeds; "
                          "the DPH-RL paper's table on your task"),
    "ablate samplers": ("sweep the DPO samplers (online, ref, gshf, mixp) x seeds; "
                        "the samplers paper's comparison on your task"),
    "ablate staleness": "sweep the staleness bound eta x off-policy correction x seeds; reward, Pass@k, IS diagnostics",
    "analyze": "weight analysis: singular spectra and principal angles of top-k subspaces, base against trained",
    "bench": "RL throughput: the same work in sync and async mode, busy timelines, weight sync, scaling",
    "bench gemm": "the learner's linear layers: oneDNN (learner.cpu_gemm) against torch's F.linear",
    "bench kernels": "peak memory and time of the fused log-prob kernels against the naive path",
    "bench peer": "the same GRPO work through dph-async, an in-repo single-process loop and TRL's GRPOTrainer",
    "bench scale": ("dph-async against TRL's GRPOTrainer and the in-repo loop over a grid of model sizes x completion "
                    "lengths"),
    "bench scorer": "scorer throughput and latency percentiles: local pool against the HTTP service",
    "bench tta": ("time to accuracy: wall-clock to a held-out Pass@1 target, dph-async async against its sync mode "
                  "and TRL, over seeds"),
    "bench transport": "rollout transport bandwidth: protocol vs bare ZeroMQ vs pickle queues, and replay ops/s",
    "bench weights": "weight sync: publish -> loaded in a vLLM actor, per stage, against memcpy",
    "config": "print the resolved config (preset + overrides) as YAML, or list the presets",
    "eval": "evaluate a model: greedy accuracy, unbiased Pass@k (k = 1..eval.k_max), distinct correct answers",
    "keys": "create CURVE keys so services can listen beyond 127.0.0.1",
    "pool": "list (or end) the actor processes a Ray cluster keeps for later runs",
    "presample": "sample pi_0 k times per prompt; write the reference pool (D_pef) and the RL set (D_exp)",
    "recover": ("SVD recovery: put the base's top-k singular directions/values back into a trained model, "
                "evaluate ID and OOD"),
    "rerun": ("re-train a run's learner on its recorded batches: check it is the run bit for bit, "
              "or train a counterfactual"),
    "run": "warm start, pre-sample, train with asynchronous DPH-RL, evaluate and report",
    "score": "score a file of responses (JSONL or parquet) and print a summary",
    "serve replay": "run the replay service (rollout ingest for actors, batches for the learner)",
    "serve scorer": "serve rewards over HTTP (a worker pool behind POST /v1/score)",
    "simulate samplers": "tabular bandit: how fast DPO converges with each pair sampler (ref, online, gshf, mixp)",
    "soak": "train continuously for N minutes, sampling RSS, fds, threads, /dev/shm, WAL and throughput",
    "status": ("health and key metrics of a run's processes (replay, learner, actors, scorers), "
               "or a finished run's result"),
}


def command_module(name: str) -> ModuleType:
    """The module of the command `name` ("bench kernels": dph_async.cli.commands.bench_kernels), imported."""
    if name not in COMMANDS:
        raise KeyError(f"no command {name!r}")
    return importlib.import_module(f"{__name__}.{name.replace(' ', '_')}")
