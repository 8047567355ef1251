"""Weight transfer integrity (dph_async/weight_buckets.py, learner/publish.py, actors/weight_client.py), over real
ZeroMQ sockets: every dtype (bf16 included) arrives bit for bit; a corrupted or torn bucket is refused
by its checksum and nothing of that version reaches the engine; the two newest versions stay
fetchable while a fetch is in progress, and a published version never changes under the actors.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dph_async.actors.rollout import RolloutWorker
from dph_async.actors.weight_client import WeightClient, WeightFetchError
from dph_async.config import RunConfig
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity
from dph_async.protocol import WeightsBucket, WeightsReady, WeightsRequest
from dph_async.tasks.dataset import PromptRecord
from dph_async.weight_buckets import checksum, make_buckets, tensor_to_array

SECURITY = NetSecurity()


class Net(torch.nn.Module):
    """Parameters and buffers of every dtype a model may publish, bf16 first."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(33, 17, generator=g).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(129, generator=g))
        self.c = torch.nn.Parameter(torch.randn(7, 5, generator=g).to(torch.float16))
        self.register_buffer("ids", torch.randint(-(2**40), 2**40, (11,), generator=g))
        self.register_buffer("i32", torch.randint(-(2**30), 2**30, (3, 4), generator=g, dtype=torch.int32))
        self.register_buffer("u8", torch.randint(0, 256, (9,), generator=g, dtype=torch.uint8))


@pytest.fixture
def server(ipc):
    # 200-byte buckets: each version is several buckets, so a fetch has a "middle".
    srv = WeightServer(ipc("weights"), SECURITY, bucket_bytes=200)
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    # Over the socket: these tests tamper with its replies (tests/test_weights_shm.py: shared memory).
    c = WeightClient(server.address, SECURITY, actor_id=0, timeout_s=5.0, transport="tcp")
    yield c
    c.close()


def newest(client: WeightClient, version: int) -> WeightsReady:
    """The manifest of `version` (or a newer one), once the server's push or an answer brought it."""
    deadline = time.monotonic() + 5
    while (ready := client.newest(version - 1)) is None or ready.version < version:
        assert time.monotonic() < deadline, f"version {version} not announced"
        time.sleep(0.01)
    return ready


def assert_bitwise(got: list[tuple[str, torch.Tensor]], model: torch.nn.Module) -> None:
    want = model.state_dict()
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        w = want[name]
        assert t.dtype == w.dtype and t.shape == w.shape, name
        # Bit patterns, not values: NaN payloads and -0.0 count too.
        assert torch.equal(t.view(torch.uint8) if t.dim() else t, w.view(torch.uint8) if w.dim() else w), name


def test_every_dtype_round_trips_bit_for_bit(server, client):
    model = Net(0)
    with torch.no_grad():
        model.a[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)
    stats = server.publish(model, version=1)
    assert stats.buckets > 3
    ready = client.newest(have_version=0)
    assert ready is not None and ready.version == 1
    assert client.newest(have_version=1) is None  # nothing newer than what the actor holds
    got = client.fetch(ready)
    assert_bitwise(got, model)
    assert dict(got)["a"].dtype == torch.bfloat16
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert client.bytes_fetched == stats.nbytes == nbytes


def test_buckets_respect_the_size_bound_and_keep_order():
    named = [(f"t{i}", np.arange(n, dtype=np.float32), "float32") for i, n in enumerate([10, 40, 60, 5, 100, 1])]
    buckets = make_buckets(named, bucket_bytes=200)
    assert [n for info, _ in buckets for n in info.names] == [n for n, *_ in named]
    for info, arrays in buckets:
        # At most bucket_bytes, unless one tensor alone is larger.
        assert info.nbytes == sum(a.nbytes for a in arrays) and (info.nbytes <= 200 or len(arrays) == 1)
        assert info.checksum == checksum(arrays)
    assert [info.index for info, _ in buckets] == list(range(len(buckets)))


def test_checksum_catches_any_single_bit_flip():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(16).astype(np.float32), rng.integers(0, 255, 7, dtype=np.uint8)]
    good = checksum(arrays)
    for which, a in enumerate(arrays):
        for byte in range(a.nbytes):
            for bit in range(8):
                bad = [x.copy() for x in arrays]
                bad[which].view(np.uint8)[byte] ^= 1 << bit
                assert checksum(bad) != good
    # A bucket cut short, or its tensors swapped, changes it too.
    assert checksum([arrays[0], arrays[1][:-1]]) != good
    assert checksum(arrays[::-1]) != good


def tamper(server: WeightServer, monkeypatch, how) -> list[int]:
    """Make the server answer bucket requests through `how(reply) -> reply`; returns the indices seen."""
    answer, seen = server._answer, []

    def bad(msg):
        reply = answer(msg)
        if isinstance(msg, WeightsRequest) and isinstance(reply, WeightsBucket):
            seen.append(msg.bucket)
            return how(reply)
        return reply

    monkeypatch.setattr(server, "_answer", bad)
    return seen


def flip_a_bit(reply: WeightsBucket) -> WeightsBucket:
    if reply.index != 2:
        return reply
    arrays = [a.copy() for a in reply.arrays]
    arrays[-1].view(np.uint8)[-1] ^= 0x10
    return WeightsBucket(reply.version, reply.index, reply.names, arrays, reply.checksum, reply.dtypes)


class RecordingEngine:
    """Stands in for vLLM in this unit test: records what would have been loaded."""

    shares_weights = False

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []

    def load_weights(self, tensors, version: int, keep: bool = False) -> bool:
        self.loaded.append((version, list(tensors)))
        self.version = version
        return False


def worker(client: WeightClient, engine: RecordingEngine) -> RolloutWorker:
    prompts = [PromptRecord("p0", "embedded", "1+1=", (1, 2, 3), "2")]
    return RolloutWorker(0, RunConfig(), engine, prompts, sender=None, weights=client, scorer=None)


def test_a_corrupted_bucket_is_refused_and_never_reaches_the_engine(server, client, monkeypatch):
    v1 = Net(1)
    server.publish(v1, version=1)
    seen = tamper(server, monkeypatch, flip_a_bit)
    with pytest.raises(WeightFetchError, match="bucket 2 failed its checksum"):
        client.fetch(client.newest(0))
    assert seen == [0, 1, 2]  # refused at the bad bucket, before the rest was even asked for

    engine = RecordingEngine()
    actor = worker(client, engine)
    actor.update_weights()
    assert engine.loaded == [] and engine.version == 0 and actor.stats.weight_fetch_failures == 1
    monkeypatch.undo()  # the fault goes away: the next pass loads the version whole
    actor.update_weights()
    assert [v for v, _ in engine.loaded] == [1] and actor.stats.weight_loads == 1
    assert_bitwise(engine.loaded[0][1], v1)


@pytest.mark.parametrize("fault", ["other_version", "renamed", "forged_checksum"])
def test_a_torn_bucket_is_refused(server, client, monkeypatch, fault):
    server.publish(Net(1), version=1)
    server.publish(Net(2), version=2)
    other = {info.index: arrays for info, arrays in server._versions[1]}

    def tear(reply: WeightsBucket) -> WeightsBucket:
        if reply.index != 1:
            return reply
        if fault == "other_version":  # the right names and shapes, another version's bytes
            return WeightsBucket(reply.version, 1, reply.names, other[1], reply.checksum, reply.dtypes)
        if fault == "renamed":
            return WeightsBucket(reply.version, 1, [*reply.names[:-1], "x"], reply.arrays, reply.checksum,
                                 reply.dtypes)
        # Bad bytes that come with their own matching checksum: the manifest's checksum still refuses them.
        arrays = [a.copy() for a in reply.arrays]
        arrays[0].view(np.uint8)[0] ^= 1
        return WeightsBucket(reply.version, 1, reply.names, arrays, checksum(arrays), reply.dtypes)

    tamper(server, monkeypatch, tear)
    engine = RecordingEngine()
    actor = worker(client, engine)
    actor.update_weights()
    assert engine.loaded == [] and actor.stats.weight_fetch_failures == 1


def test_two_versions_stay_fetchable_while_a_fetch_is_in_progress(server, client, monkeypatch):
    models = {v: Net(v) for v in (1, 2, 3, 4)}
    server.publish(models[1], version=1)
    ready = client.newest(0)
    call, published = client._call, []

    def publish_during_fetch(msg, *args):
        reply = call(msg, *args)
        if isinstance(msg, WeightsRequest) and len(published) < publish_count:
            v = server.latest + 1
            server.publish(models[v], version=v)
            published.append(v)
        return reply

    monkeypatch.setattr(client, "_call", publish_during_fetch)
    publish_count = 1  # version 2 appears after the first bucket of version 1: version 1 is still held
    assert_bitwise(client.fetch(ready), models[1])
    assert server.latest == 2

    # Two newer versions (3, 4) appear during a fetch of version 2: it is no longer held, the fetch is refused
    # (never a mix of versions), and the actor then loads the newest whole.
    published.clear()
    publish_count = 2
    newest(client, 2)  # announced by the server's thread, maybe after the fetch returned: waited for
    engine = RecordingEngine()
    engine.version = 1
    actor = worker(client, engine)
    actor.update_weights()
    assert engine.loaded == [] and actor.stats.weight_fetch_failures == 1
    newest(client, 4)  # pushed by the server's thread, maybe after the refusal's reply: waited for
    actor.update_weights()
    assert [v for v, _ in engine.loaded] == [4] and engine.version == 4
    assert_bitwise(engine.loaded[0][1], models[4])


def test_a_published_version_does_not_change_when_the_model_trains_on(server, client):
    model = Net(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    server.publish(model, version=1)
    with torch.no_grad():  # the optimizer updates parameters in place
        for p in model.parameters():
            p.add_(1)
    got = dict(client.fetch(client.newest(0)))
    for name, t in before.items():
        assert torch.equal(got[name], t), name


def test_bf16_travels_as_its_bits():
    t = torch.tensor([1.0, -2.5, 3e38, 1e-40], dtype=torch.bfloat16)
    arr, tag = tensor_to_array(t)
    assert tag == "bfloat16" and arr.dtype == np.uint16
    assert np.array_equal(arr, t.view(torch.int16).numpy().view(np.uint16))
