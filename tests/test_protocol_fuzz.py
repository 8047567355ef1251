"""Fuzzing the decoder: random and mutated frames produce ProtocolError or a valid message, nothing else."""

from __future__ import annotations

import random

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocol import assert_same

from dph_async import protocol as P
from dph_async.replay_stats import ReplayStats
from dph_async.tools.bench.transport import synthetic_group

REF = P.ReferenceSample(
    "r", np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32), np.zeros(2, np.float32), 1.0, "s"
)
TENSORS = [np.ones((2, 3), np.float32), np.zeros(4, np.uint16)]
SEEDS = [
    synthetic_group(1, 5, n=3, tokens=7),
    P.Batch(3, [synthetic_group(0, 1, n=2, tokens=3)], [REF], {"stale": 1}, 9),
    P.Ack([(0, 1), (2, 3)], "duplicate"),
    P.TicketRequest(0, 4, 1, 2, 0.5),
    P.ResumeInfo(0, 10, [12, 15], 3),
    P.BatchRequest(4, 16, 1.0, 77, b"token"),
    P.WeightsBucket(2, 0, ["a", "b"], TENSORS, "x", ["float32", "bfloat16"]),
    P.WeightsReady(2, [P.BucketInfo(0, 24, "x", ["a"], ["float32"], [[2, 3]])]),
    P.WeightsReady(2, [P.BucketInfo(0, 24, "x", ["a"], ["float32"], [[2, 3]])],
                   P.ShmSegment(f"{P.SHM_PREFIX}{'0' * 32}-0", "host/boot", 4096 + 24, [4096])),
    P.Stats(ReplayStats(version=3, drops={"stale": 2}, staleness_hist={0: 5, 1: 2})),
    P.Control("snapshot", "checkpoints/v3/replay", 3, b"token"),
    P.ErrorReply("nope", "header"),
]
SEED_FRAMES = [[bytes(f) for f in P.encode(m)] for m in SEEDS]


def check(frames) -> None:
    """The decoder's whole contract: a message or a ProtocolError (any other exception fails the test)."""
    try:
        msg = P.decode(frames)
    except P.ProtocolError as e:
        assert e.kind in {"frames", "size", "header", "version", "type", "field", "array", "value"}
        assert str(e)
        return
    assert isinstance(msg, P.MESSAGE_TYPES)


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "bigint", "neg", "float", "str", "bytes", "none", "bool", "ref", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:9])
    return {
        "int": lambda: rng.randint(0, 100),
        "bigint": lambda: rng.choice([2**63 - 1, 2**64 - 1, -(2**63), 2**40]),
        "neg": lambda: -rng.randint(1, 10),
        "float": lambda: rng.choice([0.5, float("nan"), float("inf"), -1e300]),
        "str": lambda: rng.choice(["", "int32", "float64", "bfloat16", "Ack", "x" * 50]),
        "bytes": lambda: b"\x00\xff",
        "none": lambda: None,
        "bool": lambda: rng.random() < 0.5,
        "list": lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "ref": lambda: [rng.choice(["int32", "float32", "uint16"]), [rng.randint(0, 9)], rng.randint(-1, 9)],
        "dict": lambda: {
            rng.choice(["v", "t", "m", "n", "seq", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))
        },
    }[kind]()


def mutate_tree(tree, rng: random.Random):
    """Replace, delete or add one node somewhere in a decoded header."""
    path = []
    node = tree
    while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return random_value(rng)
    parent, key = path[-1]
    action = rng.random()
    if action < 0.6:
        parent[key] = random_value(rng)
    elif action < 0.8:
        del parent[key]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "v", 1])] = random_value(rng)
    else:
        parent.insert(key, random_value(rng))
    return tree


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(8)
    i = rng.randrange(len(frames))
    if op == 0:  # flip bytes
        b = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    elif op == 1:  # truncate
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op == 2:  # extend
        frames[i] = frames[i] + bytes(rng.randrange(1, 9))
    elif op == 3:  # drop a frame
        del frames[i]
    elif op == 4:  # duplicate a frame
        frames.insert(i, frames[i])
    elif op == 5:  # swap two frames
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    else:  # a structurally plausible header with one node changed
        try:
            tree = msgpack.unpackb(frames[0], strict_map_key=False)
        except Exception:  # an earlier mutation already broke the header
            return frames
        frames[0] = msgpack.packb(mutate_tree(tree, rng))
    return frames


def test_thousands_of_mutations():
    rng = random.Random(1234)
    for _ in range(6000):
        frames = rng.choice(SEED_FRAMES)
        for _ in range(rng.randint(1, 3)):
            if frames:
                frames = mutate(frames, rng)
        check(frames)


def test_every_valid_seed_decodes():
    for msg, frames in zip(SEEDS, SEED_FRAMES, strict=True):
        assert_same(msg, P.decode(frames))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames(frames):
    check(frames)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(range(len(SEED_FRAMES))),
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers().filter(lambda i: -(2**63) <= i < 2**64)
        | st.floats()
        | st.text(max_size=10)
        | st.binary(max_size=10),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    ),
)
def test_random_header_bodies(seed, body):
    """Any msgpack value as the fields of a real message type, with that message's array frames."""
    frames = SEED_FRAMES[seed]
    head = msgpack.unpackb(frames[0], strict_map_key=False)
    check([msgpack.packb({"v": P.SCHEMA_VERSION, "t": head["t"], "n": head["n"], "m": body}), *frames[1:]])
