"""The embedded tasks by name (`task.name`): each makes its train, test, OOD-test and warm-start
problems from a seed. Both share the embedded task's rules, answers, reward and alphabet."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from dph_async.tasks import digit_sets, embedded
from dph_async.tasks.embedded import Problem

SPLITS: dict[str, Callable[[int, int, int], dict[str, list[Problem]]]] = {
    "embedded": embedded.make_splits,
    "digit_sets": digit_sets.make_splits,
}


def make_splits(name: str, seed: int, num_train: int, num_test: int,
                ood_warm_share: float = 1.0) -> dict[str, list[Problem]]:
    """The task's splits; with `ood_warm_share` < 1 the warm start keeps only that share of its
    out-of-domain problems (a seeded choice), so pi_0 learns the OOD rule partly and OOD results can
    show forgetting and keeping alike (at 1, pi_0 is at ceiling there)."""
    splits = SPLITS[name](seed, num_train, num_test)
    if ood_warm_share < 1.0:
        warm = splits["warmstart"]
        ood = [i for i, p in enumerate(warm) if p.op == "-"]
        kept = set(random.Random(seed + 1).sample(ood, math.ceil(ood_warm_share * len(ood))))
        splits["warmstart"] = [p for i, p in enumerate(warm) if p.op != "-" or i in kept]
    return splits
