"""One colour per run in every panel of a figure, and in every figure of a report.

matplotlib gives each axes its own colour cycle, so a panel that lacks a run (GRPO logs no divergence)
hands that run's colour to the next one. Plots take their colours from one mapping made before any
panel is drawn instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib's pyplot, off screen, imported where a figure is drawn: a driver starts its Ray
    cluster without it (tests/test_lazy_import.py)."""
    import matplotlib  # heavy: a figure's only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the off-screen backend

    return plt


def colour_map(names: Iterable[str], fixed: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: colour}: the `fixed` names keep their colour, the others take matplotlib's cycle
    (C0, C1, ...) in the order they first appear."""
    fixed = fixed or {}
    colours: dict[str, str] = {}
    for name in names:
        if name not in colours:
            colours[name] = fixed.get(name) or f"C{sum(1 for n in colours if n not in fixed)}"
    return colours
