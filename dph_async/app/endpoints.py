"""Finding and reading the /health and /metrics endpoints of a run's processes.

    for ep in find_endpoints(["runs/default"]):       # every <..>/endpoints/*.json below, or URLs
        reading = scrape(ep)                           # health JSON + every Prometheus sample, parsed
        reading.value("process_resident_memory_bytes")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dph_async.admission import bearer
from dph_async.telemetry import access_token

TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    pid: int | None = None
    source: str = ""  # the announce file it came from, if any
    token: str | None = field(default=None, repr=False)  # the run's access token, found beside that file


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
        for path in sorted(root.rglob("endpoints/*.json")):
            try:
                info = json.loads(path.read_text())
                found.append(Endpoint(str(info["name"]), str(info["url"]), info.get("pid"), str(path),
                                      access_token(path.parent)))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being rewritten, or not ours
    return found


def scrape(endpoint: Endpoint, client: httpx.Client | None = None) -> Reading:
    """GET /health and /metrics; a process that does not answer gives a Reading with `error` set."""
    own = client is None
    client = client or httpx.Client(timeout=TIMEOUT_S)
    reading = Reading(endpoint)
    try:
        headers = bearer(endpoint.token)  # the run's own reader: served even when others fill the endpoint
        health = client.get(f"{endpoint.url}/health", headers=headers)
        reading.health = health.json()
        text = client.get(f"{endpoint.url}/metrics", headers=headers).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                reading.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except (httpx.HTTPError, ValueError) as e:
        reading.error = f"{type(e).__name__}: {e}"[:200] or "no answer"
    finally:
        if own:
            client.close()
    return reading
