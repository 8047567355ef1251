"""dph-async: asynchronous off-policy actor-learner RL for LLMs, and the reference DPH-RL implementation.

The shared core: config schema, wire protocol, replay clients, weights format, tasks and rewards.
Above it, each importing only downward (tests/test_layers.py): `actors`, `replay`, `learner`,
`kernels` (the data flow; their directories sit beside this one and install as `dph_async.*`), then
`runtime` (the processes on Ray), `pipeline` (a run's stages), `tools` (bench, ablate, analyze,
soak) and `cli`. Kept import-light: everything imports from here.
"""

__version__ = "0.1.0"
