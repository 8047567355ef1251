"""The learner's side of the shared-memory weight transport: published versions written straight from
the model's tensors into /dev/shm files that actors on this host map (dph_async/weights_shm.py).

`SlotWriter.write` copies each tensor once, into a slot kept mapped across versions (no page faults
after the first version, no intermediate buffer), and checksums each bucket piece by piece as it is
written; the returned numpy views of the slot are what the TCP path serves too, so a version exists
once in the learner's memory whichever way it travels. Actors on this host may keep their engine's
weights as views of a slot (a reader's lease, actors/weight_client.py): a slot a reader holds is never
rewritten, so the learner writes the next version into another one.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from dph_async import weights_shm as shm
from dph_async.protocol import SHM_PREFIX, ShmSegment, storage_dtype
from dph_async.weight_buckets import bucket_groups, tensor_tag

# Copied and hashed in pieces that stay in a core's L2 cache, so the checksum reads each piece from
# the cache rather than from memory: copy + hash of 536 MB ran at 12.1 GB/s this way, against 9.5 GB/s
# copying the whole and then hashing it (memcpy 13.4; 2-CPU AMD EPYC, 1 MiB of L2 per core).
CHUNK_BYTES = 512 * 1024


def _copy_hashing(dest: np.ndarray, t: torch.Tensor, tag: str, h) -> None:
    """dest[...] = t, feeding dest's bytes to the hash `h` in order."""
    if not t.is_cpu:  # from an accelerator: one copy across, then the hash
        out = torch.from_numpy(dest)
        (out.view(torch.bfloat16) if tag == "bfloat16" else out).copy_(t)
        h.update(memoryview(dest.reshape(-1)).cast("B"))
        return
    src = t.contiguous()
    src = (src.view(torch.uint16) if tag == "bfloat16" else src).numpy().reshape(-1)
    flat = dest.reshape(-1)
    step = max(1, CHUNK_BYTES // flat.itemsize)
    for i in range(0, flat.size, step):
        np.copyto(flat[i:i + step], src[i:i + step])
        h.update(memoryview(flat[i:i + step]).cast("B"))


@dataclass
class _Slot:
    name: str
    fd: int
    mm: mmap.mmap
    size: int
    version: int = -1


class SlotWriter:
    """At most `keep` segment files of this process, each holding one version."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.host = shm.host_identity()
        if not self.host:
            raise shm.ShmUnavailable("no host identity (boot id) here: shared memory is for Linux hosts")
        self._token = secrets.token_hex(16)
        self._made = 0
        self._slots: list[_Slot] = []
        self.replaced_busy = 0  # slots a reader held when they were due: replaced by a new file

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._slots]

    def _create(self, size: int) -> _Slot:
        """A new file of `size` bytes, private to this user, mapped, flocked (this writer lives)."""
        name = f"{SHM_PREFIX}{self._token}-{self._made}"
        self._made += 1
        path = shm.segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise shm.ShmUnavailable(f"cannot create {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # Another learner's remove_stale may have taken the file for stale between its creation
            # and the flock: then the name is gone (or another file's), and a new name is due.
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(f"{path} was removed while being made")
            # Space reserved now: a full /dev/shm is an error here, not a SIGBUS on a later write.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except FileNotFoundError:
            os.close(fd)
            return self._create(size)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise shm.ShmUnavailable(f"cannot make {path} of {size} bytes: {e.strerror}") from None
        shm.write_header(mm, -1)
        return _Slot(name, fd, mm, size)

    def _retire(self, slot: _Slot) -> None:
        """Unlink and forget a slot. Its mapping is not closed here: views of it may still be on their
        way out of a ZeroMQ socket; it is unmapped once the last of them is gone."""
        with contextlib.suppress(OSError):
            os.unlink(shm.segment_path(slot.name))
        os.close(slot.fd)
        self._slots.remove(slot)

    def _slot_for(self, size: int, held: set[int]) -> _Slot:
        """A slot no reader holds and whose version is not in `held`, locked for writing."""
        free = [s for s in self._slots if s.version not in held]
        slot = min(free, key=lambda s: s.version) if free else None
        if slot is not None and (slot.size != size or not shm.try_lock(slot.fd, exclusive=True)):
            if slot.size == size:
                self.replaced_busy += 1
            self._retire(slot)
            slot = None
        if slot is None:
            if len(self._slots) >= self.keep:  # every slot holds a kept version: the oldest goes
                self._retire(min(self._slots, key=lambda s: s.version))
            slot = self._create(size)
            shm.try_lock(slot.fd, exclusive=True)
            self._slots.append(slot)
        return slot

    def write(self, named: Sequence[tuple[str, torch.Tensor]], version: int, held: set[int],
              bucket_bytes: int) -> tuple[ShmSegment, list[tuple[str, np.ndarray, str]], list[str]]:
        """Copy the tensors into a slot not holding a version in `held` (those stay readable); return
        the segment's manifest entry, read-only numpy views of each tensor in it, and the checksum of
        each bucket (`bucket_groups`) of them, hashed as they were written."""
        tags = [tensor_tag(t) for _, t in named]
        sizes = [t.numel() * t.element_size() for _, t in named]
        offsets, size = shm.layout(sizes)
        slot = self._slot_for(size, held)
        try:
            # Should the write be cut short (an exception), the slot says it holds no version.
            shm.write_header(slot.mm, -1)
            slot.version = -1
            views, checksums = [], []
            with torch.no_grad():
                for group in bucket_groups(sizes, bucket_bytes):
                    h = xxhash.xxh3_64()
                    for i in group:
                        (name, t), tag = named[i], tags[i]
                        arr = np.frombuffer(slot.mm, storage_dtype(tag), t.numel(), offsets[i]).reshape(t.shape)
                        _copy_hashing(arr, t.detach(), tag, h)
                        arr = arr.view()
                        arr.flags.writeable = False
                        views.append((name, arr, tag))
                    checksums.append(h.hexdigest())
            shm.write_header(slot.mm, version)
            slot.version = version
        finally:
            shm.unlock(slot.fd)
        return ShmSegment(slot.name, self.host, size, offsets), views, checksums

    def close(self) -> None:
        for slot in list(self._slots):
            self._retire(slot)
