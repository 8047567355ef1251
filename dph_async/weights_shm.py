"""What both ends of the shared-memory weight transport agree on (docs/weights.md).

An actor on the learner's host reads a published version straight from a file under /dev/shm that
the learner wrote, instead of pulling it in buckets over ZeroMQ. The learner keeps KEEP_VERSIONS such
files ("slots") and rewrites the one holding the oldest version; both sides keep their mappings, so
after the first version neither pays page faults again (on a fresh mapping they cost more than the
copy itself: writing a new tmpfs file ran at 0.2-0.7 GB/s where memcpy ran at 5-11 GB/s).

Two kinds of lock keep a reader from seeing a slot change under it, and stale files from piling up:

- fcntl record locks (open-file-description ones): a reader holds a shared lock while it verifies
  and copies a version; the learner rewrites a slot only under an exclusive lock taken without
  waiting. A slot that a reader holds is not waited for: it is unlinked (the reader keeps its
  mapping of the old file) and a new file takes its place.
- flock: the learner holds a shared flock on every slot it owns, for as long as its process lives.
  A file of ours on which an exclusive flock can be taken has no living writer: `remove_stale`
  deletes it (at a learner's start and when the launcher shuts down, so a killed learner leaks
  nothing past the next run). On Linux the two kinds of lock do not interact.

Only stdlib here: the driver calls `remove_stale` without loading numpy or torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from dph_async.protocol import SHM_HEADER_BYTES, SHM_NAME, SHM_PREFIX

SHM_DIR = Path("/dev/shm")
ALIGN = 64  # every tensor starts on a cache line (and at any dtype's alignment)
MAGIC = b"DPHWSHM1"
_HEADER = struct.Struct("<8sq")  # magic, version held (-1 while being written)


class ShmUnavailable(OSError):
    """The segment cannot be used here (another host, no /dev/shm, not ours, no space): use TCP."""


def host_identity() -> str:
    """This host as the learner's manifest names it: hostname, boot id and network namespace. Two
    processes with the same identity see the same /dev/shm, unless they sit in different containers,
    in which case opening the segment fails and the reader falls back to TCP. The network namespace
    is part of it so that a process in its own namespace (a container with its own network, or the
    multi-host test's namespaced hosts) is another host, and gets its weights over the network like
    one. Empty where there is no boot id (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{netns}"


def segment_path(name: str) -> Path:
    """The file of a segment named `name`; refuses any name the writer would not have made."""
    if not SHM_NAME.fullmatch(name):
        raise ValueError(f"segment name {name!r} is not one of ours ({SHM_PREFIX}<token>-<n>)")
    return SHM_DIR / name


def layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors of these sizes, in order, each aligned, past the header; and the file size."""
    offsets, end = [], SHM_HEADER_BYTES
    for n in nbytes:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += n
    return offsets, max(end, SHM_HEADER_BYTES)


def write_header(buf, version: int) -> None:
    _HEADER.pack_into(buf, 0, MAGIC, version)


def read_header(buf) -> int:
    """The version a segment holds (-1 while being written); ValueError if it is not a segment."""
    magic, version = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a weights segment (bad magic)")
    return version


def open_for_reading(name: str, size: int) -> int:
    """A read-only descriptor of segment `name`, after checking that it is what a learner of this
    user made: a regular file (no symbolic link followed), owned by this user, readable by nobody
    else, of exactly `size` bytes. ShmUnavailable if it cannot be opened; ValueError if it is not
    what the manifest says."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ShmUnavailable(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"{path} is not a private file of this user (mode {st.st_mode:o}, uid {st.st_uid})")
        if st.st_size != size:
            raise ValueError(f"{path} holds {st.st_size} bytes, the manifest says {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(fd: int, kind: int) -> None:
    """An open-file-description lock on the whole file (struct flock: type, whence, start, len 0 =
    to the end, pid 0). Unlike classic POSIX locks these belong to the descriptor, not the process:
    closing another descriptor of the file does not drop them, and two descriptors in one process
    exclude each other as two processes do."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0))


def try_lock(fd: int, exclusive: bool) -> bool:
    """Take the writer's lock (exclusive) or a reader's (shared) without waiting; False if the other
    side holds the slot."""
    try:
        _lock(fd, fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK)
    except (BlockingIOError, PermissionError):
        return False
    return True


def unlock(fd: int) -> None:
    _lock(fd, fcntl.F_UNLCK)


def remove_stale() -> list[str]:
    """Delete this user's segments that no living writer holds (see the module's docstring); returns
    their names. Others' files, and files that are not segments, are never touched."""
    removed = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if SHM_NAME.fullmatch(n)]
    except OSError:
        return removed
    for name in names:
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a writer lives
            # The name still names this file (not one made since under the same name).
            if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed
