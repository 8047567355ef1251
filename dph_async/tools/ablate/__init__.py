"""Ablation sweeps: a grid of RL runs from one base model, resumable, summarised over seeds.

    cells.py    what a sweep runs: staleness (eta x off-policy correction x seeds) and divergence
                (mode x coefficient x seeds) grids of cells, each a set of config overrides
    sweep.py    runs the cells (prepare once, then RL and evaluations per cell; a finished cell is
                never rerun) and exports intermediate checkpoints for Pass@k along the run
    results.py  reads a finished cell (curves, evaluations, staleness, IS diagnostics) and aggregates
                cells over seeds (mean and standard error)
    report.py   summary.json, summary.md (tables) and the plots (plots.py)
"""
