"""The wire protocol at its edges (dph_async/protocol.py): each bound at the value it allows and the
next one, each refusal's words whole, and the rules that relate fields for any input (hypothesis)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_protocol import _error, _header

from dph_async import protocol as P
from dph_async.app.bench.transport import synthetic_group


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
