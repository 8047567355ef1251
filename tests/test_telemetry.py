"""/health and /metrics of the long-running processes: they parse with prometheus_client's parser, their
numbers move when work happens, and `dph-async status` reads them."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dph_async.actors.telemetry import ActorCollector, actor_health
from dph_async.cli.commands.status import row
from dph_async.cli.main import main as cli
from dph_async.config import NetConfig, RunConfig
from dph_async.config.replay import ReplayConfig
from dph_async.gate import HonestLoad
from dph_async.learner.loop import LearnerLoop
from dph_async.learner.telemetry import LearnerCollector, learner_health
from dph_async.metrics_endpoint import CLIENT_TIMEOUT_S, MAX_CLIENTS, RENDER_INTERVAL_S, RESERVED, start_endpoint
from dph_async.net import NetSecurity
from dph_async.protocol import Batch
from dph_async.replay.service import ReplayService
from dph_async.replay.telemetry import ReplayCollector, replay_health, staleness_buckets
from dph_async.replay_client import ReplayClient, RolloutSender
from dph_async.replay_stats import ReplayStats
from dph_async.run_stats import ActorStats, LearnerStats, RLResult
from dph_async.runtime.endpoints import find_endpoints, scrape
from dph_async.runtime.evaluate import SplitResult
from dph_async.spans import MAX_SPANS, add_span
from dph_async.tools.bench.transport import synthetic_group


def scrape_moved(ep, name: str, since: float | None, timeout_s: float = 30.0, **labels: str):
    """A scrape whose `name` differs from `since`: /metrics is rendered at most once per
    RENDER_INTERVAL_S, so a scrape right after work may show the rendering from before it."""
    deadline = time.monotonic() + timeout_s
    while (reading := scrape(ep)).value(name, **labels) == since:
        assert time.monotonic() < deadline, f"{name} still {since} after {timeout_s:g} s"
        time.sleep(0.1)
    return reading


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
    sender = RolloutSender(svc.ingest_endpoint, 0, token=svc.actor_token)
    assert sender.tickets(6, wait_s=0.0) == 6
    anonymous = RolloutSender(svc.ingest_endpoint, 1)  # no actor token: what leaves one batch free
    assert anonymous.tickets(100, wait_s=0.0) == (4 + 1) * 4 - 6 - 4
    for i in range(6):
        sender.send(synthetic_group(0, i, n=2, tokens=8))
    assert sender.flush(10)
    client = ReplayClient(svc.batch_endpoint, token=svc.control_token)
    assert len(client.get_batch(0, 4, wait_s=1.0).groups) == 4
    after = scrape_moved(ep, "dph_replay_accepted_groups_total", 0)
    assert after.value("dph_replay_accepted_groups_total") == 6
    assert after.value("dph_replay_tickets_granted_total") == 16
    assert after.value("dph_replay_tickets_anonymous_total") == 10
    assert after.value("dph_replay_tickets_expired_total") == 0
    anonymous.close()
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
    deadline = time.monotonic() + 10  # /metrics is rendered at most once a second
    while (refused := scrape(ep)).value("dph_replay_rejected_total", reason="invalid_version") is None:
        assert time.monotonic() < deadline, "the refusal never reached /metrics"
        time.sleep(0.1)
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
        with caplog.at_level("WARNING", logger="dph_async.replay.service"):
            needed = None
            for actor in range(3):
                sender = RolloutSender(svc.ingest_endpoint, actor, token=svc.actor_token)
                sender.send(synthetic_group(actor, 0, n=8, tokens=4096))  # 8 x 4096 x 12 bytes
                assert sender.flush(10)
                sender.close()
                r = scrape_moved(ep, "dph_replay_gate_memory_megabytes", needed, what="needed")
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
        auto = [{"staleness/eta": 2.0, "staleness/signal": 0.97, "staleness/change": 1.0, "staleness/wait": 0.04},
                {"staleness/eta": 2.0}]
        for v in (1, 2):
            _log(loop, v, **{"batch/fresh_tokens": 100.0 * v, "batch/scorer_failed": 1.0,
                             "learner/tokens_per_s": 500.0 + v, **auto[v - 1]})
        loop.server.refused.update({"size": 2, "type": 1})
        loop.server.gate_restarts, loop.server.replies_dropped = 3, 5
        (loop.checkpoint_dir / "v2").mkdir(parents=True)
        (loop.checkpoint_dir / "v2" / "model.pt").write_bytes(b"x" * 1000)
        r = scrape_moved(ep, "dph_learner_fresh_tokens_total", 0)
        assert r.value("dph_learner_fresh_tokens_total") == 300 and r.value("dph_learner_scorer_failed_total") == 2
        assert r.value("dph_learner_tokens_per_second") == 502 and r.value("dph_learner_version") == 2
        assert r.value("dph_learner_checkpoints") == 1 and r.value("dph_learner_checkpoint_bytes") == 1000
        assert r.by_label("dph_weights_refused_total", "kind") == {"size": 2, "type": 1}
        assert r.value("dph_weights_gate_restarts_total") == 3 and r.value("dph_weights_replies_dropped_total") == 5
        assert "[red]gate restarted 3x" in row(r)[-1]  # `dph-async status` flags a flooded port
        assert r.value("dph_learner_staleness_bound") == 2 and r.value("dph_learner_staleness_signal") == 0.97
        assert r.value("dph_learner_staleness_wait") == 0.04 and "eta 2 (auto, ESS 0.970, wait 0.040)" in row(r)[-1]
        assert r.value("dph_weights_gate_memory_megabytes", what="limit") == 4 and "short" not in row(r)[-1]
        for actor in range(3):  # (2 x 3 + 4) buckets of 0.5 MB: more than the gate's 4 MB
            loop.server.gate_load.saw(actor, 2**19)
        r = scrape_moved(ep, "dph_weights_gate_memory_megabytes", r.value("dph_weights_gate_memory_megabytes",
                                                                           what="needed"), what="needed")
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


def closed_port() -> int:
    """A loopback port nothing listens on (a connection to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def announce_dead(directory: Path, *names: str) -> None:
    """Announce files of processes that have ended: what a stopped run leaves in its endpoints/."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / f"{name}.json").write_text(json.dumps(
            {"name": name, "url": f"http://127.0.0.1:{closed_port()}", "pid": 4242}))


def rl_result(steps: int, drops: int) -> dict:
    """An RL run's record as result.json (and summary.json's "rl") holds it."""
    replay = ReplayStats(drops={"stale": drops}, staleness_hist={0: 90, 1: 60})
    result = RLResult("r", LearnerStats(steps=steps), [ActorStats(0)], replay, 0, 16.4, "final_model")
    return msgspec.to_builtins(result)


def split_result(name: str, greedy: float, top: float) -> dict:
    return asdict(SplitResult(name, 200, greedy, {1: 0.4, 16: top}, 0.4, 2.1, 3.0, samples=16))


def write_summary(run: Path, modes: list[str]) -> None:
    """A run's summary.json, as `dph-async run` writes it last (the keys status reads)."""
    evals = {m: {s: split_result(s, g, top) for s in ("in_domain", "ood")}
             for m, g, top in (("base", 0.55, 0.98), ("grpo@d_exp", 0.5, 0.845), ("js_low_var", 0.6, 0.82))}
    (run / "summary.json").write_text(json.dumps({
        "modes": modes, "rl": {m: rl_result(150, 0) for m in modes}, "wall_seconds": 141.0,
        "stage_seconds": {"warm start": 53.0, "evaluation": 11.0}, "eval": evals}))


def test_status_of_a_finished_run_says_so_and_shows_its_result(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    modes = {"grpo@d_exp": "grpo_d_exp", "js_low_var": "js_low_var"}
    for slug in modes.values():
        announce_dead(tmp_path / "rl" / slug / "endpoints", "learner", "actor0")
        (tmp_path / "rl" / slug / "result.json").write_text(json.dumps(rl_result(150, 3)))
    assert cli(["status", str(tmp_path)]) == 1  # every mode finished, but not the run: no summary yet
    out = capsys.readouterr().out
    assert "rl/grpo_d_exp: finished, 150 steps in 16 s, 3 groups dropped" in out and "not finished" in out
    write_summary(tmp_path, list(modes))
    assert cli(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # long lines wrap
    assert f"{tmp_path}: finished" in words and "in 2 min 21 s" in words and "warm start 53 s" in words
    assert "rl/js_low_var: finished, 150 steps in 16 s" in out
    (line,) = [x for x in out.splitlines() if "grpo@d_exp" in x and "rl/" not in x]
    assert line.split() == ["grpo@d_exp", "50.0", "84.5", "50.0", "84.5"]  # greedy and P@16, in_domain and ood
    assert "down" not in out and "Errno" not in out and "refused" not in out
    assert all(len(x) <= 100 for x in out.splitlines())


def test_status_of_a_live_run_is_one_line_per_process(tmp_path, replay, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    announce_dead(tmp_path / "rl" / "js_low_var" / "endpoints", "learner", *(f"actor{i}" for i in range(8)))
    announce_dead(tmp_path / "rl" / "grpo_d_exp" / "endpoints", "learner", "actor0")  # a mode that finished
    (tmp_path / "rl" / "grpo_d_exp" / "result.json").write_text(json.dumps(rl_result(150, 0)))
    write_summary(tmp_path, ["grpo@d_exp"])  # an earlier invocation's: the replay answers, so the run is live
    assert cli(["status", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert all(len(x) <= 100 for x in lines)
    assert [x for x in lines if x.startswith("down ")] == [
        f"down {name} (pid 4242): connection refused" for name in ["actor0", *(f"actor{i}" for i in range(1, 8)),
                                                                   "learner"]]
    assert [x for x in lines if "replay" in x and "up" in x.split()]  # the live one, in the table
    assert "rl/grpo_d_exp: finished, 150 steps in 16 s" in lines
    assert len(lines) <= 24  # a screen, with ten processes


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


def _host_port(endpoint) -> tuple[str, int]:
    host, port = endpoint.url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_a_request_trickled_a_byte_at_a_time_is_cut_off_at_the_whole_request_deadline(replay):
    """Slow clients sending a byte every half second never let a per-read timeout fire; the deadline for
    the whole request closes them all the same. The bound is generous (3x the deadline): the point is
    that they are closed at all; without the deadline they are held until the test gives up."""
    _, endpoint = replay
    socks = [socket.create_connection(_host_port(endpoint)) for _ in range(4)]
    opened = time.monotonic()
    for s in socks:
        s.setblocking(False)
    held: dict[int, float] = {}
    try:
        while len(held) < len(socks) and time.monotonic() - opened < 6 * CLIENT_TIMEOUT_S:
            for i, s in enumerate(socks):
                if i in held:
                    continue
                if _closed_by_server(s):
                    held[i] = time.monotonic() - opened
                else:
                    with contextlib.suppress(OSError):
                        s.send(b"G")  # a request line that never ends, one byte at a time
            time.sleep(0.5)  # the attacker's pace, not a wait for the service
    finally:
        for s in socks:
            s.close()
    assert len(held) == len(socks), f"{len(socks) - len(held)} trickling clients still held"
    assert max(held.values()) < 3 * CLIENT_TIMEOUT_S, held


def test_status_sees_the_replay_up_while_idle_connections_fill_its_endpoint(replay, tmp_path):
    """MAX_CLIENTS + 4 idle connections from 127.0.0.1, opened before status reads: status (from the same
    address) gets its answer at once, because a new connection closes the one that has waited longest
    for its headers; a cap per address or a queue would leave it nothing until their deadline."""
    _, endpoint = replay
    idle = [socket.create_connection(_host_port(endpoint)) for _ in range(MAX_CLIENTS + 4)]
    try:
        (found,) = find_endpoints([str(tmp_path)])
        start = time.monotonic()
        reading = scrape(found)
        assert reading.up, reading.error
        assert time.monotonic() - start < CLIENT_TIMEOUT_S / 2  # not after the idle ones' deadline
    finally:
        for s in idle:
            s.close()


class _Held(Collector):
    """A collector whose collection waits until `release` is set: scrapes of /metrics stay in service."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()

    def collect(self):
        self.entered.set()
        self.release.wait(30)
        yield GaugeMetricFamily("dph_test_held", "A collection that waited", value=1)


def test_the_run_s_own_reader_is_served_while_anonymous_requests_take_every_other_slot(tmp_path):
    """Anonymous /metrics requests held in service take the MAX_CLIENTS - RESERVED slots anonymous
    clients may use: another anonymous request is answered 503, status (with the run's access token,
    found beside the announce file) reads the endpoint as up, and the token never leaves that file."""
    held = _Held()
    endpoint = start_endpoint("replay", [held], lambda: {"version": 7}, NetConfig(), 0, tmp_path / "endpoints")
    threads = [threading.Thread(target=httpx.get, args=(f"{endpoint.url}/metrics",), kwargs={"timeout": 30})
               for _ in range(MAX_CLIENTS - RESERVED)]
    try:
        for t in threads:
            t.start()
        assert held.entered.wait(30)
        deadline = time.monotonic() + 30
        while (anonymous := httpx.get(f"{endpoint.url}/health", timeout=30)).status_code != 503:
            assert time.monotonic() < deadline, "the anonymous requests never took their slots"
            time.sleep(0.05)
        assert "too many requests" in anonymous.text
        (found,) = find_endpoints([str(tmp_path)])  # what status reads with: its /metrics would wait here too
        health = httpx.get(f"{endpoint.url}/health", timeout=30, headers={"Authorization": f"Bearer {found.token}"})
        assert health.status_code == 200 and health.json()["version"] == 7
        assert found.token and found.token not in repr(found) and found.token not in json.dumps(
            json.loads((tmp_path / "endpoints" / "replay.json").read_text()))
    finally:
        held.release.set()
        for t in threads:
            t.join(30)
        endpoint.close()


class _Counting(Collector):
    def __init__(self) -> None:
        self.collections = 0

    def collect(self):
        self.collections += 1
        yield GaugeMetricFamily("dph_test_collections", "Times this collector was read", value=self.collections)


def test_a_scrape_burst_renders_the_metrics_at_most_once_per_interval(tmp_path):
    """Eight scrapers (fewer than the anonymous slots, each from an address of its own) in a loop: every
    scrape is answered, and the numbers are collected at most once per RENDER_INTERVAL_S, not per scrape."""
    counting = _Counting()
    endpoint = start_endpoint("burst", [counting], dict, NetConfig(), 0, tmp_path / "endpoints")
    answered: list[int] = []

    def scrape_loop(i: int) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=f"127.0.0.{10 + i}"), timeout=30) as c:
            for _ in range(25):
                reply = c.get(f"{endpoint.url}/metrics")
                answered.append(reply.status_code == 200 and "dph_test_collections" in reply.text)

    try:
        start = time.monotonic()
        threads = [threading.Thread(target=scrape_loop, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    finally:
        endpoint.close()
    assert len(answered) == 200 and all(answered)
    assert counting.collections <= elapsed / RENDER_INTERVAL_S + 2, (counting.collections, elapsed)


def test_a_client_that_hung_up_prints_no_traceback_and_another_error_does(capfd):
    """socketserver prints a traceback for every error of a connection's handler: for a client that
    reset or was cut off, a log any client could flood; the process's own errors still print."""
    from prometheus_client import CollectorRegistry

    from dph_async.metrics_endpoint import MetricsEndpoint

    endpoint = MetricsEndpoint("t", CollectorRegistry(), health=dict)
    try:
        for error in (ConnectionResetError(104, "reset"), BrokenPipeError(32, "pipe"), TimeoutError("slow")):
            try:
                raise error
            except OSError:
                endpoint._server.handle_error(None, ("127.0.0.1", 1))
        assert capfd.readouterr().err == ""
        try:
            raise ValueError("the handler's own bug")
        except ValueError:
            endpoint._server.handle_error(None, ("127.0.0.1", 1))
        assert "ValueError: the handler's own bug" in capfd.readouterr().err
    finally:
        endpoint.close()
