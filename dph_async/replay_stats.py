"""What the replay reports (`Stats` replies, `RLResult.replay`, result.json): typed, one class per part.

Counters are cumulative over the run (they travel with snapshots); rates cover the last 10 s of
the process. docs/data_plane.md §6 says what each one counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Occupancy:
    """What the fresh store holds now, by place (unserved, reusable, pending) and in total."""

    groups: int = 0
    unserved: int = 0
    reusable: int = 0
    pending: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0


@dataclass
class IngestRate:
    groups_per_s: float = 0.0
    mb_per_s: float = 0.0


@dataclass
class Served:
    batches: int = 0
    batches_resent: int = 0
    groups: int = 0
    samples: int = 0
    reference: int = 0
    used_up: int = 0


@dataclass
class Mix:
    """Reference (D_pef) samples served per fresh sample, overall and in the last batch."""

    reference_per_fresh_sample: float = 0.0
    last_batch_fresh_samples: int = 0
    last_batch_reference: int = 0


@dataclass
class Tickets:
    """Admission: tickets granted in all, held by actors now (the replay's own record), how many more
    may be granted now, groups admitted, ticket requests waiting for capacity, and requests whose
    actor claimed to hold more tickets than it was granted (ignored)."""

    granted: int = 0
    in_flight: int = 0
    capacity: int = 0
    admitted: int = 0
    parked: int = 0
    overclaimed: int = 0


@dataclass
class WalStats:
    """The write-ahead log: the segment being written, bytes since the last base, and what recovery
    found damaged (records whose checksum failed or that were cut short, and the bytes cut off)."""

    segment: int = -1
    bytes_since_base: int = 0
    damaged_records: int = 0
    truncated_bytes: int = 0


@dataclass
class Refusals:
    """Messages refused (by ProtocolError kind, `invalid` for unusable groups, `unauthorized` for
    requests without the control identity), and how many of them were logged or left unlogged by
    the log's rate limit."""

    by_kind: dict[str, int] = field(default_factory=dict)
    logged: int = 0
    unlogged: int = 0


@dataclass
class ReplayStats:
    version: int = 0
    occupancy: Occupancy = field(default_factory=Occupancy)
    ingest: IngestRate = field(default_factory=IngestRate)
    accepted: int = 0
    duplicates: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    refused: Refusals = field(default_factory=Refusals)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    served: Served = field(default_factory=Served)
    mix: Mix = field(default_factory=Mix)
    tickets: Tickets = field(default_factory=Tickets)
    reference_pool: int = 0
    wal: WalStats = field(default_factory=WalStats)
    replies_dropped: int = 0
    # The service: where it listens ("" for a core without sockets), and whether a batch request waits.
    ingest_endpoint: str = ""
    batch_endpoint: str = ""
    batch_parked: bool = False
