"""The application above the shared core: the pipeline and its stages (warm start, pre-sampling,
evaluation, report), the Ray launcher, the CLI and its commands, benchmarks and ablations.

Nothing in the core (`dph_async` outside this package), `actors`, `replay`, `learner` or `kernels`
imports from here (tests/test_layers.py holds that).
"""
