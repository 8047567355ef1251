"""Wire protocol: every message type round-trips, and each kind of bad input is named."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import typing
from typing import Annotated, Literal

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dph_async import protocol as P
from dph_async.replay_stats import ReplayStats
from dph_async.tools.bench.transport import synthetic_group
from dph_async.weights_shm import layout

# ---------------------------------------------------------------------------------------------
# Strategies built from the message annotations, so a message type added later is covered too.

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def arrays(spec: P.ArraySpec, length: int | None = None) -> st.SearchStrategy[np.ndarray]:
    shape = (
        st.just((length,))
        if length is not None
        else hnp.array_shapes(
            min_dims=0 if spec.ndim is None else spec.ndim, max_dims=spec.ndim or 3, min_side=0, max_side=6
        )
    )
    return st.sampled_from(spec.dtypes).flatmap(lambda d: hnp.arrays(np.dtype(d), shape))


def strategy(hint, name: str = "", array_specs: dict | None = None) -> st.SearchStrategy:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return strategy(args[0], name, array_specs)
    if hint is P.ArrayRef:
        return arrays(array_specs[name])
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is tuple:
        return st.tuples(*(strategy(a) for a in args))
    if origin is dict:
        return st.dictionaries(strategy(args[0]), strategy(args[1]), max_size=3)
    if isinstance(hint, type) and (issubclass(hint, msgspec.Struct) or dataclasses.is_dataclass(hint)):
        return message(hint)
    if name == "wait_s":
        return st.floats(0, P.MAX_WAIT_S)
    if name in ("waited_s", "cycle_s"):
        return st.floats(0, P.MAX_SECONDS)
    return {
        bool: st.booleans(),
        int: st.integers(0, 2**31 - 1) | st.integers(-(2**63), 2**64 - 1),
        float: st.floats(),
        str: st.text(max_size=12),
        bytes: st.binary(max_size=12),
    }[hint]


def _valid(msg) -> bool:
    try:
        msg.validate()
        return True
    except ValueError:
        return False


@st.composite
def completion(draw, cls=P.Completion):
    t = draw(st.integers(1, 20))
    i32, f32 = P.ArraySpec(("int32",)), P.ArraySpec(("float32",))
    return cls(
        draw(arrays(i32, t)),
        draw(arrays(f32, t)),
        draw(arrays(i32, t)),
        draw(message(P.RewardResult)),
        draw(st.text(max_size=8)),
    )


@st.composite
def reference_sample(draw):
    t = draw(st.integers(1, 20))
    i32, f32 = P.ArraySpec(("int32",)), P.ArraySpec(("float32",))
    return P.ReferenceSample(
        draw(st.text(max_size=8)),
        draw(arrays(i32)),
        draw(arrays(i32, t)),
        draw(arrays(f32, t)),
        draw(st.floats()),
        draw(st.text(max_size=8)),
    )


@st.composite
def bucket_info(draw):
    k = draw(st.integers(0, 3))
    return P.BucketInfo(
        draw(st.integers(0, 100)),
        draw(st.integers(0, 2**40)),
        draw(st.text(max_size=16)),
        draw(st.lists(st.text(max_size=8), min_size=k, max_size=k)),
        draw(st.lists(st.sampled_from(sorted(P.STORAGE_DTYPE)), min_size=k, max_size=k)),
        draw(st.lists(st.lists(st.integers(0, 4096), max_size=3), min_size=k, max_size=k)),
    )


@st.composite
def weights_bucket(draw):
    tags = draw(st.lists(st.sampled_from(sorted(P.STORAGE_DTYPE)), max_size=3))
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)
    arrays_ = [draw(hnp.arrays(P.storage_dtype(tag), shapes)) for tag in tags]
    explicit = draw(st.booleans()) or "bfloat16" in tags
    return P.WeightsBucket(
        draw(st.integers(0, 10**6)),
        draw(st.integers(0, 100)),
        [f"layer.{i}" for i in range(len(tags))],
        arrays_,
        draw(st.text(max_size=16)),
        tags if explicit else [],
    )


@st.composite
def weights_ready(draw):
    """A manifest, with or without a shared-memory segment laid out as the learner lays one out."""
    buckets = draw(st.lists(bucket_info().filter(_valid), max_size=3))
    shm = None
    if draw(st.booleans()):
        sizes = [P.storage_dtype(t).itemsize * math.prod(s)
                 for b in buckets for t, s in zip(b.dtypes, b.shapes, strict=True)]
        offsets, size = layout(sizes)
        token = draw(st.text("0123456789abcdef", min_size=32, max_size=32))
        name = f"{P.SHM_PREFIX}{token}-{draw(st.integers(0, 99))}"
        shm = P.ShmSegment(name, draw(st.text(max_size=40)), size + draw(st.integers(0, 64)), offsets)
    return P.WeightsReady(draw(st.integers(0, 10**6)), buckets, shm)


SPECIAL = {
    P.Completion: completion(),
    P.ReferenceSample: reference_sample(),
    P.BucketInfo: bucket_info(),
    P.WeightsBucket: weights_bucket(),
    P.WeightsReady: weights_ready().filter(_valid),
}


def field_names(cls) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls.__struct_fields__)


def message(cls) -> st.SearchStrategy:
    if cls in SPECIAL:
        return SPECIAL[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = dict(getattr(cls, "ARRAYS", ()))
    fields = {name: strategy(hints[name], name, specs) for name in field_names(cls)}
    built = st.builds(cls, **fields)
    return built.filter(_valid) if hasattr(cls, "validate") else built


def assert_same(a, b, where: str = "msg") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where  # bitwise, so NaN payloads count too
    elif dataclasses.is_dataclass(a) or isinstance(a, msgspec.Struct):
        assert type(a) is type(b), where
        for name in field_names(type(a)):
            assert_same(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b and type(a) is type(b), where


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", P.MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(message(cls))
    frames = P.encode(msg)
    assert isinstance(frames[0], bytes)
    # As received from a socket: separate byte strings.
    back = P.decode([bytes(f) for f in frames])
    assert_same(msg, back)
    assert_same(msg, P.decode(frames))


def test_header_is_described_and_arrays_are_raw_little_endian():
    group = synthetic_group(3, 7, n=2, tokens=5, prompt_tokens=5)
    frames = P.encode(group)
    head = msgpack.unpackb(frames[0])
    assert head["v"] == P.SCHEMA_VERSION and head["t"] == "RolloutGroup" and head["n"] == 7
    assert head["m"]["prompt_ids"] == ["int32", [5], 0]  # [dtype, shape, array frame]
    assert head["m"]["completions"][0]["token_ids"] == ["int32", [5], 1]
    assert len(frames) == 1 + 1 + 2 * 3  # header, prompt, 3 arrays per completion
    assert bytes(frames[2]) == group.completions[0].token_ids.astype("<i4").tobytes()
    back = P.decode(frames)
    assert back.group_id == (3, 7) and back.min_version == 0 and back.num_tokens == 10


def test_big_endian_and_strided_arrays_are_sent_little_endian_and_contiguous():
    group = synthetic_group(0, 0, n=1, tokens=6)
    c = group.completions[0]
    c.token_ids = c.token_ids.astype(">i4")
    c.logprobs = np.repeat(c.logprobs, 2)[::2]
    back = P.decode([bytes(f) for f in P.encode(group)]).completions[0]
    assert back.token_ids.tolist() == c.token_ids.tolist() and back.logprobs.tolist() == c.logprobs.tolist()


def test_bfloat16_travels_as_tagged_uint16():
    bits = np.array([[0x3F80, 0x4000]], dtype=np.uint16)  # 1.0, 2.0 in bfloat16
    back = P.decode(P.encode(P.WeightsBucket(4, 0, ["w"], [bits], "c", ["bfloat16"])))
    assert back.tensor_dtypes == ["bfloat16"] and back.arrays[0].dtype == np.uint16
    assert back.arrays[0].tolist() == bits.tolist()
    with pytest.raises(P.ProtocolError, match="tagged bfloat16 is stored as float32"):
        P.encode(P.WeightsBucket(4, 0, ["w"], [bits.astype(np.float32)], "c", ["bfloat16"]))


def _header(msg) -> tuple[dict, list]:
    frames = P.encode(msg)
    return msgpack.unpackb(frames[0]), frames[1:]


def _decode_with(head: dict, arrays: list):
    return P.decode([msgpack.packb(head), *arrays])


def _error(frames, limits: P.Limits = P.DEFAULT_LIMITS) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frames, limits)
    return info.value


def test_each_problem_is_named():
    head, arrays = _header(synthetic_group(1, 2, n=2, tokens=4))

    def error_after(change) -> P.ProtocolError:
        h = msgpack.unpackb(msgpack.packb(head))  # a deep copy
        a = list(arrays)
        change(h, a)
        return _error([msgpack.packb(h), *a])

    e = error_after(lambda h, a: h.update(v=P.SCHEMA_VERSION + 1))
    assert e.kind == "version" and f"schema version {P.SCHEMA_VERSION + 1} is not supported" in str(e)
    e = error_after(lambda h, a: h.update(t="Nope"))
    assert e.kind == "type" and "'Nope'" in str(e)
    e = error_after(lambda h, a: h["m"].pop("seq"))
    assert e.kind == "field" and str(e) == "RolloutGroup: Object missing required field `seq`"
    e = error_after(lambda h, a: h["m"].update(extra=1))
    assert e.kind == "field" and "unknown field `extra`" in str(e)
    e = error_after(lambda h, a: h["m"].update(seq="7"))
    assert e.kind == "field" and str(e) == "RolloutGroup.seq: Expected `int`, got `str`"
    e = error_after(lambda h, a: h["m"]["completions"][1].update(logprobs=["float64", [4], 5]))
    assert e.kind == "array" and str(e).startswith(
        "RolloutGroup.completions[1].logprobs: dtype 'float64' not allowed"
    )
    e = error_after(lambda h, a: h["m"]["completions"][1].update(versions=["int32", [5], 6]))
    assert e.kind == "array" and "completions[1].versions: frame 6 of 16 bytes" in str(e)
    e = error_after(lambda h, a: h["m"]["completions"][0]["reward"].update(status="great"))
    assert e.kind == "field" and "completions[0].reward.status: Invalid enum value 'great'" in str(e)
    e = error_after(lambda h, a: a.pop())
    assert e.kind == "frames" and "header announces 7 array frames, 6 came" in str(e)
    e = error_after(lambda h, a: a.append(b"\0" * 4))
    assert e.kind == "frames" and "header announces 7 array frames, 8 came" in str(e)
    e = error_after(lambda h, a: h["m"]["completions"][1].update(versions=["int32", [4], 3]))
    assert e.kind == "frames" and "completions[1].versions: array frame 3 described twice" in str(e)
    e = error_after(lambda h, a: h["m"]["completions"][1].update(versions=["int32", [4], 9]))
    assert e.kind == "frames" and "array frame 9 described, but only 7" in str(e)
    e = error_after(lambda h, a: (h.update(n=8), a.append(b"")))
    assert e.kind == "frames" and "array frame(s) [7] described by no field" in str(e)
    e = error_after(
        lambda h, a: (
            h["m"]["completions"][0].update(logprobs=["float32", [3], 2]),
            a.__setitem__(2, b"\0" * 12),
        )
    )
    assert (
        e.kind == "value"
        and "completions[0]: lengths disagree: 4 token_ids, 3 logprobs, 4 versions" in str(e)
    )
    e = error_after(lambda h, a: (h["m"].update(completions=[]), h.update(n=1), a.__delitem__(slice(1, None))))
    assert e.kind == "value" and "group has no completions" in str(e)
    e = error_after(lambda h, a: h["m"].update(completions=[]))  # its array frames left over
    assert e.kind == "frames" and "array frame(s) [1, 2, 3, 4, 5, 6] described by no field" in str(e)
    e = error_after(lambda h, a: h["m"].update(actor_id=-1))
    assert e.kind == "value" and "actor_id -1" in str(e)


def test_malformed_frames_and_sizes():
    assert _error([]).kind == "frames"
    assert _error([b"\xc1"]).kind == "header"  # 0xc1 is never valid msgpack
    assert _error([msgpack.packb([1, 2])]).kind == "header"
    assert _error([msgpack.packb({"v": P.SCHEMA_VERSION, "t": "Ack"})]).kind == "header"
    assert _error(["not bytes"]).kind == "frames"
    frames = P.encode(synthetic_group(0, 0, n=1, tokens=1000))
    e = _error(frames, P.Limits(max_bytes=1000))
    assert e.kind == "size" and "exceeds its limit of 1000" in str(e)
    e = _error(frames, P.Limits(max_header_bytes=10))
    assert e.kind == "size" and "header of" in str(e)
    e = _error(frames, P.Limits(max_frames=2))
    assert e.kind == "frames"
    e = _error(frames, P.Limits(accept=frozenset({P.BatchRequest})))
    assert e.kind == "type" and "RolloutGroup is not served on this endpoint" in str(e)
    # Every type has its own cap: an acknowledgement does not get to be 17 MiB.
    big_ack = P.encode(P.Ack([(0, i) for i in range(10)], "error", "x" * (17 << 20)))
    e = _error(big_ack)
    assert e.kind == "size" and "Ack header of" in str(e)


def test_msgpack_extensions_and_absurd_shapes_are_refused():
    ext = msgpack.packb({"v": P.SCHEMA_VERSION, "t": "StatsRequest", "n": 0, "m": msgpack.ExtType(5, b"x")})
    e = _error([ext])
    assert e.kind == "field" and "got `ext`" in str(e)
    head, arrays = _header(P.WeightsBucket(0, 0, ["w"], [np.zeros(0, np.float32)], "c"))
    head["m"]["arrays"] = [["float32", [0, 2**40, 2**40], 0]]
    e = _error([msgpack.packb(head), *arrays])
    assert e.kind == "array"
    assert "WeightsBucket.arrays[0]: shape [0, 1099511627776, 1099511627776] is too large" in str(e)
    head["m"]["arrays"] = [["float32", [1] * 9, 0]]
    assert "Expected `array` of length <= 8" in str(_error([msgpack.packb(head), *arrays]))


def test_encode_refuses_what_would_not_decode():
    group = synthetic_group(0, 0, n=2, tokens=3)
    group.completions[1].token_ids = group.completions[1].token_ids.astype(np.int64)
    with pytest.raises(
        P.ProtocolError, match=r"RolloutGroup: completions\[1\]: token_ids: dtype int64 not allowed \(allowed: int32\)"
    ):
        P.encode(group)
    with pytest.raises(P.ProtocolError, match="not a protocol message"):
        P.encode(P.SamplingInfo(1.0, 1.0, -1, 4))
    with pytest.raises(P.ProtocolError, match="BatchRequest: wait_s nan"):
        P.encode(P.BatchRequest(0, 1, float("nan")))
    for bad in (float("nan"), -0.5, float("inf")):  # a duration the learner would steer eta by
        with pytest.raises(P.ProtocolError, match=re.escape(f"Batch: cycle_s {bad} outside")):
            P.encode(P.Batch(0, [], [], {}, cycle_s=bad))
    with pytest.raises(P.ProtocolError, match=re.escape("Batch: waited_s -1.0 outside")):
        P.encode(P.Batch(0, [], [], {}, waited_s=-1.0))


def test_nothing_is_unpickled(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the protocol must never unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    # numpy's own unpickling path too (object arrays), which np.load would take
    monkeypatch.setattr(np.lib.format, "read_array", refuse)
    for msg in (synthetic_group(0, 1), P.Stats(ReplayStats(drops={"stale": 1})), P.Ack([(0, 1)], "ok")):
        assert_same(msg, P.decode([bytes(f) for f in P.encode(msg)]))
    # A pickle where an array frame belongs is refused as an array, never loaded.
    frames = [bytes(f) for f in P.encode(synthetic_group(0, 1))]
    frames[1] = pickle.dumps(np.zeros(len(frames[1]) // 4, np.int32))
    with pytest.raises(P.ProtocolError):
        P.decode(frames)


def test_decoded_arrays_are_views_of_the_frames():
    frames = [bytes(f) for f in P.encode(synthetic_group(0, 0, n=1, tokens=64))]
    back = P.decode(frames)
    assert not back.completions[0].token_ids.flags.owndata  # no copy on receipt
    assert not back.completions[0].token_ids.flags.writeable


def test_a_control_command_an_older_peer_knows_is_sent_as_it_reads_it():
    """Control leaves default fields out: a snapshot command carries no set_staleness bound, so a peer
    of the schema before that command reads it unchanged; set_staleness carries its bound."""
    fields = lambda msg: msgpack.unpackb(P.encode(msg)[0])["m"]  # noqa: E731
    assert fields(P.Control("snapshot", "ckpt/v3", 3, b"t")) == {"command": "snapshot", "path": "ckpt/v3",
                                                                 "version": 3, "token": b"t"}
    assert fields(P.Control("set_staleness", token=b"t", max_staleness=4)) == {
        "command": "set_staleness", "token": b"t", "max_staleness": 4}
    with pytest.raises(P.ProtocolError, match="set_staleness needs a bound"):
        P.encode(P.Control("set_staleness", token=b"t"))


# (message at its bounds, field, the lowest and the highest value it may hold)
REQUEST_BOUNDS = [
    (P.TicketRequest(1, 1), "actor_id", 0, P.MAX_ACTOR_ID),
    (P.TicketRequest(1, 1), "want", 0, P.MAX_COUNT),
    (P.TicketRequest(1, 1), "outstanding", 0, P.MAX_COUNT),
    (P.TicketRequest(1, 1), "weights_version", -1, P.MAX_VERSION),
    (P.ResumeRequest(1), "actor_id", 0, P.MAX_ACTOR_ID),
    (P.BatchRequest(1, 1, 0.0), "version", 0, P.MAX_VERSION),
    (P.BatchRequest(1, 1, 0.0), "num_groups", 0, P.MAX_COUNT),
    (P.BatchRequest(1, 1, 0.0), "request_id", 0, P.MAX_SEQ),
    (P.Control("snapshot", "x"), "version", -1, P.MAX_VERSION),
    (P.WeightsQuery(1, 1), "actor_id", 0, P.MAX_ACTOR_ID),
    (P.WeightsQuery(1, 1), "have_version", -1, P.MAX_VERSION),
    (P.WeightsRequest(1, 1), "version", 0, P.MAX_VERSION),
    (P.WeightsRequest(1, 1), "bucket", 0, P.MAX_COUNT),
    (synthetic_group(1, 2, n=1, tokens=1), "actor_id", 0, P.MAX_ACTOR_ID),
    (synthetic_group(1, 2, n=1, tokens=1), "seq", 0, P.MAX_SEQ),
]


@pytest.mark.parametrize(("msg", "name", "lo", "hi"), REQUEST_BOUNDS,
                         ids=[f"{type(m).__name__}.{n}" for m, n, _, _ in REQUEST_BOUNDS])
def test_every_integer_a_request_carries_is_bounded_at_both_ends(msg, name, lo, hi):
    """Before the bounds, TicketRequest(want=2**64 - 1) under replay.admission=false was granted, and
    the replay died encoding its next Stats. Each bound holds at the sender and at the receiver."""
    head, arrays = _header(msg)
    for fits in (lo, hi):
        head["m"][name] = fits
        assert getattr(_decode_with(head, arrays), name) == fits
    for past in (lo - 1, hi + 1, 2**64 - 1):
        head["m"][name] = past
        e = _error([msgpack.packb(head), *arrays])
        assert e.kind == "value" and f"{name} {past} outside [{lo}, {hi}]" in str(e)
        with pytest.raises(P.ProtocolError, match=f"{name} {past} outside"):
            P.encode(msgspec.structs.replace(msg, **{name: past}) if isinstance(msg, msgspec.Struct) else msg)
