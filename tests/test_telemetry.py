"""/health and /metrics of the long-running processes: they parse with prometheus_client's parser, their
numbers move when work happens, and `dph-async status` reads them."""

from __future__ import annotations

import json
import socket
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from actors.rollout import ActorStats
from actors.telemetry import ActorCollector, actor_health
from dph_async.app.bench.transport import synthetic_group
from dph_async.app.cli import main as cli
from dph_async.app.commands.status import row
from dph_async.app.endpoints import find_endpoints, scrape
from dph_async.config import NetConfig, RunConfig
from dph_async.config.replay import ReplayConfig
from dph_async.gate import HonestLoad
from dph_async.net import NetSecurity
from dph_async.protocol import Batch
from dph_async.replay_client import ReplayClient, RolloutSender
from dph_async.spans import MAX_SPANS, add_span
from dph_async.telemetry import MAX_CLIENTS, start_endpoint
from learner.loop import LearnerLoop
from learner.telemetry import LearnerCollector, learner_health
from replay.service import ReplayService
from replay.telemetry import ReplayCollector, replay_health, staleness_buckets


@pytest.fixture
def replay(tmp_path):
    svc = ReplayService(ReplayConfig(max_staleness=4, admission=True), f"ipc://{tmp_path}/in",
                        f"ipc://{tmp_path}/out", 4)
    svc.start_in_thread()
    endpoint = start_endpoint("replay", [ReplayCollector(svc)], lambda: replay_health(svc), NetConfig(), 0,
                              tmp_path / "endpoints")
    yield svc, endpoint
    endpoint.close()
    svc.stop()


def test_replay_metrics_parse_and_move_with_work(replay, tmp_path):
    svc, endpoint = replay
    (ep,) = find_endpoints([str(tmp_path)])
    assert ep.name == "replay" and ep.url == endpoint.url and endpoint.url.startswith("http://127.0.0.1:")
    before = scrape(ep)
    assert before.up and before.value("dph_replay_accepted_groups_total") == 0
    sender = RolloutSender(svc.ingest_endpoint, 0)
    assert sender.tickets(6, wait_s=0.0) == 6
    for i in range(6):
        sender.send(synthetic_group(0, i, n=2, tokens=8))
    assert sender.flush(10)
    client = ReplayClient(svc.batch_endpoint, token=svc.control_token)
    assert len(client.get_batch(0, 4, wait_s=1.0).groups) == 4
    after = scrape(ep)
    assert after.value("dph_replay_accepted_groups_total") == 6
    assert after.value("dph_replay_tickets_granted_total") == 6
    assert after.value("dph_replay_occupancy", what="groups") == 6  # 4 pending in the batch, 2 unserved
    assert after.value("dph_replay_occupancy", what="unserved") == 2
    assert after.value("dph_replay_served_total", what="groups") == 4
    assert after.value("dph_replay_served_staleness_count") == 4
    assert after.value("dph_replay_ingest_groups_per_second") > 0
    assert after.value("dph_replay_gate_restarts_total") == 0  # served through its gate, never restarted
    assert after.value("dph_replay_replies_dropped_total") == 0
    assert "gate" not in row(after)[-1] and "ingest" in row(after)[-1] and "refused" not in row(after)[-1]
    assert after.value("dph_replay_max_staleness") == 4 and "eta 4," in row(after)[-1]
    assert after.value("process_resident_memory_bytes") > 10e6 and after.value("process_open_fds") > 3
    assert after.value("process_threads") >= 3 and after.health["groups"] == 6
    # A group from the far future is refused, and the refusal is in /metrics and on the status line.
    sender.send(synthetic_group(0, 6, n=2, tokens=8, version=10**9))
    assert sender.flush(10) and len(sender.rejected) == 1
    refused = scrape(ep)
    assert refused.value("dph_replay_rejected_total", reason="invalid_version") == 1
    assert "refused {'invalid_version': 1}" in row(refused)[-1]
    client.close()
    sender.close()


def test_a_gate_too_small_for_the_actors_seen_is_warned_about_and_flagged(tmp_path, caplog):
    """Three actors sending groups of 0.4 MB could make a 4 MB gate hold (3 x 3 + 4) x 0.4 MB at once:
    the replay warns, naming the setting, and `dph-async status` flags it."""
    svc = ReplayService(ReplayConfig(max_staleness=4, admission=False, max_group_mb=1), f"ipc://{tmp_path}/in",
                        f"ipc://{tmp_path}/out", 4, security=NetSecurity(gate_memory_mb=4))  # fmt: skip
    svc.start_in_thread()
    endpoint = start_endpoint("replay", [ReplayCollector(svc)], lambda: replay_health(svc), NetConfig(), 0,
                              tmp_path / "endpoints")
    try:
        (ep,) = find_endpoints([str(tmp_path)])
        with caplog.at_level("WARNING", logger="replay.service"):
            for actor in range(3):
                sender = RolloutSender(svc.ingest_endpoint, actor)
                sender.send(synthetic_group(actor, 0, n=8, tokens=4096))  # 8 x 4096 x 12 bytes
                assert sender.flush(10)
                sender.close()
                r = scrape(ep)
                needed = r.value("dph_replay_gate_memory_megabytes", what="needed")
                assert r.value("dph_replay_gate_memory_megabytes", what="limit") == 4
                assert needed == pytest.approx((3 * (actor + 1) + 4) * 0.375, rel=0.01)
                assert ("replay gate memory short" in row(r)[-1]) == (needed > 4)
        warnings = [m for m in caplog.messages if "net.gate_memory_mb (4) is less than" in m]
        assert len(warnings) == 1 and "3 actors sending groups of up to 0.38 MB" in warnings[0]
        assert "at least 5" in warnings[0]
    finally:
        endpoint.close()
        svc.stop()


def test_staleness_buckets_are_cumulative():
    assert staleness_buckets({"0": 3, "2": 1, "9": 2}) == [
        ("0", 3.0), ("1", 3.0), ("2", 4.0), ("4", 4.0), ("8", 4.0), ("16", 6.0), ("32", 6.0), ("+Inf", 6.0)]


def _loop(run_dir: Path) -> LearnerLoop:
    """A real LearnerLoop without its model, replay or weight server: the parts the tests log through
    (and the weight server's refusal counts)."""
    loop = LearnerLoop(RunConfig(), trainer=SimpleNamespace(version=0), replay=None,
                       server=SimpleNamespace(refused=Counter(), gate_restarts=0, replies_dropped=0, gated=True,
                                              gate_load=HonestLoad(4.0, 2, "actors fetching weight buckets")),
                       run_dir=run_dir)  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    return loop


def _log(loop: LearnerLoop, v: int, **m: float) -> None:
    loop.trainer.version, loop.stats.steps = v, v
    loop.log_step({"learner/version": float(v), **m}, Batch(v - 1, [], [], {}))


def test_learner_metrics_move_with_steps(tmp_path):
    loop = _loop(tmp_path / "rl")
    endpoint = start_endpoint("learner", [LearnerCollector(loop)], lambda: learner_health(loop), NetConfig(), 1,
                              tmp_path / "endpoints")
    try:
        (ep,) = find_endpoints([str(tmp_path)])
        assert scrape(ep).value("dph_learner_fresh_tokens_total") == 0
        assert "eta" not in row(scrape(ep))[-1]  # a fixed bound: the replay's row says it
        # replay.max_staleness=auto: the bound every step, the controller's signal at a window's end.
        auto = [{"staleness/eta": 2.0, "staleness/signal": 0.97, "staleness/change": 1.0}, {"staleness/eta": 2.0}]
        for v in (1, 2):
            _log(loop, v, **{"batch/fresh_tokens": 100.0 * v, "batch/scorer_failed": 1.0,
                             "learner/tokens_per_s": 500.0 + v, **auto[v - 1]})
        loop.server.refused.update({"size": 2, "type": 1})
        loop.server.gate_restarts, loop.server.replies_dropped = 3, 5
        (loop.checkpoint_dir / "v2").mkdir(parents=True)
        (loop.checkpoint_dir / "v2" / "model.pt").write_bytes(b"x" * 1000)
        r = scrape(ep)
        assert r.value("dph_learner_fresh_tokens_total") == 300 and r.value("dph_learner_scorer_failed_total") == 2
        assert r.value("dph_learner_tokens_per_second") == 502 and r.value("dph_learner_version") == 2
        assert r.value("dph_learner_checkpoints") == 1 and r.value("dph_learner_checkpoint_bytes") == 1000
        assert r.by_label("dph_weights_refused_total", "kind") == {"size": 2, "type": 1}
        assert r.value("dph_weights_gate_restarts_total") == 3 and r.value("dph_weights_replies_dropped_total") == 5
        assert "[red]gate restarted 3x" in row(r)[-1]  # `dph-async status` flags a flooded port
        assert r.value("dph_learner_staleness_bound") == 2 and r.value("dph_learner_staleness_signal") == 0.97
        assert "eta 2 (auto, ESS 0.970)" in row(r)[-1]
        assert r.value("dph_weights_gate_memory_megabytes", what="limit") == 4 and "short" not in row(r)[-1]
        for actor in range(3):  # (2 x 3 + 4) buckets of 0.5 MB: more than the gate's 4 MB
            loop.server.gate_load.saw(actor, 2**19)
        r = scrape(ep)
        assert r.value("dph_weights_gate_memory_megabytes", what="needed") == 5
        assert "[red]weights gate memory short: needs 5 MB" in row(r)[-1]
        assert r.health["version"] == 2
    finally:
        endpoint.close()


def test_the_learner_holds_only_the_steps_its_driver_has_not_read(tmp_path):
    loop = _loop(tmp_path / "rl")
    for v in (1, 2, 3):
        _log(loop, v)
    assert [m["learner/version"] for m in loop.metrics_since(0)] == [1, 2, 3]
    assert [m["learner/version"] for m in loop.metrics_since(2)] == [3]  # the driver holds steps 0 and 1
    _log(loop, 4)
    assert [m["learner/version"] for m in loop.metrics_since(3)] == [4]
    with pytest.raises(ValueError, match=r"metrics\.jsonl"):
        loop.metrics_since(1)  # read and forgotten: the file has it
    with pytest.raises(ValueError, match="from step 9"):
        loop.metrics_since(9)
    lines = (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["learner/version"] for x in lines] == [1, 2, 3, 4]
    loop.listeners.append(lambda m: 1 / 0)  # a broken observer is logged, and training goes on
    _log(loop, 5)
    assert [m["learner/version"] for m in loop.metrics_since(4)] == [5]
    loop.listeners.clear()
    # A long-running learner read as it goes: memory does not grow with the steps (it kept every
    # step's dict before, about 2.5 KB each in a real run).
    tracemalloc.start()
    try:
        for v in range(6, 3006):
            _log(loop, v, **{f"metric/{k}": float(k) for k in range(40)})
            if v == 1000:
                base = tracemalloc.get_traced_memory()[0]
            loop.metrics_since(v)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 50_000, grown  # 2000 steps kept would be about 6 MB
    assert loop.logged == 3005


def test_a_timeline_stops_recording_at_its_bound():
    line: list = []
    for i in range(MAX_SPANS + 100):
        add_span(line, 2.0 * i, 2.0 * i + 1, "train" if i % 2 else "wait")
    assert len(line) == MAX_SPANS and line[-1] == (2.0 * (MAX_SPANS - 1), 2.0 * MAX_SPANS - 1, "train")
    add_span(line, 2.0 * MAX_SPANS - 1, 2.0 * MAX_SPANS + 5, "train")  # touching the last span: merged
    assert len(line) == MAX_SPANS and line[-1] == (2.0 * (MAX_SPANS - 1), 2.0 * MAX_SPANS + 5, "train")


def test_actor_metrics_and_the_status_table(tmp_path, replay, capsys):
    worker = SimpleNamespace(actor_id=1, stats=ActorStats(1))
    collector = ActorCollector(worker)
    actor = start_endpoint("actor1", [collector], lambda: actor_health(worker), NetConfig(), 3, tmp_path / "endpoints")
    try:
        (ep,) = [e for e in find_endpoints([str(tmp_path)]) if e.name == "actor1"]
        assert scrape(ep).value("dph_actor_tokens_generated_total", actor="1") == 0
        collector._last = (time.monotonic() - 2.0, 0)  # the previous scrape, 2 s ago
        worker.stats.tokens_generated, worker.stats.version = 1000, 5
        r = scrape(ep)
        assert r.value("dph_actor_weights_version", actor="1") == 5
        assert 400 < r.value("dph_actor_tokens_per_second") <= 500  # 1000 tokens in a little over 2 s
        assert cli(["status", str(tmp_path), "--json"]) == 0
        readings = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert readings["actor1"]["up"] and readings["replay"]["up"]
        assert readings["actor1"]["metrics"]["dph_actor_weights_version{'actor': '1'}"] == 5
        cells = row(r)
        assert cells[:2] == ["actor1", "[green]up"] and "tok/s" in cells[-1]
        actor.close()
        assert cli(["status", str(tmp_path), "--json"]) == 1  # its announce file remains, its process is gone
        readings = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert not readings["actor1"]["up"] and readings["replay"]["up"]
    finally:
        actor.close()


def test_endpoint_serves_only_gets_of_its_paths_and_bounds_clients(replay):
    _, endpoint = replay
    assert httpx.get(f"{endpoint.url}/other").status_code == 404
    assert httpx.post(f"{endpoint.url}/metrics", content=b"x" * 10).status_code == 501
    idle = [socket.create_connection(endpoint.url.removeprefix("http://").split(":")) for _ in range(MAX_CLIENTS + 4)]
    try:  # clients that never send a request take no more than MAX_CLIENTS slots, then time out
        start = time.monotonic()
        while time.monotonic() - start < 10:
            try:
                if httpx.get(f"{endpoint.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the endpoint never answered again after idle clients")
    finally:
        for s in idle:
            s.close()
    health = json.loads(httpx.get(f"{endpoint.url}/health").text)
    assert health["status"] == "ok" and health["name"] == "replay"
