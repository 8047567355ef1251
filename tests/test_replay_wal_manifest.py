"""The write-ahead log knows what it should find: its manifest and wal.ack name every file, its bytes and
how much was acknowledged, so a missing, shortened, foreign or unnamed file is refused by name, never
truncated, while a crash at any step still comes back up."""

from __future__ import annotations

from pathlib import Path

import pytest

import dph_async.replay.wal as wal
from dph_async.config.replay import ReplayConfig
from dph_async.replay.core import ReplayCore
from dph_async.replay.wal import MAGIC, SEARCH_BYTES, Damage, WalFormatError, WriteAheadLog, record_header, scan
from dph_async.tools.bench.transport import synthetic_group


def make_core(wal_dir: Path, fsync: bool = False) -> ReplayCore:
    """A core on `wal_dir`; dropping it without closing is what a killed process leaves behind."""
    config = ReplayConfig(max_staleness=100, admission=False, max_version_lead=100)
    return ReplayCore(config, groups_per_batch=4, wal=WriteAheadLog(wal_dir, fsync=fsync))


def held(core: ReplayCore) -> list[int]:
    return sorted(e.group.seq for e in core.store)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def three_files(tmp_path: Path) -> tuple[Path, ReplayCore]:
    """A log of a sealed segment (groups 5-9), a base (of 0-9) and a live segment (10-14), each group
    acknowledged in a record of its own."""
    directory = tmp_path / "wal"
    core = make_core(directory)
    for i in range(5):
        core.ingest([synthetic_group(0, i)])
    core.snapshot(tmp_path / "ckpt")  # keeps segment 1 on after the base below
    for i in range(5, 10):
        core.ingest([synthetic_group(0, i)])
    core = make_core(directory)  # recovery: base-00000002, segment 1 sealed, segment 2 live
    for i in range(10, 15):
        core.ingest([synthetic_group(0, i)])
    assert sorted(p.name for p in directory.glob("*0*")) == ["base-00000002.arrow", "seg-00000001.wal",
                                                             "seg-00000002.wal"]
    return directory, core


def test_a_flipped_bit_of_the_magic_refuses_the_segment_and_loses_nothing(tmp_path):
    core = make_core(tmp_path)
    for i in range(20):
        core.ingest([synthetic_group(0, i)])
    segment = tmp_path / "seg-00000000.wal"
    data = bytearray(segment.read_bytes())
    data[7] ^= 0x07  # b"DPHWAL04" -> b"DPHWAL03", an earlier build's magic
    segment.write_bytes(bytes(data))
    before = files(tmp_path)
    with pytest.raises(WalFormatError, match=r"seg-00000000\.wal: bytes 0-7 hold b'DPHWAL03', not b'DPHWAL04'"):
        make_core(tmp_path)
    assert files(tmp_path) == before  # nothing truncated
    data[7] ^= 0x07
    segment.write_bytes(bytes(data))
    assert held(make_core(tmp_path)) == list(range(20))


def _cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _last_record_start(path: Path) -> int:
    data = path.read_bytes()
    return data.rindex(record_header(b"")[:4])


DAMAGE = {
    "sealed segment deleted": ("seg-00000001.wal", lambda p: p.unlink(), "missing; .*wal.json names it"),
    "sealed segment cut at a record": ("seg-00000001.wal", lambda p: _cut(p, _last_record_start(p)),
                                       r"\d+ bytes, .*wal.json says \d+"),
    "live segment deleted": ("seg-00000002.wal", lambda p: p.unlink(), "missing; .*acknowledged"),
    "live segment emptied": ("seg-00000002.wal", lambda p: _cut(p, 0), "0 bytes, but bytes up to"),
    "live segment cut to its magic": ("seg-00000002.wal", lambda p: _cut(p, 8), "8 bytes, but bytes up to"),
    "live segment cut at a record": ("seg-00000002.wal", lambda p: _cut(p, _last_record_start(p)),
                                     r"acknowledged records from byte \d+ on are missing"),
    "base deleted": ("base-00000002.arrow", lambda p: p.unlink(), "missing; .*wal.json names it"),
    "base's trailer cut": ("base-00000002.arrow", lambda p: _cut(p, p.read_bytes().rindex(b"ARROW1") + 6),
                           r"\d+ bytes, .*wal.json says \d+"),
    "an unnamed segment": ("seg-00000003.wal", lambda p: p.write_bytes((p.parent / "seg-00000001.wal").read_bytes()),
                           "a segment .*wal.json does not name"),
    "the manifest lost": ("wal.json", lambda p: p.unlink(), "missing, yet the directory holds log files"),
    "wal.ack lost": ("wal.ack", lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_missing_shortened_or_unnamed_file_is_refused_by_name_and_left_as_it_is(tmp_path, case):
    directory, _ = three_files(tmp_path)
    name, damage, message = DAMAGE[case]
    damage(directory / name)
    before = files(directory)
    with pytest.raises(WalFormatError, match=f"{name}: .*{message}"):
        make_core(directory)
    assert files(directory) == before


def test_records_replaced_in_a_sealed_segment_or_another_base_are_refused(tmp_path):
    directory, _ = three_files(tmp_path / "a")
    base = (directory / "base-00000002.arrow").read_bytes()
    other, _ = three_files(tmp_path / "b")  # the same groups: a base of the same bytes, another log's id
    assert (other / "base-00000002.arrow").stat().st_size == len(base)
    (directory / "base-00000002.arrow").write_bytes((other / "base-00000002.arrow").read_bytes())
    with pytest.raises(WalFormatError, match=r"base-00000002\.arrow: not the base .*wal.json names"):
        make_core(directory)
    (directory / "base-00000002.arrow").write_bytes(base)
    sealed = directory / "seg-00000001.wal"
    data = sealed.read_bytes()
    starts = [i for i in range(len(data)) if data.startswith(record_header(b"")[:4], i)]
    first, second = data[starts[0] : starts[1]], data[starts[1] : starts[2]]
    assert len(first) == len(second)
    sealed.write_bytes(data[: starts[0]] + second + first + data[starts[2] :])  # every record sound, reordered
    core = make_core(directory)  # recovery reads from the base on; a restore reads the sealed segment
    with pytest.raises(WalFormatError, match=rf"seg-00000001\.wal: every record is sound, yet bytes 0-{len(data) - 1} "
                                             "do not match the checksum"):
        core.restore(tmp_path / "a" / "ckpt")


class Crash(Exception):
    pass


def _crash_on(monkeypatch, target, name: str) -> None:
    def crash(*args, **kwargs):
        raise Crash(name)

    monkeypatch.setattr(target, name, crash)


@pytest.mark.parametrize("step", ["manifest", "unlink"])  # before the manifest names the new files; after
def test_a_crash_at_any_step_of_writing_a_base_comes_back_up(tmp_path, monkeypatch, step):
    _, core = three_files(tmp_path)
    with monkeypatch.context() as m:
        _crash_on(m, wal, "_write_durably") if step == "manifest" else _crash_on(m, Path, "unlink")
        with pytest.raises(Crash):
            core.wal.write_base(core._write_base)
    (tmp_path / "wal" / "base-00000002.arrow.tmp").write_bytes(b"a write cut short")
    recovered = make_core(tmp_path / "wal")
    assert held(recovered) == list(range(15))
    manifest = wal.read_manifest(tmp_path / "wal" / "wal.json")
    named = {f"seg-{n:08d}.wal" for n in manifest.numbers} | {f"base-{manifest.base.n:08d}.arrow"}
    assert set(files(tmp_path / "wal")) == named | {"wal.ack", "wal.json"}  # what the crash left is gone


def test_a_crash_between_starting_a_segment_and_naming_it_comes_back_up(tmp_path, monkeypatch):
    _, core = three_files(tmp_path)
    with monkeypatch.context() as m:
        _crash_on(m, wal, "_write_durably")
        with pytest.raises(Crash):
            core.wal.roll()
    assert (tmp_path / "wal" / "seg-00000003.wal").read_bytes() == MAGIC  # started, never named
    recovered = make_core(tmp_path / "wal")
    assert held(recovered) == list(range(15))
    recovered.ingest([synthetic_group(0, 15)])
    assert held(make_core(tmp_path / "wal")) == list(range(16))


def test_a_torn_write_past_the_acknowledged_end_is_cut_off(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    segment = tmp_path / "seg-00000000.wal"
    with open(segment, "ab") as f:  # what a process killed inside its next write leaves
        payload = b"G" + bytes(100)
        f.write(record_header(payload) + payload[:40])
    recovered = make_core(tmp_path)
    assert held(recovered) == [0] and recovered.stats().wal.truncated_bytes == 20 + 40


def test_a_restarted_machine_without_fsync_loses_only_what_the_os_held(tmp_path, monkeypatch, caplog):
    """With replay.wal_fsync=false a power cut may take the records acknowledged last; the log then comes
    up without them, loudly, their positions open. On the same boot, or with fsync on, it is refused."""
    for fsync in (False, True):
        directory = tmp_path / f"fsync-{fsync}"
        core = make_core(directory, fsync)
        for i in range(4):
            core.ingest([synthetic_group(0, i)])
        segment = directory / "seg-00000000.wal"
        _cut(segment, _last_record_start(segment))
        acked, size = core.wal._written, segment.stat().st_size
        with pytest.raises(WalFormatError, match="acknowledged records from byte"):
            make_core(directory)  # the same boot: the OS held every write, so someone cut it
        with monkeypatch.context() as m:
            m.setattr(wal, "_boot_id", lambda: b"another boot....")
            if fsync:
                with pytest.raises(WalFormatError, match="acknowledged records from byte"):
                    make_core(directory)
                continue
            with caplog.at_level("ERROR", logger="dph_async.replay.wal"):
                recovered = make_core(directory)
        assert held(recovered) == [0, 1, 2] and recovered.resume(0).watermark == 3
        assert recovered.stats().wal.damaged_records == 1 and recovered.stats().wal.skipped_bytes == acked - size
        assert caplog.messages == [
            f"write-ahead log {segment}: {size} bytes, but bytes up to {acked} were acknowledged before the machine "
            "restarted: with replay.wal_fsync=false the OS lost them; their groups are not accepted, so their actors "
            "generate them again when they resume"]


def test_a_torn_slot_of_wal_ack_falls_back_to_the_other(tmp_path):
    core = make_core(tmp_path)
    for i in range(3):
        core.ingest([synthetic_group(0, i)])
    ack = tmp_path / "wal.ack"
    data = bytearray(ack.read_bytes())
    newest = len(data) // 2 if core.wal._ack.writes & 1 else 0
    data[newest + 10] ^= 1
    ack.write_bytes(bytes(data))
    assert held(make_core(tmp_path)) == [0, 1, 2]
    ack.write_bytes(bytes(len(data)))
    with pytest.raises(WalFormatError, match=r"wal\.ack: damaged: .* neither slot matches its checksum"):
        make_core(tmp_path)


def _segment(*payloads: bytes) -> bytearray:
    return bytearray(MAGIC + b"".join(record_header(p) + p for p in payloads))


# Bytes of the sound record's sync before the window's end: across it (1-3), or the next window's first (0).
@pytest.mark.parametrize("straddle", [0, 1, 2, 3])
def test_a_sound_record_across_the_search_window_after_damage_is_found(straddle):
    """After a damaged record of over a window's bytes, the search for the next sound record starts a byte
    into it; the record after it begins `straddle` bytes before that search window's end."""
    damaged_length = 1 + SEARCH_BYTES - straddle - 20  # its header is 20 bytes
    big = bytes(range(256)) * (SEARCH_BYTES // 128)  # a sound record longer than the window too
    data = _segment(b"a" * damaged_length, b"sound", big, b"last")
    data[len(MAGIC) + 20 + 7] ^= 1  # the damaged record's payload
    found = list(scan(memoryview(bytes(data)), len(data)))
    sound_at = len(MAGIC) + 20 + damaged_length
    assert (sound_at - (len(MAGIC) + 1)) % SEARCH_BYTES == (SEARCH_BYTES - straddle) % SEARCH_BYTES
    assert found[0] == Damage(len(MAGIC), sound_at, "payload fails its checksum")
    assert [bytes(data[a : a + n]) for a, n in found[1:]] == [b"sound", big, b"last"]
