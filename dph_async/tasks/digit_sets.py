"""The digit-sets task: the embedded task's rules on seven-digit sets, every set in every split.

    prompt  "1245789+23="   answer "5+9+2+7" or "4+8+9+2" or ...   (in-domain: a sum of 2+ distinct given digits)
    prompt  "1245789-3="    answer "4-1" or "5-2" or ...            (out-of-domain: a difference of two)

The same rules, answers and reward as the embedded task (dph_async/tasks/embedded.py), on the 36 sets
of seven distinct digits 1-9 instead of the 126 sets of five. Each set's sum targets are dealt to
test, train and warm start in turn, and its difference targets to the OOD test and warm start, so
every set has prompts in every split: the training prompts pi_0 always solves (D_pef) and those it
rarely solves share their digit set, and their answers share partial sums. docs/ablations.md
(Divergence frontier, the digit-sets task) says why.
"""

from __future__ import annotations

import random

from dph_async.tasks.embedded import Problem, digit_sets, problems_of

SET_SIZE = 7


def _dealt(rng: random.Random, per_set: list[list[Problem]]) -> list[Problem]:
    """The problems of all sets, each set's shuffled, in rounds: one problem of every set (the sets in
    a fresh random order each round), then the next. Any prefix holds every set about equally."""
    for problems in per_set:
        rng.shuffle(problems)
    out = []
    for i in range(max(map(len, per_set))):
        round_ = [problems[i] for problems in per_set if i < len(problems)]
        rng.shuffle(round_)
        out += round_
    return out


def make_splits(seed: int, num_train: int, num_test: int) -> dict[str, list[Problem]]:
    """Disjoint train / test / OOD-test / warm-start problem sets, all from `seed`, each drawing from
    every digit set about equally. RL trains on `train` (sum rule only); the warm start sees the
    sums and differences no other split took."""
    rng = random.Random(seed)
    sets = digit_sets(SET_SIZE)
    sums = _dealt(rng, [problems_of(d, "+") for d in sets])
    diffs = _dealt(rng, [problems_of(d, "-") for d in sets])
    if num_train + num_test > len(sums) or num_test > len(diffs):
        raise ValueError(f"task.num_train + task.num_test must be <= {len(sums)} and task.num_test <= {len(diffs)} "
                         "for the digit_sets task")
    test, train = sums[:num_test], sums[num_test:num_test + num_train]
    warm = sums[num_test + num_train:] + diffs[num_test:]
    rng.shuffle(warm)
    return {"train": train, "test": test, "ood_test": diffs[:num_test], "warmstart": warm}
