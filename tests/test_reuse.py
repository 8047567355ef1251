"""What a driver keeps between runs (dph_async/runtime/reuse.py): taking removes, each kind by its own
key; `release` ends the spares, the actors kept for this invocation only (those that outlive it are
forgotten, never ended) and the learner with its placement group, only the kinds asked, whatever a
kill raises. Ray's kill and placement-group removal are recorded, not run."""

from __future__ import annotations

import pytest

from dph_async.config import load_config
from dph_async.runtime import reuse


@pytest.fixture
def ended(monkeypatch):
    monkeypatch.setattr(reuse, "KEPT", reuse.Kept())
    log: list[str] = []

    def kill(handle, no_restart):
        assert no_restart is True
        log.append(handle)
        if handle == "raises":
            raise RuntimeError("already gone")

    monkeypatch.setattr(reuse.ray, "kill", kill)
    monkeypatch.setattr(reuse, "remove_placement_group", lambda group: log.append(f"group {group}"))
    return log


def test_taking_removes_and_each_kind_has_its_key(ended):
    cfg = load_config("default", ["launcher.max_actor_restarts=3", "actors.threads=2"])
    key = reuse.spare_key(cfg, 1)
    assert key == (1, 3, 2)
    assert not reuse.has_spare(key)
    reuse.put_spare(key, "s1")
    reuse.put_actor(key, "a1", outlives=False)  # another kind: the same tuple is another entry
    assert reuse.has_spare(key)
    assert reuse.take_spare(key) == "s1" and reuse.take_spare(key) is None and not reuse.has_spare(key)
    assert reuse.take_actor(key) == "a1" and reuse.take_actor(key) is None
    learner = reuse.KeptLearner("L", "pg", "dph-learner-x")
    assert not reuse.has_learner()
    reuse.put_learner(learner)
    assert reuse.has_learner() and reuse.take_learner() is learner and reuse.take_learner() is None
    assert ended == []


def test_release_ends_what_this_invocation_alone_holds_of_the_kinds_asked(ended):
    reuse.put_spare((0,), "raises")  # a kill that raises stops nothing
    reuse.put_spare((1,), "s1")
    reuse.put_actor(("a",), "mine", outlives=False)
    reuse.put_actor(("b",), "pooled", outlives=True)
    reuse.put_learner(reuse.KeptLearner("L", "pg", "n"))
    reuse.release(spares=False, learner=False)
    assert ended == ["mine"]  # the pooled process stays for a later invocation
    assert reuse.KEPT.actors == {} and set(reuse.KEPT.spares) == {(0,), (1,)} and reuse.has_learner()
    reuse.put_actor(("c",), "kept", outlives=False)
    reuse.release(actors=False, learner=False)
    assert ended == ["mine", "raises", "s1"] and reuse.KEPT.spares == {} and reuse.has_learner()
    assert reuse.take_actor(("c",)) == "kept"  # actors not asked: neither ended nor forgotten
    reuse.release()
    assert ended == ["mine", "raises", "s1", "L", "group pg"] and not reuse.has_learner()
    reuse.release()
    assert ended == ["mine", "raises", "s1", "L", "group pg"]  # nothing left: nothing ended twice


def test_ending_a_learner_that_is_gone_raises_nothing(ended, monkeypatch):
    def gone(group):
        raise RuntimeError("no such group")

    monkeypatch.setattr(reuse, "remove_placement_group", gone)
    reuse.end_learner(reuse.KeptLearner("L", "pg", "n"))
    assert ended == ["L"]
