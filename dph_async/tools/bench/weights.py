"""`dph-async bench weights`: how fast published weights reach a vLLM actor, against memcpy.

A model of >= 100 M parameters is made here (random init, a Llama config vLLM serves, saved with
save_pretrained; kept for the next run). This process is the learner side: it publishes versions
through two real `WeightServer`s, one with the shared-memory transport and one with TCP only. A vLLM
actor in a child process (real `WeightClient`s and a `VLLMEngine`) learns of each version, reads it
(from the learner's /dev/shm slot, or in buckets over the weight socket), verifies it and loads it
into its engine. Per version, the stages:

    snapshot   learner: the model's tensors copied into the shared-memory slot, or into buckets,
               and checksummed (WeightServer.publish)
    transfer   actor: shm: opening and read-locking the slot (a map kept from the previous reads);
               tcp: the buckets over ZeroMQ (request, reply, one bucket at a time)
    checksum   actor: verifying every bucket (in the slot, for shm)
    load       actor: into the engine, in place (the default) or through vLLM's reload path
    publish -> loaded   wall clock from the start of the publish to the end of the load

The rounds run three variants one after the other: "shm" and "tcp" (both loaded in place) and
"tcp+reload" (vLLM's reload path, the way weights were loaded before the in-place loader). Each
variant's rounds run back to back, as in an RL run that reads every version the same way: under
`actors.cpu_gemm=torch` a shared-memory load leaves the engine's layers as views of the leased slot,
and a load after a TCP one frees the engine's own copy first (about 10 ms at this size), which no RL
run pays per version. Each round's ratio is to a memcpy timed just before its publish, so a drift in
others' load on the machine falls on both sides of it. GB/s = the version's bytes / seconds. memcpy: the same
bytes copied tensor by tensor into buffers already touched, by one thread of this process, just
before each publish, so each round's ratio is taken under the same load. Every stage is also timed
in CPU-seconds of its process (memcpy's too): on a machine others share, wall-clock rates fall with
the share of the cores a process gets, while the CPU cost of moving a byte does not. Target: the
actor's fetch + verify + load (what the RL runs report as "load GB/s") at >= 50% of memcpy.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dph_async.actors.engine import VLLMEngine
from dph_async.actors.weight_client import WeightClient
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity
from dph_async.pipeline.report import markdown_table
from dph_async.tasks.embedded import ALPHABET
from dph_async.tasks.tiny_model import build_tokenizer


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 2048
    vocab: int = 32000

    @property
    def name(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-v{self.vocab}"


VARIANTS = ("shm", "tcp", "tcp+reload")


@dataclass
class Round:
    path: str  # the variant: "shm", "tcp" or "tcp+reload" (transport, and how the engine loaded)
    memcpy_s: float  # copying the version's bytes, just before its publish
    snapshot_s: float
    transfer_s: float
    checksum_s: float
    load_s: float
    publish_to_loaded_s: float
    cpu: dict[str, float]  # CPU-seconds of memcpy, snapshot, transfer, checksum, load (their process's)

    @property
    def actor_s(self) -> float:
        """fetch + verify + load: the actor's part."""
        return self.transfer_s + self.checksum_s + self.load_s


@dataclass
class WeightsBench:
    date: str
    machine: dict
    model: dict  # shape, parameters, bytes
    bucket_mb: float
    cpu_gemm: str  # the actor engine's linear layers (actors.cpu_gemm)
    memcpy_gb_per_s: float
    rounds: list[Round]
    summary: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> stage -> median GB/s

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "rounds": [asdict(r) for r in self.rounds]}, indent=2)


def make_model(shape: ModelShape, out: Path) -> Path:
    """A random-init Llama of `shape` with the embedded task's tokenizer, saved with save_pretrained
    (skipped if `out` already holds it)."""
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.heads, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    tmp = out.with_name(out.name + ".partial")
    LlamaForCausalLM(config).save_pretrained(tmp)
    build_tokenizer(ALPHABET).save_pretrained(tmp)
    tmp.rename(out)
    return out


def memcpy(dest: list[np.ndarray], arrays: list[np.ndarray]) -> tuple[float, float]:
    """(wall, CPU) seconds of copying `arrays` into `dest` (buffers already touched), one thread."""
    start, cpu = time.perf_counter(), time.thread_time()
    for d, a in zip(dest, arrays, strict=True):
        np.copyto(d, a)
    return time.perf_counter() - start, time.thread_time() - cpu


def actor_main(model_dir: str, addrs: dict[str, str], conn, cpu_gemm: str) -> None:
    """The actor (a child process): for each ("load", version, variant) from `conn`, wait for that
    version on the variant's server, read, verify and load it, and answer with the stage times."""
    engine = VLLMEngine(model_dir, max_model_len=64, cpu_gemm=cpu_gemm)
    # transport="shm" and "tcp": a variant that silently took the other transport would be misreported.
    clients = {t: WeightClient(addr, NetSecurity(), actor_id=0, transport=t) for t, addr in addrs.items()}
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        _, version, variant = msg
        client = clients[variant.split("+")[0]]
        while (ready := client.newest(engine.version, timeout_s=30.0)) is None or ready.version < version:
            time.sleep(0.001)
        transfer0, checksum0, cpu0 = client.fetch_seconds, client.checksum_seconds, time.process_time()
        verify_cpu0 = client.checksum_cpu_seconds
        engine.inplace_loading = not variant.endswith("+reload")
        loads = dict(engine.loads)
        with client.tensors(ready, lease=engine.shares_weights) as tensors:
            fetched, cpu1 = time.time(), time.process_time()
            engine.load_weights(tensors, ready.version, keep=client.leased)
            done, cpu2 = time.time(), time.process_time()
        path = "inplace" if engine.loads["inplace"] > loads["inplace"] else "reload"
        del tensors
        checksum_s, checksum_cpu = client.checksum_seconds - checksum0, client.checksum_cpu_seconds - verify_cpu0
        conn.send({"path": path, "transfer_s": client.fetch_seconds - transfer0 - checksum_s,
                   "checksum_s": checksum_s, "load_s": done - fetched, "loaded_at": done,
                   "cpu": {"transfer": cpu1 - cpu0 - checksum_cpu, "checksum": checksum_cpu, "load": cpu2 - cpu1}})
    for client in clients.values():
        client.close()


# Versions of each variant left out: the first load builds the engine's plan and maps the slot, and
# the learner's first KEEP_VERSIONS writes create its slots (page faults on new files cost several
# times the copy).
WARMUP = 2

STAGES = ("snapshot", "transfer", "checksum", "load", "actor", "publish_to_loaded")


def _summary(rounds: list[Round], nbytes: int) -> dict[str, dict[str, float]]:
    """Per variant: median GB/s of every stage (wall clock), of memcpy, the actor's share of memcpy
    per round (median), and the same in CPU-seconds."""
    out = {}
    for path in sorted({r.path for r in rounds}):
        rs = [r for r in rounds if r.path == path]
        med = lambda xs: statistics.median(list(xs))  # noqa: E731
        s = {stage: nbytes / med(r.actor_s if stage == "actor" else getattr(r, f"{stage}_s") for r in rs) / 1e9
             for stage in STAGES}
        s["memcpy"] = nbytes / med(r.memcpy_s for r in rs) / 1e9
        s["actor_of_memcpy"] = med(r.memcpy_s / r.actor_s for r in rs)
        s["publish_to_loaded_of_memcpy"] = med(r.memcpy_s / r.publish_to_loaded_s for r in rs)
        for stage in ("memcpy", "snapshot", "transfer", "checksum", "load"):
            s[f"cpu_{stage}"] = nbytes / med(r.cpu[stage] for r in rs) / 1e9
        actor_cpu = [sum(r.cpu[k] for k in ("transfer", "checksum", "load")) for r in rs]
        s["cpu_actor"] = nbytes / med(actor_cpu) / 1e9
        s["cpu_actor_of_memcpy"] = med(r.cpu["memcpy"] / a for r, a in zip(rs, actor_cpu, strict=True))
        out[path] = s
    return out


def run(shape: ModelShape, model_root: Path, rounds: int, bucket_mb: float, machine: dict,
        on_round=None, cpu_gemm: str = "onednn") -> WeightsBench:
    """Publish `rounds` versions (after WARMUP warm-ups per variant, left out), split between the
    variants; return every round's stage times and the medians."""
    model_dir = make_model(shape, model_root / shape.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
    params = sum(p.numel() for p in model.parameters())
    # As in RL runs: tcp on loopback, the shared-memory slots under /dev/shm.
    servers = {t: WeightServer("tcp://127.0.0.1:0", NetSecurity(), int(bucket_mb * 2**20), transport=t)
               for t in ("shm", "tcp")}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=actor_main, args=(str(model_dir), {t: s.address for t, s in servers.items()}, child,
                                                cpu_gemm), daemon=True)
    proc.start()
    try:
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError("the actor's engine did not start within 10 minutes")
        results: list[Round] = []
        sources = [t.detach().numpy() for t in model.state_dict().values()]
        dest = [np.ones_like(a) for a in sources]
        per_variant = [rounds // len(VARIANTS) + (i < rounds % len(VARIANTS)) for i in range(len(VARIANTS))]
        plan = [(v, i >= WARMUP) for v, n in zip(VARIANTS, per_variant, strict=True) for i in range(WARMUP + n)]
        for version, (variant, timed) in enumerate(plan, start=1):
            copy_s, copy_cpu = memcpy(dest, sources)
            start, cpu = time.time(), time.thread_time()
            stats = servers[variant.split("+")[0]].publish(model, version)
            snapshot_cpu = time.thread_time() - cpu
            parent.send(("load", version, variant))
            reply = parent.recv()
            want = "reload" if variant.endswith("+reload") else "inplace"
            if reply["path"] != want:
                raise RuntimeError(f"round {version} ({variant}): the engine loaded through its {reply['path']} path")
            r = Round(variant, copy_s, stats.seconds, reply["transfer_s"], reply["checksum_s"], reply["load_s"],
                      reply["loaded_at"] - start, {"memcpy": copy_cpu, "snapshot": snapshot_cpu, **reply["cpu"]})
            if timed:
                results.append(r)
                if on_round:
                    on_round(r, stats.nbytes)
        nbytes = stats.nbytes
        parent.send("stop")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        for server in servers.values():
            server.close()
    return WeightsBench(
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine={**machine, "load_avg_end": os.getloadavg()},
        model={**asdict(shape), "parameters": params, "bytes": nbytes},
        bucket_mb=bucket_mb,
        cpu_gemm=cpu_gemm,
        memcpy_gb_per_s=nbytes / statistics.median(r.memcpy_s for r in results) / 1e9,
        rounds=results,
        summary=_summary(results, nbytes),
    )


def markdown(res: WeightsBench) -> str:
    m, mem = res.model, res.memcpy_gb_per_s
    rows = [[path, f"{s['memcpy']:.2f}", *(f"{s[k]:.2f}" for k in STAGES), f"{s['actor_of_memcpy']:.0%}",
             f"{s['publish_to_loaded_of_memcpy']:.0%}"] for path, s in res.summary.items()]
    cpu_rows = [[path, *(f"{s['cpu_' + k]:.2f}" for k in ("memcpy", "snapshot", "transfer", "checksum", "load",
                                                          "actor")), f"{s['cpu_actor_of_memcpy']:.0%}"]
                for path, s in res.summary.items()]
    return "\n".join([
        f"# dph-async bench weights ({res.date})", "",
        f"Machine: {res.machine.get('cpu', '?')}, {res.machine.get('cores')} cores; load average at start "
        f"{res.machine.get('load_avg')}, at end {res.machine.get('load_avg_end')}.",
        f"Model: random-init Llama, hidden {m['hidden']}, {m['layers']} layers, vocabulary {m['vocab']}: "
        f"{m['parameters'] / 1e6:.0f} M parameters, {m['bytes'] / 1e6:.0f} MB per version (fp32), buckets of "
        f"{res.bucket_mb:g} MiB; {len(res.rounds)} rounds; the actor's CPU linear layers: {res.cpu_gemm}. memcpy "
        f"of the same bytes: {mem:.2f} GB/s.", "",
        "GB/s per stage, wall clock (medians over the rounds of each variant; the shares of memcpy are each "
        "round's own, then the median):", "",
        markdown_table(["variant", "memcpy", "snapshot", "transfer", "checksum", "load",
                        "actor (fetch+verify+load)", "publish -> loaded", "actor / memcpy",
                        "publish->loaded / memcpy"], rows), "",
        "GB per CPU-second of each stage's process (steadier than wall clock on a shared machine):", "",
        markdown_table(["variant", "memcpy", "snapshot", "transfer", "checksum", "load", "actor",
                        "actor / memcpy"], cpu_rows), "",
    ])
