"""The embedded tasks by name (`task.name`): each makes its train, test, OOD-test and warm-start
problems from a seed. embedded and digit_sets share the embedded task's rules, answers, reward and
alphabet; stride (dph_async/tasks/stride.py) counts in steps, with long-tailed answer lengths."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, Protocol

from dph_async.tasks import digit_sets, embedded, stride


class TaskProblem(Protocol):
    """What the pipeline (data files), the warm start and the OOD share read of a problem."""

    @property
    def prompt(self) -> str: ...
    @property
    def data_source(self) -> str: ...
    @property
    def ground_truth(self) -> dict[str, Any]: ...
    @property
    def out_of_domain(self) -> bool: ...
    def solutions(self) -> list[str]: ...
    def wrong_answer(self, rng: random.Random) -> str: ...


SPLITS: dict[str, Callable[[int, int, int], dict[str, list[Any]]]] = {
    "embedded": embedded.make_splits,
    "digit_sets": digit_sets.make_splits,
    "stride": stride.make_splits,
}
# The characters of each task's prompts and answers: the tiny model's tokenizer, one token each.
ALPHABETS = {"embedded": embedded.ALPHABET, "digit_sets": embedded.ALPHABET, "stride": stride.ALPHABET}
# The longest prompt and answer in characters (= tokens), where a task's answers outgrow the defaults.
LONGEST = {"stride": (stride.MAX_PROMPT_CHARS, stride.MAX_ANSWER_CHARS)}


def make_splits(name: str, seed: int, num_train: int, num_test: int,
                ood_warm_share: float = 1.0) -> dict[str, list[TaskProblem]]:
    """The task's splits; with `ood_warm_share` < 1 the warm start keeps only that share of its
    out-of-domain problems (a seeded choice), so pi_0 learns the OOD rule partly and OOD results can
    show forgetting and keeping alike (at 1, pi_0 of the digit tasks is at ceiling there)."""
    splits = SPLITS[name](seed, num_train, num_test)
    if ood_warm_share < 1.0:
        warm = splits["warmstart"]
        ood = [i for i, p in enumerate(warm) if p.out_of_domain]
        kept = set(random.Random(seed + 1).sample(ood, math.ceil(ood_warm_share * len(ood))))
        splits["warmstart"] = [p for i, p in enumerate(warm) if not p.out_of_domain or i in kept]
    return splits


def fits(name: str, max_tokens: int, max_model_len: int) -> str | None:
    """Why the task's longest answer (and EOS) does not fit `max_tokens`, or its longest prompt (and
    BOS) the room `max_model_len` leaves beside `max_tokens`; None when both fit. A cut answer scores 0
    whatever the policy, and a prompt without room is refused only once the run has started."""
    if name not in LONGEST:
        return None
    prompt, answer = LONGEST[name]
    need_tokens, room = answer + 1, prompt + 1
    if max_tokens >= need_tokens and max_model_len - max_tokens >= room:
        return None
    return (f"task.name={name} has answers of up to {answer} characters and prompts of up to {prompt}: it needs "
            f"sampling.max_tokens >= {need_tokens} and model.max_model_len >= sampling.max_tokens + {room} (got "
            f"{max_tokens} and {max_model_len}); add sampling.max_tokens={need_tokens} "
            f"model.max_model_len={need_tokens + room}")
