"""The scorer service (in-process app and the `serve scorer` command) and its client's retries."""

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect, Request

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.client import ScorerClient
from dph_async.rewards.fixtures import build_sql_fixture
from dph_async.rewards.registry import UnknownDataSource
from dph_async.rewards.scorer import make_scorer
from dph_async.rewards.service import ServiceSettings, _Admission, _read_body, make_app
from dph_async.rewards.worker import ScoreRequest

HANGS = {"data_source": "math", "response": r"\boxed{9^{9^{9^{9}}}}", "ground_truth": "5"}


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition, parsed with prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def item(i: int) -> dict:
    return {"data_source": "countdown", "response": f"<answer>{i} * 2</answer>",
            "ground_truth": {"target": 2 * i, "numbers": [i, 2]}}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return build_sql_fixture(tmp_path_factory.mktemp("svcfix")).parent


@pytest.fixture(scope="module")
def cfg(fixture_dir):
    config = RewardConfig(workers=2, timeout_s=1.5)
    config.sql.db_root = str(fixture_dir / "databases")
    return config


@pytest.fixture(scope="module")
def client(cfg):
    app = make_app(cfg, ServiceSettings(max_queued_bytes=4000, max_body_bytes=2000, max_items=8, max_budget_s=30))
    with TestClient(app) as c:
        yield c


def test_health_and_scoring_in_order(client):
    assert client.get("/health").json()["status"] == "ok"
    wrong = {**item(1), "ground_truth": {"target": 3, "numbers": [1, 2]}}
    reply = client.post("/v1/score", json={"requests": [item(i) for i in range(6)] + [wrong]})
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert [r["correct"] for r in results] == [True] * 6 + [False]
    assert all(r["status"] == "ok" and r["latency_s"] > 0 for r in results)


def test_refusals_are_clear_http_errors(client):
    unknown = client.post("/v1/score", json={"requests": [item(1), {**item(2), "data_source": "nope_ds"}]})
    assert unknown.status_code == 400
    assert unknown.json()["error"] == "unknown_data_source" and unknown.json()["data_source"] == "nope_ds"
    assert client.post("/v1/score", content=b"{not json").status_code == 400
    missing = client.post("/v1/score", json={"requests": [{"data_source": "countdown"}]})
    assert missing.status_code == 400 and "response" in missing.json()["detail"]
    assert client.post("/v1/score", content=b"x" * 2001).status_code == 413
    too_many = client.post("/v1/score", json={"requests": [item(i) for i in range(9)]})
    assert too_many.status_code == 413 and "9 requests" in too_many.json()["detail"]
    health = client.get("/health").json()
    assert health["in_flight"] == 0 and health["queued_bytes"] == 0


def test_batch_budget_bounds_the_answer_time(client):
    start = time.monotonic()
    reply = client.post("/v1/score", json={"requests": [HANGS, HANGS, HANGS, item(3)], "budget_s": 0.5})
    assert time.monotonic() - start < 3.0
    # Two hanging ones ran on the two workers and were killed; the others never started (the scorer's
    # failure: nothing was learned about them).
    assert [r["status"] for r in reply.json()["results"]] == ["timeout", "timeout", "error", "error"]
    assert client.post("/v1/score", json={"requests": [item(4)]}).json()["results"][0]["correct"]


def test_metrics(client):
    client.post("/v1/score", json={"requests": [item(5)]})
    before = scrape(client.get("/metrics").text)
    client.post("/v1/score", json={"requests": [item(6), item(7)]})
    batches = ("dph_scorer_batches_total", (("code", "200"),))
    deadline = time.monotonic() + 30
    # Rendered at most once a second: a scrape right after the batch may show the rendering before it.
    while (after := scrape(client.get("/metrics").text))[batches] == before[batches]:
        assert time.monotonic() < deadline, "the metrics never showed the batch"
        time.sleep(0.1)
    ok = ("dph_scorer_items_total", (("data_source", "countdown"), ("status", "ok")))
    latencies = ("dph_scorer_item_latency_seconds_count", ())
    assert after[ok] == before[ok] + 2 and after[batches] == before[batches] + 1
    assert after[latencies] == before[latencies] + 2
    assert after[("dph_scorer_workers", ())] == 2 and after[("process_resident_memory_bytes", ())] > 10e6


def test_shared_token(cfg):
    app = make_app(cfg.model_copy(update={"workers": 1}), ServiceSettings(token="s3cret"))
    with TestClient(app) as c:
        assert c.post("/v1/score", json={"requests": [item(1)]}).status_code == 401
        ok = c.post("/v1/score", json={"requests": [item(1)]}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def _asgi_scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


def test_a_cancelled_upload_gives_its_reservation_back(cfg):
    """The request's task cancelled mid-upload (a server shutting down does this): its admitted bytes
    are given back, as for any other end of the request."""
    app = make_app(cfg, ServiceSettings(max_queued_bytes=1000, max_body_bytes=500))

    async def queued_bytes() -> float:
        sent: list[bytes] = []

        async def send(message: dict) -> None:
            sent.append(message.get("body", b""))

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        await app(_asgi_scope("GET", "/metrics", []), receive, send)
        return scrape(b"".join(sent).decode())[("dph_scorer_queued_bytes", ())]

    async def cancelled_upload() -> float:
        started = asyncio.Event()

        async def receive() -> dict:
            if not started.is_set():
                started.set()
                return {"type": "http.request", "body": b"{", "more_body": True}
            await asyncio.Event().wait()  # the rest never comes
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            pass

        upload = asyncio.create_task(app(_asgi_scope("POST", "/v1/score", [(b"content-length", b"400")]),
                                         receive, send))
        await started.wait()  # its first byte admitted, and reading
        upload.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await upload
        return await queued_bytes()

    assert asyncio.run(cancelled_upload()) == 0


CHUNKS = [b'{"requests": [', b'{"data_source": "countdown", "response": "1"}', b"]}"]


async def _upload(style: str, ending: str, admission: _Admission, settings: ServiceSettings) -> list[int]:
    """One upload of CHUNKS through `_read_body`, sent with a Content-Length or chunked, completed or
    hung up after its second chunk: what the service holds after each chunk, then after the request."""
    headers = [(b"content-length", str(len(b"".join(CHUNKS))).encode())] if style == "content-length" else []
    held: list[int] = []
    messages = [{"type": "http.request", "body": chunk, "more_body": True} for chunk in CHUNKS]
    messages[-1]["more_body"] = False
    if ending == "hung up":
        messages[-1] = {"type": "http.disconnect"}

    async def receive() -> dict:
        held.append(admission.held)  # what the chunks before this one hold
        return messages.pop(0)

    with admission.reservation() as reservation, contextlib.suppress(ClientDisconnect):
        await _read_body(Request(_asgi_scope("POST", "/v1/score", headers), receive), settings, reservation)
        held.append(admission.held)  # the whole body, held until the request is answered
    return [*held[1:], admission.held]


@pytest.mark.parametrize("style", ["content-length", "chunked"])
@pytest.mark.parametrize("ending", ["completed", "hung up"])
def test_bytes_are_taken_as_they_arrive_and_all_given_back(style, ending):
    """The bytes held grow with what arrived, never with what a Content-Length claims, and return to
    zero however the upload ends; one upload after another, nothing accumulates."""
    settings = ServiceSettings(max_queued_bytes=1000, max_body_bytes=500)
    admission = _Admission(settings.max_queued_bytes)
    sizes = list(itertools.accumulate(len(c) for c in CHUNKS))
    for _ in range(3):
        held = asyncio.run(_upload(style, ending, admission, settings))
        assert held == (sizes if ending == "completed" else sizes[:2]) + [0]


def test_one_request_holds_at_most_as_much_as_it_leaves_free():
    """No upload fills the service alone; a second greedy one gets half of what is left, and a small
    honest batch still fits beside them."""
    admission = _Admission(1000)
    with admission.reservation() as greedy, admission.reservation() as second, admission.reservation() as honest:
        greedy.grow_to(500)
        with pytest.raises(Exception, match="retry later") as refused:
            greedy.grow_to(501)
        assert refused.value.code == 503 and refused.value.headers == {"Retry-After": "1"}
        second.grow_to(250)
        with pytest.raises(Exception, match="retry later"):
            second.grow_to(251)
        honest.grow_to(100)
        assert admission.held == 850
    assert admission.held == 0


def test_settings_a_lone_largest_body_could_never_fit_are_refused():
    with pytest.raises(ValueError, match=r"max_queued_bytes \(100\) must be at least twice max_body_bytes \(51\)"):
        ServiceSettings(max_queued_bytes=100, max_body_bytes=51)


class _Flaky(BaseHTTPRequestHandler):
    """First answers 503, then garbage, then a valid reply of the right length."""

    calls = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["requests"])
        type(self).calls += 1
        if self.calls == 1:
            code, body = 503, b"{}"
        elif self.calls == 2:
            code, body = 200, b'{"results": "nonsense"}'
        else:
            code, body = 200, json.dumps({"results": [{"score": 1.0, "correct": True}] * n}).encode()
        self.send_response(code)
        self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_client_retries_with_backoff_then_gives_statuses(closed_port):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    requests = [ScoreRequest(**item(i), extra_info={}) for i in range(3)]
    try:
        with ScorerClient([url], timeout_s=5, retries=3) as c:
            results = c.score_many(requests)
        assert _Flaky.calls == 3 and [r.correct for r in results] == [True] * 3
        start = time.monotonic()
        with ScorerClient([f"http://127.0.0.1:{closed_port}"], timeout_s=5, retries=2) as c:
            down = c.score_many(requests)
        assert time.monotonic() - start < 5
        assert all(r.status == "error" and "unavailable" in r.detail and r.scorer_failed for r in down)
    finally:
        server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_scorer_command_end_to_end(fixture_dir, cfg, scorer_process, closed_port):
    root = fixture_dir / "databases"
    with scorer_process("rewards.workers=1", "rewards.timeout_s=2", f"rewards.sql.db_root={root}") as (url, _):
        rows = [json.loads(line) for line in (fixture_dir / "responses.jsonl").read_text().splitlines()]
        requests = [ScoreRequest(r["data_source"], r["response"], r["reward_model"]["ground_truth"],
                                 r["extra_info"]) for r in rows]
        # The first URL is dead: the client moves on to the live one.
        remote_cfg = cfg.model_copy(update={"scorer_urls": [f"http://127.0.0.1:{closed_port}", url],
                                            "client_batch_size": 8})
        with make_scorer(remote_cfg) as remote, make_scorer(cfg) as local:
            got, want = remote.score_many(requests), local.score_many(requests)
            assert isinstance(remote._remote, ScorerClient)
            def key(results):
                return [(r.score, r.correct, r.status) for r in results]

            assert key(got) == key(want)
            assert sum(r.correct for r in got) == 24
            with pytest.raises(UnknownDataSource, match="nope_ds"):
                remote.score_many([ScoreRequest("nope_ds", "x", None, {})])
    refused = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "serve", "scorer", "--host", "0.0.0.0"],
                             capture_output=True, text=True, env={**os.environ, "DPH_SCORER_TOKEN": ""})
    assert refused.returncode == 2 and "--insecure" in refused.stderr


def test_benchmark_runs_on_the_pool():
    from dph_async.tools.bench import scorer as bench

    cells = bench.run(workers=1, concurrency=[2], batch=4, seconds=0.3, timeout_s=10, backends=["pool"],
                      workloads=["sql", "math"], log=lambda line: None)
    assert [(c.workload, c.concurrency, c.batch) for c in cells] == [("sql", 2, 1), ("sql", 1, 4),
                                                                      ("math", 2, 1), ("math", 1, 4)]
    assert all(c.requests_per_s > 0 and set(c.statuses) == {"ok"} for c in cells)
    assert "| sql | pool | 2 | 1 |" in bench.markdown(cells)
