"""The tree's layers hold, each importing only downward: actors, replay and learner import only the
shared core (and the learner the kernels), never each other; the shared core imports none of the
layers above it; the runtime (Ray hosting) never the pipeline, tools or CLI; the pipeline never the
tools or CLI; the tools never the CLI. Read from the source with `ast`, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# directory -> the modules it must never import (every import is `dph_async.…`; the design card's
# directories install as dph_async.actors, .replay, .learner and .kernels)
DATA_FLOW = ("dph_async.actors", "dph_async.replay", "dph_async.learner", "dph_async.kernels")
ABOVE_CORE = ("dph_async.runtime", "dph_async.pipeline", "dph_async.tools", "dph_async.cli")
FORBIDDEN = {
    "actors": {"dph_async.replay", "dph_async.learner", "dph_async.kernels", *ABOVE_CORE},
    "replay": {"dph_async.actors", "dph_async.learner", "dph_async.kernels", *ABOVE_CORE},
    "learner": {"dph_async.actors", "dph_async.replay", *ABOVE_CORE},
    "kernels": {"dph_async"},  # nothing of the project but the kernels themselves
    "dph_async": {*DATA_FLOW, *ABOVE_CORE},  # the shared core: dph_async/ outside the layers below
    "dph_async/runtime": set(ABOVE_CORE[1:]),
    "dph_async/pipeline": set(ABOVE_CORE[2:]),
    "dph_async/tools": set(ABOVE_CORE[3:]),
}
ALLOWED = {"kernels": "dph_async.kernels"}  # an exception inside a forbidden prefix
LAYERS = ("runtime", "pipeline", "tools", "cli")  # folders of dph_async/ that are not the shared core


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    if package == "dph_async":
        files = [f for f in files if f.relative_to(ROOT / package).parts[0] not in LAYERS]
    return files


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layers(package: str) -> None:
    files = sources(package)
    assert files, f"no sources found for {package}"
    bad = []
    for f in files:
        for name in imported_modules(f):
            allowed = ALLOWED.get(package)
            if allowed and (name == allowed or name.startswith(allowed + ".")):
                continue
            for banned in FORBIDDEN[package]:
                if name == banned or name.startswith(banned + "."):
                    bad.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
