"""dph-async: asynchronous off-policy actor-learner RL for LLMs, and the reference DPH-RL implementation.

The shared core: config schema, wire protocol, replay clients, weights format, tasks and rewards.
The application (pipeline, launcher, CLI, benchmarks, ablations) lives in `dph_async.app`, above it.
Kept import-light: `actors`, `replay` and `learner` import from here.
"""

__version__ = "0.1.0"
