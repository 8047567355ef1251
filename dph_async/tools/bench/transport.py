"""Transport benchmark: the rollout wire protocol against bare ZeroMQ, pickle and memcpy.

Between two processes (this one receives, a spawned one sends), for rollout groups of realistic
shape, each measurement moves the same bytes:

    zmq           the group's arrays as raw frames over PUSH/PULL, nothing else (the floor of any
                  protocol on ZeroMQ)
    protocol      encode(group) -> the same socket -> decode(frames): header, validation, typed message
    pickle        the RolloutGroup (numpy arrays) pickled through multiprocessing.Queue
    pickle_lists  the same data as Python lists of ints and floats, the way TRL's async GRPO holds a
                  rollout group, through multiprocessing.Queue
    memcpy        copying the group's bytes in one process, for scale

Every repeat runs each mode once, in a rotating order, and the ratios are taken within a repeat,
so load from other processes on the machine shifts both sides of a ratio alike. The CPU time both
processes spend per group (all threads, ZeroMQ's I/O threads included) is recorded too: unlike
wall-clock rates it hardly depends on who else is using the cores.

plus the whole ingest path into a replay process (with and without its write-ahead log) and the
replay's own insert+sample rate in-process with 100k groups held. `synthetic_group`
makes the groups; the data-plane tests use it too.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from dph_async.config.replay import ReplayConfig
from dph_async.net import NetSecurity
from dph_async.protocol import BatchRequest, Completion, RolloutGroup, SamplingInfo, decode, encode
from dph_async.replay.core import ReplayCore
from dph_async.replay.service import ReplayService
from dph_async.replay.wal import WriteAheadLog
from dph_async.replay_client import ReplayClient, RolloutSender
from dph_async.rewards.result import RewardResult

HWM = 64  # messages queued per socket: bounds memory at the largest shapes, same for both modes


def synthetic_group(
    actor_id: int,
    seq: int,
    n: int = 8,
    tokens: int = 16,
    version: int = 0,
    prompt_tokens: int = 32,
    rng: np.random.Generator | None = None,
) -> RolloutGroup:
    """A rollout group of realistic shape: n completions of `tokens` tokens (token ids, behaviour
    log-probs and per-token versions, all `version`), rewards alternating correct/wrong."""
    rng = rng or np.random.default_rng(seq)
    completions = [
        Completion(
            token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
            logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
            versions=np.full(tokens, version, dtype=np.int32),
            reward=RewardResult(float(i % 2), bool(i % 2)),
            finish_reason="stop",
        )
        for i in range(n)
    ]
    return RolloutGroup(
        actor_id=actor_id,
        seq=seq,
        prompt_id=f"prompt-{actor_id}-{seq}",
        data_source="synthetic",
        prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        completions=completions,
        sampling=SamplingInfo(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=tokens),
        created_at=0.0,
        finished_at=0.0,
    )


def as_lists(group: RolloutGroup) -> dict:
    """The group the way TRL's async GRPO keeps one: Python lists of token ids and log-probs."""
    return {
        "prompt_ids": group.prompt_ids.tolist(),
        "completions_ids": [c.token_ids.tolist() for c in group.completions],
        "completions_logprobs": [c.logprobs.tolist() for c in group.completions],
        "versions": [c.versions.tolist() for c in group.completions],
    }


def raw_frames(group: RolloutGroup) -> list[memoryview]:
    """The group's arrays as frames, exactly the array frames `encode` produces, without the header."""
    arrays = [group.prompt_ids] + [a for c in group.completions for a in (c.token_ids, c.logprobs, c.versions)]
    return [memoryview(a).cast("B") for a in arrays]


# ---------------------------------------------------------------------------------------------
# The sending process: told what to send over a control socket, so one process serves every cell.


def _sender(control: str, data: str, queue: mp.Queue) -> None:
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.connect(control)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, HWM)
    push.connect(data)
    groups: dict[tuple[int, int], RolloutGroup] = {}
    loop_start = time.process_time()
    while True:
        cmd = ctl.recv_json()
        if cmd["mode"] == "exit":
            break
        if cmd["mode"] == "cpu":  # asked once the receiver has everything: our I/O thread is done too
            ctl.send_json(time.process_time() - loop_start)
            continue
        shape = (cmd["n"], cmd["tokens"])
        if shape not in groups:
            groups[shape] = synthetic_group(0, 0, n=cmd["n"], tokens=cmd["tokens"], prompt_tokens=cmd["prompt"])
        group = groups[shape]
        frames = raw_frames(group)
        lists = as_lists(group) if cmd["mode"] == "pickle_lists" else None
        loop_start = time.process_time()
        for _ in range(cmd["count"]):
            if cmd["mode"] == "zmq":
                push.send_multipart(frames, copy=False)
            elif cmd["mode"] == "protocol":
                push.send_multipart(encode(group), copy=False)
            else:
                queue.put(lists if lists is not None else group)
    push.close(linger=0)
    ctl.close()
    ctx.term()


@dataclass
class Cell:
    mode: str
    transport: str
    n: int
    tokens: int
    group_bytes: int
    count: int
    seconds: float
    cpu_s: float  # CPU time of both processes (all their threads) for the whole run

    @property
    def cpu_us_per_group(self) -> float:
        return self.cpu_s / self.count * 1e6

    @property
    def groups_per_s(self) -> float:
        return (self.count - 1) / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.groups_per_s * self.group_bytes / 1e9


class TransportBench:
    """The receiving side; one sender process per transport."""

    def __init__(self, transport: str, prompt_tokens: int, on_cell: Callable[[Cell], None] | None = None):
        self.transport = transport
        self.on_cell = on_cell
        self.prompt = prompt_tokens
        self.tmp = tempfile.mkdtemp(prefix="dph-bench-")
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.PAIR)
        self.ctl.bind(f"ipc://{self.tmp}/ctl")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, HWM)
        if transport == "tcp":
            port = self.pull.bind_to_random_port("tcp://127.0.0.1")
            data = f"tcp://127.0.0.1:{port}"
        else:
            data = f"ipc://{self.tmp}/data"
            self.pull.bind(data)
        spawn = mp.get_context("spawn")
        self.queue = spawn.Queue(maxsize=HWM)
        self.proc = spawn.Process(target=_sender, args=(f"ipc://{self.tmp}/ctl", data, self.queue), daemon=True)
        self.proc.start()

    def run(self, mode: str, n: int, tokens: int, count: int) -> Cell:
        """Time `count` groups from the first received to the last (process start-up excluded)."""
        group_bytes = n * tokens * 12 + self.prompt * 4
        cpu_start = time.process_time()
        self.ctl.send_json({"mode": mode, "n": n, "tokens": tokens, "prompt": self.prompt, "count": count})
        if mode.startswith("pickle"):
            receive = self.queue.get
        elif mode == "protocol":
            receive = lambda: decode(self.pull.recv_multipart(copy=False))  # noqa: E731
        else:
            receive = lambda: self.pull.recv_multipart(copy=False)  # noqa: E731
        receive()
        start = time.perf_counter()
        for _ in range(count - 1):
            receive()
        seconds = time.perf_counter() - start
        self.ctl.send_json({"mode": "cpu"})
        cpu_s = time.process_time() - cpu_start + self.ctl.recv_json()
        cell = Cell(mode, self.transport, n, tokens, group_bytes, count, seconds, cpu_s)
        if self.on_cell is not None:
            self.on_cell(cell)
        return cell

    def close(self) -> None:
        self.ctl.send_json({"mode": "exit"})
        self.proc.join(10)
        self.pull.close(linger=0)
        self.ctl.close(linger=0)
        self.ctx.term()


def memcpy_gb_per_s(nbytes: int, min_seconds: float = 0.2) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copies, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        np.copyto(dst, src)
        copies += 1
    return copies * nbytes / elapsed / 1e9


def count_for(group_bytes: int, target_bytes: float) -> int:
    return int(min(20_000, max(200, target_bytes / group_bytes)))


def _summary(cells: list[Cell]) -> dict:
    rates = [c.groups_per_s for c in cells]
    median = statistics.median(rates)
    return {
        "groups_per_s": median,
        "gb_per_s": median * cells[0].group_bytes / 1e9,
        "cpu_us_per_group": statistics.median(c.cpu_us_per_group for c in cells),
        "runs_groups_per_s": rates,
    }


MODES = ("zmq", "protocol", "pickle", "pickle_lists")


def bench_transport(
    shapes: list[tuple[int, int]],
    transports: list[str],
    repeats: int,
    target_mb: float,
    prompt_tokens: int,
    on_cell: Callable[[Cell], None] | None = None,
) -> list[dict]:
    """One row per (shape, transport). Each repeat runs every mode once, in a rotating order, and
    the ratios protocol/baseline are taken within the repeat; rows report medians."""
    rows = []
    for transport in transports:
        bench = TransportBench(transport, prompt_tokens, on_cell)
        try:
            for n, tokens in shapes:
                group_bytes = n * tokens * 12 + prompt_tokens * 4
                count = count_for(group_bytes, target_mb * 1e6)
                # The pickle queues are slower: fewer groups keep their runs about as long.
                counts = {
                    "zmq": count,
                    "protocol": count,
                    "pickle": max(50, count // 4),
                    "pickle_lists": max(10, count // 40),
                }
                runs: dict[str, list[Cell]] = {mode: [] for mode in MODES}
                for r in range(repeats):
                    for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                        runs[mode].append(bench.run(mode, n, tokens, counts[mode]))
                row = {"n": n, "tokens": tokens, "group_bytes": group_bytes, "transport": transport, "count": count}
                for mode in MODES:
                    row[mode] = _summary(runs[mode])
                for base in ("zmq", "pickle", "pickle_lists"):
                    ratios = [
                        p.groups_per_s / b.groups_per_s for p, b in zip(runs["protocol"], runs[base], strict=True)
                    ]
                    row[f"protocol_vs_{base}"] = statistics.median(ratios)
                    row[f"protocol_vs_{base}_runs"] = ratios
                # CPU seconds hardly depend on who else uses the cores: the protocol's own cost.
                cpu = [p.cpu_s / z.cpu_s for p, z in zip(runs["protocol"], runs["zmq"], strict=True)]
                row["protocol_cpu_vs_zmq"] = statistics.median(cpu)
                row["memcpy_gb_per_s"] = memcpy_gb_per_s(group_bytes)
                rows.append(row)
        finally:
            bench.close()
    return rows


# ---------------------------------------------------------------------------------------------
# The replay's store in-process: insert and sample with many groups held.


def bench_replay(held: int, batch: int, seconds: float, wal_dir: str | None = None) -> dict:
    """Groups/s of ReplayCore with about `held` groups held: inserting (ingest, as the service calls
    it, `batch` groups per call), sampling (batches of `batch`, each confirming the one before), and
    both in turn at a steady `held`.

    Small groups (8 x 16 tokens): the store's cost is per group, not per byte; the arrays are
    shared so 100k groups fit in memory. Validation reads every array, so it is per byte."""
    template = synthetic_group(0, 0, n=8, tokens=16)
    core = ReplayCore(
        ReplayConfig(max_staleness=10**6, admission=False, wal_dir=None, max_version_lead=10**6, max_store_mb=1e9),
        batch,
        wal=WriteAheadLog(wal_dir) if wal_dir else None,
    )
    seq = 0
    request_ids = iter(range(1, 1 << 62))

    def insert() -> int:
        nonlocal seq
        groups = [
            RolloutGroup(0, s, "p", "synthetic", template.prompt_ids, template.completions, template.sampling, 0.0, 0.0)
            for s in range(seq, seq + batch)
        ]
        core.ingest(groups)
        seq += batch
        return batch

    def sample() -> int:
        return len(core.request(BatchRequest(0, batch, 0.0, next(request_ids))).groups)

    def rate(step, calls: int | None = None) -> float:
        """Groups/s of `step` over `calls` calls, or over `seconds` if calls is None."""
        done, start = 0, time.perf_counter()
        while (done < calls * batch) if calls is not None else (time.perf_counter() - start < seconds):
            done += step()
        return done / (time.perf_counter() - start)

    while seq < held:
        insert()
    half = held // (2 * batch)
    sample_rate = rate(sample, half)  # held -> held / 2
    insert_rate = rate(insert, half)  # held / 2 -> held
    pair_rate = rate(lambda: insert() + sample()) / 2
    return {
        "held": len(core.store),
        "batch": batch,
        "wal": wal_dir is not None,
        "insert_groups_per_s": insert_rate,
        "sample_groups_per_s": sample_rate,
        "insert_plus_sample_per_s": pair_rate,
    }


def _replay_process(ingest: str, batch: str, wal_dir: str | None, token: bytes, gate: bool) -> None:
    cfg = ReplayConfig(max_staleness=10**6, admission=False, max_group_mb=1024, max_store_mb=1e9)
    security = NetSecurity(gate=gate, gate_memory_mb=4096)
    ReplayService(cfg, ingest, batch, 64, wal_dir=wal_dir, control_token=token, security=security).serve_forever()


def bench_ingest(n: int, tokens: int, count: int, prompt_tokens: int, wal: bool, gate: bool = True) -> dict:
    """The whole ingest path: RolloutSender here -> the replay service in another process (through
    its gate process when `gate`; decode, validation, write-ahead log when `wal`, acknowledgement),
    until every group is acknowledged."""
    tmp = tempfile.mkdtemp(prefix="dph-bench-ingest-")
    ingest, batch = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    token = secrets.token_bytes(32)  # to shut it down: only the control identity may
    proc = mp.get_context("spawn").Process(
        target=_replay_process, args=(ingest, batch, f"{tmp}/wal" if wal else None, token, gate), daemon=True
    )
    proc.start()
    group = synthetic_group(0, 0, n=n, tokens=tokens, prompt_tokens=prompt_tokens)
    sender = RolloutSender(ingest, 0)
    sender.resume()  # waits until the service is up
    start = time.perf_counter()
    for seq in range(count):
        group.seq = seq
        sender.send(group)
    acked = sender.flush(300)
    seconds = time.perf_counter() - start
    sender.close()
    client = ReplayClient(batch, token=token)
    client.shutdown()
    client.close()
    proc.join(30)
    group_bytes = n * tokens * 12 + prompt_tokens * 4
    return {
        "n": n,
        "tokens": tokens,
        "group_bytes": group_bytes,
        "wal": wal,
        "gate": gate,
        "count": count,
        "all_acknowledged": acked,
        "groups_per_s": count / seconds,
        "gb_per_s": count * group_bytes / seconds / 1e9,
    }


