"""Tools over the pipeline: benchmarks (`bench/`), ablation sweeps and pre-registered tests
(`ablate/`), checkpoint analysis (`analyze/`), the soak, the sampler-bandit simulation, the scaling
model and the docs renderer. Each is a library its `dph-async` command calls; none imports the CLI.
"""
