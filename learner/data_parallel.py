"""Data-parallel learner ranks: each batch split over R DeepSpeed ranks, the same update as one rank.

    rank 0: the learner (replay, weights, checkpoints)       ranks 1..R-1: trainer.follow(trainer, checkpoints)
    trainer.train_step(batch)   -- "train" + the batch -->   trainer.train_step(batch)
    trainer.save(...)           -- "save" -------------->    trainer.save(...)   (same tag)
    trainer.whole_state()       -- "gather" ------------>    trainer.whole_state()  (ZeRO-3 only)
    trainer.load(..., tag)      -- "load" + tag -------->    trainer.load(..., tag)
    trainer.close()             -- "stop" -------------->    return

Why R ranks compute the update of one: the objectives give each micro-batch its share of the
mini-batch objective with batch-wide denominators (`learner.objectives`), so the mini-batch loss is
the sum of the shares, whichever rank computes them. Every rank holds the whole batch and takes a
deterministic share of its units (GRPO groups, reference samples), balanced by tokens. DeepSpeed
averages gradients over ranks; each rank scales its loss by R, so the average is the sum.

Every rank runs the same number of backward passes per optimizer step: ZeRO-2 reduces gradients
during each backward, in buckets filled in the order the gradients arrive, so a rank with fewer
micro-batches pads with passes of zero weight over a real sequence (`Trainer._idle_loss`).

Control traffic (commands, the batch, each step's record for the metrics) goes over a gloo group of
its own, as bytes of the wire protocol or msgpack: nothing is pickled, and on GPUs it stays off NCCL.
Only rank 0 computes metrics; it gathers the others' losses, parts and per-token diagnostics.

Under ZeRO-3 each rank holds 1/R of every parameter, and every forward gathers them: a collective.
So the ranks run as many forwards everywhere (the proximal passes are padded like the backward
ones), and what needs whole weights on rank 0 alone (publishing, the final model, the KL monitor's
sampling) starts with a "gather" that every rank takes part in.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import torch
import torch.distributed as dist

from dph_async import protocol
from dph_async.learner.losses import PolicyLoss
from dph_async.protocol import Batch

if TYPE_CHECKING:
    from dph_async.learner.batching import Unit
    from dph_async.learner.step_record import StepRecord

# Followers wait on the control group for as long as rank 0 waits for the replay to fill a batch.
CONTROL_TIMEOUT = timedelta(hours=24)
_TAG = re.compile(r"v\d+")
_ACCEPT_BATCH = protocol.Limits(accept=frozenset({Batch}))


@dataclass(frozen=True)
class Rendezvous:
    """Where rank `rank` of `world` meets the others, all on one node: a file store at `store`, in a
    directory only this user can open (`private_dir`). Nothing listens on the network for it: torch's
    default, a TCP store, listens on every interface and answers anyone; gloo's own sockets stay on
    loopback."""

    rank: int
    world: int
    store: str


def private_dir() -> Path:
    """A new directory that only this user can open (mode 0700), for a rendezvous's store."""
    return Path(tempfile.mkdtemp(prefix="dph-async-ranks-"))


Op = Literal["train", "save", "load", "gather", "stop"]


class Command(msgspec.Struct):
    """What rank 0 tells the others to do next; a "train" command's frames carry the batch."""

    op: Op
    tag: str = ""  # the checkpoint to load


class _Record(msgspec.Struct):
    """One rank's share of a step's record: what rank 0 needs for the batch's metrics."""

    loss: list[float]
    parts: dict[str, float]
    trained: int
    tokens: int
    grads: list[str]


@dataclass
class Ranks:
    """This process's place among the learner's ranks, and the collectives the trainer needs."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = field(default=None, repr=False)  # the control group (gloo)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, *kinds: list[Unit]) -> list[list[Unit]]:
        """This rank's units of each kind. Every rank computes the same assignment: units longest
        first (the order given breaks ties), each to the rank with the fewest tokens so far."""
        if self.world == 1:
            return list(kinds)
        items = [(k, i, len(u[0].prompt_ids) + sum(len(s.response_ids) for s in u))
                 for k, units in enumerate(kinds) for i, u in enumerate(units)]
        load = [0] * self.world
        mine: set[tuple[int, int]] = set()
        for k, i, cost in sorted(items, key=lambda x: -x[2]):
            r = load.index(min(load))
            load[r] += cost
            if r == self.rank:
                mine.add((k, i))
        return [[u for i, u in enumerate(units) if (k, i) in mine] for k, units in enumerate(kinds)]

    def most(self, n: int) -> int:
        """The largest `n` over the ranks."""
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    # --- Commands from rank 0 -------------------------------------------------------------------

    def send(self, op: Op, batch: Batch | None = None, tag: str = "") -> None:
        """Rank 0 tells the others what to do next (nothing to do with one rank)."""
        if self.world == 1:
            return
        frames = [msgspec.msgpack.encode(Command(op, tag)), *(protocol.encode(batch) if batch is not None else [])]
        self._broadcast(frames)

    def receive(self) -> tuple[Command, Batch | None]:
        frames = self._broadcast(None)
        cmd = msgspec.msgpack.decode(frames[0], type=Command)
        if cmd.op == "load" and not _TAG.fullmatch(cmd.tag):
            raise ValueError(f"checkpoint tag {cmd.tag!r} is not of the form v<version>")
        batch = protocol.decode(frames[1:], _ACCEPT_BATCH) if cmd.op == "train" else None
        return cmd, batch  # type: ignore[return-value]

    def _broadcast(self, frames: list | None) -> list[memoryview]:
        """Rank 0's frames to every rank: their count, their lengths, then their bytes."""
        count = torch.tensor([len(frames) if frames is not None else 0], dtype=torch.int64)
        dist.broadcast(count, 0, group=self.group)
        lengths = (torch.tensor([len(memoryview(f).cast("B")) for f in frames], dtype=torch.int64)
                   if frames is not None else torch.zeros(int(count), dtype=torch.int64))
        dist.broadcast(lengths, 0, group=self.group)
        # Never empty: the command's own frame comes first.
        data = (torch.frombuffer(bytearray(b"".join(bytes(f) for f in frames)), dtype=torch.uint8)
                if frames is not None else torch.empty(int(lengths.sum()), dtype=torch.uint8))
        dist.broadcast(data, 0, group=self.group)
        # Writable memory: the decoded arrays become tensors without a copy.
        raw, out, at = memoryview(bytearray(data.numpy().tobytes())), [], 0
        for n in lengths.tolist():
            out.append(raw[at:at + n])
            at += n
        return out

    # --- Gathering a step's record on rank 0 ----------------------------------------------------

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return [o[:int(s)].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]

    def merge(self, record: StepRecord, params: list[torch.Tensor]) -> None:
        """Make rank 0's `record` the whole step's: losses and parts summed over the ranks, the
        per-token diagnostics of every rank, each part's gradient summed (when diagnosed)."""
        if self.world == 1:
            return
        rows = _token_rows(record)
        mine = _Record([float(x) for x in record.loss], {k: float(sum(v)) for k, v in record.parts.items()},
                       record.trained_tokens, rows.shape[1], sorted(record.grads))
        heads = [msgspec.msgpack.decode(b, type=_Record) for b in self._all_gather_bytes(msgspec.msgpack.encode(mine))]
        # Gradients on the engine's own group (NCCL on GPUs); a rank with no micro-batch of a kind adds zeros.
        for kind in sorted({k for h in heads for k in h.grads}):
            grads = record.grads.get(kind) or [torch.zeros_like(p) for p in params]
            for g in grads:
                dist.all_reduce(g)
            record.grads[kind] = grads
        longest = max(h.tokens for h in heads)
        padded = torch.zeros((rows.shape[0], longest), dtype=torch.float32)
        padded[:, :rows.shape[1]] = rows
        gathered = [torch.empty_like(padded) for _ in range(self.world)] if self.main else None
        dist.gather(padded, gathered, dst=0, group=self.group)
        if not self.main:
            return
        record.loss = [torch.tensor(sum(x)) for x in zip(*(h.loss for h in heads), strict=True)]
        parts: dict[str, float] = {}
        for h in heads:
            for k, v in h.parts.items():
                parts[k] = parts.get(k, 0.0) + v
        record.parts = {k: [torch.tensor(v)] for k, v in parts.items()}
        record.trained_tokens = sum(h.trained for h in heads)
        record.tokens = [_from_rows(g[:, :h.tokens]) for g, h in zip(gathered, heads, strict=True) if h.tokens]


# A step record's per-token entry: the PolicyLoss fields, then prox, behaviour log-probs, entropy.
_BOOL_FIELDS = ("clipped", "dual_clipped")


def _token_rows(record: StepRecord) -> torch.Tensor:
    """The record's per-token tensors as one float32 [fields, tokens] tensor on the CPU."""
    n_fields = len(PolicyLoss._fields) + 3
    if not record.tokens:
        return torch.zeros((n_fields, 0), dtype=torch.float32)
    columns = [torch.cat([t.detach().reshape(-1).float().cpu() for t in (*out, *rest)]).reshape(n_fields, -1)
               for out, *rest in record.tokens]
    return torch.cat(columns, dim=1)


def _from_rows(rows: torch.Tensor) -> tuple[PolicyLoss, torch.Tensor, torch.Tensor, torch.Tensor]:
    k = len(PolicyLoss._fields)
    fields = [rows[i][None].bool() if name in _BOOL_FIELDS else rows[i][None]
              for i, name in enumerate(PolicyLoss._fields)]
    return PolicyLoss(*fields), rows[k][None], rows[k + 1][None], rows[k + 2][None]


def init_distributed(rendezvous: Rendezvous | None = None) -> Ranks:
    """Join the learner's process group (a single rank's, on an in-memory store, without a
    rendezvous) and, with several ranks, the control group."""
    import deepspeed  # heavy: a trainer's (learner/trainer.py), which calls this; the rendezvous needs none

    rank, world = (rendezvous.rank, rendezvous.world) if rendezvous else (0, 1)
    gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpu else "cpu")
    # A GPU rank started by Ray sees only its own device.
    local = 0 if torch.cuda.device_count() == 1 else rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
    # gloo listens on the address the host name resolves to unless told otherwise: the ranks share a
    # node, so all their sockets stay on loopback, as every other socket of a run is by default.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if gpu else "gloo"
    if not dist.is_initialized():
        # Our store, not DeepSpeed's env:// (a TCP store on every interface, for as long as the process
        # lives); DeepSpeed then takes the group as it finds it.
        store = dist.FileStore(rendezvous.store, world) if rendezvous else dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend=backend)
    if dist.get_world_size() != world:
        raise RuntimeError(f"this process already belongs to a group of {dist.get_world_size()} rank(s), "
                           f"not the {world} asked for")
    if world == 1:
        return Ranks()
    return Ranks(rank, world, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
