"""Replay service configuration: staleness policy, admission, reference mix, write-ahead log."""

from pydantic import Field

from dph_async.config.base import Section


class ReplayConfig(Section):
    # eta: a group is used only while (learner version - oldest token version) <= max_staleness.
    max_staleness: int = Field(1, ge=0)
    # Admission control: prompts in flight or buffered stay within (eta + 1) batches of the learner.
    admission: bool = True
    # How often a fresh group may be served (1 = use once, as in AReaL and PipelineRL).
    max_reuse: int = Field(1, ge=1)
    # Reference (D_pef) samples mixed into each batch per fresh sample (DPH-RL scripts: 256 / 2048).
    reference_ratio: float = Field(0.125, ge=0)
    # Write-ahead log directory (relative to the run directory); None disables durability.
    wal_dir: str | None = "replay_wal"
