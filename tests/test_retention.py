"""Checkpoint retention: the newest N, the protected versions and `latest` stay; the rest go, whole."""

from __future__ import annotations

import pytest

from dph_async.config import load_config
from dph_async.learner.retention import checkpoints, prune, to_delete
from dph_async.tools.ablate.cells import staleness_sweep
from dph_async.tools.ablate.sweep import cell_config, eval_versions


@pytest.mark.parametrize(("versions", "keep", "protect", "latest", "expected"), [
    ([10, 20, 30, 40, 50], 2, [], 50, [10, 20, 30]),
    ([10, 20, 30, 40, 50], 2, [20], 50, [10, 30]),
    ([10, 20, 30, 40, 50], 0, [], 50, []),  # 0 keeps every checkpoint
    ([10, 20, 30], 5, [], 30, []),
    ([10, 20, 30, 40], 1, [], 20, [10, 30]),  # `latest` is never deleted, whatever its age
])
def test_which_checkpoints_go(versions, keep, protect, latest, expected):
    assert to_delete(versions, keep, protect, latest) == expected


def test_prune_deletes_whole_checkpoints_and_spares_the_rest(tmp_path):
    for v in (5, 10, 15, 20):
        (tmp_path / f"v{v}" / "replay").mkdir(parents=True)
        (tmp_path / f"v{v}" / "mp_rank_00_model_states.pt").write_bytes(b"w" * 10)
    (tmp_path / "latest").write_text("v20")
    (tmp_path / ".deleting-v1").mkdir()  # left by a crash during an earlier prune
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    deleted = prune(tmp_path, keep=2, protect=[5])
    assert sorted(p.name for p in deleted) == ["v10"]
    assert sorted(checkpoints(tmp_path)) == [5, 15, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes", "v15", "v20", "v5"]


def test_an_ablation_keeps_the_checkpoints_it_evaluates():
    cell = staleness_sweep([1], ["decoupled"], [0], "grpo").cells[0]
    cfg = cell_config(load_config("default", ["learner.steps=100"]), cell, eval_points=3)
    assert cfg.learner.keep_versions == eval_versions(100, 3) == [34, 68, 100]
    versions = list(range(cfg.learner.checkpoint_every, 101, cfg.learner.checkpoint_every))
    assert versions == [34, 68]
    assert to_delete(versions, 1, [], None) == [34]
    assert to_delete(versions, 1, cfg.learner.keep_versions, None) == []
