"""What both ends of a weight transfer agree on: buckets, dtype tags, checksums.

The learner publishes a version as buckets of at most `bucket_bytes`, each with a checksum; an
actor fetches them one by one over ZeroMQ, verifies every checksum, and only then loads the version,
so a torn transfer never reaches the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

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


def make_buckets(named: list[tuple[str, np.ndarray, str]], bucket_bytes: int) -> list[Bucket]:
    """Group (name, array, dtype tag) into buckets of at most bucket_bytes (a larger tensor goes alone)."""
    buckets: list[Bucket] = []
    names: list[str] = []
    arrays: list[np.ndarray] = []
    tags: list[str] = []
    size = 0

    def close() -> None:
        info = BucketInfo(index=len(buckets), nbytes=size, checksum=checksum(arrays), names=list(names),
                          dtypes=list(tags), shapes=[list(a.shape) for a in arrays])
        buckets.append((info, list(arrays)))

    for name, arr, tag in named:
        if arrays and size + arr.nbytes > bucket_bytes:
            close()
            names, arrays, tags, size = [], [], [], 0
        names.append(name)
        arrays.append(arr)
        tags.append(tag)
        size += arr.nbytes
    if arrays:
        close()
    return buckets
