"""dph-async: asynchronous off-policy actor-learner RL for LLMs, and the reference DPH-RL implementation.

The shared core: config schema, wire protocol, tasks and rewards, pipeline and CLI, Ray launcher, metrics.
Kept import-light: `actors`, `replay` and `learner` import from here.
"""

__version__ = "0.1.0"
