"""The staleness bound (eta) and admission control (AReaL's rule), docs/data_plane.md §3.

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

"Ahead" is in grant order, but groups arrive in any order: a slow actor's group granted at w can
arrive after fresher groups filled batch w + eta. So the replay records each ticket's basis version
w, and a batch of version v that could be served waits (up to its deadline) while tickets granted at
v - eta are still on their way and fit in it: it is their last batch. An arriving group uses its
actor's ticket of the newest basis not newer than its oldest token (an actor running several prompts
at once finishes them out of order), and tickets an actor no longer counts are taken from its newest
grant; both err toward waiting for a group, never toward forgetting one on its way.

in_flight is the replay's own record: what it granted each actor, less the groups that arrived. An
actor's account of the tickets it holds (`TicketRequest.outstanding`) may only lower that record (an
actor gives back tickets it lost), never raise it, so no peer can shrink the capacity of the others.
Only actors holding tickets have an entry, so the bookkeeping is bounded by the capacity, not by the
actor ids peers make up.

A peer without the run's actor token (or CURVE key) is *anonymous*: it is granted only from what is
left once one batch of tickets (B) is kept for the run's own actors, and it cannot lower or void the
record of an actor whose tickets were granted with the token. So a loopback client that takes every
ticket it can for made-up actor ids still leaves the run's actors a batch per version, and the
learner moves on. Tickets whose last batch was served expire (a group made from them would be
dropped as stale): what a peer took and never used frees itself within eta + 1 versions.
"""

from __future__ import annotations

from collections import Counter, deque

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
        # actor -> [basis version, tickets] granted and not yet used, oldest grant first; no empty entries
        self.in_flight: dict[int, deque[list[int]]] = {}
        self.by_version: Counter[int] = Counter()  # basis version -> tickets in flight; no zero entries
        self.in_flight_total = 0
        self.overclaimed = 0  # requests whose actor claimed more tickets than it was granted
        self.expired = 0  # tickets dropped unused once their last batch was served
        self.trusted: set[int] = set()  # actors whose tickets were granted with the actor token
        self.anonymous_granted = 0  # tickets granted to requests without it

    @staticmethod
    def basis(learner_version: int, weights_version: int) -> int:
        """The version a group made now is at least as new as: the learner's, or the actor's weights
        if those are older (-1: not told)."""
        return learner_version if weights_version < 0 else min(learner_version, weights_version)

    def capacity(self, learner_version: int, admitted: int, weights_version: int = -1) -> int:
        """How many more tickets may be granted now."""
        return max(0, self._limit(learner_version, weights_version) - admitted - self.in_flight_total)

    def _limit(self, learner_version: int, weights_version: int) -> int:
        return (self.max_staleness + self.basis(learner_version, weights_version) + 1) * self.groups_per_batch

    def _anonymous_in_flight(self, basis: int | None = None) -> int:
        """Tickets in flight to actors granted without the token (of one basis, if given)."""
        return sum(n for a, chunks in self.in_flight.items() if a not in self.trusted
                   for b, n in chunks if basis is None or b == basis)

    def held(self, actor: int) -> int:
        return sum(n for _, n in self.in_flight.get(actor, ()))

    def last_chance(self, batch_version: int, bound: int) -> int:
        """Tickets in flight whose groups a batch of `batch_version` is the last one allowed to use,
        under the staleness `bound` it expires by (eta, or a grace's: ReplayCore.expiry_bound). Only
        the run's actors' tickets: waited for, an anonymous peer's would hold a batch every version."""
        basis = batch_version - bound
        coming = self.by_version.get(basis, 0)
        if coming and len(self.trusted) < len(self.in_flight):
            coming -= self._anonymous_in_flight(basis)
        return coming

    def _add(self, actor: int, basis: int, n: int) -> None:
        chunks = self.in_flight.setdefault(actor, deque())
        if chunks and chunks[-1][0] == basis:
            chunks[-1][1] += n
        else:
            chunks.append([basis, n])
        self.by_version[basis] += n
        self.in_flight_total += n

    def _use(self, actor: int, n: int) -> int:
        """Take up to n of the actor's tickets, newest grant first; returns how many it held of them."""
        chunks = self.in_flight.get(actor)
        used = 0
        while chunks and used < n:
            used += self._take(chunks, -1, n - used)
        self._settle(actor, used)
        return used

    def _take(self, chunks: deque[list[int]], i: int, n: int) -> int:
        """Take up to n tickets from chunk i, dropping it once empty."""
        basis, held = chunks[i]
        k = min(held, n)
        self.by_version[basis] -= k
        if not self.by_version[basis]:
            del self.by_version[basis]
        if k == held:
            del chunks[i]
        else:
            chunks[i][1] -= k
        return k

    def _settle(self, actor: int, used: int) -> None:
        if actor in self.in_flight and not self.in_flight[actor]:
            del self.in_flight[actor]
            self.trusted.discard(actor)
        self.in_flight_total -= used

    def grant(
        self,
        actor: int,
        want: int,
        outstanding: int,
        learner_version: int,
        admitted: int,
        weights_version: int,
        trusted: bool = True,
    ) -> int:
        """Answer a ticket request. `outstanding` (the actor's own count of unused tickets) lowers our
        record of what it holds, never raises it. The tickets it no longer counts are taken as its
        newest: an honest actor counts fewer than we do only while a grant is on its way to it.
        `trusted`: the request carried the actor token; without it the request gets nothing for an
        actor whose tickets were granted with it, and otherwise only what leaves one batch free."""
        if not trusted and actor in self.trusted:
            return 0
        held = self.held(actor)
        if outstanding > held:
            self.overclaimed += 1
        self._use(actor, held - min(held, max(outstanding, 0)))
        room = self.capacity(learner_version, admitted, weights_version)
        if not trusted:
            room = max(0, room - self.groups_per_batch)
        elif room < self.groups_per_batch and (anonymous := self._anonymous_in_flight()):
            # Anonymous tickets never keep the run's actors from a batch (or what is left of the limit,
            # if less). Granted under a larger eta (set_staleness lowers it), they would otherwise
            # take it all and hold the learner at its version for ever: they expire only once the
            # batch they keep the run's actors from making is served.
            left = self._limit(learner_version, weights_version) - admitted
            room = max(room, min(self.groups_per_batch, left) - (self.in_flight_total - anonymous))
        granted = want if not self.enabled else min(want, room)
        if granted > 0:
            self._add(actor, self.basis(learner_version, weights_version), granted)
            if trusted:
                self.trusted.add(actor)
            else:
                self.anonymous_granted += granted
        return granted

    def expire(self, oldest_basis: int) -> int:
        """Drop the tickets granted at a basis older than `oldest_basis`: their last batch was served,
        so a group made from them would be dropped as stale. Returns how many."""
        gone = 0
        for actor, chunks in list(self.in_flight.items()):
            # Oldest grant first, but a peer's weights_version can make a later grant's basis older.
            old = [i for i, (basis, _) in enumerate(chunks) if basis < oldest_basis]
            used = sum(self._take(chunks, i, chunks[i][1]) for i in reversed(old))
            self._settle(actor, used)
            gone += used
        self.expired += gone
        return gone

    def arrived(self, actor: int, min_version: int) -> None:
        """A new group from `actor` was accepted. It used a ticket granted at a basis no newer than
        its oldest token's version: the newest such (groups finish out of order when an actor runs
        several prompts at once, so the oldest ticket is not always the one used; taking the newest
        that fits errs toward waiting for a group still on its way, never toward forgetting it)."""
        chunks = self.in_flight.get(actor)
        if not chunks:
            return
        fits = [i for i, (basis, _) in enumerate(chunks) if basis <= min_version]
        self._take(chunks, fits[-1] if fits else 0, 1)
        self._settle(actor, 1)

    def reset(self, actor: int, trusted: bool) -> int:
        """The actor (re)connected and resumed: its earlier tickets are void. Returns how many there
        were: positions granted to its previous process and never delivered (they are regenerated).
        Without the actor token, tickets granted with it stay."""
        if not trusted and actor in self.trusted:
            return 0
        return self._use(actor, self.held(actor))
