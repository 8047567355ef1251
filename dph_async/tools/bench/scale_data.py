"""What `dph-async bench scale` records (bench.json, each cell's cell.json): per cell, every system's
figures and dph-async's ratio to each peer with its interval. Light (no torch, no Ray), so that the
report and the docs renderer read it without the bench."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from dph_async.errors import UserError
from dph_async.safe_files import UnsafeFile, read_json
from dph_async.stats import RatioInterval

# A grid's largest record: 9 cells take 40 KB; a file is read no further than this, nor through a link.
MAX_BYTES = 16 * 2**20
NAME = re.compile(r"[0-9A-Za-z_.]+")  # a size's name (2m, 52m, 512x6): safe in a table and a path


@dataclass
class SystemFigures:
    """One system's figures in a cell: medians over its runs' steady states; peak memory the largest."""

    step_s: float
    completions_per_s: float
    tokens_per_s: float
    cpu_s_per_step: float | None
    startup_s: float | None
    peak_rss_mb: dict[str, float]


@dataclass
class ScaleCell:
    key: str
    size: str
    params: int
    hidden: int
    layers: int
    heads: int
    length: int
    prompts_per_step: int
    n: int
    steps: int
    skip: int
    date: str
    wall_s: float  # the cell's runs and their start-ups
    load_avg: tuple[float, float]  # 1-minute load average at the cell's start and end
    outside_cores: float | None  # cores others' jobs used during dph-async's steady state
    systems: dict[str, SystemFigures]
    ratios: dict[str, float]  # peer -> dph-async's median completions/s / the peer's median
    parts: dict[str, float]  # dph-async's CPU-seconds per step by part (bench/peer_limit.py)
    threads: dict[str, float]  # the busiest actor thread's CPU-seconds per step
    ceilings: dict[str, dict[str, float]]  # peer -> bound -> the most dph-async / peer it allows
    projection: list[dict[str, float]]  # scaling model: dph-async and the peers' best on more cores
    notes: list[str] = field(default_factory=list)
    repeats: int = 1  # runs of each system (a cell recorded before repeats: one)
    # peer -> the repeats' paired ratios' geometric mean with its 95% interval (none under two repeats)
    intervals: dict[str, RatioInterval] = field(default_factory=dict)
    commit: str | None = None  # the checkout's when the cell ran (cells recorded before it have none)
    # what else the cell ran with: preset, --set overrides, systems, vocabulary (cells recorded before it: {})
    setup: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> ScaleCell:
        """A cell from its JSON object, every field's type checked (msgspec.ValidationError)."""
        return msgspec.convert(data, cls)

    def __post_init__(self) -> None:
        """What the report relies on beyond types (msgspec calls this when decoding; a ValueError is a
        refused record): a key and size that are names, each interval around its centre, each
        projection row with its columns."""
        if not NAME.fullmatch(self.size) or self.key != f"{self.size}-L{self.length}":
            raise ValueError(f"cell {self.key[:40]!r} of size {self.size[:40]!r}: not a cell's name")
        for peer, ci in self.intervals.items():
            if not ci.low <= ci.ratio <= ci.high or ci.low <= 0:
                raise ValueError(f"{peer}: ratio {ci.ratio} outside its interval {ci.low}-{ci.high}")
        if any(not {"cores", "actors", "dph-async"} <= row.keys() for row in self.projection):
            raise ValueError("a projection row without cores, actors or dph-async")

    def work(self) -> dict:
        """What makes two records of a cell the same measurement."""
        return {"key": self.key, "params": self.params, "length": self.length,
                "prompts_per_step": self.prompts_per_step, "n": self.n, "steps": self.steps, "skip": self.skip,
                "repeats": self.repeats, "setup": self.setup}

    def ratio(self, peer: str) -> float | None:
        """dph-async's ratio to `peer` as the docs show it: the geometric mean of the repeats' paired
        ratios (the centre of the interval), or the ratio of the one run's rates; None if not run."""
        ci = self.intervals.get(peer)
        return ci.ratio if ci else self.ratios.get(peer)


@dataclass
class ScaleBench:
    date: str
    machine: dict
    settings: dict
    cells: list[ScaleCell]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def load(path: Path) -> ScaleBench:
    """A grid's bench.json; a file that is not one this version writes is an error naming it."""
    try:
        return read_json(path, ScaleBench, MAX_BYTES)
    except (OSError, UnsafeFile, msgspec.MsgspecError, RecursionError) as e:
        raise UserError(f"{path} is not a bench.json this version of `bench scale` writes "
                        f"({type(e).__name__}: {e})") from e
