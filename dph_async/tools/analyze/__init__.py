"""Weight analysis of trained checkpoints against their base, and the SVD recovery experiment.

    svd.py          float64 SVD statistics: principal angles, spectra, the update's energy split, and
                    the top-k replacements of the recovery experiment (pure functions)
    checkpoints.py  reading matrices from Hugging Face directories, learner checkpoints and run
                    directories; naming each matrix by layer and type
    drift.py        every matrix of every checkpoint against the base; means per type
    report.py       analysis.json, spectra.npz, analysis.md; plots.py draws plots/
    recover.py      recovered models written, evaluated in Ray workers, tabulated and plotted
"""
