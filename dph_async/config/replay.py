"""Replay service configuration: staleness policy, admission, reference mix, write-ahead log, limits.

docs/data_plane.md explains each rule; the service is replay/service.py.
"""

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dph_async.config.base import Section


class ReplayConfig(Section):
    # eta: a group is used only while (learner version - oldest token version) <= max_staleness.
    # auto: the learner steers eta within [staleness_min, staleness_max], starting at the minimum:
    # every `staleness_window` steps, halved if the window's mean ESS of the importance weights is
    # below `staleness_target_ess`, else raised (doubled until the first halving, then by one) if the
    # learner waited for data at least `staleness_min_wait` of its time and the window's data reached
    # the bound; a bound that keeps nobody waiting only costs freshness. A lowered bound spares the
    # groups admitted under the higher one (learner/staleness_control.py; docs/decisions.md says why).
    # The target 0.93: held-out reward fell at mean ESS 0.84-0.89 (digit sets eta = 3 and 4, the
    # embedded task's eta = 8) and held or fell 3 points at 0.95 (docs/ablations.md, Staleness that
    # steers itself).
    max_staleness: int | Literal["auto"] = 1
    staleness_min: int = Field(1, ge=0)
    staleness_max: int = Field(8, ge=0)
    staleness_target_ess: float = Field(0.93, gt=0, lt=1)
    staleness_min_wait: float = Field(0.02, ge=0, lt=1)
    staleness_window: int = Field(5, ge=1)
    # Admission control: prompts in flight or buffered stay within (eta + 1) batches of the learner.
    admission: bool = True
    # How often a fresh group may be served (1 = use once, as in AReaL and PipelineRL). Reuse only
    # fills a batch when too few unused groups arrived within the learner's wait.
    max_reuse: int = Field(1, ge=1)
    # Reference (D_pef) samples mixed into each batch per fresh sample (DPH-RL scripts: 256 / 2048).
    reference_ratio: float = Field(0.125, ge=0)
    # Write-ahead log directory (relative to the run directory); None disables durability.
    wal_dir: str | None = "replay_wal"
    # fsync the log at every commit: survives a machine crash, not only a process crash, at the cost
    # of one disk flush per commit (commits group all messages that arrived together).
    wal_fsync: bool = False
    # A log segment is closed and a new one started past this size.
    wal_segment_mb: float = Field(256.0, gt=0)
    # After this much log since the last compaction, the replay writes its state as a new base and
    # deletes segments nothing needs any more, so the log and the recovery time stay bounded.
    wal_compact_mb: float = Field(1024.0, gt=0)
    # Limits on what a peer may send the ingest endpoint (docs/data_plane.md, "Hostile peers"):
    # the largest rollout-group message, all frames together (libzmq also disconnects a peer sending
    # any one frame larger than this, before buffering it);
    max_group_mb: float = Field(256.0, gt=0)
    # the largest message header, refused before it is parsed;
    max_header_kb: float = Field(1024.0, gt=0)
    # the most array frames one message may announce (a group of n completions has 1 + 3n).
    max_frames: int = Field(16384, ge=1)
    # Ticket requests waiting for capacity: at most this many in all, and per connection; a request
    # past either is answered at once with what can be granted.
    max_parked: int = Field(1024, ge=0)
    max_parked_per_peer: int = Field(4, ge=0)
    # Refused messages are all counted (stats: refused) but at most this many logged per minute.
    refusal_log_per_min: int = Field(10, ge=0)
    # A connection that has not finished its handshake after this long, or has sent nothing (not
    # even a heartbeat) for this long, is closed: slow and stalled peers hold nothing for ever.
    peer_timeout_s: float = Field(30.0, gt=0)
    # Messages libzmq queues per connection before it stops reading from that peer (backpressure,
    # not drops): what one peer can make the replay hold is at most this many messages. Behind the
    # gate (net.gate) the gate reads two messages ahead per connection, and this bounds what the
    # replay holds from its gate, all connections together (more lets a log commit take more).
    queue_per_peer: int = Field(64, ge=1)
    # Messages taken off the ingest socket per log commit (group commit: one flush, then the acks).
    ingest_batch: int = Field(256, ge=1)
    # What an accepted group may hold (replay/validation.py; docs/data_plane.md, "Ingest validation").
    # Upper bound on a behaviour log-prob (a log-prob is <= 0; this allows float rounding).
    logprob_tolerance: float = Field(1e-3, ge=0)
    # Token ids below this: the model's vocabulary, which `dph-async run` sets from the model (None:
    # ids need only be non-negative; `serve replay --vocab-size` sets it for a service of its own).
    vocab_size: int | None = Field(None, ge=1)
    # Prompt + response tokens at most this: the model's context (model.max_model_len in a run).
    max_sequence_tokens: int | None = Field(None, ge=1)
    # |reward| at most this: two rewards of 1e308 in a group overflow its standard deviation.
    max_abs_reward: float = Field(1e6, gt=0)
    # Token versions at most the learner's version plus this: the learner publishes version v + 1
    # before it asks for the batch of version v + 1, so an honest actor is at most one ahead.
    max_version_lead: int = Field(1, ge=0)
    # Budgets, so that no peer can take the service from the others. The fresh store's resident cost
    # (arrays plus per-group and per-completion overhead, docs/data_plane.md): a group that would pass
    # this is answered "retry" (the sender keeps it and sends it again later).
    max_store_mb: float = Field(2048.0, gt=0)
    # With admission on, groups that arrive without a ticket of their actor (resent after the replay
    # restarted, or from a peer that never asked) are held at most this many at a time, beyond which
    # they are answered "retry"; they do not count against the tickets honest actors are granted.
    # None: one batch (learner.groups_per_step). They hold at most max_ticketless_mb between them.
    max_ticketless: int | None = Field(None, ge=0)
    max_ticketless_mb: float = Field(64.0, ge=0)

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _eta(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("an integer >= 0, or auto")

    @model_validator(mode="after")
    def _limits(self) -> "ReplayConfig":
        if self.staleness_min > self.staleness_max:
            raise ValueError(f"replay.staleness_min ({self.staleness_min}) must be <= replay.staleness_max "
                             f"({self.staleness_max})")
        return self

    @property
    def auto_staleness(self) -> bool:
        return self.max_staleness == "auto"

    @property
    def initial_staleness(self) -> int:
        """eta at the start: the fixed bound, or with auto the lower limit."""
        return self.staleness_min if self.max_staleness == "auto" else self.max_staleness
