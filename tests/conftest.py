"""Fixtures shared by several test files."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _scorer(*args: str) -> Iterator[tuple[str, int]]:
    """`dph-async serve scorer --port 0 ARGS` in its own process, until ready: (url, pid)."""
    server = subprocess.Popen([sys.executable, "-m", "dph_async.app.cli", "serve", "scorer", "--port", "0", *args],
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = server.stderr.readline()  # "scorer: N workers, http://127.0.0.1:PORT"
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), line
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(timeout=20)
        server.stderr.close()


@pytest.fixture(scope="session")
def scorer_process() -> Callable[..., contextlib.AbstractContextManager[tuple[str, int]]]:
    """A function starting the scorer service in a process of its own: `with scorer_process(*args) as
    (url, pid)`."""
    return _scorer
