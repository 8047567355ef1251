"""A held group that cannot be stored is quarantined: snapshots, log bases and recovery go on.

Before, one acknowledged group with sampling.top_k = 2^64 - 1 made every snapshot die converting it to
int64 (replay/records.py), and every restart on the same log died writing its base. Validation now
refuses such a group at ingest (tests/test_replay_validation.py); these tests let one through, as
the build that acknowledged it did, and check the replay keeps running and comes back up."""

from __future__ import annotations

import logging

import msgspec
import pytest

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest
from dph_async.replay import core as core_module
from dph_async.replay.core import ReplayCore
from dph_async.replay.state import read_state
from dph_async.replay.wal import WriteAheadLog
from dph_async.tools.bench.transport import synthetic_group


def replay(wal_dir, **cfg) -> ReplayCore:
    return ReplayCore(ReplayConfig(**({"admission": False} | cfg)), groups_per_batch=4, wal=WriteAheadLog(wal_dir))


def unstorable(seq: int):
    g = synthetic_group(0, seq, n=2, tokens=3)
    g.sampling = msgspec.structs.replace(g.sampling, top_k=2**64 - 1)
    return g


@pytest.fixture
def accepted_unstorable(tmp_path, monkeypatch):
    """A log holding groups 0 and 2 and, between them, group 1 that cannot be stored, all acknowledged."""
    with monkeypatch.context() as m:
        m.setattr(core_module, "problem", lambda *a: None)  # the build that accepted anything
        c = replay(tmp_path / "wal")
        verdicts = c.ingest([synthetic_group(0, 0, n=2, tokens=3), unstorable(1), synthetic_group(0, 2, n=2, tokens=3)])
    assert [v.status for v in verdicts] == ["ok"] * 3
    return c, tmp_path


def test_a_snapshot_quarantines_the_group_it_cannot_store_and_keeps_the_rest(accepted_unstorable, caplog):
    c, tmp_path = accepted_unstorable
    with caplog.at_level(logging.ERROR, logger="dph_async.replay.core"):
        reply = c.snapshot(tmp_path / "snap", version=0)
    assert "2 groups held" in reply
    assert [g.seq for g in read_state(tmp_path / "snap").groups] == [0, 2]
    assert (0, 1) not in c.store and (0, 1) not in c.accepted  # its position is open: regenerated on resume
    assert c.stats().refused.by_kind == {"quarantined": 1} and c.admitted == 2
    assert "group (0, 1) quarantined" in caplog.text and "OverflowError" in caplog.text
    assert c.snapshot(tmp_path / "snap2", version=0)  # and the next one needs no quarantine
    assert c.stats().refused.by_kind == {"quarantined": 1}


def test_a_restart_on_a_log_holding_it_comes_up_without_it(accepted_unstorable):
    c, tmp_path = accepted_unstorable
    c.wal.close()
    for _ in range(2):  # the base written at recovery holds what could be stored; a second restart reads it
        again = replay(tmp_path / "wal")
        assert sorted(e.group.seq for e in again.store) == [0, 2] and (0, 1) not in again.accepted
        batch = again.request(BatchRequest(0, 4, 0.0, request_id=1))
        assert sorted(g.seq for g in batch.groups) == [0, 2]
        again.wal.close()


def test_a_log_compaction_during_ingest_quarantines_it_and_ingest_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(core_module, "problem", lambda *a: None)
    c = replay(tmp_path / "wal", wal_compact_mb=1e-6)  # a new base after every commit
    assert [v.status for v in c.ingest([unstorable(0)])] == ["ok"]
    assert [v.status for v in c.ingest([synthetic_group(0, 1, n=2, tokens=3)])] == ["ok"]
    assert [e.group.seq for e in c.store] == [1] and c.stats().refused.by_kind == {"quarantined": 1}


def test_a_failure_no_group_explains_is_still_an_error(tmp_path, monkeypatch):
    """Quarantine is for records; a state that fails for another reason must not be written short."""
    c = replay(tmp_path / "wal")
    c.ingest([synthetic_group(0, 0, n=2, tokens=3)])

    def fails(path, state):
        raise ValueError("disk says no")

    monkeypatch.setattr(core_module, "write_state", fails)
    with pytest.raises(ValueError, match="disk says no"):
        c.snapshot(tmp_path / "snap")
    assert (0, 0) in c.store and not c.stats().refused.by_kind
