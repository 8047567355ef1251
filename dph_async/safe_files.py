"""Files in a run directory, which may have been copied from anyone: read and written without trusting it.

    data = read_regular(run / "summary.json", limit=1 << 20)    # UnsafeFile unless a regular file within 1 MiB
    out = output_dir(run, run / "rerun" / "same")             # made below `run`, through no symlink
    with open_output(out / "report.md") as f: ...              # never follows a link planted there

Reading: a symlink is not followed (O_NOFOLLOW), a FIFO or a device is refused before it is read
(O_NONBLOCK, so opening a FIFO does not wait for a writer; then fstat), and at most `limit` bytes are
read, so /dev/zero, a pipe or a 300 MB file costs nothing. Writing: every directory from the base down
must be a real directory, and an output file that is a link (symbolic, or hard: another name of a file
elsewhere) is refused before anything is truncated.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import IO, TypeVar

import msgspec

from dph_async.errors import UserError

T = TypeVar("T")

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(UserError):
    """A file that is not a regular file within its size limit, or an output that would leave its directory."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _open(path: Path, flags: int, dir_fd: int | None) -> int:
    try:
        return os.open(path, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise UnsafeFile(f"{path}: a symbolic link, not followed") from None
        if e.errno == errno.ENXIO:  # O_WRONLY | O_NONBLOCK met a FIFO that nobody reads
            raise UnsafeFile(f"{path}: a FIFO, not written") from None
        raise


def read_regular(path: Path, limit: int, dir_fd: int | None = None) -> bytes:
    """The bytes of regular file `path` (relative to `dir_fd` if given); UnsafeFile if it is a symlink, not a
    regular file, or longer than `limit` bytes. OSError (FileNotFoundError...) as open() raises it."""
    fd = _open(path, _READ, dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path}: {_kind(st.st_mode)}, not read")
        if st.st_size > limit:
            raise UnsafeFile(f"{path}: {st.st_size} bytes, more than the {limit} allowed")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)  # the file may have grown since fstat
    if len(data) > limit:
        raise UnsafeFile(f"{path}: more than the {limit} bytes allowed")
    return data


def read_json(path: Path, kind: type[T], limit: int, dir_fd: int | None = None) -> T:
    """The record of type `kind` in regular file `path` (read as `read_regular` reads), strict JSON (no NaN)
    whose every field has its type; UnsafeFile, OSError or msgspec.MsgspecError otherwise."""
    return msgspec.json.decode(read_regular(path, limit, dir_fd), type=kind)


def output_dir(base: Path, out: Path) -> Path:
    """Make directory `out` (`base` or below it): each directory from `base` down to `out` must be a real
    one (an existing symlink is refused, a missing one is made), so nothing written there lands elsewhere."""
    try:
        parts = out.relative_to(base).parts
    except ValueError:
        parts = ("..",)
    if ".." in parts:
        raise UnsafeFile(f"{out}: not inside {base}")
    base.mkdir(parents=True, exist_ok=True)  # the way to `base` is the user's to choose
    here = base
    for part in parts:
        here = here / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(here)
        mode = os.lstat(here).st_mode
        if not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else _kind(mode)
            raise UnsafeFile(f"{here}: {what}, where an output directory belongs; not followed")
    return out


def open_output(path: Path, mode: str = "w") -> IO:
    """`path` opened for writing from its start (text `mode` "w" or binary "wb"), as open() would, except that
    a symlink, a hard link, a FIFO or a device there is refused (UnsafeFile) before it is touched."""
    fd = _open(path, _WRITE, None)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
            raise UnsafeFile(f"{path}: {what}, not written")
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_output(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through `open_output`."""
    with open_output(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
