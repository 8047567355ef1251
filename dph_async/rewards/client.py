"""A client for one or more scorer services (`dph-async serve scorer`), with retries and backoff.

    with ScorerClient(["http://10.0.0.5:5101", "http://10.0.0.6:5101"], timeout_s=120, retries=3) as c:
        results = c.score_many(requests)

Batches are split into chunks of `batch_size`, spread over the services in turn and sent concurrently.
A chunk that fails (connection refused, timeout, 5xx, 503 overloaded) is retried on the next service
after an exponential backoff with jitter (honouring Retry-After). When every attempt has failed, its
requests come back with status "error", so the caller can go on and count them; an unknown data_source
raises `UnknownDataSource`, as it does with the local pool.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec

from dph_async.rewards.registry import UnknownDataSource
from dph_async.rewards.result import RewardResult, failure
from dph_async.rewards.wire import TOKEN_ENV, ScoreBatch, ScoreItem, ScoreReply
from dph_async.rewards.worker import ScoreRequest

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 5.0
# Time to connect and transfer beyond the scoring budget the service is given.
NETWORK_MARGIN_S = 5.0


class _Retryable(Exception):
    """This attempt failed in a way another attempt (or another service) may not."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ScorerClient:
    """Scores requests on scorer services; same `score_many` as `RewardPool`."""

    def __init__(self, urls: list[str], timeout_s: float, retries: int, batch_size: int = 64) -> None:
        if not urls:
            raise ValueError("ScorerClient needs at least one scorer service URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch_size = batch_size
        token = os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(timeout_s + NETWORK_MARGIN_S, connect=5.0)
        self._http = httpx.Client(headers=headers, timeout=timeout)
        self._next_url = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        # Sends the chunks of a large batch in parallel; a one-chunk batch goes from the caller's thread.
        self._threads = ThreadPoolExecutor(max_workers=4 * len(self.urls), thread_name_prefix="scorer-client")

    def _pick(self) -> int:
        with self._lock:
            return next(self._next_url)

    def score_many(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        chunks = [requests[i : i + self.batch_size] for i in range(0, len(requests), self.batch_size)]
        if len(chunks) == 1:
            return self._score_chunk(chunks[0])
        futures = [self._threads.submit(self._score_chunk, chunk) for chunk in chunks]
        return [result for f in futures for result in f.result()]

    def _score_chunk(self, chunk: list[ScoreRequest]) -> list[RewardResult]:
        payload = msgspec.json.encode(ScoreBatch([ScoreItem.from_request(r) for r in chunk], self.timeout_s))
        first = self._pick()
        problem = ""
        for attempt in range(self.retries + 1):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                return self._post(url, payload, len(chunk))
            except _Retryable as e:
                problem = f"{url}: {e}"
                if attempt < self.retries:
                    backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
                    time.sleep(max(backoff, e.retry_after_s or 0.0))
        log.warning("scorer services failed %d times for %d requests: %s",
                    self.retries + 1, len(chunk), problem)
        return [failure("error", f"scorer service unavailable ({problem})"[:500]) for _ in chunk]

    def _post(self, url: str, payload: bytes, expected: int) -> list[RewardResult]:
        try:
            reply = self._http.post(f"{url}/v1/score", content=payload,
                                    headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        if reply.status_code == 400:
            info = _json(reply)
            if info.get("error") == "unknown_data_source":
                raise UnknownDataSource(str(info.get("data_source")), str(info.get("detail")))
            raise ValueError(f"scorer service refused the batch: {info.get('detail', reply.text[:300])}")
        if reply.status_code in (413, 422, 401, 403):
            raise ValueError(f"scorer service refused the batch ({reply.status_code}): {reply.text[:300]}")
        if reply.status_code != 200:
            retry_after = reply.headers.get("Retry-After", "")
            wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
            raise _Retryable(f"HTTP {reply.status_code}", wait)
        try:
            results = msgspec.json.decode(reply.content, type=ScoreReply).results
        except msgspec.DecodeError as e:
            raise _Retryable(f"malformed reply: {e}"[:300]) from e
        if len(results) != expected:
            raise _Retryable(f"reply has {len(results)} results for {expected} requests")
        return results

    def health(self, url: str | None = None) -> dict:
        """The /health reply of one service (the first by default)."""
        reply = self._http.get(f"{url or self.urls[0]}/health", timeout=5.0)
        reply.raise_for_status()
        return reply.json()

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> ScorerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json(reply: httpx.Response) -> dict:
    try:
        data = reply.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
