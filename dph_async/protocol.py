"""The wire protocol: typed messages, each one ZeroMQ multipart message.

    frame 0   msgpack header {"v": SCHEMA_VERSION, "t": <message type>, "m": <fields>}
    frame 1.. the numeric arrays as raw little-endian bytes, in the order they occur in the fields

In the header an array field holds [dtype, shape]; its bytes are the next array frame. Nested
dataclasses are maps of their fields, lists are lists. `encode` and `decode` walk the same type
annotations, so the schema is the dataclasses below and nothing else. Decoding trusts nothing: it
checks sizes before parsing, every field's type, dtypes against a whitelist, shapes against frame
lengths and that lengths agree, and raises `ProtocolError` naming where and what. Nothing is
ever unpickled. docs/data_plane.md is the prose version of this file.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union

import msgpack
import numpy as np

from dph_async.rewards.result import RewardResult

# Bump on any change to a message's fields: peers with another version are refused, not misread.
# 2: Control.version (the learner's version at a snapshot).
# 3: Completion.policy_weight (which distribution sampled it: the DPO samplers).
SCHEMA_VERSION = 3

MiB = 1 << 20


class ProtocolError(ValueError):
    """A message could not be encoded or decoded. `kind` is a short category for metrics
    (frames, size, header, version, type, field, array, value); str() names the place and problem."""

    def __init__(self, kind: str, detail: str, where: str = ""):
        super().__init__(kind, detail, where)
        self.kind = kind
        self.detail = detail
        self.where = where

    def within(self, segment: str) -> ProtocolError:
        """The same error one level further out: `segment` is ".name" or "[i]" (built only on error)."""
        where = segment + ("" if not self.where else self.where if self.where[0] == "[" else "." + self.where)
        return ProtocolError(self.kind, self.detail, where.lstrip("."))

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail


# ---------------------------------------------------------------------------------------------
# Field annotations the codec understands beyond plain Python types.


@dataclass(frozen=True)
class ArraySpec:
    """An array field: the dtypes it may have and its number of dimensions (None: any)."""

    dtypes: tuple[str, ...]
    ndim: int | None = 1


# Storage dtypes a weights tensor may have. numpy has no bfloat16: such tensors travel as their raw
# uint16 bits, tagged "bfloat16" in the message's dtype list.
TENSOR_DTYPES = (
    "float32",
    "float16",
    "uint16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
STORAGE_DTYPE = {name: name for name in TENSOR_DTYPES} | {"bfloat16": "uint16"}

Int32Array = Annotated[np.ndarray, ArraySpec(("int32",))]
Float32Array = Annotated[np.ndarray, ArraySpec(("float32",))]
TensorArray = Annotated[np.ndarray, ArraySpec(TENSOR_DTYPES, None)]


class _JsonMarker:
    """Marks a field holding plain data (None, bool, int, float, str, lists, str-keyed maps)."""


Json = Annotated[object, _JsonMarker]

MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_JSON_DEPTH = 16


def storage_dtype(tag: str) -> np.dtype:
    """The numpy dtype that carries a tensor of dtype `tag` ("bfloat16" -> uint16)."""
    if tag not in STORAGE_DTYPE:
        raise ProtocolError("value", f"dtype tag {tag!r} not allowed (allowed: {', '.join(STORAGE_DTYPE)})")
    return np.dtype(STORAGE_DTYPE[tag])


MAX_WAIT_S = 3600.0


def _check_wait(wait_s: float) -> None:
    if not 0 <= wait_s <= MAX_WAIT_S:  # NaN fails too
        raise ValueError(f"wait_s {wait_s} outside [0, {MAX_WAIT_S:.0f}]")


def _non_negative(**values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{name} {v} must be >= 0")


def _disagree(**lengths: int) -> str:
    return "lengths disagree: " + ", ".join(f"{n} {name}" for name, n in lengths.items())


# ---------------------------------------------------------------------------------------------
# Messages. Arrays are numpy arrays; decoded arrays are read-only views of the received frames.


@dataclass
class SamplingInfo:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int


@dataclass(eq=False)
class Completion:
    """One sampled response. token_ids include the end-of-sequence token when one was generated;
    logprobs are the behaviour log-probs of the distribution actually sampled; versions[i] is the
    policy version of the weights that produced token i. policy_weight says which distribution
    sampled it: softmax((a z_theta + (1 - a) z_ref) / temperature) with a = policy_weight, z_theta
    the logits of those weights and z_ref those of the frozen reference pi_0 (1: the policy itself,
    0: pi_ref; the `mixp` sampler uses 1.5 and 0.5)."""

    token_ids: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    reward: RewardResult
    finish_reason: str
    policy_weight: float = 1.0

    def validate(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("completion has no tokens")
        if not -8.0 <= self.policy_weight <= 8.0:  # NaN fails too
            raise ValueError(f"policy_weight {self.policy_weight} outside [-8, 8]")
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(_disagree(token_ids=n, logprobs=len(self.logprobs), versions=len(self.versions)))


@dataclass(eq=False)
class RolloutGroup:
    """The n completions of one prompt (a GRPO group, never split). Its id is (actor_id, seq), where
    seq is the actor's position in its prompt shard: a restarted actor that regenerates an already
    accepted position produces a duplicate, which the replay drops."""

    MAX_BYTES: ClassVar[int] = 256 * MiB

    actor_id: int
    seq: int
    prompt_id: str
    data_source: str
    prompt_ids: Int32Array
    completions: list[Completion]
    sampling: SamplingInfo
    created_at: float
    finished_at: float

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
        if not 0 <= self.actor_id < 1 << 31:
            raise ValueError(f"actor_id {self.actor_id} out of range [0, 2^31)")
        if not 0 <= self.seq < 1 << 62:
            raise ValueError(f"seq {self.seq} out of range [0, 2^62)")
        if not self.completions:
            raise ValueError("group has no completions")


@dataclass(eq=False)
class ReferenceSample:
    """A preserved D_pef sample with the per-token log-probs of the base policy pi_0."""

    sample_id: str
    prompt_ids: Int32Array
    response_ids: Int32Array
    ref_logprobs: Float32Array
    reward: float
    source: str

    def validate(self) -> None:
        if len(self.response_ids) == 0:
            raise ValueError("reference sample has no response tokens")
        if len(self.ref_logprobs) != len(self.response_ids):
            raise ValueError(_disagree(response_ids=len(self.response_ids), ref_logprobs=len(self.ref_logprobs)))


AckStatus = Literal["ok", "duplicate", "error"]


@dataclass
class Ack:
    """The replay's answer to rollout groups: "ok" (logged, will be served), "duplicate" (already
    accepted earlier; the sender may forget it) or "error" (rejected; `error` says why). An error ack
    with no ids answers a message that could not be decoded."""

    MAX_BYTES: ClassVar[int] = 16 * MiB

    group_ids: list[tuple[int, int]]
    status: AckStatus
    error: str = ""


@dataclass
class TicketRequest:
    """An actor asks for up to `want` admission tickets (one per prompt it may start).

    outstanding: tickets it holds that have not yet become sent groups; the replay takes this as the
        truth for the actor's in-flight count, so counts heal after either side restarts.
    weights_version: the policy version the actor generates with (-1: unknown); tickets are sized so
        its groups are still fresh when consumed.
    wait_s: how long the replay may hold the request waiting for capacity before granting what it can.
    """

    MAX_BYTES: ClassVar[int] = MiB

    actor_id: int
    want: int
    outstanding: int = 0
    weights_version: int = -1
    wait_s: float = 0.0

    def validate(self) -> None:
        _non_negative(want=self.want, outstanding=self.outstanding)
        _check_wait(self.wait_s)


@dataclass
class TicketGrant:
    MAX_BYTES: ClassVar[int] = MiB

    actor_id: int
    granted: int
    learner_version: int


@dataclass
class ResumeRequest:
    """A (re)started actor asks which of its shard positions are already accepted. It also tells the
    replay that the actor's earlier tickets are void."""

    MAX_BYTES: ClassVar[int] = MiB

    actor_id: int


@dataclass
class ResumeInfo:
    """Every seq < watermark is accepted, and so is every seq in accepted_above (all > watermark)."""

    MAX_BYTES: ClassVar[int] = 256 * MiB

    actor_id: int
    watermark: int
    accepted_above: list[int]
    learner_version: int

    def is_accepted(self, seq: int) -> bool:
        return seq < self.watermark or seq in self.accepted_above


@dataclass
class BatchRequest:
    """The learner, at `version` (optimizer steps applied), asks for `num_groups` fresh groups.

    The replay answers within about wait_s with what satisfies the staleness bound (maybe fewer or
    none). request_id > 0 makes the request idempotent: asking again with the same id returns the same
    batch (a lost reply is retried without losing or repeating groups); a new id tells the replay the
    previous batch arrived. 0 means no retry protection.
    """

    MAX_BYTES: ClassVar[int] = MiB

    version: int
    num_groups: int
    wait_s: float
    request_id: int = 0

    def validate(self) -> None:
        _non_negative(version=self.version, num_groups=self.num_groups, request_id=self.request_id)
        _check_wait(self.wait_s)


@dataclass(eq=False)
class Batch:
    """Fresh groups plus reference samples for one learner step. drops: groups dropped (by reason)
    since the previous batch, so the learner can log them with this step."""

    MAX_BYTES: ClassVar[int] = 64 * 1024 * MiB

    version: int
    groups: list[RolloutGroup]
    reference: list[ReferenceSample]
    drops: dict[str, int]
    request_id: int = 0

    @property
    def num_samples(self) -> int:
        return sum(len(g.completions) for g in self.groups)


@dataclass
class WeightsQuery:
    MAX_BYTES: ClassVar[int] = MiB

    actor_id: int
    have_version: int


@dataclass
class BucketInfo:
    """One bucket of a weights version: which tensors, their dtype tags and shapes, and a checksum."""

    index: int
    nbytes: int
    checksum: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    def validate(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(_disagree(names=len(self.names), dtypes=len(self.dtypes), shapes=len(self.shapes)))
        for tag in self.dtypes:
            storage_dtype(tag)


@dataclass
class WeightsReady:
    MAX_BYTES: ClassVar[int] = 256 * MiB

    version: int
    buckets: list[BucketInfo]


@dataclass
class WeightsRequest:
    MAX_BYTES: ClassVar[int] = MiB

    version: int
    bucket: int


@dataclass(eq=False)
class WeightsBucket:
    """The tensors of one bucket, one frame each. dtypes tags each array ("bfloat16" for uint16
    bits); empty means each array's own numpy dtype."""

    MAX_BYTES: ClassVar[int] = 64 * 1024 * MiB

    version: int
    index: int
    names: list[str]
    arrays: list[TensorArray]
    checksum: str
    dtypes: list[str] = field(default_factory=list)

    @property
    def tensor_dtypes(self) -> list[str]:
        return self.dtypes or [a.dtype.name for a in self.arrays]

    def validate(self) -> None:
        if len(self.names) != len(self.arrays):
            raise ValueError(_disagree(names=len(self.names), arrays=len(self.arrays)))
        if self.dtypes and len(self.dtypes) != len(self.arrays):
            raise ValueError(_disagree(dtypes=len(self.dtypes), arrays=len(self.arrays)))
        for name, tag, array in zip(self.names, self.tensor_dtypes, self.arrays, strict=True):
            if storage_dtype(tag) != array.dtype:
                raise ValueError(f"tensor {name!r} tagged {tag} is stored as {array.dtype.name}")


@dataclass
class StatsRequest:
    MAX_BYTES: ClassVar[int] = MiB


@dataclass
class Stats:
    MAX_BYTES: ClassVar[int] = 64 * MiB

    metrics: dict[str, Json]


ControlCommand = Literal["snapshot", "restore", "shutdown"]


@dataclass
class Control:
    MAX_BYTES: ClassVar[int] = MiB

    command: ControlCommand
    path: str = ""
    # snapshot: the learner's version (optimizer steps applied) at the checkpoint; -1 if unknown.
    version: int = -1


@dataclass
class ControlReply:
    MAX_BYTES: ClassVar[int] = MiB

    ok: bool
    detail: str = ""


@dataclass
class ErrorReply:
    """The answer to a request that was refused; kind is the ProtocolError kind when decoding failed."""

    MAX_BYTES: ClassVar[int] = MiB

    error: str
    kind: str = ""


MESSAGE_TYPES: tuple[type, ...] = (
    RolloutGroup, Ack, TicketRequest, TicketGrant, ResumeRequest, ResumeInfo, BatchRequest, Batch,
    WeightsQuery, WeightsReady, WeightsRequest, WeightsBucket, StatsRequest, Stats, Control,
    ControlReply, ErrorReply,
)  # fmt: skip
Message = Union[  # noqa: UP007 (a runtime alias, spelled so it also works on 3.10)
    RolloutGroup, Ack, TicketRequest, TicketGrant, ResumeRequest, ResumeInfo, BatchRequest, Batch,
    WeightsQuery, WeightsReady, WeightsRequest, WeightsBucket, StatsRequest, Stats, Control,
    ControlReply, ErrorReply,
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The codec: one (encode, decode) pair of closures per annotation, compiled once per type.

Encoder = Callable[[Any, list], Any]  # (value, array frames out) -> header value
# (header value, next array frame) -> value; the second argument hands out the array frames in
# order (an iterator's __next__: a C-level call per array on the hot path).
Decoder = Callable[[Any, Callable[[], memoryview]], Any]


def _type_name(value: object) -> str:
    return type(value).__name__


def _brief(value: object) -> str:
    """A short description of untrusted input for an error message: repr for scalars, else the type."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:40]
    if isinstance(value, str):
        return repr(value[:40])
    return f"a {_type_name(value)}"


@dataclass(frozen=True)
class _Scalar:
    """How a scalar is checked: the types encoding accepts, the exact types a decoded value may have,
    the conversion applied, and the allowed values of a Literal."""

    label: str
    accepts: tuple[type, ...]
    exact: tuple[type, ...]
    convert: Callable
    allowed: tuple | None = None

    def encode(self, v: Any) -> Any:
        # bool is an int subclass: never accepted as a number.
        if not isinstance(v, self.accepts) or (self.convert is not bool and isinstance(v, (bool, np.bool_))):
            raise self.error(v)
        if self.allowed is not None and v not in self.allowed:
            raise self.error(v)
        return self.convert(v)

    def error(self, v: Any) -> ProtocolError:
        if self.allowed is not None and isinstance(v, str):
            return ProtocolError("field", f"{_brief(v)} is not one of {', '.join(map(repr, self.allowed))}")
        return ProtocolError("field", f"expected {self.label}, got {_type_name(v)}")


_SCALARS = {
    bool: _Scalar("bool", (bool, np.bool_), (bool,), bool),
    int: _Scalar("int", (int, np.integer), (int,), int),
    float: _Scalar("float", (int, float, np.integer, np.floating), (int, float), float),
    str: _Scalar("str", (str,), (str,), str),
}


def _scalar(hint: Any) -> _Scalar | None:
    if typing.get_origin(hint) is Literal:
        return _Scalar("str", (str,), (str,), str, typing.get_args(hint))
    return _SCALARS.get(hint)


def _scalar_codec(spec: _Scalar) -> tuple[Encoder, Decoder]:
    """A scalar inside a list or tuple (a dataclass checks its own scalar fields inline)."""
    exact, allowed, convert = spec.exact, spec.allowed, spec.convert

    def dec(v, _):
        if type(v) not in exact or (allowed is not None and v not in allowed):
            raise spec.error(v)
        return convert(v)

    return (lambda v, _: spec.encode(v)), dec


def _list_codec(item: tuple[Encoder, Decoder]) -> tuple[Encoder, Decoder]:
    item_enc, item_dec = item

    def convert(v, frames, fn, kinds):
        if not isinstance(v, kinds):
            raise ProtocolError("field", f"expected list, got {_type_name(v)}")
        result = []
        i = 0
        try:
            for i, x in enumerate(v):  # noqa: B007 (i names the failing item)
                result.append(fn(x, frames))
        except ProtocolError as e:
            raise e.within(f"[{i}]") from None
        return result

    # Encoding takes tuples too; a decoded list must be exactly a list.
    return (lambda v, out: convert(v, out, item_enc, (list, tuple))), (lambda v, fr: convert(v, fr, item_dec, list))


def _tuple_codec(items: list[tuple[Encoder, Decoder]]) -> tuple[Encoder, Decoder]:
    def enc(v, out):
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise ProtocolError("field", f"expected a {len(items)}-tuple, got {_brief(v)}")
        return [e(x, out) for (e, _), x in zip(items, v, strict=True)]

    def dec(v, frames):
        if type(v) is not list or len(v) != len(items):
            raise ProtocolError("field", f"expected a list of {len(items)}, got {_type_name(v)}")
        return tuple(d(x, frames) for (_, d), x in zip(items, v, strict=True))

    return enc, dec


def _dict_codec(value: tuple[Encoder, Decoder]) -> tuple[Encoder, Decoder]:
    value_enc, value_dec = value

    def convert(v, frames, fn):
        if not isinstance(v, dict):
            raise ProtocolError("field", f"expected map, got {_type_name(v)}")
        result = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise ProtocolError("field", f"map key {_brief(k)} is not a str")
            try:
                result[k] = fn(x, frames)
            except ProtocolError as e:
                raise e.within(f"[{k!r:.40}]") from None
        return result

    return (lambda v, out: convert(v, out, value_enc)), (lambda v, fr: convert(v, fr, value_dec))


def _json_check(v: object, depth: int = 0) -> object:
    if depth > MAX_JSON_DEPTH:
        raise ProtocolError("field", f"plain data nested deeper than {MAX_JSON_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_json_check(x, depth + 1) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ProtocolError("field", "plain-data map with a non-str key")
        return {k: _json_check(x, depth + 1) for k, x in v.items()}
    raise ProtocolError("field", f"{_type_name(v)} is not plain data")


def _json_codec() -> tuple[Encoder, Decoder]:
    return (lambda v, _: _json_check(v)), (lambda v, _: _json_check(v))


def _array_codec(spec: ArraySpec) -> tuple[Encoder, Decoder]:
    # Lookups by dtype object and by name: dtype.name is a slow Python-level property.
    by_dtype = {np.dtype(name): name for name in spec.dtypes}
    by_name = {name: (np.dtype(name).newbyteorder("<"), np.dtype(name).itemsize) for name in spec.dtypes}
    ndim = spec.ndim
    allowed = ", ".join(spec.dtypes)

    def enc(a, out):
        name = by_dtype.get(a.dtype) if isinstance(a, np.ndarray) else None
        if name is None:
            if not isinstance(a, np.ndarray):
                raise ProtocolError("array", f"expected a numpy array, got {_type_name(a)}")
            if a.dtype.byteorder != ">" or (name := by_dtype.get(a.dtype.newbyteorder("<"))) is None:
                raise ProtocolError("array", f"dtype {a.dtype.name} not allowed (allowed: {allowed})")
            a = a.astype(a.dtype.newbyteorder("<"))
        if ndim is not None and a.ndim != ndim:
            raise ProtocolError("array", f"expected {ndim} dimension(s), got shape {a.shape}")
        try:
            view = memoryview(a).cast("B")
        except TypeError:  # not C-contiguous, or 0-d
            view = memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")
        out.append(view)
        return [name, list(a.shape)]

    def dec(v, frames):
        try:
            name, shape = v
            dtype, itemsize = by_name[name]
        except (TypeError, ValueError, KeyError):  # not a pair, or an unknown or unhashable dtype
            raise _bad_descriptor(v, allowed) from None
        if type(shape) is not list or (ndim is not None and len(shape) != ndim) or len(shape) > MAX_NDIM:
            raise ProtocolError("array", f"shape must be a list of {ndim or f'at most {MAX_NDIM}'} dimensions")
        count = 1
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_DIM:
                raise ProtocolError("array", f"shape entry {_brief(d)} is not an int in [0, 2^40]")
            count *= d
        try:
            buf = frames()
        except StopIteration:
            raise ProtocolError("frames", "the header describes more arrays than there are array frames") from None
        if buf.nbytes != count * itemsize:
            raise ProtocolError(
                "array", f"frame of {buf.nbytes} bytes does not hold a {name}{shape} array ({count * itemsize})"
            )
        array = np.frombuffer(buf, dtype=dtype)
        if ndim == 1:
            return array
        try:
            return array.reshape(shape)
        except ValueError:  # an empty array whose other dimensions multiply past numpy's limit
            raise ProtocolError("array", f"shape {shape} is too large") from None

    return enc, dec


def _bad_descriptor(v: Any, allowed: str) -> ProtocolError:
    if type(v) is list and len(v) == 2 and type(v[0]) is str:
        return ProtocolError("array", f"dtype {_brief(v[0])} not allowed (allowed: {allowed})")
    return ProtocolError("array", "array descriptor must be [dtype, shape]")


_DATACLASS_CODECS: dict[type, tuple[Encoder, Decoder]] = {}


def _field_mismatch(body: dict, names: list[str]) -> ProtocolError:
    missing = [n for n in names if n not in body]
    extra = sorted(str(k) for k in body if k not in names)
    parts = [f"missing field(s) {', '.join(missing)}"] if missing else []
    parts += [f"unknown field(s) {', '.join(extra)[:200]}"] if extra else []
    return ProtocolError("field", "; ".join(parts))


def _dataclass_codec(cls: type) -> tuple[Encoder, Decoder]:
    if cls in _DATACLASS_CODECS:
        return _DATACLASS_CODECS[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    # Scalar fields are checked inline, the rest by their codecs (in declaration order, which is
    # also the order of the array frames).
    scalars = [(n, spec, spec.exact, spec.allowed, spec.convert is float) for n in names if (spec := _scalar(hints[n]))]
    others = [(n, *_codec_for(hints[n])) for n in names if _scalar(hints[n]) is None]
    validate = getattr(cls, "validate", None)
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        construct = lambda fields: cls(**fields)  # noqa: E731
    else:
        # Filling __dict__ is what the generated __init__ does, without its per-field calls (and,
        # for frozen classes, object.__setattr__).
        def construct(fields):
            obj = cls.__new__(cls)
            obj.__dict__.update(fields)
            return obj

    def check(obj):
        try:
            validate(obj)
        except ValueError as e:
            raise ProtocolError("value", str(e)) from None

    def enc(obj, out):
        if type(obj) is not cls:
            raise ProtocolError("field", f"expected {cls.__name__}, got {_type_name(obj)}")
        if validate is not None:
            check(obj)
        body = {}
        name = ""
        try:
            for name, spec, exact, allowed, to_float in scalars:
                v = getattr(obj, name)
                if type(v) in exact and (allowed is None or v in allowed):  # plain Python values
                    body[name] = float(v) if to_float else v
                else:  # numpy scalars are converted; anything else is the error
                    body[name] = spec.encode(v)
            for name, field_enc, _ in others:
                body[name] = field_enc(getattr(obj, name), out)
        except ProtocolError as e:
            raise e.within("." + name) from None
        return body

    def dec(body, frames):
        if type(body) is not dict:
            raise ProtocolError("field", f"expected a {cls.__name__} map, got {_type_name(body)}")
        if len(body) != len(names):
            raise _field_mismatch(body, names)
        name = ""
        try:
            for name, spec, exact, allowed, to_float in scalars:
                v = body[name]
                if type(v) not in exact or (allowed is not None and v not in allowed):
                    raise spec.error(v)
                if to_float:
                    body[name] = float(v)
            for name, _, field_dec in others:
                body[name] = field_dec(body[name], frames)
        except KeyError:
            raise _field_mismatch(body, names) from None
        except ProtocolError as e:
            raise e.within("." + name) from None
        obj = construct(body)  # body now holds exactly the decoded fields
        if validate is not None:
            check(obj)
        return obj

    _DATACLASS_CODECS[cls] = (enc, dec)
    return enc, dec


def _codec_for(hint: Any) -> tuple[Encoder, Decoder]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Annotated:
        marker = hint.__metadata__[0]
        if isinstance(marker, ArraySpec):
            return _array_codec(marker)
        if marker is _JsonMarker:
            return _json_codec()
        raise TypeError(f"protocol: unknown annotation {marker!r}")
    if origin is list:
        return _list_codec(_codec_for(args[0]))
    if origin is tuple:
        return _tuple_codec([_codec_for(a) for a in args])
    if origin is dict:
        if args[0] is not str:
            raise TypeError("protocol: map keys must be str")
        return _dict_codec(_codec_for(args[1]))
    if dataclasses.is_dataclass(hint):
        return _dataclass_codec(hint)
    spec = _scalar(hint)
    if spec is None:
        raise TypeError(f"protocol: no codec for {hint!r}")
    return _scalar_codec(spec)


_BY_TYPE = {cls: (cls.__name__, _dataclass_codec(cls)) for cls in MESSAGE_TYPES}
_BY_NAME = {name: (cls, codec) for cls, (name, codec) in _BY_TYPE.items()}


# ---------------------------------------------------------------------------------------------
# Entry points.


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts. max_bytes caps the whole message; each message type also has its own
    cap (MAX_BYTES on the class) and the smaller one applies."""

    max_bytes: int = 64 * 1024 * MiB
    max_header_bytes: int = 64 * MiB
    max_frames: int = 1 << 20


DEFAULT_LIMITS = Limits()


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for `socket.send_multipart(frames, copy=False)`: the header, then one frame per array
    (views of the arrays, not copies). Raises ProtocolError if `msg` does not fit its schema."""
    entry = _BY_TYPE.get(type(msg))
    if entry is None:
        raise ProtocolError("type", f"{_type_name(msg)} is not a protocol message")
    name, (enc, _) = entry
    arrays: list[memoryview] = []
    try:
        body = enc(msg, arrays)
    except ProtocolError as e:
        raise e.within(name) from None
    return [msgpack.packb({"v": SCHEMA_VERSION, "t": name, "m": body}, use_bin_type=True), *arrays]


def _bytes_view(frame: Any) -> memoryview:
    """A flat byte view of a frame (zmq.Frame, bytes, memoryview), without copying."""
    view = getattr(frame, "buffer", None)  # a zmq.Frame's buffer is already flat bytes
    if view is None:
        view = memoryview(frame)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    return view


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode the frames of one multipart message (bytes, memoryviews or zmq.Frame objects).

    Raises ProtocolError, and nothing else, for any input that is not a valid message."""
    if not frames:
        raise ProtocolError("frames", "empty message (no frames)")
    if len(frames) - 1 > limits.max_frames:
        raise ProtocolError("frames", f"{len(frames) - 1} array frames exceed the limit of {limits.max_frames}")
    try:
        bufs = [_bytes_view(f) for f in frames]
    except TypeError as e:
        raise ProtocolError("frames", f"a frame is not a byte buffer ({e})") from None
    total = sum(b.nbytes for b in bufs)
    if total > limits.max_bytes:
        raise ProtocolError("size", f"message of {total} bytes exceeds the limit of {limits.max_bytes}")
    if bufs[0].nbytes > limits.max_header_bytes:
        raise ProtocolError("size", f"header of {bufs[0].nbytes} bytes exceeds the limit of {limits.max_header_bytes}")
    try:
        head = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True, ext_hook=_reject_ext)
    # msgpack signals bad input through many exception types (ExtraData, FormatError, StackError,
    # ValueError, TypeError, UnicodeDecodeError): all of them mean "not a valid header".
    except Exception as e:
        raise ProtocolError("header", f"header is not valid msgpack ({_type_name(e)}: {e})") from None
    if type(head) is not dict or set(head) != {"v", "t", "m"}:
        raise ProtocolError("header", "header must be a map with exactly the keys v, t, m")
    if head["v"] != SCHEMA_VERSION or type(head["v"]) is not int:
        raise ProtocolError(
            "version",
            f"schema version {_brief(head['v'])} is not supported (this side speaks {SCHEMA_VERSION})",
        )
    entry = _BY_NAME.get(head["t"]) if type(head["t"]) is str else None
    if entry is None:
        raise ProtocolError("type", f"unknown message type {_brief(head['t'])}")
    cls, (_, dec) = entry
    cap = min(limits.max_bytes, cls.MAX_BYTES)
    if total > cap:
        raise ProtocolError("size", f"{cls.__name__} of {total} bytes exceeds its limit of {cap}")
    array_frames = iter(bufs[1:])
    try:
        msg = dec(head["m"], array_frames.__next__)
    except ProtocolError as e:
        raise e.within(cls.__name__) from None
    if next(array_frames, None) is not None:
        raise ProtocolError(
            "frames", f"{cls.__name__}: {len(bufs) - 1} array frames sent, more than the header describes"
        )
    return msg
