"""Which group ids were ever accepted, per actor: a watermark plus the seqs accepted above it.

An actor walks its prompt shard in order, so its accepted seqs are almost contiguous: "every seq
below the watermark" plus a small set of stragglers keeps dedup exact in memory proportional to the
gaps, not to the run's length.
"""

from __future__ import annotations


class AcceptedSeqs:
    def __init__(self) -> None:
        self._watermark: dict[int, int] = {}
        self._above: dict[int, set[int]] = {}

    def __contains__(self, group_id: tuple[int, int]) -> bool:
        actor, seq = group_id
        return seq < self._watermark.get(actor, 0) or seq in self._above.get(actor, ())

    def add(self, group_id: tuple[int, int]) -> None:
        actor, seq = group_id
        low = self._watermark.get(actor, 0)
        if seq < low:
            return
        above = self._above.setdefault(actor, set())
        above.add(seq)
        while low in above:
            above.discard(low)
            low += 1
        self._watermark[actor] = low

    def discard(self, group_id: tuple[int, int]) -> None:
        """Forget one accepted seq (a rewound group): it becomes acceptable again."""
        actor, seq = group_id
        low = self._watermark.get(actor, 0)
        above = self._above.setdefault(actor, set())
        if seq < low:
            above.update(range(seq + 1, low))
            self._watermark[actor] = seq
        else:
            above.discard(seq)

    def resume_point(self, actor: int) -> tuple[int, list[int]]:
        """(watermark, sorted seqs accepted above it) for one actor."""
        return self._watermark.get(actor, 0), sorted(self._above.get(actor, ()))

    def to_state(self) -> dict[str, list]:
        actors = sorted(set(self._watermark) | set(self._above))
        return {str(a): [self._watermark.get(a, 0), sorted(self._above.get(a, ()))] for a in actors}

    @classmethod
    def from_state(cls, state: dict[str, list]) -> AcceptedSeqs:
        seqs = cls()
        for actor, (watermark, above) in state.items():
            seqs._watermark[int(actor)] = int(watermark)
            seqs._above[int(actor)] = {int(s) for s in above}
        return seqs
