"""Checkpoint retention: keep the newest `keep` checkpoints and the protected versions, delete the rest.

    prune(checkpoint_dir, keep=3, protect={50, 100})    # after a new checkpoint is complete

Checkpoints are `<dir>/v<version>/` (DeepSpeed's tag) with `<dir>/latest` naming the newest. Called
only once the new checkpoint is complete (DeepSpeed writes `latest` last), so a crash never leaves a
run with fewer good checkpoints than it had; the one `latest` names is never deleted. A checkpoint is
renamed out of the v<N> namespace before it is removed, so a crash mid-delete leaves nothing that
looks like a checkpoint. Protected versions are those something still needs: an ablation evaluates
the weights at its evaluation points after the run (learner.keep_versions).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

_TAG = re.compile(r"v(\d+)")


def checkpoints(directory: Path) -> dict[int, Path]:
    """{version: path} of the checkpoints in `directory`."""
    if not directory.is_dir():
        return {}
    return {int(m.group(1)): p for p in directory.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name))}


def to_delete(versions: Iterable[int], keep: int, protect: Iterable[int], latest: int | None) -> list[int]:
    """Versions beyond the newest `keep` (0 keeps all), less the protected ones and `latest`."""
    if keep <= 0:
        return []
    spared = {*sorted(versions, reverse=True)[:keep], *protect}
    if latest is not None:
        spared.add(latest)
    return sorted(v for v in versions if v not in spared)


def prune(directory: Path, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Delete the checkpoints `to_delete` names; return what was deleted."""
    found = checkpoints(directory)
    latest_file = directory / "latest"
    latest_tag = latest_file.read_text().strip() if latest_file.is_file() else ""
    latest = int(m.group(1)) if (m := _TAG.fullmatch(latest_tag)) else None
    deleted = []
    for version in to_delete(found, keep, protect, latest):
        path = found[version]
        doomed = path.with_name(f".deleting-{path.name}")
        path.rename(doomed)
        shutil.rmtree(doomed)
        deleted.append(path)
    for leftover in directory.glob(".deleting-v*"):  # from a crash during an earlier prune
        shutil.rmtree(leftover, ignore_errors=True)
    return deleted
