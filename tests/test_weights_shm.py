"""The shared-memory weight transport (dph_async/weights_shm.py, learner/shm_slots.py, actors/weight_client.py):
a version read from the learner's /dev/shm slot is bit for bit what was published, read in place (no
bucket crosses the socket); a byte of the slot changed after it was written is refused by its
checksum whichever transport reads it, and never reaches the engine; a segment that cannot be opened
sends the actor to TCP, or is an error under transport=shm; a hostile manifest is refused before
anything is mapped; the files stay at two per learner, a slot a reader holds is replaced rather than
rewritten under it, and nothing is left in /dev/shm after close or after a writer died.
"""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
from test_weights import Net, RecordingEngine, assert_bitwise, newest, worker

from dph_async import weights_shm as shm
from dph_async.actors.weight_client import WeightClient, WeightFetchError, WeightTransportError
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity
from dph_async.protocol import SHM_PREFIX, WeightsReady

SECURITY = NetSecurity()


def ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(SHM_PREFIX)}


@pytest.fixture
def server(ipc):
    srv = WeightServer(ipc("weights"), SECURITY, bucket_bytes=200, transport="shm")
    yield srv
    srv.close()


def client_of(server: WeightServer, transport: str = "auto") -> WeightClient:
    return WeightClient(server.address, SECURITY, actor_id=0, timeout_s=5.0, transport=transport)


@pytest.fixture
def client(server):
    c = client_of(server)
    yield c
    c.close()


def test_round_trip_is_bit_for_bit_and_reads_the_segment_in_place(server, client):
    model = Net(0)
    with torch.no_grad():
        model.a[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    server.publish(model, version=1)
    with torch.no_grad():  # the optimizer goes on in place: the published version must not follow
        for p in model.parameters():
            p.add_(1)
    ready = newest(client, 1)
    assert ready.shm is not None and ready.shm.name in ours() and ready.shm.host == shm.host_identity()
    with client.tensors(ready) as got:
        assert_bitwise(got, _frozen(want))
        # Views of one read-only map of the segment: nothing was copied on the way.
        assert len({t.untyped_storage().data_ptr() for _, t in got}) == 1
        assert all(not t.is_contiguous() or t.numel() == 0 or t.data_ptr() % shm.ALIGN == 0 for _, t in got)
    assert client.loads == {"shm": 1, "tcp": 0} and client.shm_fallbacks == 0
    assert server.bytes_served == 0  # no bucket crossed the socket
    assert os.stat(shm.segment_path(ready.shm.name)).st_mode & 0o777 == 0o600


def flip_a_byte(ready: WeightsReady) -> None:
    """Change one bit of the last tensor in the learner's segment, as a stray write after the learner
    hashed it would (the file is the learner's user's, as the test's)."""
    fd = os.open(shm.segment_path(ready.shm.name), os.O_RDWR)
    try:
        offset = ready.shm.offsets[-1]
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0x10]), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_a_corrupted_byte_in_the_segment_is_refused_and_never_reaches_the_engine(server, transport):
    """Every way an actor reads a version: from the segment (auto, the default on one host; shm), or
    over the socket (tcp), whose buckets are views of the same slot."""
    client = client_of(server, transport)
    try:
        server.publish(Net(6), version=1)
        flip_a_byte(newest(client, 1))
        engine = RecordingEngine()
        actor = worker(client, engine)
        actor.update_weights()
        assert engine.loaded == [] and engine.version == 0 and actor.stats.weight_fetch_failures == 1
        assert client.loads == {"shm": 0, "tcp": 0}  # refused, not read another way instead
        ready = newest(client, 1)
        with pytest.raises(WeightFetchError, match=r"bucket \d+ failed its checksum"), client.tensors(ready):
            pass
        server.publish(Net(7), version=2)  # the learner's next version, whole: loaded
        newest(client, 2)
        actor.update_weights()
        assert [v for v, _ in engine.loaded] == [2] and actor.stats.weight_loads == 1
        assert_bitwise(engine.loaded[0][1], Net(7))
    finally:
        client.close()


class _frozen(torch.nn.Module):
    """A module whose state_dict is the given tensors (what was published)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._t = tensors

    def state_dict(self, *args, **kwargs):
        return self._t


def test_a_segment_that_cannot_be_opened_falls_back_to_tcp(server, client):
    model = Net(1)
    server.publish(model, version=1)
    ready = newest(client, 1)
    os.unlink(shm.segment_path(ready.shm.name))  # as if on another host, or in another container
    with client.tensors(ready) as got:
        assert_bitwise(got, model)
    assert client.loads == {"shm": 0, "tcp": 1} and client.shm_fallbacks == 1
    # Another host's segment is not even looked for.
    elsewhere = msgspec.structs.replace(ready, shm=msgspec.structs.replace(ready.shm, host="elsewhere/boot"))
    with client.tensors(elsewhere) as got:
        assert_bitwise(got, model)
    assert client.loads["tcp"] == 2
    # Under transport=shm that is an error, never a silent change of transport.
    strict = client_of(server, "shm")
    try:
        with pytest.raises(WeightTransportError, match=r"weight_transport=shm.*cannot open"), strict.tensors(ready):
            pass
    finally:
        strict.close()


@pytest.mark.parametrize(("change", "says"), [
    (dict(name="../../etc/passwd"), "not one of ours"),
    (dict(name=f"{SHM_PREFIX}{'0' * 32}-1/../../x"), "not one of ours"),
    (dict(name="/dev/shm/other"), "not one of ours"),
    (dict(name=f"deepspeed_allreduce_buffer_{'0' * 20}"), "not one of ours"),
    (dict(offsets="past_end"), "outside the segment"),
    (dict(offsets="overlap"), "outside the segment"),
    (dict(offsets="into_header"), "outside the segment"),
    (dict(offsets="unaligned"), "not aligned"),
    (dict(offsets="missing"), "disagree"),
    (dict(size="bigger"), "holds .* bytes, the manifest says"),
])
def test_a_hostile_manifest_is_refused_before_anything_is_mapped(server, client, change, says):
    server.publish(Net(2), version=1)
    ready = newest(client, 1)
    seg, offsets = ready.shm, list(ready.shm.offsets)
    how = change.get("offsets")
    if how == "past_end":
        offsets[-1] = seg.size - 1
    elif how == "overlap":
        offsets[1] = offsets[0] + 4  # inside tensor 0 (1,122 bytes)
    elif how == "into_header":
        offsets[0] = 8  # over the header
    elif how == "unaligned":
        offsets[1] += 1  # a float32 tensor: item size 4
    elif how == "missing":
        offsets = offsets[:-1]
    size = seg.size + 4096 if change.get("size") else seg.size
    bad = msgspec.structs.replace(ready, shm=msgspec.structs.replace(
        seg, name=change.get("name", seg.name), offsets=offsets, size=size))
    with pytest.raises(WeightFetchError, match=f"refused: .*{says}"), client.tensors(bad):
        pass
    assert client.loads == {"shm": 0, "tcp": 0}  # refused, not sent round to the other transport
    with client.tensors(ready):  # the segment, now mapped, is checked against each manifest anew
        pass
    with pytest.raises(WeightFetchError, match=f"refused: .*{says}"), client.tensors(bad):
        pass


def test_a_segment_someone_else_could_write_is_refused(server, client):
    server.publish(Net(3), version=1)
    ready = newest(client, 1)
    os.chmod(shm.segment_path(ready.shm.name), 0o666)
    with pytest.raises(WeightFetchError, match="not a private file"), client.tensors(ready):
        pass


def test_two_newest_versions_are_kept_in_two_files_and_close_removes_them(server, client):
    before = ours()
    models = {v: Net(10 + v) for v in range(1, 7)}
    readies = {}
    for v, model in models.items():
        server.publish(model, version=v)
        readies[v] = newest(client, v)
        assert len(server.segment_names) == min(v, 2) and ours() - before == set(server.segment_names)
        with client.tensors(readies[v]) as got:
            assert_bitwise(got, model)
        if v > 1:  # the previous version is still held (an actor may be reading it) ...
            with client.tensors(readies[v - 1]) as got:
                assert_bitwise(got, models[v - 1])
        if v > 2:  # ... the one before is not: its slot holds version v now
            with pytest.raises(WeightFetchError, match=f"version {v - 2} is no longer held"), \
                    client.tensors(readies[v - 2]):
                pass
    assert len({r.shm.name for r in readies.values()}) == 2  # the slots were rewritten, not made anew
    server.close()
    assert ours() - before == set()


def test_a_slot_held_by_a_reader_is_replaced_not_rewritten(server, client):
    before = ours()
    models = {v: Net(20 + v) for v in (1, 2, 3)}
    server.publish(models[1], version=1)
    ready = newest(client, 1)
    with client.tensors(ready) as got:
        server.publish(models[2], version=2)
        server.publish(models[3], version=3)  # version 1's slot is due, but this reader holds it
        assert_bitwise(got, models[1])  # unchanged under the reader
        assert server._slots.replaced_busy == 1
        assert ready.shm.name not in ours() and len(ours() - before) == 2
    with client.tensors(newest(client, 3)) as got:
        assert_bitwise(got, models[3])


def test_a_leased_slot_read_again_stays_leased(server, client):
    """An engine keeps views of a leased slot after its block; reading that slot again (the same
    version loaded twice) must not drop the lease, or the learner would rewrite it under the views."""
    models = {v: Net(30 + v) for v in (1, 2, 3)}
    server.publish(models[1], version=1)
    ready = newest(client, 1)
    with client.tensors(ready, lease=True) as kept:
        pass
    with client.tensors(ready, lease=True) as again:
        assert_bitwise(again, models[1])
    server.publish(models[2], version=2)
    server.publish(models[3], version=3)  # version 1's slot is due, but the lease holds it
    assert server._slots.replaced_busy == 1
    assert_bitwise(kept, models[1])
    client.release()
    server.publish(Net(34), version=4)  # released: version 2's slot is due and free, rewritten
    assert server._slots.replaced_busy == 1


def test_a_leased_load_that_failed_keeps_both_slots_its_engine_may_rest_on(server, client):
    """A load that fails part way may have installed some views of the new slot while the others are
    still views of the leased one: both stay locked until a later leased load succeeds."""
    models = {v: Net(40 + v) for v in (1, 2)}
    server.publish(models[1], version=1)
    with client.tensors(newest(client, 1), lease=True):
        pass
    server.publish(models[2], version=2)
    with pytest.raises(RuntimeError, match="load failed"), client.tensors(newest(client, 2), lease=True):
        raise RuntimeError("load failed")
    server.publish(Net(43), version=3)  # version 1's slot is due: leased
    server.publish(Net(44), version=4)  # version 2's slot is due: the failed load may rest on it
    assert server._slots.replaced_busy == 2
    with client.tensors(newest(client, 4), lease=True):
        pass
    server.publish(Net(45), version=5)  # both released: the slot of version 3 is rewritten
    assert server._slots.replaced_busy == 2


def test_stale_segments_are_removed_and_live_ones_kept(server):
    server.publish(Net(4), version=1)
    live = set(server.segment_names)
    dead = f"{SHM_PREFIX}{'f' * 32}-0"  # a file of a writer that died: nobody holds its flock
    fd = os.open(shm.segment_path(dead), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    removed = shm.remove_stale()
    assert dead in removed and not live & set(removed)
    assert live <= ours() and dead not in ours()


def test_tcp_transport_makes_no_segment(ipc):
    before = ours()
    server = WeightServer(ipc("weights"), SECURITY, bucket_bytes=200, transport="tcp")
    client = client_of(server)
    try:
        model = Net(5)
        server.publish(model, version=1)
        ready = newest(client, 1)
        assert ready.shm is None and ours() == before
        with client.tensors(ready) as got:
            assert_bitwise(got, model)
        assert client.loads == {"shm": 0, "tcp": 1}
    finally:
        client.close()
        server.close()
    with pytest.raises(ValueError, match="not one of auto, tcp, shm"):
        WeightServer(ipc("w2"), SECURITY, bucket_bytes=200, transport="udp")


def test_checksums_hashed_while_writing_equal_those_of_the_written_bytes(monkeypatch):
    """The writer hashes each bucket in pieces as it copies; the checksums are those of the bytes
    in the slot, computed afresh, for every dtype and with pieces that split tensors anywhere."""
    from dph_async.learner import shm_slots
    from dph_async.weight_buckets import make_buckets

    monkeypatch.setattr(shm_slots, "CHUNK_BYTES", 1000)  # not a multiple of any row or dtype
    g = torch.Generator().manual_seed(11)
    named = [("a", torch.randn(37, 29, generator=g)), ("b", torch.randn(300, generator=g).to(torch.bfloat16)),
             ("c", torch.randint(-9, 9, (17, 3), generator=g)), ("d", torch.randn(5, 7, generator=g).t()),
             ("e", torch.randn(2000, generator=g).to(torch.float16))]
    writer = shm_slots.SlotWriter(keep=2)
    try:
        _, views, checksums = writer.write(named, version=1, held=set(), bucket_bytes=3000)
        fresh = make_buckets(views, 3000)
        assert len(checksums) == len(fresh) > 2 and checksums == [info.checksum for info, _ in fresh]
        for (name, t), (vname, arr, _) in zip(named, views, strict=True):
            got = torch.from_numpy(arr.copy())
            assert name == vname and torch.equal(got.view(t.dtype) if t.dtype == torch.bfloat16 else got, t)
    finally:
        writer.close()
