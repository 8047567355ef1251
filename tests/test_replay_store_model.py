"""The fresh store against a plain model of it: every operation in random order, and after each the
same groups in the same places, served in the same order, with the same samples, tokens and cost; and
the cost a group is charged moves by exactly the size of each string it carries (replay/store.py)."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dph_async.replay.store import FreshStore, resident_cost
from dph_async.tools.bench.transport import synthetic_group


def _group(seq: int, versions: list[int], tokens: int):
    g = synthetic_group(0, seq, n=len(versions), tokens=tokens)
    for c, v in zip(g.completions, versions, strict=True):
        c.versions = np.full(tokens, v, np.int32)
    return g


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(1, 4),
              st.booleans(), st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50), st.integers(1, 3)),
    st.tuples(st.just("expire"), st.integers(0, 7)),
    st.tuples(st.just("claim"), st.integers(0, 50)),
    st.tuples(st.just("remove"), st.integers(0, 50)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
# equal oldest versions are served in arrival order, also once a group is queued again after a claim
@example([("add", [2], 1, False, False), ("add", [2, 5], 1, False, False), ("add", [3], 1, True, False),
          ("add", [2], 1, True, False), ("take", 2, False), ("release", 1, 3), ("claim", 0),
          ("release", 0, 3), ("take", 4, True)])
def test_the_store_holds_serves_and_counts_what_a_plain_model_does(ops):
    store = FreshStore()
    model: dict[tuple[int, int], dict] = {}  # gid -> place, served, min version, order, sizes
    order = 0
    for op in ops:
        held = sorted(model)
        if op[0] == "add":
            _, versions, tokens, served, pending = op
            g = _group(10**6 - order, versions, tokens)  # ids fall as groups arrive: ties go by arrival, not id
            order += 1
            store.add(g, served=int(served), pending=pending)
            model[g.group_id] = {"place": "pending" if pending else ("reusable" if served else "unserved"),
                                 "served": int(served), "min": min(versions), "order": order,
                                 "samples": len(versions), "tokens": g.num_tokens, "cost": resident_cost(g)}
        elif op[0] == "take":
            _, n, reuse = op
            want = []
            for place in ("unserved", "reusable") if reuse else ("unserved",):
                queue = sorted((m["min"], m["order"], gid) for gid, m in model.items() if m["place"] == place)
                want += [gid for *_, gid in queue][: n - len(want)]
            got = [e.group.group_id for e in store.take(n, reuse)]
            assert got == want
            for gid in got:
                model[gid]["place"] = "pending"
        elif op[0] == "release":
            pending = [gid for gid in held if model[gid]["place"] == "pending"]
            if pending:
                gid, max_reuse = pending[op[1] % len(pending)], op[2]
                used_up = store.release(store.get(gid), max_reuse)
                model[gid]["served"] += 1
                assert used_up == (model[gid]["served"] >= max_reuse)
                if used_up:
                    del model[gid]
                else:
                    order += 1
                    model[gid].update(place="reusable", order=order)
        elif op[0] == "expire":
            gone = {e.group.group_id for e in store.expire(op[1])}
            want = {gid for gid, m in model.items() if m["place"] != "pending" and m["min"] < op[1]}
            assert gone == want
            for gid in gone:
                del model[gid]
        elif op[0] == "claim" and held:
            gid = held[op[1] % len(held)]
            assert store.claim(gid) is store.get(gid)
            model[gid]["place"] = "pending"
        elif op[0] == "remove" and held:
            gid = held[op[1] % len(held)]
            assert store.remove(gid).group.group_id == gid and store.get(gid) is None
            del model[gid]
        assert len(store) == len(model) and set(model) == {e.group.group_id for e in store}
        for place in ("unserved", "reusable", "pending"):
            assert store.count(place) == sum(m["place"] == place for m in model.values())
        for key in ("samples", "tokens", "cost"):
            assert getattr(store, key) == sum(m[key] for m in model.values())
    assert store.claim((99, 99)) is None


def test_the_cost_moves_by_exactly_each_strings_size():
    """A peer's strings are held as sent: each one is charged as Python holds it."""
    base = synthetic_group(0, 1, n=3, tokens=4)
    cost = resident_cost(base)
    long = "x" * 10_000
    for change in (lambda g: setattr(g, "prompt_id", long), lambda g: setattr(g, "data_source", long),
                   lambda g: setattr(g.completions[1], "finish_reason", long),
                   lambda g: setattr(g.completions[1], "reward", dataclasses.replace(g.completions[1].reward,
                                                                                     status=long)),
                   lambda g: setattr(g.completions[1], "reward", dataclasses.replace(g.completions[1].reward,
                                                                                     detail=long))):
        g = synthetic_group(0, 1, n=3, tokens=4)
        before = {"prompt_id": g.prompt_id, "data_source": g.data_source,
                  "finish_reason": g.completions[1].finish_reason, "status": g.completions[1].reward.status,
                  "detail": g.completions[1].reward.detail}
        change(g)
        after = {"prompt_id": g.prompt_id, "data_source": g.data_source,
                 "finish_reason": g.completions[1].finish_reason, "status": g.completions[1].reward.status,
                 "detail": g.completions[1].reward.detail}
        (key,) = [k for k in before if before[k] != after[k]]
        assert resident_cost(g) - cost == sys.getsizeof(after[key]) - sys.getsizeof(before[key]) > 9_000
