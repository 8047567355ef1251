"""The pipeline: one `dph-async run` as stages over the runtime (`stages.py`): inputs and preflight
checks, warm start, pre-sampling, RL, evaluation, the report; and re-execution of a recorded run
(`rerun.py`). It imports the runtime and the core, never the tools or the CLI (tests/test_layers.py).
"""
