"""What `dph-async bench tta` records (tta.json): every run's curve and the workload. Light (no
torch, no Ray), so that the command line and the docs renderer read it without the bench."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from dph_async.errors import UserError
from dph_async.safe_files import UnsafeFile, read_json

SYSTEMS = ("async", "sync", "trl")
SPLIT = "in_domain"  # the held-out split whose Pass@1 is the target's
DEFAULT_GAIN = 0.04  # the default target: pi_0's held-out Pass@1 plus this
# A summary's largest size: 15 runs of 200 steps kept every 20 take 5 KB; a shared or foreign
# directory's file is read no further than this, and a link is not followed.
MAX_BYTES = 16 * 2**20


@dataclass
class Curve:
    """One run: its kept versions, the run's clock at each, and the held-out Pass@1 there; the
    first point is pi_0 at 0 s."""

    system: str
    seed: int
    steps: list[int]
    wall: list[float]
    pass1: list[float]
    run_s: float = 0.0  # the run's clock at its last step

    def __post_init__(self) -> None:
        """What the report relies on beyond types (msgspec calls this when decoding; a ValueError is a
        refused record): a known system, and points that make a curve."""
        if self.system not in SYSTEMS:
            raise ValueError(f"system {self.system[:40]!r}: not one of {', '.join(SYSTEMS)}")
        if not 2 <= len(self.steps) == len(self.wall) == len(self.pass1):
            raise ValueError(f"{self.system}: steps, wall and pass1 of {len(self.steps)}, {len(self.wall)} and "
                             f"{len(self.pass1)} points; a curve needs the same number, two at least")
        if self.steps[0] != 0 or any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError(f"{self.system}: steps {self.steps[:5]}... do not rise from 0")


@dataclass
class TTABench:
    provenance: dict
    workload: dict
    base_pass1: float  # pi_0's held-out Pass@1: the mean of its evaluations under the seeds
    base_se: float  # one of those evaluations' sampling standard error on its prompts (bench/tta.py)
    every: int
    curves: list[Curve]
    notes: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def load(path: Path) -> TTABench:
    """A tta.json; a file that is not one this version writes (a link, over MAX_BYTES, not its JSON, a
    field of another type) is an error naming it."""
    try:
        return read_json(path, TTABench, MAX_BYTES)
    except (OSError, UnsafeFile, msgspec.MsgspecError, RecursionError) as e:
        raise UserError(f"{path} is not a tta.json this version of `bench tta` writes ({type(e).__name__}: {e})") \
            from e
