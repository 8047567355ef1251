"""The fresh store: accepted groups until they are used up or too old, handed out whole.

Each group is in one of three places: `unserved` (never in a batch), `pending` (in the batch the
learner has not yet confirmed) or `reusable` (served fewer than max_reuse times). The two queues are
heaps ordered by the group's oldest token version, then arrival: the batch takes the oldest usable
groups first, which is also the order in which they would expire, so expiry pops from the same heap
front. Heaps are lazy: an item whose group moved on is skipped when it surfaces.

A group is charged what it costs held (`resident_cost`), not its array bytes: a completion of one
token is 12 bytes of arrays and about 900 bytes of objects. To make that cost the same whatever the
group came from, `add` compacts it: each of its completions' arrays becomes a view of one array per
field, the prompt a copy, so it keeps no received frame, log segment or Arrow table alive.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from dph_async.protocol import RolloutGroup

GroupId = tuple[int, int]
Place = Literal["unserved", "reusable", "pending"]
COMPLETION_FIELDS = ("token_ids", "logprobs", "versions")
# Bytes a held group costs beyond its arrays' data and its strings (sys.getsizeof each): per
# completion its struct, reward and three array views; per group its struct, sampling, lists, prompt
# array and the three joined arrays. Measured as RSS growth over a socket into the store: ~730 and
# ~1,650 bytes (tracemalloc sees ~600 and ~1,400); tests/test_replay_budget.py holds the model to it.
COMPLETION_OVERHEAD = 768
GROUP_OVERHEAD = 2048


def resident_cost(group: RolloutGroup) -> int:
    """What `group` costs in memory once the store holds it (compacted): what the budgets charge."""
    text = sum(sys.getsizeof(c.finish_reason) + sys.getsizeof(c.reward.status) + sys.getsizeof(c.reward.detail)
               for c in group.completions)
    names = sys.getsizeof(group.prompt_id) + sys.getsizeof(group.data_source)
    return GROUP_OVERHEAD + len(group.completions) * COMPLETION_OVERHEAD + group.nbytes + text + names


def compact(group: RolloutGroup) -> None:
    """Each completion's arrays as views of one array per field of the group, the prompt a copy."""
    comps = group.completions
    lengths = [len(c.token_ids) for c in comps]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    for name in COMPLETION_FIELDS:
        joined = np.concatenate([getattr(c, name) for c in comps])
        for c, start, end in zip(comps, starts.tolist(), ends.tolist(), strict=True):
            setattr(c, name, joined[start:end])
    group.prompt_ids = group.prompt_ids.copy()


@dataclass(eq=False)
class Entry:
    group: RolloutGroup
    min_version: int
    max_version: int
    tokens: int
    cost: int  # resident_cost
    served: int = 0
    place: Place = "unserved"
    push: int = 0  # which heap push is current; older heap items for this group are stale


class FreshStore:
    def __init__(self) -> None:
        self._entries: dict[GroupId, Entry] = {}
        self._heaps: dict[Place, list[tuple[int, int, GroupId]]] = {"unserved": [], "reusable": []}
        self._counts: dict[Place, int] = {"unserved": 0, "reusable": 0, "pending": 0}
        self._pushes = 0
        self.samples = 0
        self.tokens = 0
        self.cost = 0  # resident bytes of the held groups

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, group_id: GroupId) -> bool:
        return group_id in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def count(self, place: Place) -> int:
        return self._counts[place]

    def add(self, group: RolloutGroup, served: int = 0, pending: bool = False) -> Entry:
        """Hold a new group, compacted (its arrays are replaced by equal ones). served and pending
        restore a snapshot's reusable and pending groups."""
        compact(group)
        entry = Entry(group, group.min_version, group.max_version, group.num_tokens, resident_cost(group), served,
                      "pending")
        self._entries[group.group_id] = entry
        self._counts["pending"] += 1
        if not pending:
            self._enqueue(entry, "reusable" if served else "unserved")
        self.samples += len(group.completions)
        self.tokens += entry.tokens
        self.cost += entry.cost
        return entry

    def _enqueue(self, entry: Entry, place: Place) -> None:
        self._counts[entry.place] -= 1
        self._counts[place] += 1
        entry.place = place
        self._pushes += 1
        entry.push = self._pushes
        heapq.heappush(self._heaps[place], (entry.min_version, entry.push, entry.group.group_id))

    def _front(self, place: Place) -> Entry | None:
        """The entry at the front of a queue (left in the heap); stale items on the way are dropped."""
        heap = self._heaps[place]
        while heap:
            _, push, gid = heap[0]
            entry = self._entries.get(gid)
            if entry is not None and entry.place == place and entry.push == push:
                return entry
            heapq.heappop(heap)
        return None

    def _pop(self, place: Place) -> Entry | None:
        entry = self._front(place)
        if entry is not None:
            heapq.heappop(self._heaps[place])
        return entry

    def unserved_up_to(self, version: int) -> int:
        """How many unserved groups have tokens as old as `version` or older."""
        return sum(1 for e in self._entries.values() if e.place == "unserved" and e.min_version <= version)

    def take(self, n: int, reuse: bool) -> list[Entry]:
        """Up to n groups, unserved ones first (then reusable ones if `reuse`), now pending."""
        taken: list[Entry] = []
        for place in ("unserved", "reusable") if reuse else ("unserved",):
            while len(taken) < n and (entry := self._pop(place)) is not None:
                self._to_pending(entry)
                taken.append(entry)
        return taken

    def expire(self, oldest_version: int) -> list[Entry]:
        """Remove and return the queued groups whose oldest token version is below `oldest_version`."""
        expired = []
        for place in ("unserved", "reusable"):
            while (front := self._front(place)) is not None and front.min_version < oldest_version:
                self._pop(place)
                expired.append(self.remove(front.group.group_id))
        return expired

    def release(self, entry: Entry, max_reuse: int) -> bool:
        """A pending group's batch was confirmed: count the use; returns True if it is used up."""
        entry.served += 1
        if entry.served >= max_reuse:
            self.remove(entry.group.group_id)
            return True
        self._enqueue(entry, "reusable")
        return False

    def claim(self, group_id: GroupId) -> Entry | None:
        """Move a held group to pending (replaying a logged batch); None if it is not held."""
        entry = self._entries.get(group_id)
        if entry is not None and entry.place != "pending":
            self._to_pending(entry)
        return entry

    def _to_pending(self, entry: Entry) -> None:
        """Out of its queue (its heap item goes stale) and into the pending batch."""
        self._counts[entry.place] -= 1
        self._counts["pending"] += 1
        entry.place = "pending"

    def get(self, group_id: GroupId) -> Entry | None:
        return self._entries.get(group_id)

    def remove(self, group_id: GroupId) -> Entry:
        entry = self._entries.pop(group_id)
        self._counts[entry.place] -= 1
        self.samples -= len(entry.group.completions)
        self.tokens -= entry.tokens
        self.cost -= entry.cost
        return entry
