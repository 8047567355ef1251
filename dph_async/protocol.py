"""The wire protocol: typed messages, each one ZeroMQ multipart message.

    frame 0   msgpack header {"v": SCHEMA_VERSION, "t": <message type>, "n": <array frames>, "m": <fields>}
    frame 1.. the numeric arrays as raw little-endian bytes

Messages are msgspec Structs: msgspec encodes their fields and decodes a header straight into the
typed class, checking each field's type as it reads it. In the header an array field is its
descriptor [dtype, shape, frame] (`ArrayRef`); its bytes are array frame number `frame`. Decoding
swaps each descriptor for a read-only numpy view of its frame (no copy; arrays never pass through
msgpack).

Decoding trusts nothing and builds nothing it has not checked, in this order:
  1. sizes from the frame lengths alone: the header against `Limits.max_header_bytes`;
  2. the envelope (v, t, n) with the fields kept as raw bytes (skipped over, not built);
  3. the schema version, the message type (one the endpoint accepts), n against `Limits.max_frames`
     and the frames that came, the whole message against its byte cap;
  4. the fields, into the type's Struct: containers against their length limits before they are
     built, dtypes against each array field's whitelist, shapes against frame lengths, every frame
     described exactly once;
  5. `validate()`: what relates fields (lengths that agree, ranges).
Anything wrong is a `ProtocolError` naming where and what. Nothing is ever unpickled; msgpack
extension types are refused. docs/data_plane.md is the prose version of this file.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from dph_async.replay_stats import ReplayStats
from dph_async.rewards.result import RewardResult

# Bump on any change to a message's fields: peers with another version are refused, not misread.
# 2: Control.version. 3: msgspec codec; frame count n in the header, arrays name their frame;
#    BatchRequest.token and Control.token; Stats carries ReplayStats.
# 4: Completion.policy_weight (which distribution sampled it: the DPO samplers).
# 5: WeightsReady.shm (the version's shared-memory segment on the learner's host).
# 6: ReplayStats.gate_restarts.
# 7: ReplayStats.gate_memory_mb and gate_memory_needed_mb.
# 8: TicketRequest.token and ResumeRequest.token; ReplayStats.tickets.expired and .anonymous.
SCHEMA_VERSION = 8

MiB = 1 << 20


class ProtocolError(ValueError):
    """A message could not be encoded or decoded. `kind` is a short category for metrics
    (frames, size, header, version, type, field, array, value); str() names the place and problem."""

    def __init__(self, kind: str, detail: str, where: str = ""):
        super().__init__(kind, detail, where)
        self.kind = kind
        self.detail = detail
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail


# ---------------------------------------------------------------------------------------------
# Arrays and limits.


@dataclass(frozen=True)
class ArraySpec:
    """What an array field may hold: its dtypes and number of dimensions (None: any)."""

    dtypes: tuple[str, ...]
    ndim: int | None = 1
    # Lookups for the hot paths: wire dtype by name (decoding), and the dtypes an array may have in
    # Python, either byte order (encoding).
    wire: dict[str, np.dtype] = field(init=False, repr=False, compare=False)
    accepts: frozenset[np.dtype] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        wire = {name: np.dtype(name).newbyteorder("<") for name in self.dtypes}
        object.__setattr__(self, "wire", wire)
        object.__setattr__(self, "accepts", frozenset(wire.values()) | {d.newbyteorder(">") for d in wire.values()})


# Storage dtypes a weights tensor may have. numpy has no bfloat16: such tensors travel as their raw
# uint16 bits, tagged "bfloat16" in the message's dtype list.
TENSOR_DTYPES = ("float32", "float16", "uint16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
STORAGE_DTYPE = {name: name for name in TENSOR_DTYPES} | {"bfloat16": "uint16"}
INT32 = ArraySpec(("int32",))
FLOAT32 = ArraySpec(("float32",))
TENSOR = ArraySpec(TENSOR_DTYPES, None)

MAX_NDIM = 8
MAX_DIM = 1 << 40
# Container limits, checked from a container's length prefix before anything in it is built.
MAX_COMPLETIONS = 4096  # completions in one rollout group
MAX_ITEMS = 1 << 22  # any other list in a header (ids, groups, tensors of a bucket)
MAX_TOKEN_BYTES = 256  # a control or actor token
# Upper bounds on the integers a request carries (docs/data_plane.md, "Bounds"), checked by validate():
# what a peer sends is stored, summed and sent on, and must stay far inside int64 there.
MAX_ACTOR_ID = (1 << 31) - 1
MAX_VERSION = (1 << 31) - 1  # versions travel per token as int32
MAX_SEQ = (1 << 62) - 1  # a shard position, and a batch request id
MAX_COUNT = MAX_ITEMS  # tickets wanted or held, groups asked for, a bucket's index
MAX_PATH = 4096  # a snapshot name
# A shared-memory segment's name: this prefix, the writer's random token, a counter. Nothing else is
# ever opened, so a manifest cannot name another file (no '/', no '..', nobody else's prefix).
SHM_PREFIX = "dph-weights-"
SHM_NAME = re.compile(r"dph-weights-[0-9a-f]{32}-[0-9]{1,12}")
# A segment starts with a header (magic, the version it holds); tensors start past it.
SHM_HEADER_BYTES = 4096

_NAMES = {np.dtype(name): name for name in TENSOR_DTYPES}


class ArrayRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """An array in the header: dtype, shape, and the number of the array frame holding its bytes."""

    dtype: str
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]], msgspec.Meta(max_length=MAX_NDIM)]
    frame: Annotated[int, msgspec.Meta(ge=0)]


# The type of an array field. In Python the field holds a numpy array; in the header, its ArrayRef,
# which is what msgspec decodes the field as (the class's __post_init__ then swaps in the array).
Array = ArrayRef


def storage_dtype(tag: str) -> np.dtype:
    """The numpy dtype that carries a tensor of dtype `tag` ("bfloat16" -> uint16)."""
    if tag not in STORAGE_DTYPE:
        raise ProtocolError("value", f"dtype tag {tag!r} not allowed (allowed: {', '.join(STORAGE_DTYPE)})")
    return np.dtype(STORAGE_DTYPE[tag])


MAX_WAIT_S = 3600.0
# A duration a message reports (not a wait it asks for): finite, not negative, under 30 years.
MAX_SECONDS = 1e9


def _check_wait(wait_s: float) -> None:
    if not 0 <= wait_s <= MAX_WAIT_S:  # NaN fails too
        raise ValueError(f"wait_s {wait_s} outside [0, {MAX_WAIT_S:.0f}]")


def _within(lo: int, hi: int, **values: int) -> None:
    for name, v in values.items():
        if not lo <= v <= hi:
            raise ValueError(f"{name} {v} outside [{lo}, {hi}]")


def _disagree(**lengths: int) -> str:
    return "lengths disagree: " + ", ".join(f"{n} {name}" for name, n in lengths.items())


def _check_array(name: str, a: Any, spec: ArraySpec) -> None:
    """Encoding: the value of an array field must be an array the receiver will accept."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype not in spec.accepts:
        raise ValueError(f"{name}: dtype {a.dtype.name} not allowed (allowed: {', '.join(spec.dtypes)})")
    if spec.ndim is not None and a.ndim != spec.ndim:
        raise ValueError(f"{name}: expected {spec.ndim} dimension(s), got shape {a.shape}")


class _Frames(threading.local):
    """The array frames of the message being encoded or decoded in this thread."""

    out: list[memoryview] | None = None  # encoding: frames so far
    bufs: Sequence[memoryview] | None = None  # decoding: the frames that came
    used: bytearray = bytearray()
    kind: str = ""  # decoding: the ProtocolError kind of the failure being raised
    field: str = ""  # and the array field it is in (msgspec's path ends at the struct)


_frames = _Frames()


def _fail(kind: str, name: str, detail: str) -> ValueError:
    """An error raised inside msgspec's decoding (which adds where it happened); kind and field go aside."""
    _frames.kind, _frames.field = kind, name
    return ValueError(detail)


def _take(ref: ArrayRef, spec: ArraySpec, name: str) -> np.ndarray:
    """Decoding: the array `ref` describes, a read-only view of its frame."""
    dtype, shape, i = spec.wire.get(ref.dtype), ref.shape, ref.frame
    if dtype is None:
        raise _fail("array", name, f"dtype {ref.dtype[:40]!r} not allowed (allowed: {', '.join(spec.dtypes)})")
    if spec.ndim is not None and len(shape) != spec.ndim:
        raise _fail("array", name, f"expected {spec.ndim} dimension(s), got shape {shape}")
    frames = _frames
    bufs, used = frames.bufs, frames.used
    if bufs is None:
        raise _fail("array", name, "an array descriptor outside decoding")
    if i >= len(bufs):
        raise _fail("frames", name, f"array frame {i} described, but only {len(bufs)} array frames came")
    if used[i]:
        raise _fail("frames", name, f"array frame {i} described twice")
    used[i] = 1
    buf = bufs[i]
    count = shape[0] if len(shape) == 1 else math.prod(shape)
    if buf.nbytes != count * dtype.itemsize:
        raise _fail("array", name, f"frame {i} of {buf.nbytes} bytes does not hold a {ref.dtype}{shape} array")
    array = np.frombuffer(buf, dtype=dtype)
    if len(shape) == 1:
        return array
    try:
        return array.reshape(ref.shape)
    except ValueError:  # an empty array whose other dimensions multiply past numpy's limit
        raise _fail("array", name, f"shape {shape} is too large") from None


def _swap_arrays(msg: Any) -> None:
    """__post_init__ of a class with array fields: after decoding, each ArrayRef becomes its array."""
    for name, spec in msg.ARRAYS:
        ref = getattr(msg, name)
        if type(ref) is ArrayRef:
            setattr(msg, name, _take(ref, spec, name))


def _check_arrays(msg: Any) -> None:
    for name, spec in msg.ARRAYS:
        _check_array(name, getattr(msg, name), spec)


class _Struct(msgspec.Struct, forbid_unknown_fields=True):
    """Every struct of the protocol: a field the class does not declare is an error."""


class Message(_Struct):
    """A message type. MAX_BYTES caps a whole message of the type (header and array frames)."""

    MAX_BYTES: ClassVar[int] = MiB

    def validate(self) -> None:
        """Raise ValueError if the fields do not fit together (their types are the decoder's job)."""


def _validate_each(name: str, items: Sequence[Any]) -> None:
    for i, item in enumerate(items):
        try:
            item.validate()
        except ValueError as e:
            raise ValueError(f"{name}[{i}]: {e}") from None


# ---------------------------------------------------------------------------------------------
# Messages. Decoded arrays are read-only views of the received frames.


class SamplingInfo(_Struct):
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int


class Completion(_Struct, eq=False):
    """One sampled response. token_ids include the end-of-sequence token when one was generated;
    logprobs are the behaviour log-probs of the distribution actually sampled; versions[i] is the
    policy version of the weights that produced token i. policy_weight says which distribution
    sampled it: softmax((a z_theta + (1 - a) z_ref) / temperature) with a = policy_weight, z_theta
    the logits of those weights and z_ref those of the frozen reference pi_0 (1: the policy itself,
    0: pi_ref; the `mixp` sampler uses 1.5 and 0.5)."""

    ARRAYS: ClassVar = (("token_ids", INT32), ("logprobs", FLOAT32), ("versions", INT32))

    token_ids: Array
    logprobs: Array
    versions: Array
    reward: RewardResult
    finish_reason: str
    policy_weight: float = 1.0

    __post_init__ = _swap_arrays

    def validate(self) -> None:
        _check_arrays(self)
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("completion has no tokens")
        if not -8.0 <= self.policy_weight <= 8.0:  # NaN fails too
            raise ValueError(f"policy_weight {self.policy_weight} outside [-8, 8]")
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(_disagree(token_ids=n, logprobs=len(self.logprobs), versions=len(self.versions)))


class RolloutGroup(Message, eq=False):
    """The n completions of one prompt (a GRPO group, never split). Its id is (actor_id, seq), where
    seq is the actor's position in its prompt shard: a restarted actor that regenerates an already
    accepted position produces a duplicate, which the replay drops."""

    MAX_BYTES: ClassVar[int] = 256 * MiB
    ARRAYS: ClassVar = (("prompt_ids", INT32),)

    actor_id: int
    seq: int
    prompt_id: str
    data_source: str
    prompt_ids: Array
    completions: Annotated[list[Completion], msgspec.Meta(max_length=MAX_COMPLETIONS)]
    sampling: SamplingInfo
    created_at: float
    finished_at: float

    __post_init__ = _swap_arrays

    @property
    def group_id(self) -> tuple[int, int]:
        return (self.actor_id, self.seq)

    @property
    def min_version(self) -> int:
        """The oldest policy version among the group's tokens: what its staleness is measured from."""
        return min(int(c.versions.min()) for c in self.completions)

    @property
    def max_version(self) -> int:
        return max(int(c.versions.max()) for c in self.completions)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def nbytes(self) -> int:
        arrays = [self.prompt_ids] + [a for c in self.completions for a in (c.token_ids, c.logprobs, c.versions)]
        return sum(a.nbytes for a in arrays)

    def validate(self) -> None:
        _check_arrays(self)
        _within(0, MAX_ACTOR_ID, actor_id=self.actor_id)
        _within(0, MAX_SEQ, seq=self.seq)
        if not self.completions:
            raise ValueError("group has no completions")
        _validate_each("completions", self.completions)


class ReferenceSample(_Struct, eq=False):
    """A preserved D_pef sample with the per-token log-probs of the base policy pi_0."""

    ARRAYS: ClassVar = (("prompt_ids", INT32), ("response_ids", INT32), ("ref_logprobs", FLOAT32))

    sample_id: str
    prompt_ids: Array
    response_ids: Array
    ref_logprobs: Array
    reward: float
    source: str

    __post_init__ = _swap_arrays

    def validate(self) -> None:
        _check_arrays(self)
        if len(self.response_ids) == 0:
            raise ValueError("reference sample has no response tokens")
        if len(self.ref_logprobs) != len(self.response_ids):
            raise ValueError(_disagree(response_ids=len(self.response_ids), ref_logprobs=len(self.ref_logprobs)))


AckStatus = Literal["ok", "duplicate", "error", "retry"]
GroupIds = Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_ITEMS)]


class Ack(Message):
    """The replay's answer to rollout groups: "ok" (logged, will be served), "duplicate" (already
    accepted earlier; the sender may forget it), "error" (refused for good; `error` says why) or
    "retry" (a budget is full now: send it again later; `error` names the budget). An error ack with
    no ids answers a message that was refused before it could be read."""

    MAX_BYTES: ClassVar[int] = 16 * MiB

    group_ids: GroupIds
    status: AckStatus
    error: str = ""


Token = Annotated[bytes, msgspec.Meta(max_length=MAX_TOKEN_BYTES)]


class TicketRequest(Message):
    """An actor asks for up to `want` admission tickets (one per prompt it may start).

    outstanding: tickets it holds that have not yet become sent groups. The replay keeps its own
        record of what it granted each actor and takes this only to lower that record (an actor that
        lost tickets gives them back), never to raise it.
    weights_version: the policy version the actor generates with (-1: unknown); tickets are sized so
        its groups are still fresh when consumed.
    wait_s: how long the replay may hold the request waiting for capacity before granting what it can.
    token: the run's actor token (without CURVE): a request without it is served from what is left
        once one batch of tickets is kept for the run's own actors (docs/data_plane.md, Admission).
    """

    actor_id: int
    want: int
    outstanding: int = 0
    weights_version: int = -1
    wait_s: float = 0.0
    token: Token = b""

    def validate(self) -> None:
        _within(0, MAX_ACTOR_ID, actor_id=self.actor_id)
        _within(0, MAX_COUNT, want=self.want, outstanding=self.outstanding)
        _within(-1, MAX_VERSION, weights_version=self.weights_version)
        _check_wait(self.wait_s)


class TicketGrant(Message):
    actor_id: int
    granted: int
    learner_version: int


class ResumeRequest(Message):
    """A (re)started actor asks which of its shard positions are already accepted. It also tells the
    replay that the actor's earlier tickets are void (tickets granted with the actor token only by a
    request that carries it)."""

    actor_id: int
    token: Token = b""

    def validate(self) -> None:
        _within(0, MAX_ACTOR_ID, actor_id=self.actor_id)


class ResumeInfo(Message):
    """Every seq < watermark is accepted, and so is every seq in accepted_above (all > watermark)."""

    MAX_BYTES: ClassVar[int] = 256 * MiB

    actor_id: int
    watermark: int
    accepted_above: Annotated[list[int], msgspec.Meta(max_length=MAX_ITEMS)]
    learner_version: int

    def is_accepted(self, seq: int) -> bool:
        return seq < self.watermark or seq in self.accepted_above


class BatchRequest(Message):
    """The learner, at `version` (optimizer steps applied), asks for `num_groups` fresh groups.

    The replay answers within about wait_s with what satisfies the staleness bound (maybe fewer or
    none). request_id > 0 makes the request idempotent: asking again with the same id returns the same
    batch (a lost reply is retried without losing or repeating groups); a new id tells the replay the
    previous batch arrived. 0 means no retry protection. token: the control token (without CURVE).
    """

    version: int
    num_groups: int
    wait_s: float
    request_id: int = 0
    token: Token = b""

    def validate(self) -> None:
        _within(0, MAX_VERSION, version=self.version)
        _within(0, MAX_COUNT, num_groups=self.num_groups)
        _within(0, MAX_SEQ, request_id=self.request_id)
        _check_wait(self.wait_s)


class Batch(Message, eq=False):
    """Fresh groups plus reference samples for one learner step. drops: groups dropped (by reason)
    since the previous batch, so the learner can log them with this step. waited_s: how long the
    replay held the request for want of groups; cycle_s: the time from its previous answer to this
    request (the learner's step as the replay saw it). Together they say what fraction of its time the
    learner spent waiting for data, the signal that raises replay.max_staleness=auto."""

    MAX_BYTES: ClassVar[int] = 64 * 1024 * MiB

    version: int
    groups: Annotated[list[RolloutGroup], msgspec.Meta(max_length=MAX_ITEMS)]
    reference: Annotated[list[ReferenceSample], msgspec.Meta(max_length=MAX_ITEMS)]
    drops: dict[str, int]
    request_id: int = 0
    waited_s: float = 0.0
    cycle_s: float = 0.0

    @property
    def num_samples(self) -> int:
        return sum(len(g.completions) for g in self.groups)

    @property
    def data_wait(self) -> float:
        """The fraction of the learner's time between batches spent waiting for this one's groups."""
        total = self.waited_s + self.cycle_s
        return self.waited_s / total if total > 0 else 0.0

    def validate(self) -> None:
        _validate_each("groups", self.groups)
        _validate_each("reference", self.reference)
        for name, seconds in (("waited_s", self.waited_s), ("cycle_s", self.cycle_s)):
            if not 0 <= seconds <= MAX_SECONDS:  # NaN fails too
                raise ValueError(f"{name} {seconds} outside [0, {MAX_SECONDS:.0f}]")


class WeightsQuery(Message):
    actor_id: int
    have_version: int

    def validate(self) -> None:
        _within(0, MAX_ACTOR_ID, actor_id=self.actor_id)
        _within(-1, MAX_VERSION, have_version=self.have_version)


Names = Annotated[list[str], msgspec.Meta(max_length=MAX_ITEMS)]


class BucketInfo(_Struct):
    """One bucket of a weights version: which tensors, their dtype tags and shapes, and a checksum."""

    index: int
    nbytes: int
    checksum: str
    names: Names
    dtypes: Names
    shapes: Annotated[list[Annotated[list[int], msgspec.Meta(max_length=MAX_NDIM)]], msgspec.Meta(max_length=MAX_ITEMS)]

    def validate(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(_disagree(names=len(self.names), dtypes=len(self.dtypes), shapes=len(self.shapes)))
        for tag in self.dtypes:
            storage_dtype(tag)


class ShmSegment(_Struct):
    """Where a version's tensors lie in shared memory on the learner's host: the file `name` under
    /dev/shm, of `size` bytes, on the host `host` (hostname, boot id, network namespace); tensor i
    (in the order of the buckets' names) starts at byte offsets[i]. Dtypes, shapes and checksums are the buckets'."""

    name: Annotated[str, msgspec.Meta(max_length=64)]
    host: Annotated[str, msgspec.Meta(max_length=512)]
    size: int
    offsets: Annotated[list[int], msgspec.Meta(max_length=MAX_ITEMS)]

    def validate(self) -> None:
        if not SHM_NAME.fullmatch(self.name):
            raise ValueError(f"segment name {self.name!r} is not one of ours ({SHM_PREFIX}<token>-<n>)")
        if not SHM_HEADER_BYTES <= self.size <= MAX_DIM:
            raise ValueError(f"segment size {self.size} outside [{SHM_HEADER_BYTES}, {MAX_DIM}]")


class WeightsReady(Message):
    MAX_BYTES: ClassVar[int] = 256 * MiB

    version: int
    buckets: Annotated[list[BucketInfo], msgspec.Meta(max_length=MAX_ITEMS)]
    shm: ShmSegment | None = None

    def validate(self) -> None:
        _validate_each("buckets", self.buckets)
        if self.shm is not None:
            self._validate_shm(self.shm)

    def _validate_shm(self, shm: ShmSegment) -> None:
        """Every tensor inside the segment, past its header, in order and without overlap: what a
        reader checks before it maps anything."""
        shm.validate()
        tags = [(tag, shape) for b in self.buckets for tag, shape in zip(b.dtypes, b.shapes, strict=True)]
        if len(shm.offsets) != len(tags):
            raise ValueError(_disagree(offsets=len(shm.offsets), tensors=len(tags)))
        end = SHM_HEADER_BYTES
        for i, (offset, (tag, shape)) in enumerate(zip(shm.offsets, tags, strict=True)):
            if any(d < 0 for d in shape):
                raise ValueError(f"shm tensor {i}: negative dimension in {shape}")
            itemsize = storage_dtype(tag).itemsize
            nbytes = itemsize * math.prod(shape)
            if offset % itemsize:
                raise ValueError(f"shm tensor {i}: offset {offset} not aligned to its {itemsize}-byte items")
            if offset < end or offset + nbytes > shm.size:
                raise ValueError(f"shm tensor {i}: bytes [{offset}, {offset + nbytes}) outside the segment's "
                                 f"[{end}, {shm.size}) (overlapping, out of order or past its end)")
            end = offset + nbytes


class WeightsRequest(Message):
    version: int
    bucket: int

    def validate(self) -> None:
        _within(0, MAX_VERSION, version=self.version)
        _within(0, MAX_COUNT, bucket=self.bucket)


class WeightsBucket(Message, eq=False):
    """The tensors of one bucket, one frame each. dtypes tags each array ("bfloat16" for uint16
    bits); empty means each array's own numpy dtype."""

    MAX_BYTES: ClassVar[int] = 64 * 1024 * MiB

    version: int
    index: int
    names: Names
    arrays: Annotated[list[Array], msgspec.Meta(max_length=MAX_ITEMS)]
    checksum: str
    dtypes: Names = []

    def __post_init__(self) -> None:
        arrays = self.arrays
        self.arrays = [_take(a, TENSOR, f"arrays[{i}]") if type(a) is ArrayRef else a for i, a in enumerate(arrays)]

    @property
    def tensor_dtypes(self) -> list[str]:
        return self.dtypes or [a.dtype.name for a in self.arrays]

    def validate(self) -> None:
        for i, a in enumerate(self.arrays):
            _check_array(f"arrays[{i}]", a, TENSOR)
        if len(self.names) != len(self.arrays):
            raise ValueError(_disagree(names=len(self.names), arrays=len(self.arrays)))
        if self.dtypes and len(self.dtypes) != len(self.arrays):
            raise ValueError(_disagree(dtypes=len(self.dtypes), arrays=len(self.arrays)))
        for name, tag, array in zip(self.names, self.tensor_dtypes, self.arrays, strict=True):
            if storage_dtype(tag) != array.dtype.newbyteorder("="):
                raise ValueError(f"tensor {name!r} tagged {tag} is stored as {array.dtype.name}")


class StatsRequest(Message):
    pass


class Stats(Message):
    MAX_BYTES: ClassVar[int] = 64 * MiB

    replay: ReplayStats


ControlCommand = Literal["snapshot", "restore", "shutdown", "set_staleness"]


class Control(Message, omit_defaults=True):
    """A command for the replay, obeyed only from the control identity (the CURVE control key, or
    without CURVE `token`). path: a snapshot's name relative to the replay's data directory.
    Fields left at their defaults are not sent, so a command a peer of schema 7 knows reads the same
    there (set_staleness and its field came without a new schema version: such a peer refuses the
    command by name)."""

    command: ControlCommand
    path: Annotated[str, msgspec.Meta(max_length=MAX_PATH)] = ""
    # snapshot: the learner's version (optimizer steps applied) at the checkpoint; -1 if unknown.
    version: int = -1
    token: Token = b""
    # set_staleness: the new bound eta (replay.max_staleness=auto only, within its limits).
    max_staleness: int = -1

    def validate(self) -> None:
        _within(-1, MAX_VERSION, version=self.version)
        if self.command == "set_staleness" and not 0 <= self.max_staleness < 1 << 31:
            raise ValueError(f"set_staleness needs a bound in [0, 2^31), got {self.max_staleness}")


class ControlReply(Message):
    ok: bool
    detail: str = ""


class ErrorReply(Message):
    """The answer to a request that was refused; kind is the ProtocolError kind when decoding failed."""

    error: str
    kind: str = ""


MESSAGE_TYPES: tuple[type[Message], ...] = (
    RolloutGroup, Ack, TicketRequest, TicketGrant, ResumeRequest, ResumeInfo, BatchRequest, Batch,
    WeightsQuery, WeightsReady, WeightsRequest, WeightsBucket, StatsRequest, Stats, Control,
    ControlReply, ErrorReply,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Encoding and decoding.


def _enc_hook(obj: Any) -> Any:
    """What msgspec cannot encode itself: arrays (to a frame and a descriptor) and numpy scalars."""
    if isinstance(obj, np.ndarray):
        name = _NAMES.get(obj.dtype)
        if name is None and obj.dtype.byteorder == ">":
            obj = obj.astype(obj.dtype.newbyteorder("<"))
            name = _NAMES.get(obj.dtype)
        if name is None:
            raise ProtocolError("array", f"dtype {obj.dtype.name} cannot travel (allowed: {', '.join(TENSOR_DTYPES)})")
        try:
            view = memoryview(obj).cast("B")
        except TypeError:  # not C-contiguous, or 0-d
            view = memoryview(np.ascontiguousarray(obj).reshape(-1)).cast("B")
        out = _frames.out
        assert out is not None
        out.append(view)
        return (name, obj.shape, len(out) - 1)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not a protocol type")


class _Envelope(msgspec.Struct):
    v: int
    t: str
    m: msgspec.Raw
    n: int = -1


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_BY_NAME = {cls.__name__: cls for cls in MESSAGE_TYPES}
_DECODERS = {cls: msgspec.msgpack.Decoder(cls) for cls in MESSAGE_TYPES}


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts: the whole message's bytes (each type's MAX_BYTES caps it too; the
    smaller applies), the header's bytes, the number of array frames, and which message types
    (None: all)."""

    max_bytes: int = 64 * 1024 * MiB
    max_header_bytes: int = 64 * MiB
    max_frames: int = 1 << 20
    accept: frozenset[type] | None = None


DEFAULT_LIMITS = Limits()


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for `socket.send_multipart(frames, copy=False)`: the header, then one frame per array
    (views of the arrays, not copies). Raises ProtocolError if `msg` does not fit its schema."""
    cls = type(msg)
    name = cls.__name__
    if _BY_NAME.get(name) is not cls:
        raise ProtocolError("type", f"{name} is not a protocol message")
    try:
        msg.validate()
    except ValueError as e:
        raise ProtocolError("value", str(e), name) from None
    _frames.out = out = []
    try:
        body = _ENCODER.encode(msg)
    except ProtocolError as e:
        raise ProtocolError(e.kind, e.detail, name) from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError("field", str(e), name) from None
    finally:
        _frames.out = None
    return [_ENCODER.encode(_Envelope(SCHEMA_VERSION, name, msgspec.Raw(body), len(out))), *out]


def _bytes_view(frame: Any) -> memoryview:
    """A flat byte view of a frame (zmq.Frame, bytes, memoryview), without copying. ProtocolError for
    anything else: no buffer (TypeError), a strided one (cast takes only C-contiguous views), one that
    cannot be had (ValueError: a released view, a closed mmap, a numpy dtype with no buffer format),
    or a .buffer that raises. A zmq.Frame's bytes are its .buffer."""
    try:
        return memoryview(getattr(frame, "buffer", frame)).cast("B")
    except Exception as e:  # whatever the frame raises, decode raises ProtocolError only
        raise ProtocolError("frames", f"a frame is not a byte buffer ({e})") from None


def _brief(value: object) -> str:
    return repr(value)[:40] if isinstance(value, (int, str)) else f"a {type(value).__name__}"


@dataclass(frozen=True)
class Header:
    """A message's header, checked; its fields not read yet."""

    cls: type[Message]
    frames: int  # array frames that must follow
    cap: int  # bytes the whole message may have
    nbytes: int  # bytes of the header
    fields: msgspec.Raw


def read_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Steps 1-3 of decoding (module docstring): everything that can be checked before the array
    frames are looked at or any field is built."""
    buf = _bytes_view(frame)
    if buf.nbytes > limits.max_header_bytes:
        raise ProtocolError("size", f"header of {buf.nbytes} bytes exceeds the limit of {limits.max_header_bytes}")
    try:
        env = _ENVELOPE.decode(buf)
    # Deep nesting overflows msgspec's recursion guard, bad UTF-8 fails to decode: all "not a header".
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError("header", f"header is not a valid message envelope ({e})") from None
    if env.v != SCHEMA_VERSION:
        raise ProtocolError(
            "version", f"schema version {_brief(env.v)} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    cls = _BY_NAME.get(env.t)
    if cls is None:
        raise ProtocolError("type", f"unknown message type {_brief(env.t)}")
    if limits.accept is not None and cls not in limits.accept:
        raise ProtocolError("type", f"{env.t} is not served on this endpoint")
    if not 0 <= env.n <= limits.max_frames:
        raise ProtocolError("frames", f"header announces {env.n} array frames (allowed: 0 to {limits.max_frames})")
    cap = min(limits.max_bytes, cls.MAX_BYTES)
    if buf.nbytes > cap:
        raise ProtocolError("size", f"{env.t} header of {buf.nbytes} bytes exceeds the message's limit of {cap}")
    return Header(cls, env.n, cap, buf.nbytes, env.m)


def _where(cls: type, error: Exception) -> tuple[str, str]:
    """(detail, place) from a msgspec error: "Expected `int`, got `str` - at `$.seq`"."""
    text = str(error)
    detail, sep, path = text.rpartition(" - at `")
    if not sep:
        return text, cls.__name__
    return detail, cls.__name__ + path.rstrip("`")[1:]


def decode_fields(header: Header, arrays: Sequence[Any]) -> Message:
    """Steps 3-5 of decoding: the array frames against the header, then the fields, then validate()."""
    name = header.cls.__name__
    if len(arrays) != header.frames:
        raise ProtocolError("frames", f"{name}: header announces {header.frames} array frames, {len(arrays)} came")
    bufs = [_bytes_view(a) for a in arrays]
    total = header.nbytes + sum(b.nbytes for b in bufs)
    if total > header.cap:
        raise ProtocolError("size", f"{name} of {total} bytes exceeds its limit of {header.cap}")
    _frames.bufs, _frames.used, _frames.kind, _frames.field = bufs, bytearray(len(bufs)), "", ""
    try:
        msg = _DECODERS[header.cls].decode(header.fields)
    except msgspec.ValidationError as e:
        detail, where = _where(header.cls, e)
        where += f".{_frames.field}" if _frames.field else ""
        raise ProtocolError(_frames.kind or "field", detail, where) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError("header", f"fields are not valid msgpack ({e})", name) from None
    finally:
        _frames.bufs = None
    if not all(_frames.used):
        unused = [i for i, u in enumerate(_frames.used) if not u]
        raise ProtocolError("frames", f"{name}: array frame(s) {unused[:10]} described by no field")
    try:
        msg.validate()
    except ValueError as e:
        raise ProtocolError("value", str(e), name) from None
    return msg


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode the frames of one multipart message (bytes, memoryviews or zmq.Frame objects).

    Raises ProtocolError, and nothing else, for any input that is not a valid message."""
    if not frames:
        raise ProtocolError("frames", "empty message (no frames)")
    if len(frames) - 1 > limits.max_frames:
        raise ProtocolError("frames", f"{len(frames) - 1} array frames exceed the limit of {limits.max_frames}")
    return decode_fields(read_header(frames[0], limits), frames[1:])
