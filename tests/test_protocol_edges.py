"""The wire protocol at its edges (dph_async/protocol.py): each bound at the value it allows and the
next one, each refusal's words whole, and the rules that relate fields for any input (hypothesis)."""

from __future__ import annotations

import mmap
import re
from types import SimpleNamespace

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from test_protocol import _error, _header, assert_same

from dph_async import protocol as P
from dph_async.tools.bench.transport import synthetic_group


def refusal(msg: P.Message) -> str:
    """What encoding `msg` is refused with."""
    with pytest.raises(P.ProtocolError) as info:
        P.encode(msg)
    assert info.value.kind == "value"
    return str(info.value)


def test_an_error_keeps_its_kind_detail_and_place_and_reads_as_place_then_detail():
    e = P.ProtocolError("size", "too big", "Ack")
    assert (e.args, e.kind, e.detail, e.where, str(e)) == (("size", "too big", "Ack"), "size", "too big", "Ack",
                                                           "Ack: too big")
    bare = P.ProtocolError("frames", "no frames")
    assert (bare.args, str(bare)) == (("frames", "no frames", ""), "no frames")


@given(st.integers(0, 20), st.sets(st.integers(0, 40), max_size=8), st.integers(0, 40))
def test_a_seq_is_accepted_below_the_watermark_or_when_listed_above_it(watermark, above, seq):
    info = P.ResumeInfo(0, watermark, sorted(a for a in above if a > watermark), 0)
    assert info.is_accepted(seq) == (seq < watermark or seq in info.accepted_above)


def test_the_watermark_itself_is_accepted_only_when_listed():
    assert not P.ResumeInfo(0, 5, [7], 0).is_accepted(5)
    assert P.ResumeInfo(0, 5, [7], 0).is_accepted(4) and P.ResumeInfo(0, 5, [7], 0).is_accepted(7)
    assert not P.ResumeInfo(0, 5, [7], 0).is_accepted(6)


def bucket(names=("a", "b"), dtypes=("float32", "bfloat16"), shapes=([2], [3])) -> P.BucketInfo:
    return P.BucketInfo(0, 0, "c", list(names), list(dtypes), [list(s) for s in shapes])


def shm(size: int, offsets: list[int], name: str = f"{P.SHM_PREFIX}{'0' * 32}-1") -> P.ShmSegment:
    return P.ShmSegment(name, "host", size, offsets)


def test_a_bucket_s_lists_must_agree_and_the_error_names_each_length():
    assert refusal(P.WeightsReady(1, [bucket(), bucket(dtypes=["float32"])])) == (
        "WeightsReady: buckets[1]: lengths disagree: 2 names, 1 dtypes, 2 shapes")
    assert refusal(P.WeightsReady(1, [bucket(shapes=[[1]])])) == (
        "WeightsReady: buckets[0]: lengths disagree: 2 names, 2 dtypes, 1 shapes")


@pytest.mark.parametrize(("size", "fits"), [(P.SHM_HEADER_BYTES, True), (P.SHM_HEADER_BYTES - 1, False),
                                            (P.MAX_DIM, True), (P.MAX_DIM + 1, False)])
def test_a_segment_s_size_is_bounded_at_both_ends(size, fits):
    msg = P.WeightsReady(1, [], shm(size, []))
    if fits:
        assert P.decode(P.encode(msg)).shm.size == size
    else:
        assert refusal(msg) == f"WeightsReady: segment size {size} outside [4096, 1099511627776]"


def test_a_segment_not_named_as_ours_is_refused_naming_it():
    assert refusal(P.WeightsReady(1, [], shm(8192, [], "../etc/passwd"))) == (
        "WeightsReady: segment name '../etc/passwd' is not one of ours (dph-weights-<token>-<n>)")


def test_the_tensors_must_be_one_offset_each():
    assert refusal(P.WeightsReady(1, [bucket()], shm(8192, [4096]))) == (
        "WeightsReady: lengths disagree: 1 offsets, 2 tensors")


def test_a_tensor_with_no_elements_fits_anywhere_past_the_header_and_a_negative_dimension_nowhere():
    empty = bucket(names=["e", "f"], dtypes=["float32", "int8"], shapes=[[0, 4], [3]])
    assert P.decode(P.encode(P.WeightsReady(1, [empty], shm(4099, [4096, 4096])))).shm.offsets == [4096, 4096]
    negative = bucket(names=["e", "f"], dtypes=["float32", "int8"], shapes=[[2], [-1, 2]])
    assert refusal(P.WeightsReady(1, [negative], shm(8192, [4096, 4104]))) == (
        "WeightsReady: shm tensor 1: negative dimension in [-1, 2]")


@pytest.mark.parametrize(("bound", "fits"), [(0, True), (-1, False), ((1 << 31) - 1, True), (1 << 31, False)])
def test_set_staleness_takes_a_bound_from_0_to_2_31_minus_1(bound, fits):
    msg = P.Control("set_staleness", token=b"t", max_staleness=bound)
    if fits:
        assert P.decode(P.encode(msg)).max_staleness == bound
    else:
        assert refusal(msg) == f"Control: set_staleness needs a bound in [0, 2^31), got {bound}"


def test_an_unknown_type_is_named_in_its_first_40_characters():
    head, arrays = _header(P.StatsRequest())
    head["t"] = "T" * 100
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, str(e)) == ("type", f"unknown message type '{'T' * 39}")


def test_a_field_error_is_placed_by_the_last_path_in_msgspec_s_message():
    """A value that itself reads like a path (an enum value sent back in the message) does not move
    the place."""
    head, arrays = _header(synthetic_group(1, 2, n=1, tokens=2))
    head["m"]["completions"][0]["reward"]["status"] = "great - at `x"
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, e.where, e.detail) == ("field", "RolloutGroup.completions[0].reward.status",
                                           "Invalid enum value 'great - at `x'")


def test_an_array_spec_reads_little_endian_and_accepts_either_byte_order():
    spec = P.ArraySpec(("int32", "float16"))
    assert spec.wire == {"int32": np.dtype("<i4"), "float16": np.dtype("<f2")}
    assert spec.accepts == {np.dtype("<i4"), np.dtype(">i4"), np.dtype("<f2"), np.dtype(">f2")}


@pytest.mark.parametrize(("wait_s", "fits"), [(0.0, True), (P.MAX_WAIT_S, True), (-0.0, True), (-1e-9, False),
                                              (np.nextafter(P.MAX_WAIT_S, 1e9), False)])
def test_a_wait_is_bounded_at_both_ends(wait_s, fits):
    msg = P.BatchRequest(1, 1, float(wait_s))
    if fits:
        assert P.decode(P.encode(msg)).wait_s == wait_s
    else:
        assert refusal(msg) == f"BatchRequest: wait_s {float(wait_s)} outside [0, 3600]"


def completion(tokens: int, policy_weight: float = 1.0, logprobs: int | None = None) -> P.Completion:
    ids = np.arange(tokens, dtype=np.int32)
    return P.Completion(ids, np.zeros(tokens if logprobs is None else logprobs, np.float32), ids.copy(),
                        P.RewardResult(1.0, True), "stop", policy_weight)


def group(*completions: P.Completion) -> P.RolloutGroup:
    return P.RolloutGroup(1, 2, "p", "d", np.arange(3, dtype=np.int32), list(completions),
                          P.SamplingInfo(1.0, 1.0, -1, 4), 0.0, 0.0)


@pytest.mark.parametrize(("weight", "fits"), [(-8.0, True), (8.0, True), (-8.5, False), (8.5, False),
                                              (float("nan"), False)])
def test_a_policy_weight_is_within_minus_8_and_8(weight, fits):
    msg = group(completion(2), completion(3, weight))
    if fits:
        assert P.decode(P.encode(msg)).completions[1].policy_weight == weight
    else:
        assert refusal(msg) == f"RolloutGroup: completions[1]: policy_weight {weight} outside [-8, 8]"


def test_a_group_and_its_completions_are_refused_in_words_naming_what_is_missing():
    assert refusal(group(completion(1), completion(0))) == "RolloutGroup: completions[1]: completion has no tokens"
    assert refusal(group()) == "RolloutGroup: group has no completions"
    assert refusal(group(completion(2, logprobs=1))) == (
        "RolloutGroup: completions[0]: lengths disagree: 2 token_ids, 1 logprobs, 2 versions")


def reference(tokens: int, logprobs: int | None = None) -> P.ReferenceSample:
    return P.ReferenceSample("r", np.zeros(2, np.int32), np.zeros(tokens, np.int32),
                             np.zeros(tokens if logprobs is None else logprobs, np.float32), 1.0, "pi0")


def test_a_batch_names_the_group_or_reference_sample_it_refuses():
    assert len(P.decode(P.encode(P.Batch(3, [group(completion(1))], [reference(1)], {}))).reference) == 1
    assert refusal(P.Batch(3, [group(completion(1)), group()], [], {})) == (
        "Batch: groups[1]: group has no completions")
    assert refusal(P.Batch(3, [], [reference(1), reference(0)], {})) == (
        "Batch: reference[1]: reference sample has no response tokens")
    assert refusal(P.Batch(3, [], [reference(2, logprobs=3)], {})) == (
        "Batch: reference[0]: lengths disagree: 2 response_ids, 3 ref_logprobs")


@pytest.mark.parametrize("name", ["waited_s", "cycle_s"])
def test_a_batch_s_timings_may_be_exactly_their_limit(name):
    msg = P.Batch(3, [], [], {}, **{name: P.MAX_SECONDS})
    assert getattr(P.decode(P.encode(msg)), name) == P.MAX_SECONDS
    assert refusal(P.Batch(3, [], [], {}, **{name: P.MAX_SECONDS * 1.5})) == (
        f"Batch: {name} {P.MAX_SECONDS * 1.5} outside [0, 1000000000]")


def test_a_weights_bucket_names_the_tensor_or_list_that_does_not_fit():
    a = np.zeros(2, np.float32)
    assert refusal(P.WeightsBucket(1, 0, ["w", "v"], [a, [1.0]], "c")) == (
        "WeightsBucket: arrays[1]: expected a numpy array, got list")
    assert refusal(P.WeightsBucket(1, 0, ["w"], [a, a], "c")) == "WeightsBucket: lengths disagree: 1 names, 2 arrays"
    assert refusal(P.WeightsBucket(1, 0, ["w", "v"], [a, a], "c", ["float32"])) == (
        "WeightsBucket: lengths disagree: 1 dtypes, 2 arrays")


def test_the_frames_are_unsigned_bytes_whatever_the_arrays_layout():
    """A contiguous array is sent as a view of itself, a strided or 0-d one as a contiguous copy."""
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    scalar = np.array(7, dtype=np.int8)
    frames = P.encode(P.WeightsBucket(1, 0, ["a", "b", "c"], [np.arange(3, dtype=np.int16), strided, scalar], "c"))
    assert [f.format for f in frames[1:]] == ["B", "B", "B"]
    assert [bytes(f) for f in frames[1:]] == [np.arange(3, dtype="<i2").tobytes(), strided.tobytes(), b"\x07"]


def test_a_value_no_message_can_carry_is_named_by_its_type():
    with pytest.raises(P.ProtocolError) as info:
        P.encode(P.Batch(0, [], [], {"stale": object()}))
    assert (info.value.kind, str(info.value)) == ("field", "Batch: object is not a protocol type")


def test_a_dtype_tag_or_array_that_cannot_travel_is_named_with_what_can():
    dtypes = "float32, float16, uint16, float64, int64, int32, int16, int8, uint8, bool"
    with pytest.raises(P.ProtocolError) as tag:
        P.storage_dtype("complex64")
    assert (tag.value.kind, str(tag.value)) == (
        "value", f"dtype tag 'complex64' not allowed (allowed: {dtypes}, bfloat16)")
    with pytest.raises(P.ProtocolError) as array:
        P.encode(P.Batch(0, [], [], {"stale": np.zeros(2, np.complex64)}))
    assert (array.value.kind, str(array.value)) == (
        "array", f"Batch: dtype complex64 cannot travel (allowed: {dtypes})")


def two_tensors() -> P.BucketInfo:
    return bucket(names=["a", "b"], dtypes=["float32", "float32"], shapes=[[2], [3]])  # 8 and 12 bytes


@pytest.mark.parametrize(("size", "offsets", "says"), [
    (4116, [4096, 4104], None),  # back to back, the second ending exactly at the segment's end
    (4200, [4096, 4160], None),  # gaps are allowed
    (4115, [4096, 4104], "shm tensor 1: bytes [4104, 4116) outside the segment's [4104, 4115)"),
    (4200, [4096, 4100], "shm tensor 1: bytes [4100, 4112) outside the segment's [4104, 4200)"),  # overlapping
    (4200, [4104, 4096], "shm tensor 1: bytes [4096, 4108) outside the segment's [4112, 4200)"),  # out of order
    (4200, [4092, 4104], "shm tensor 0: bytes [4092, 4100) outside the segment's [4096, 4200)"),  # in the header
    (4200, [4096, 4102], "shm tensor 1: offset 4102 not aligned to its 4-byte items"),
])
def test_each_tensor_lies_past_the_header_in_order_within_the_segment(size, offsets, says):
    msg = P.WeightsReady(1, [two_tensors()], shm(size, offsets))
    if says is None:
        assert P.decode(P.encode(msg)).shm.offsets == offsets
    else:
        tail = " (overlapping, out of order or past its end)" if "outside" in says else ""
        assert refusal(msg) == f"WeightsReady: {says}{tail}"


def test_an_array_of_the_wrong_dimensions_or_dtype_is_named_on_both_sides():
    flat = completion(2)
    flat.token_ids = flat.token_ids.reshape(2, 1)
    assert refusal(group(flat)) == (
        "RolloutGroup: completions[0]: token_ids: expected 1 dimension(s), got shape (2, 1)")
    wide = completion(2)
    wide.versions = wide.versions.astype(np.int64)
    assert refusal(group(wide)) == (
        "RolloutGroup: completions[0]: versions: dtype int64 not allowed (allowed: int32)")
    head, arrays = _header(group(completion(2)))
    head["m"]["completions"][0]["logprobs"] = ["float32", [2, 1], 1]
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, str(e)) == (
        "array", "RolloutGroup.completions[0].logprobs: expected 1 dimension(s), got shape [2, 1]")
    head["m"]["completions"][0]["logprobs"] = ["x" * 60, [2], 1]
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, str(e)) == ("array", f"RolloutGroup.completions[0].logprobs: dtype '{'x' * 40}' not allowed "
                                         "(allowed: float32)")


def test_a_frame_number_one_past_the_last_is_refused_naming_the_field():
    head, arrays = _header(group(completion(2)))
    head["m"]["completions"][0]["versions"] = ["int32", [2], len(arrays)]
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, str(e)) == ("frames", f"RolloutGroup.completions[0].versions: array frame {len(arrays)} "
                                          f"described, but only {len(arrays)} array frames came")


def test_an_array_field_decoded_outside_the_protocol_s_decoder_is_refused():
    """Also right after a message was decoded in the same thread: its frames are not lent on."""
    head, arrays = _header(group(completion(2)))
    P.decode([msgpack.packb(head), *arrays])
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.msgpack.decode(msgpack.packb(head["m"]["completions"][0]), type=P.Completion)
    assert str(info.value) == "an array descriptor outside decoding"


def test_a_message_of_exactly_its_byte_limit_is_decoded_and_one_byte_more_is_not():
    frames = P.encode(group(completion(3)))
    total = sum(memoryview(f).nbytes for f in frames)
    assert P.decode(frames, P.Limits(max_bytes=total)).seq == 2
    e = _error(frames, P.Limits(max_bytes=total - 1))
    assert (e.kind, str(e)) == ("size", f"RolloutGroup of {total} bytes exceeds its limit of {total - 1}")


def test_frames_that_do_not_fit_the_header_are_named_with_the_type():
    frames = P.encode(group(completion(2)))
    e = _error(frames[:-1])
    assert (e.kind, str(e)) == ("frames", f"RolloutGroup: header announces {len(frames) - 1} array frames, "
                                          f"{len(frames) - 2} came")
    e = _error([frames[0], *frames[1:-1], "not bytes"])
    assert e.kind == "frames" and str(e).startswith("a frame is not a byte buffer (")
    with pytest.raises(P.ProtocolError) as info:
        P.encode(P.SamplingInfo(1.0, 1.0, -1, 4))
    assert (info.value.kind, str(info.value)) == ("type", "SamplingInfo is not a protocol message")


def test_a_tensor_of_a_dtype_no_bucket_carries_is_named_with_every_dtype_one_may_have():
    dtypes = "float32, float16, uint16, float64, int64, int32, int16, int8, uint8, bool"
    assert refusal(P.WeightsBucket(1, 0, ["w"], [np.zeros(2, np.complex64)], "c")) == (
        f"WeightsBucket: arrays[0]: dtype complex64 not allowed (allowed: {dtypes})")
    head, arrays = _header(P.WeightsBucket(1, 0, ["w"], [np.zeros(2, np.float32)], "c"))
    head["m"]["arrays"][0][0] = "complex64"
    e = _error([msgpack.packb(head), *arrays])
    assert (e.kind, str(e)) == ("array", f"WeightsBucket.arrays[0]: dtype 'complex64' not allowed (allowed: {dtypes})")


class BufferOnly:
    """A frame whose bytes are reachable only as `.buffer`: pyzmq's cffi Frame before Python 3.12."""

    def __init__(self, data: bytes):
        self.buffer = memoryview(data)


def viewed(data: bytes, dtype: str, rows: int = 0) -> memoryview:
    """`data` in a buffer of another item format (and 2-d with `rows`), as a caller's array may hold it."""
    a = np.frombuffer(data, np.uint8).view(dtype)
    return memoryview(a.reshape(rows, -1) if rows else a)


# How the header and how each array frame is held (the header's length need be no multiple of 2 or 4).
HOLDERS = {
    "bytes": (bytes, bytes), "bytearray": (bytearray, bytearray), "zmq.Frame": (zmq.Frame, zmq.Frame),
    "buffer-only": (BufferOnly, BufferOnly),
    "float32": (lambda b: viewed(b, "uint8", 1), lambda b: viewed(b, "float32")),
    "int16-2d": (lambda b: viewed(b, "uint8"), lambda b: viewed(b, "int16", 2)),
    "uint8-2d": (lambda b: viewed(b, "uint8", 1), lambda b: viewed(b, "uint8", 2)),
}


@pytest.mark.parametrize("holders", HOLDERS.values(), ids=HOLDERS.keys())
def test_a_frame_is_read_as_its_bytes_whatever_holds_them(holders):
    head_as, array_as = holders
    msg = group(completion(4), completion(2))
    head, *arrays = (bytes(f) for f in P.encode(msg))
    assert_same(P.decode([head_as(head), *map(array_as, arrays)]), msg)


def strided(dtype: str, rows: int = 0) -> memoryview:
    """Every other item of a buffer: no contiguous run of bytes."""
    a = np.zeros((rows or 1, 16), dtype)[:, ::2]
    return memoryview(a if rows else a[0])


@pytest.mark.parametrize("at", [0, 1], ids=["header", "array"])
@pytest.mark.parametrize("frame", [strided("float32"), strided("int8"), strided("uint8", 2), strided("uint8"),
                                   memoryview(b"abcdef")[::2]],
                         ids=["float32", "int8", "uint8-2d", "uint8", "bytes"])
def test_a_strided_frame_is_refused_as_no_byte_buffer(at, frame):
    frames = [bytes(f) for f in P.encode(group(completion(2)))]
    frames[at] = frame
    e = _error(frames)
    assert (e.kind, str(e)) == ("frames", "a frame is not a byte buffer (memoryview: casts are restricted to "
                                          "C-contiguous views)")


@pytest.mark.parametrize("frame", [object(), SimpleNamespace(buffer="text")], ids=["object", "a .buffer of text"])
def test_a_header_that_is_no_byte_buffer_is_named(frame):
    e = _error([frame])
    assert e.kind == "frames" and str(e).startswith("a frame is not a byte buffer (memoryview: a bytes-like object")


def released() -> memoryview:
    view = memoryview(b"abcdef")
    view.release()
    return view


def closed_mmap() -> mmap.mmap:
    m = mmap.mmap(-1, 16)
    m.close()
    return m


class _BufferFails:
    @property
    def buffer(self) -> bytes:
        raise RuntimeError("no buffer to give")


@pytest.mark.parametrize("at", [0, 1], ids=["header", "array"])
@pytest.mark.parametrize("frame", [released(), closed_mmap(), np.zeros(4, "datetime64[s]"), _BufferFails()],
                         ids=["released-memoryview", "closed-mmap", "datetime64", "buffer-raises"])
def test_a_frame_whose_buffer_cannot_be_had_is_refused_as_no_byte_buffer(at, frame):
    """memoryview() raises ValueError for a released view, a closed mmap or a numpy dtype with no buffer
    format, and a .buffer may raise anything: each is still a ProtocolError, never the error itself."""
    frames: list = [bytes(f) for f in P.encode(group(completion(2)))]
    frames[at] = frame
    e = _error(frames)
    assert e.kind == "frames" and str(e).startswith("a frame is not a byte buffer (")


def test_an_empty_message_is_refused_in_words():
    e = _error([])
    assert (e.kind, str(e)) == ("frames", "empty message (no frames)")


def test_a_header_alone_of_exactly_its_limits_is_decoded_and_one_byte_more_is_not():
    """A message without arrays is its header: both the header's limit and the message's bind it."""
    frames = P.encode(P.Ack([(1, 2)], "ok"))
    n = len(frames[0])
    assert len(frames) == 1
    for limits in (P.Limits(max_header_bytes=n), P.Limits(max_bytes=n)):
        assert P.decode(frames, limits).group_ids == [(1, 2)]
    e = _error(frames, P.Limits(max_header_bytes=n - 1))
    assert (e.kind, str(e)) == ("size", f"header of {n} bytes exceeds the limit of {n - 1}")
    e = _error(frames, P.Limits(max_bytes=n - 1))
    assert (e.kind, str(e)) == ("size", f"Ack header of {n} bytes exceeds the message's limit of {n - 1}")


def test_exactly_the_limit_of_array_frames_is_decoded_and_one_more_is_not_sent_or_announced():
    msg = P.WeightsBucket(1, 0, ["a", "b", "c"], [np.zeros(1, np.float32)] * 3, "c")
    frames = P.encode(msg)
    assert len(P.decode(frames, P.Limits(max_frames=3)).arrays) == 3
    e = _error(frames, P.Limits(max_frames=2))
    assert (e.kind, str(e)) == ("frames", "3 array frames exceed the limit of 2")
    head, arrays = _header(msg)
    head["n"] = 4  # one more announced than came, which is the limit
    e = _error([msgpack.packb(head), *arrays], P.Limits(max_frames=3))
    assert (e.kind, str(e)) == ("frames", "header announces 4 array frames (allowed: 0 to 3)")


def test_frames_described_by_no_field_are_listed_up_to_ten():
    head, _ = _header(P.ErrorReply("x"))
    head["n"] = 11
    e = _error([msgpack.packb(head), *[b""] * 11])
    assert (e.kind, str(e)) == ("frames", f"ErrorReply: array frame(s) {list(range(10))} described by no field")


def test_fields_with_a_string_not_in_utf_8_are_refused_naming_the_type():
    head, _ = _header(P.ErrorReply("x"))
    frame = msgpack.packb(head).replace(b"\xa1x", b"\xa1\xff")  # the one-byte string "x", its byte not UTF-8
    e = _error([frame])
    # The reason in brackets is msgspec's own words, which its releases reword (0.22: Python's codec
    # message; 0.23: "Invalid UTF-8 encoded string"): the refusal, its kind and the type are ours.
    assert (e.kind, e.where) == ("header", "ErrorReply")
    assert re.fullmatch(r"ErrorReply: fields are not valid msgpack \((?i:.*utf-8.*)\)", str(e)), str(e)


def test_a_decoded_message_whose_fields_do_not_fit_together_is_refused_naming_its_type():
    head, _ = _header(P.Control("set_staleness", max_staleness=3))
    head["m"]["max_staleness"] = -5
    e = _error([msgpack.packb(head)])
    assert (e.kind, e.where, e.detail) == ("value", "Control", "set_staleness needs a bound in [0, 2^31), got -5")
