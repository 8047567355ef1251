"""What both ends of a weight transfer agree on: buckets, dtype tags, checksums.

The learner publishes a version as buckets of at most `bucket_bytes`, each with a checksum; an
actor fetches them one by one over ZeroMQ, verifies every checksum, and only then loads the version,
so a torn transfer never reaches the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash

from dph_async.protocol import BucketInfo

# Tensors travel as raw little-endian bytes; numpy has no bfloat16, so those go as uint16 bit patterns.
_TO_TAG = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8"}
_FROM_TAG = {tag: dt for dt, tag in _TO_TAG.items()}


def tensor_tag(t: torch.Tensor) -> str:
    """The dtype tag `t` travels under; TypeError for a dtype that cannot be published."""
    if t.dtype not in _TO_TAG:
        raise TypeError(f"cannot publish a tensor of dtype {t.dtype}")
    return _TO_TAG[t.dtype]


def tensor_to_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    # Always a copy: for a CPU tensor .cpu() is the same storage, and a published version must not
    # change under the actors when the optimizer next updates the parameters in place.
    tag = tensor_tag(t)
    t = t.detach().contiguous().to("cpu", copy=True)
    arr = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return arr, tag


def tag_dtype(tag: str) -> torch.dtype:
    """The torch dtype of the tag `tag`."""
    if tag not in _FROM_TAG:
        raise TypeError(f"unknown dtype tag {tag!r}")
    return _FROM_TAG[tag]


def array_to_tensor(arr: np.ndarray, tag: str, shape: list[int]) -> torch.Tensor:
    """A tensor over `arr`'s memory, without copying: a received array is a read-only view of its
    message frame, and the engine copies it into its own parameters (the tensor must not be written)."""
    if tag not in _FROM_TAG:
        raise TypeError(f"unknown dtype tag {tag!r}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if tag == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.reshape(shape)


def checksum(arrays: Iterable[np.ndarray]) -> str:
    """XXH3-64 over the bucket's bytes, in order: catches torn or mixed buckets, and runs at about
    twice memcpy's speed (CRC-32 took 3.5 memcpys' time, the largest cost of loading weights)."""
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


Bucket = tuple[BucketInfo, list[np.ndarray]]


def bucket_groups(nbytes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Which tensors (by position) each bucket holds: in order, at most bucket_bytes per bucket (a
    larger tensor goes alone)."""
    groups: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if i > start and size + n > bucket_bytes:
            groups.append(range(start, i))
            start, size = i, 0
        size += n
    if len(nbytes) > start:
        groups.append(range(start, len(nbytes)))
    return groups


def make_buckets(named: list[tuple[str, np.ndarray, str]], bucket_bytes: int,
                 checksums: Sequence[str] | None = None) -> list[Bucket]:
    """Group (name, array, dtype tag) into buckets (`bucket_groups`), each with its checksum: the
    one given (computed as the bytes were written, learner/shm_slots.py) or computed here."""
    buckets: list[Bucket] = []
    for index, group in enumerate(bucket_groups([arr.nbytes for _, arr, _ in named], bucket_bytes)):
        items = [named[i] for i in group]
        arrays = [arr for _, arr, _ in items]
        info = BucketInfo(index=index, nbytes=sum(a.nbytes for a in arrays),
                          checksum=checksums[index] if checksums is not None else checksum(arrays),
                          names=[name for name, _, _ in items], dtypes=[tag for _, _, tag in items],
                          shapes=[list(a.shape) for a in arrays])
        buckets.append((info, arrays))
    return buckets
