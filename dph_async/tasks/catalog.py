"""The embedded tasks by name (`task.name`): each makes its train, test, OOD-test and warm-start
problems from a seed. Both share the embedded task's rules, answers, reward and alphabet."""

from __future__ import annotations

from collections.abc import Callable

from dph_async.tasks import digit_sets, embedded
from dph_async.tasks.embedded import Problem

SPLITS: dict[str, Callable[[int, int, int], dict[str, list[Problem]]]] = {
    "embedded": embedded.make_splits,
    "digit_sets": digit_sets.make_splits,
}


def make_splits(name: str, seed: int, num_train: int, num_test: int) -> dict[str, list[Problem]]:
    return SPLITS[name](seed, num_train, num_test)
