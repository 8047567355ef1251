"""The digit-sets task (dph_async/tasks/digit_sets.py): its generator against brute force over the
digit sets, the shared reward on seven-digit answers, and its selection by `task.name`."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import get_args

import pytest

from dph_async.config import ConfigError, TaskConfig, load_config
from dph_async.paths import RunPaths
from dph_async.pipeline.stages import StageTimer, prepare_embedded
from dph_async.rewards.registry import get_reward_fn
from dph_async.tasks import digit_sets
from dph_async.tasks.catalog import SPLITS
from dph_async.tasks.dataset import read_rows
from dph_async.tasks.embedded import IN_DOMAIN, OUT_OF_DOMAIN, check

SEVEN = ["".join(c) for c in itertools.combinations("123456789", 7)]


def brute_force_targets(digits: str, op: str) -> set[int]:
    ds = [int(c) for c in digits]
    if op == "-":
        return {a - b for a in ds for b in ds if a > b}
    return {sum(s) for r in range(2, len(ds) + 1) for s in itertools.combinations(ds, r)}


@pytest.fixture(scope="module")
def splits():
    return digit_sets.make_splits(random.randrange(1000), 400, 100)


def test_splits_are_disjoint_and_cover_every_problem_of_the_seven_digit_sets(splits):
    everything = {(d, t, op) for d in SEVEN for op in "+-" for t in brute_force_targets(d, op)}
    keys = {name: [(p.digits, p.target, p.op) for p in ps] for name, ps in splits.items()}
    assert {name: len(k) for name, k in keys.items()} == {"train": 400, "test": 100, "ood_test": 100,
                                                          "warmstart": len(everything) - 600}
    assert sum(len(set(k)) for k in keys.values()) == len(everything)  # no problem twice
    assert set().union(*map(set, keys.values())) == everything
    assert {op for _, _, op in keys["train"] + keys["test"]} == {"+"} and {op for *_, op in keys["ood_test"]} == {"-"}
    assert {op for *_, op in keys["warmstart"]} == {"+", "-"}


def test_every_digit_set_is_in_every_split_about_equally(splits):
    for name, lo, hi in (("test", 2, 3), ("train", 10, 12), ("ood_test", 2, 3)):
        counts = Counter(p.digits for p in splits[name])
        assert set(counts) == set(SEVEN), name
        assert lo <= min(counts.values()) and max(counts.values()) <= hi, (name, counts)
    assert {p.digits for p in splits["warmstart"] if p.op == "+"} == set(SEVEN)


def test_splits_depend_on_the_seed_only():
    a, b, c = digit_sets.make_splits(5, 40, 20), digit_sets.make_splits(5, 40, 20), digit_sets.make_splits(6, 40, 20)
    assert a == b and a["train"] != c["train"]


def test_too_many_prompts_are_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"task\.num_train"):
        digit_sets.make_splits(0, 1100, 100)


def test_solutions_are_exactly_the_answers_the_verifier_accepts(splits):
    """On sampled problems of both rules: every listed solution verifies, and every well-formed
    answer over the set's digits (all orders, all lengths) verifies iff it is listed."""
    rng = random.Random(0)
    for p in rng.sample(splits["train"], 6) + rng.sample(splits["ood_test"], 6):
        listed = set(p.solutions())
        assert listed, p
        lengths = (2,) if p.op == "-" else range(2, 8)
        for r in lengths:
            for terms in itertools.permutations(p.digits, r):
                answer = p.op.join(terms)
                assert check(answer, p.digits, p.target, p.op) == (True, answer in listed), answer


@pytest.mark.parametrize(("answer", "correct", "format_ok"), [
    ("9+8+7+5+4+2+1", True, True),  # all seven digits: 36
    ("1+2+4+5+7+8+9", True, True),
    ("9+9+9+9", False, True),  # 36, but a digit used twice
    ("9+8+7+6+5+1", False, True),  # 6 is not in the set
    ("9+8+7+5+4+2", False, True),  # 35
    ("36", False, False),
    (" 9+8+7+5+4+2+1 ", True, True),
])
def test_the_shared_reward_scores_seven_digit_answers(answer, correct, format_ok):
    res = get_reward_fn(IN_DOMAIN)(answer, {"digits": "1245789", "target": 36, "op": "+"}, {})
    assert (res.correct, res.format_ok, res.score) == (correct, format_ok, float(correct))
    ood = get_reward_fn(OUT_OF_DOMAIN)("9-1", {"digits": "1245789", "target": 8, "op": "-"}, {})
    assert ood.correct


def test_task_name_lists_exactly_the_catalog():
    assert set(get_args(TaskConfig.model_fields["name"].annotation)) == set(SPLITS)


def test_task_name_does_not_apply_to_user_data():
    with pytest.raises(ConfigError, match=r"task\.name"):
        load_config("default", ["task.name=digit_sets", "task.data=train.parquet"])


def test_task_name_selects_the_datasets_a_run_writes(tmp_path: Path):
    cfg = load_config("default", ["task.name=digit_sets", "task.num_train=40", "task.num_test=20",
                                  "warmstart.steps=0", f"output_dir={tmp_path}"])
    files = prepare_embedded(cfg, RunPaths(tmp_path), StageTimer())
    want = digit_sets.make_splits(cfg.seed, 40, 20)
    for name in ("train", "test", "ood_test"):
        rows = read_rows(files[name])
        assert [r.messages[-1]["content"] for r in rows] == [p.prompt for p in want[name]]
        assert [r.ground_truth for r in rows] == [p.ground_truth for p in want[name]]
    assert json.loads((tmp_path / "base_model" / "config.json").read_text())["vocab_size"] == 16


@pytest.mark.parametrize("name", ["embedded", "digit_sets"])
def test_the_warm_start_can_keep_a_share_of_the_ood_rule(name):
    """Below 1, the warm start keeps that share of its OOD problems (rounded up) and every in-domain
    one, in order; the test splits do not change, and the same seed keeps the same problems."""
    from dph_async.tasks.catalog import make_splits

    seed = random.randrange(1000)
    full = make_splits(name, seed, 200, 50)
    part = make_splits(name, seed, 200, 50, ood_warm_share=0.1)
    ood_full = [p for p in full["warmstart"] if p.op == "-"]
    ood_part = [p for p in part["warmstart"] if p.op == "-"]
    assert len(ood_part) == math.ceil(0.1 * len(ood_full)) > 0
    assert [p for p in part["warmstart"] if p.op == "+"] == [p for p in full["warmstart"] if p.op == "+"]
    assert set(ood_part) < set(ood_full)
    assert [p for p in full["warmstart"] if p in set(part["warmstart"])] == part["warmstart"]  # order kept
    assert all(part[k] == full[k] for k in ("train", "test", "ood_test"))
    assert make_splits(name, seed, 200, 50, ood_warm_share=0.1) == part
