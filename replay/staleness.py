"""The staleness bound (eta) and admission control (AReaL's rule), DESIGN.md §5.

Staleness of a group consumed at learner version v is v minus the oldest policy version among its
tokens. A group is served only while that is <= eta; older ones are dropped and counted by reason:

    stale          never served, now older than eta
    stale_reused   served before (max_reuse > 1), now older than eta
    rewound        holds tokens from versions after the learner's restored checkpoint

Admission keeps actors from producing what would be dropped. With B groups per batch, tickets are
granted only while

    admitted + in_flight <= (eta + v + 1) * B

where admitted counts groups ever accepted minus those dropped unused, and in_flight counts tickets
granted but not yet turned into accepted groups. v is the learner's version, or the actor's weights
version if that is older: a group made with weights w is consumed by a batch of version at most
w + eta only if at most (eta + w + 1) * B groups are ahead of it.

in_flight is the replay's own record: what it granted each actor, less the groups that arrived. An
actor's account of the tickets it holds (`TicketRequest.outstanding`) may only lower that record (an
actor gives back tickets it lost), never raise it, so no peer can shrink the capacity of the others.
Only actors holding tickets have an entry, so the bookkeeping is bounded by the capacity, not by the
actor ids peers make up.
"""

from __future__ import annotations

DROP_REASONS = ("stale", "stale_reused", "rewound")


def staleness(version: int, min_version: int) -> int:
    """Staleness of a group at learner `version` (never negative: newer weights than the request's
    version happen when a batch request waited while actors loaded the next weights)."""
    return max(0, version - min_version)


class Admission:
    """Ticket accounting for all actors."""

    def __init__(self, max_staleness: int, groups_per_batch: int, enabled: bool):
        self.max_staleness = max_staleness
        self.groups_per_batch = groups_per_batch
        self.enabled = enabled
        self.in_flight: dict[int, int] = {}  # actor -> tickets granted and not yet used; no zero entries
        self.in_flight_total = 0
        self.granted_total = 0
        self.overclaimed = 0  # requests whose actor claimed more tickets than it was granted

    def capacity(self, learner_version: int, admitted: int, weights_version: int = -1) -> int:
        """How many more tickets may be granted now."""
        version = learner_version if weights_version < 0 else min(learner_version, weights_version)
        limit = (self.max_staleness + version + 1) * self.groups_per_batch
        return max(0, limit - admitted - self.in_flight_total)

    def _set(self, actor: int, n: int) -> None:
        self.in_flight_total += n - self.in_flight.get(actor, 0)
        if n > 0:
            self.in_flight[actor] = n
        else:
            self.in_flight.pop(actor, None)

    def grant(
        self,
        actor: int,
        want: int,
        outstanding: int,
        learner_version: int,
        admitted: int,
        weights_version: int,
    ) -> int:
        """Answer a ticket request. `outstanding` (the actor's own count of unused tickets) lowers our
        record of what it holds, never raises it."""
        held = self.in_flight.get(actor, 0)
        if outstanding > held:
            self.overclaimed += 1
        self._set(actor, min(held, outstanding))
        granted = want if not self.enabled else min(want, self.capacity(learner_version, admitted, weights_version))
        self._set(actor, self.in_flight.get(actor, 0) + granted)
        self.granted_total += granted
        return granted

    def arrived(self, actor: int) -> None:
        """A new group from `actor` was accepted: one of its tickets is used."""
        if actor in self.in_flight:
            self._set(actor, self.in_flight[actor] - 1)

    def reset(self, actor: int) -> int:
        """The actor (re)connected and resumed: its earlier tickets are void. Returns how many there
        were: positions granted to its previous process and never delivered (they are regenerated)."""
        voided = self.in_flight.get(actor, 0)
        self._set(actor, 0)
        return voided
