"""The scorer service: a worker pool behind HTTP, for actors on other machines (`dph-async serve scorer`).

Endpoints:
- POST /v1/score: a batch (see `wire`); 200 with one result per request, in order. 400 for a malformed
  body or an unknown data_source (the body names it), 401 without the shared token when one is set,
  413 for a body over the size limit, 503 with Retry-After when accepting the batch would put more
  than `max_queued` requests in the queue (the client backs off and retries).
- GET /health: {"status": "ok", workers, in_flight, restarts, timeout_s}.
- GET /metrics: Prometheus text (items by data_source and status, latency histogram, HTTP codes).

Every batch has a deadline (its `budget_s`, at most `max_budget_s`): the pool starts no request after
it and kills any still running at it, so an answer always comes in time. Scoring runs in threads off
the event loop, which only parses, admits and answers.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn
from dph_async.rewards.service_metrics import ServiceMetrics
from dph_async.rewards.wire import ScoreBatch, ScoreReply


@dataclass(frozen=True)
class ServiceSettings:
    # Requests admitted (scoring or waiting) at once; more gets 503 so clients back off.
    max_queued: int = 4096
    # The longest a batch may take, whatever budget the client asks for.
    max_budget_s: float = 600.0
    max_body_bytes: int = 64 * 2**20
    # Shared secret required as "Authorization: Bearer <token>" on /v1/score; None: no check.
    token: str | None = None


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing to hold more than `limit` bytes (whatever Content-Length claims)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _error(code: int, error: str, detail: str, **extra: object) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail, **extra}, status_code=code)


def make_app(cfg: RewardConfig, settings: ServiceSettings | None = None) -> FastAPI:
    """The service app; its pool of `cfg.workers` processes lives as long as the app runs."""
    settings = settings or ServiceSettings()
    metrics = ServiceMetrics()
    state: dict[str, int] = {"in_flight": 0}
    pools: list[RewardPool] = []
    # Threads that wait on the pool; batches beyond them queue here, already admitted.
    executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="scorer-batch")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg)
        await asyncio.get_running_loop().run_in_executor(executor, pool.warm_up)
        pools.append(pool)
        try:
            yield
        finally:
            pool.close()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dph-async scorer", lifespan=lifespan)

    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        if settings.token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode()):
                metrics.record_batch(401)
                return _error(401, "unauthorized", "missing or wrong bearer token")
        try:
            batch = ScoreBatch.model_validate_json(await _read_body(request, settings.max_body_bytes))
        except _BodyTooLarge:
            metrics.record_batch(413)
            detail = f"body over {settings.max_body_bytes} bytes; send smaller batches"
            return _error(413, "too_large", detail)
        except ValidationError as e:
            metrics.record_batch(400)
            return _error(400, "bad_request", str(e)[:2000])
        sources = [item.data_source for item in batch.requests]
        for source in set(sources):
            try:
                get_reward_fn(source)
            except UnknownDataSource as e:
                metrics.record_batch(400)
                return _error(400, "unknown_data_source", str(e), data_source=source)
        n = len(batch.requests)
        if state["in_flight"] + n > settings.max_queued:
            metrics.record_batch(503)
            return JSONResponse({"error": "overloaded", "detail": f"{state['in_flight']} requests queued"},
                                status_code=503, headers={"Retry-After": "1"})
        budget = min(batch.budget_s or settings.max_budget_s, settings.max_budget_s)
        deadline = time.monotonic() + budget
        requests = [item.to_request() for item in batch.requests]
        state["in_flight"] += n
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(executor, pools[0].score_many, requests, deadline)
        finally:
            state["in_flight"] -= n
        metrics.record_batch(200, sources, results)
        return Response(ScoreReply(results=results).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        pool = pools[0]
        return {"status": "ok", "workers": cfg.workers, "in_flight": state["in_flight"],
                "restarts": pool.restarts, "timeout_s": cfg.timeout_s}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        gauges = {"in_flight": float(state["in_flight"]), "worker_restarts": float(pools[0].restarts),
                  "workers": float(cfg.workers)}
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4")

    return app
