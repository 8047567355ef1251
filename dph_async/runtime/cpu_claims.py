"""Cores claimed on this host by the RL runs of every invocation, so that two invocations side by side
pin their processes to different cores (or the second says it shares them and leaves its processes
to the OS).

A claim is one JSON file in a directory of this host (`claims_dir()`: DPH_CORES_DIR, else a folder of
this user's in the system's temporary directory), written and removed under an exclusive lock on a
file there. It names the claiming process by pid and start time: a claim whose process has ended, or
whose pid now belongs to another process, is stale and removed by the next invocation that looks, so
a killed invocation frees its cores without a clean exit. A claim is released when its run ends, on
every exit path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

MAX_CLAIM_BYTES = 65536  # a claim file larger than this is not ours: ignored
P = TypeVar("P")


@dataclass(frozen=True)
class Claim:
    id: str
    pid: int
    started: int  # the process's start time in clock ticks since boot (/proc/PID/stat): tells a reused pid
    cores: list[int]
    command: str  # what the invocation runs, for the message of one that shares

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}) holds cores {self.cores}"


@dataclass
class Taken(Generic[P]):
    """What `claim_cores` decided: the cores planned (None: too few free) and the claims seen."""

    plan: P | None  # what `plan_of` returned for the free cores
    claim: Claim | None  # ours, to release; None where nothing was claimed
    others: list[Claim] = field(default_factory=list)  # the live claims before ours


def claims_dir() -> Path:
    """Where this host's claims live: DPH_CORES_DIR, else `<tmp>/dph-async-cores-<uid>`."""
    if given := os.environ.get("DPH_CORES_DIR"):
        return Path(given)
    return Path(tempfile.gettempdir()) / f"dph-async-cores-{os.getuid()}"


def start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot; None if it does not run."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


def _command(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in args if a)[:200]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> Claim | None:
    """A claim file, or None for one that is not a claim (too large, not JSON, wrong fields)."""
    try:
        if path.stat().st_size > MAX_CLAIM_BYTES:
            return None
        data = json.loads(path.read_text())
        claim = Claim(id=str(data["id"]), pid=int(data["pid"]), started=int(data["started"]),
                      cores=[int(c) for c in data["cores"]], command=str(data["command"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return claim


def live_claims(directory: Path) -> list[Claim]:
    """The claims of running processes; stale and unreadable claim files are removed. Under the lock."""
    live = []
    for path in sorted(directory.glob("claim-*.json")):
        claim = _read(path)
        if claim is None or start_time(claim.pid) != claim.started:
            if claim is None:
                log.warning("core claims: %s is not a claim; removed", path)
            path.unlink(missing_ok=True)
            continue
        live.append(claim)
    return live


def claim_cores(cores: Collection[int], plan_of: Callable[[list[int]], P | None], used: Callable[[P], list[int]],
         directory: Path | None = None) -> Taken[P]:
    """Plan over the cores of `cores` no live claim holds (`plan_of`: None if they are too few) and claim
    the planned ones (`used`), atomically with respect to every other invocation on this host."""
    directory = directory or claims_dir()
    with _locked(directory):
        others = live_claims(directory)
        held = {core for c in others for core in c.cores}
        plan = plan_of(sorted(set(cores) - held))
        if plan is None:
            return Taken(None, None, others)
        me = os.getpid()
        claim = Claim(uuid.uuid4().hex, me, start_time(me) or 0, sorted(used(plan)), _command(me))
        tmp = directory / f".claim-{claim.id}.tmp"
        tmp.write_text(json.dumps(asdict(claim)))
        tmp.rename(directory / f"claim-{claim.id}.json")  # whole or absent for a reader
    return Taken(plan, claim, others)


def release_cores(claim: Claim | None, directory: Path | None = None) -> None:
    """Give back the cores of `claim` (nothing for None or a claim already released)."""
    if claim is None:
        return
    directory = directory or claims_dir()
    with _locked(directory):
        (directory / f"claim-{claim.id}.json").unlink(missing_ok=True)
