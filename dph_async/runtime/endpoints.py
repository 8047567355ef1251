"""Finding and reading the /health and /metrics endpoints of a run's processes.

    for ep in find_endpoints(["runs/default"]):       # every <..>/endpoints/*.json below, or URLs
        reading = scrape(ep)                           # health JSON + every Prometheus sample, parsed
        reading.value("process_resident_memory_bytes")

The announce files and the endpoints may be a stranger's: an announce file is read only if it is a
regular file of at most MAX_ANNOUNCE_BYTES (dph_async/safe_files.py), a symlinked endpoints/ directory
is not entered, and one scrape (both GETs) ends within TIMEOUT_S and reads at most MAX_HEALTH_BYTES and
MAX_METRICS_BYTES (dph_async/runtime/http_get.py). What cannot be read is a Reading with `error` set,
never an exception: the other processes are still shown.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from dph_async.admission import bearer
from dph_async.metrics_endpoint import access_token
from dph_async.runtime.http_get import FetchError, http_get
from dph_async.safe_files import UnsafeFile, read_json

TIMEOUT_S = 3.0  # one endpoint's whole scrape: /health and /metrics
MAX_ANNOUNCE_BYTES = 4 << 10
MAX_HEALTH_BYTES = 64 << 10
MAX_METRICS_BYTES = 4 << 20  # a process's own metrics are tens of KB
MAX_PARALLEL = 16  # endpoints scraped at once


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    pid: int | None = None
    source: str = ""  # the announce file it came from, if any
    problem: str = ""  # why its announce file could not be used ("" when it could)
    token: str | None = field(default=None, repr=False)  # the run's access token, found beside that file


class _Announce(msgspec.Struct):
    """An announce file, as `MetricsEndpoint.announce` writes it."""

    name: str
    url: str
    pid: int | None = None


@dataclass
class Reading:
    endpoint: Endpoint
    health: dict = field(default_factory=dict)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    error: str = ""  # why it could not be read ("" when it was)

    @property
    def up(self) -> bool:
        return not self.error and self.health.get("status") == "ok"

    def value(self, name: str, default: float | None = None, **labels: str) -> float | None:
        """One sample by name and labels (labels not given are summed over)."""
        want = set(labels.items())
        hits = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        return sum(hits) if hits else default

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """{label value: sample} of a labelled metric, e.g. drops by reason."""
        out: dict[str, float] = {}
        for (n, ls), v in self.samples.items():
            if n == name:
                key = dict(ls).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out


def find_endpoints(targets: list[str]) -> list[Endpoint]:
    """Endpoints named by URLs (http://...) or announced under run directories (any depth)."""
    found: list[Endpoint] = []
    for target in targets:
        if target.startswith(("http://", "https://")):
            found.append(Endpoint(target.rstrip("/").rsplit("/", 1)[-1], target.rstrip("/")))
            continue
        root = Path(target)
        if not root.exists():
            raise FileNotFoundError(f"{target}: no such run directory (give a run directory or a URL)")
        for here, dirs, _ in os.walk(root):  # never enters a symlinked directory
            dirs.sort()
            for name in dirs:
                if name == "endpoints" and os.path.islink(os.path.join(here, name)):
                    found.append(Endpoint(os.path.join(here, name), "",
                                          problem="a symbolic link to a directory, not followed"))
            if os.path.basename(here) == "endpoints":
                found += _announced(Path(here))
    return found


def _announced(directory: Path) -> list[Endpoint]:
    """The endpoints announced in one endpoints/ directory (one with a `problem` per unusable file)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []  # gone, or swapped for a link since the walk
    try:
        found = []
        token = access_token(directory)  # the run's own reader is served even when others fill an endpoint
        for name in sorted(n for n in os.listdir(fd) if n.endswith(".json")):
            source = str(directory / name)
            try:
                info = read_json(Path(name), _Announce, MAX_ANNOUNCE_BYTES, dir_fd=fd)
                found.append(Endpoint(info.name, info.url, info.pid, source, token=token))
            except FileNotFoundError:
                continue  # removed since listed
            except (UnsafeFile, OSError, msgspec.DecodeError) as e:
                found.append(Endpoint(name.removesuffix(".json"), "", source=source, problem=" ".join(str(e).split())))
        return found
    finally:
        os.close(fd)


def _get(url: str, path: str, deadline: float, max_bytes: int, token: str | None) -> tuple[int, bytes]:
    try:
        return http_get(f"{url}{path}", deadline=deadline, max_bytes=max_bytes, headers=bearer(token))
    except FetchError as e:
        raise FetchError(f"{path}: {e}") from None


def _health(url: str, deadline: float, token: str | None) -> dict:
    """The /health JSON object. A 503 with a JSON object is an answer: the process says it is unwell."""
    _, body = _get(url, "/health", deadline, MAX_HEALTH_BYTES, token)
    try:
        health = json.loads(body)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser
        raise FetchError(f"/health: not JSON ({type(e).__name__})") from None
    if not isinstance(health, dict):
        raise FetchError(f"/health: a JSON {type(health).__name__}, not an object")
    return health


def _samples(url: str, deadline: float, token: str | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = _get(url, "/metrics", deadline, MAX_METRICS_BYTES, token)
    if status != 200:
        raise FetchError(f"/metrics: HTTP {status}")
    try:
        return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
                for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    except (ValueError, IndexError, KeyError, TypeError) as e:  # the parser's ways of refusing
        raise FetchError(f"/metrics: not Prometheus text ({' '.join(str(e).split())[:80]})") from None


def scrape(endpoint: Endpoint) -> Reading:
    """GET /health and /metrics within TIMEOUT_S; what does not answer, or answers nonsense, gives a
    Reading with `error` set."""
    if endpoint.problem:
        return Reading(endpoint, error=f"unreadable: {endpoint.problem}")
    reading = Reading(endpoint)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        reading.health = _health(endpoint.url, deadline, endpoint.token)
        reading.samples = _samples(endpoint.url, deadline, endpoint.token)
    except FetchError as e:
        reading.error = str(e)
    return reading


def scrape_all(endpoints: list[Endpoint]) -> list[Reading]:
    """Every endpoint scraped at once, so that the whole takes one TIMEOUT_S, however many do not answer."""
    if not endpoints:
        return []
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(endpoints)), thread_name_prefix="scrape") as pool:
        return list(pool.map(scrape, endpoints))
