"""One import namespace: the design card's directories (actors/, replay/, learner/, kernels/) install as
`dph_async.actors` … `dph_async.kernels` (pyproject.toml's package-dir mapping), in the wheel and in
the editable install the test suite runs on; no top-level name but `dph_async` is the project's, and no
source imports the directories by their bare names."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("actors", "replay", "learner", "kernels")


def test_the_editable_install_maps_each_directory_into_the_namespace():
    for name in MAPPED:
        spec = importlib.util.find_spec(f"dph_async.{name}")
        assert spec is not None and Path(spec.origin).resolve() == ROOT / name / "__init__.py", (name, spec)


@pytest.mark.slow
def test_the_wheel_holds_every_module_under_dph_async_and_nothing_else(tmp_path):
    src = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "dph_async", *MAPPED):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is
                                           shutil.copytree else {}))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("dph_async-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dph_async"}
    sources = {f"dph_async/{p.relative_to(ROOT).as_posix()}" for d in MAPPED for p in (ROOT / d).rglob("*.py")}
    sources |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "dph_async").rglob("*.py")}
    assert sources <= names, sorted(sources - names)[:5]
    assert "dph_async/presets/default.yaml" in names


def test_no_source_imports_a_directory_by_its_bare_name():
    bad = []
    for f in sorted(p for d in (*MAPPED, "dph_async", "tests", "scripts") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bad += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in MAPPED]
    assert not bad, "\n".join(bad)
