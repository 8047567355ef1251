"""A nested state (dicts, lists, numbers, strings, tensors) as one safetensors file: nothing is pickled.

The tensors are the file's tensors; the structure around them is JSON in the file's metadata
(`tree`), each node one of

    null, true, 1, "s", 0.5          itself (a float keeps its type: JSON writes 1.0, not 1)
    ["f", "nan" | "inf" | "-inf"]    a float JSON has no number for
    ["t", name, crc32]               the tensor `name`, with the CRC-32 of its bytes
    ["l", [node...]]  ["u", [...]]   a list, a tuple
    ["d", [[key, node]...]]          a dict (keys are str or int nodes; optimizer states key by int)
    ["o", [[key, node]...]]          an OrderedDict
    ["s", [int...]]                  a torch.Size
    ["x", kind, node]                an object of a kind the writer and the reader both name (`Codec`)

Reading never builds anything but these: an unknown node, a file that is not safetensors (a pickle
included) or a tensor whose bytes fail their checksum is a `StateFileError` naming the file (and the
tensor with its byte range). A tensor referred to twice is stored once and read back as one tensor.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dph_async.errors import UserError

FORMAT = "dph-async-state/1"
MAX_DEPTH = 64  # far beyond any state DeepSpeed writes; a deeper tree is refused, not recursed into
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its header


class StateFileError(UserError):
    """A state file that is not one (another format, a pickle), or damaged: names the file."""


@dataclass
class Codec:
    """The objects a state may hold beyond the built-in nodes: each type's kind, how it becomes a
    node's plain value, and how that value becomes the object again. Nothing else is ever built."""

    encoders: dict[type, tuple[str, Callable[[Any], Any]]] = field(default_factory=dict)
    decoders: dict[str, Callable[[Any], Any]] = field(default_factory=dict)


PLAIN = Codec()


def _float(x: float) -> Any:
    return x if math.isfinite(x) else ["f", repr(x)]


class _Writer:
    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.tensors: dict[str, torch.Tensor] = {}
        self.names: dict[int, str] = {}  # id(tensor) -> its name: a tensor met twice is stored once
        self.storages: set[int] = set()

    def tensor(self, t: torch.Tensor, path: str) -> list:
        if id(t) not in self.names:
            data = t.detach().to("cpu").contiguous()
            if data.numel() and data.untyped_storage().data_ptr() in self.storages:
                data = data.clone()  # another view of a stored tensor's memory: safetensors refuses shared memory
            self.storages.add(data.untyped_storage().data_ptr())
            self.names[id(t)] = path
            self.tensors[path] = data
        name = self.names[id(t)]
        return ["t", name, _crc(self.tensors[name])]

    def node(self, x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, str)) or type(x) is int:
            return x
        if type(x) is float:
            return _float(x)
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        if type(x) is torch.Size:
            return ["s", list(x)]
        if type(x) in (dict, OrderedDict):
            for k in x:
                if not (isinstance(k, str) or type(k) is int):
                    raise TypeError(f"{path}: a key of type {type(k).__name__} cannot be stored")
            return ["o" if type(x) is OrderedDict else "d", [[k, self.node(v, f"{path}/{k}")] for k, v in x.items()]]
        if type(x) in (list, tuple):
            return ["l" if type(x) is list else "u", [self.node(v, f"{path}/{i}") for i, v in enumerate(x)]]
        if type(x) in self.codec.encoders:
            kind, encode = self.codec.encoders[type(x)]
            return ["x", kind, self.node(encode(x), f"{path}/{kind}")]
        raise TypeError(f"{path}: a {type(x).__module__}.{type(x).__qualname__} cannot be stored in a state file")


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


def save_state(state: Any, path: Path, codec: Codec = PLAIN) -> None:
    """Write `state` to `path` (see the module docstring); a value of a type not listed there or in
    `codec` is a TypeError naming where it is."""
    writer = _Writer(codec)
    tree = writer.node(state, "")
    save_file(writer.tensors, str(path), metadata={"format": FORMAT, "tree": json.dumps(tree, allow_nan=False)})


def _offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in the file, from its safetensors header (for an error's message)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(min(n, MAX_HEADER_BYTES)))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


class StateFile:
    """An open state file: `get(*keys)` reads the value at that path of the state, and only that.

        with StateFile(path, codec) as f:
            weights = f.get("module")
    """

    def __init__(self, path: Path, codec: Codec = PLAIN) -> None:
        self.path, self.codec = Path(path), codec
        if not self.path.is_file():
            raise StateFileError(f"{self.path}: missing")
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise StateFileError(f"{self.path}: not a safetensors state file ({' '.join(str(e).split())[:120]}); "
                                 "files of other formats, pickles included, are never loaded") from None
        meta = self._file.metadata() or {}
        if meta.get("format") != FORMAT:
            raise StateFileError(f"{self.path}: a safetensors file of format {meta.get('format')!r}, "
                                 f"not a state file ({FORMAT})")
        try:
            self.tree = json.loads(meta.get("tree", ""))
        except (ValueError, RecursionError):
            raise StateFileError(f"{self.path}: its tree is not JSON") from None
        self._read: dict[str, torch.Tensor] = {}

    def get(self, *keys: str | int) -> Any:
        """The value at `keys` (dict keys or list indices, from the top), decoded."""
        node = self.tree
        for i, key in enumerate(keys):
            node = self._child(node, key, keys[:i + 1])
        return self._decode(node, 0)

    def _child(self, node: Any, key: str | int, where: tuple) -> Any:
        """The node at `key` of a dict node (or at index `key` of a list node)."""
        if isinstance(node, list) and len(node) == 2 and isinstance(node[1], list):
            if node[0] in ("l", "u") and type(key) is int and 0 <= key < len(node[1]):
                return node[1][key]
            if node[0] in ("d", "o"):
                for pair in node[1]:
                    if isinstance(pair, list) and len(pair) == 2 and pair[0] == key:
                        return pair[1]
        raise StateFileError(f"{self.path}: no {'/'.join(map(str, where))}")

    def _decode(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateFileError(f"{self.path}: nested deeper than {MAX_DEPTH}")
        if node is None or isinstance(node, (bool, str, int, float)):
            return node
        if not (isinstance(node, list) and node and isinstance(node[0], str)):
            raise StateFileError(f"{self.path}: a node that is none of the state file's: {str(node)[:60]}")
        tag, args = node[0], node[1:]
        match tag, args:
            case "t", [str(name), int(crc)]:
                return self._tensor(name, crc)
            case "l" | "u", [list(items)]:
                out = [self._decode(v, depth + 1) for v in items]
                return out if tag == "l" else tuple(out)
            case "d" | "o", [list(items)]:
                pairs = [(self._key(p), self._decode(p[1], depth + 1)) for p in items]
                return dict(pairs) if tag == "d" else OrderedDict(pairs)
            case "s", [list(dims)] if all(type(d) is int and d >= 0 for d in dims):
                return torch.Size(dims)
            case "f", ["nan" | "inf" | "-inf" as x]:
                return float(x)
            case "x", [str(kind), value] if kind in self.codec.decoders:
                return self.codec.decoders[kind](self._decode(value, depth + 1))
        raise StateFileError(f"{self.path}: a node that is none of the state file's: {str(node)[:60]}")

    def _key(self, pair: Any) -> str | int:
        if isinstance(pair, list) and len(pair) == 2 and (isinstance(pair[0], str) or type(pair[0]) is int):
            return pair[0]
        raise StateFileError(f"{self.path}: a dict entry that is no [key, value] pair: {str(pair)[:60]}")

    def _tensor(self, name: str, crc: int) -> torch.Tensor:
        if name not in self._read:
            try:
                t = self._file.get_tensor(name)
            except (SafetensorError, KeyError):
                raise StateFileError(f"{self.path}: no tensor {name!r}") from None
            if _crc(t) != crc:
                start, end = _offsets(self.path)[name]
                raise StateFileError(f"{self.path}: tensor {name!r} (bytes {start}-{end}) fails its checksum")
            self._read[name] = t
        return self._read[name]

    def close(self) -> None:
        self._read.clear()
        self._file.__exit__(None, None, None)

    def __enter__(self) -> StateFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_state(path: Path, codec: Codec = PLAIN) -> Any:
    """The whole state in `path`."""
    with StateFile(path, codec) as f:
        return f.get()
