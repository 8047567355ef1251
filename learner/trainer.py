"""Training on one replay batch: PPO mini-batch updates of the configured objective, through DeepSpeed.

    version v = rollout batches trained; optimizer steps = v x mini_batches x epochs

A batch is split into `mini_batches` parts, one optimizer step each, for `epochs` passes (the later
ones reshuffled, seeded by the version so a resumed run repeats them). The proximal policy of the
decoupled correction is the policy at the start of the batch: its log-probs are recorded before the
first update (the first mini-batch's from its own forward pass, the others' from a no-grad pass),
so the clip and the correction act from the second update on. With one update per batch the
proximal policy is the current one and nothing extra runs.

Micro-batches accumulate gradients up to each optimizer step; each contributes its share of the
mini-batch objective (`learner.objectives`: batch-wide denominators and the DPH sample-share
weighting), so their sum is the mini-batch loss whatever the packing. With `learner.ranks` = R the
micro-batches are split over R data-parallel ranks, and the update is the same
(`learner.data_parallel`).
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from dph_async.config import LearnerConfig
from dph_async.learner import checkpoint_engine, cpu_gemm, zero3
from dph_async.learner.batching import MicroBatch, MiniBatch, PreparedBatch, Unit, pack, prepare
from dph_async.learner.critic import Critic
from dph_async.learner.data_parallel import Ranks, Rendezvous, init_distributed
from dph_async.learner.diagnostics import policy_diagnostics
from dph_async.learner.guard import StepGuard, all_finite, screen
from dph_async.learner.kl_monitor import KLMonitor
from dph_async.learner.logprobs import response_logprobs
from dph_async.learner.losses import PolicyLoss, policy_loss
from dph_async.learner.objectives import Objective, make_objective
from dph_async.learner.step_record import StepRecord
from dph_async.protocol import Batch
from dph_async.state_file import StateFileError

# Devices on which torch's AdamW has its fused form (one kernel over each tensor).
FUSED_ADAM_DEVICES = ("cpu", "cuda")


def deepspeed_config(cfg: LearnerConfig, dtype: str, device: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's FusedAdam would compile an extension first (35-70 s on the CPU).
        # Its fused form: on the CPU it stepped 52 M parameters in 0.025 s of one core against 0.24 s
        # for the loop over tensors torch runs there by default (docs/scaling.md, bench scale).
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                   "betas": [0.9, 0.999], "torch_adam": True,
                                                   "fused": device in FUSED_ADAM_DEVICES}},
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "stage3_param_persistence_threshold": cfg.zero3_persist_below},
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _flat(out: PolicyLoss, mask: torch.Tensor) -> PolicyLoss:
    return PolicyLoss(*(t.detach()[mask][None] for t in out))


def gradient_parts(grads: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Norms of the fresh part's and the reference part's gradients (each already weighted as in the
    objective) and the cosine between them: how much the divergence pulls against the policy loss."""
    flat = {k: torch.cat([g.reshape(-1).double() for g in v]) for k, v in grads.items()}
    out = {f"grad/{k}_norm": float(v.norm()) for k, v in flat.items()}
    if len(flat) == 2:
        a, b = flat["fresh"], flat["reference"]
        out["grad/cosine"] = float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))
    return out


class Trainer:
    def __init__(self, model_dir: str, cfg: LearnerConfig, *, temperature: float, dtype: str, pad_id: int,
                 max_response_tokens: int, seed: int = 0, rendezvous: Rendezvous | None = None) -> None:
        """`rendezvous`: this rank's place among `cfg.ranks` ranks; None for a single rank."""
        # heavy (DeepSpeed): imported where a trainer is built, once its process has set the environment
        # DeepSpeed reads at import (dph_async/runtime/learner_trainer.py); the learner's other users need none
        import deepspeed.accelerator

        self.objective: Objective = make_objective(cfg.loss)
        if cfg.critic.enabled and self.objective.whole_units:
            raise ValueError(f"learner.critic: objective {self.objective.name!r} has no per-token advantage")
        if (rendezvous.world if rendezvous else 1) != cfg.ranks:
            raise ValueError(f"learner.ranks={cfg.ranks} needs a rendezvous of as many ranks")
        self.ranks: Ranks = init_distributed(rendezvous)
        self.cfg, self.loss_cfg, self.seed = cfg, cfg.loss, seed
        self.temperature, self.pad_id = temperature, pad_id
        self.norm = cfg.loss.aggregation_norm or max_response_tokens
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, use_safetensors=True)
        self.vocab = model.get_input_embeddings().num_embeddings  # ids at or past it cannot be trained on
        self.guard = StepGuard(cfg.max_skipped_steps)
        self.cpu_gemm = cpu_gemm.resolve(cfg.cpu_gemm, device=deepspeed.accelerator.get_accelerator().device_name(),
                                         zero_stage=cfg.zero_stage, dtype=torch_dtype)
        if self.cpu_gemm == "onednn":
            cpu_gemm.use_onednn(model)  # before the copies below, which then run through oneDNN too
        # The LM head's products in the CPU kernel through oneDNN too, where the linear layers' are: over a
        # 32k vocabulary the head is most of the learner's products (docs/scaling.md, bench scale).
        self.kernel = "onednn" if self.cpu_gemm == "onednn" and cfg.kernel in ("auto", "torch") else cfg.kernel
        # A frozen copy of pi_0 for objectives with a divergence on fresh tokens (reverse_kl, js, dapo).
        # The KL monitor scores against it too.
        self.reference_model, self.kl_monitor = None, None
        if self.objective.uses_reference_model or cfg.kl_every:
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.kl_every and self.ranks.main:  # rank 0 measures; the weights are the same on every rank
            eos = model.config.eos_token_id
            self.kl_monitor = KLMonitor(self.reference_model, every=cfg.kl_every, samples=cfg.kl_samples,
                                        per_prompt=cfg.kl_per_prompt, temperature=temperature,
                                        max_tokens=max_response_tokens, eos_id=eos[0] if isinstance(eos, list) else eos,
                                        pad_id=pad_id, seed=seed)
        self.critic = None
        if cfg.critic.enabled:
            self.critic = Critic(cfg.critic, model, cfg.grad_clip, seed)
        if cfg.zero_stage == 3:
            zero3.prepare_model(model)  # after the copy: the frozen reference model stays whole
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=deepspeed_config(cfg, dtype,
                                                                               deepspeed.accelerator.get_accelerator().device_name()))
        checkpoint_engine.install(self.engine)  # checkpoints as state files: nothing read back is unpickled
        if cfg.zero_stage == 3:
            zero3.prepare_engine(self.engine)
        # Under ZeRO-3 with several ranks every forward of the model is a collective (its weights are
        # gathered from all ranks): the ranks run as many, and rank 0 never runs one alone. Each
        # micro-batch is then one pass of the model's body, never the two of a shared prompt: the
        # ranks' i-th micro-batches must gather alike whatever their kind.
        self.collective_forwards = cfg.zero_stage == 3 and self.ranks.world > 1
        if self.collective_forwards and self.objective.whole_units:
            raise ValueError(f"learner.loss.objective={cfg.loss.objective} keeps each pair in one shared-prompt "
                             "row, which ZeRO-3 over several ranks cannot run: use learner.ranks=1 or "
                             "learner.zero_stage<=2")
        self._whole: torch.nn.Module | None = None  # rank 0's whole copy for the KL monitor, if needed
        self.version = 0

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def updates_per_batch(self) -> int:
        return self.cfg.mini_batches * self.cfg.epochs

    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """[B, T] log-probs of the micro-batch's responses under the current weights (no gradient)."""
        with torch.no_grad():
            return self._logprobs(self.module, mb, with_entropy=False)[0]

    def _logprobs(self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return response_logprobs(model, mb, self.temperature, with_entropy=with_entropy, impl=self.kernel)

    def _critic_update(self, groups: list[Unit], record: StepRecord) -> dict[str, float]:
        """The critic's targets and update (`Critic.update`) on every fresh sequence of the batch,
        before the policy's first update, which uses the advantages it sets."""
        start = time.perf_counter()
        cfg = self.cfg
        metrics = self.critic.update(pack(groups, "fresh", cfg.micro_token_budget, self.pad_id, cfg.share_prompts,
                                          cfg.pack_row_tokens))
        record.time("critic", start)
        return metrics

    def pack_fresh(self, units: list[Unit]) -> list[MicroBatch]:
        cfg = self.cfg
        whole = self.objective.whole_units  # a DPO pair stays in one row of one micro-batch
        share = (cfg.share_prompts and not self.collective_forwards) or whole
        return pack(units, "fresh", cfg.micro_token_budget, self.pad_id, share,
                    1 << 30 if whole else cfg.pack_row_tokens)

    def pack_reference(self, units: list[Unit]) -> list[MicroBatch]:
        return pack(units, "reference", self.cfg.micro_token_budget, self.pad_id)

    def _pack(self, mini: MiniBatch, skip: bool) -> tuple[list[MicroBatch], list[MicroBatch]]:
        units = mini.fresh_units(skip)
        if not units and mini.groups:
            # Every sequence has zero advantage: one still runs, so the optimizer steps on the zero
            # gradient exactly as it would without skipping (Adam's moments move either way).
            units = [mini.groups[0][:1]]
        units, refs = self.ranks.share(units, [[s] for s in mini.reference])  # this rank's part
        return self.pack_fresh(units), self.pack_reference(refs)

    def _record_prox(self, minis: list[MiniBatch], skip: bool, record: StepRecord) -> None:
        """log pi_prox of every sequence these mini-batches will train on, under the current weights."""
        start = time.perf_counter()
        self.engine.eval()
        todo, recorded = [], set()  # a micro-batch runs if it has a sequence no earlier one records
        for mini in minis:
            for mb in self._pack(mini, skip)[0]:
                if any(s.prox is None and id(s) not in recorded for s in mb.sequences):
                    todo.append(mb)
                    recorded.update(id(s) for s in mb.sequences)
        # Counted before any runs: a rank waiting for the count would stall the others' forwards.
        passes = self.ranks.most(len(todo)) if self.collective_forwards else len(todo)
        with torch.no_grad():
            for i in range(passes):
                mb = todo[i] if i < len(todo) else self._idle_micro(minis[0])
                logp = self._logprobs(self.module, mb, with_entropy=False)[0]
                if i < len(todo):
                    mb.record_prox(logp)
        self.engine.train()
        record.time("proximal", start)

    def _fresh_share(self, mb: MicroBatch, mini: MiniBatch, record: StepRecord) -> torch.Tensor:
        start = time.perf_counter()
        logp, entropy = self._logprobs(self.module, mb, with_entropy=True)
        logp_ref = None
        if self.objective.uses_reference_model:
            with torch.no_grad():
                logp_ref = self._logprobs(self.reference_model, mb, with_entropy=False)[0]
        prox = mb.prox()
        if prox is None and self.updates_per_batch > 1:
            mb.record_prox(logp)  # the batch's first update: the current policy is the proximal one
        start = record.time("forward", start)
        advantages = mb.advantages if self.critic is None else mb.token_field("token_advantages")
        out = policy_loss(logp, mb.old_logprobs, advantages, mb.mask, self.loss_cfg, prox)
        share = self.objective.fresh_share(out, mb.mask, mini.counts, self.norm, entropy=entropy, logp=logp,
                                           logp_ref=logp_ref, advantages=mb.advantages)
        m = mb.mask
        prox_tokens = (logp if prox is None else prox).detach()[m][None]
        record.tokens.append((_flat(out, m), prox_tokens, mb.old_logprobs[m][None], entropy.detach()[m][None]))
        record.trained_tokens += int(m.sum())
        record.add_parts(share.parts)
        record.time("loss", start)
        return share.loss

    def share_loss(self, mb: MicroBatch, mini: MiniBatch, record: StepRecord) -> torch.Tensor:
        """The micro-batch's share of the mini-batch objective, with its graph (what one backward takes)."""
        return (self._fresh_share if mb.kind == "fresh" else self._reference_share)(mb, mini, record)

    def _reference_share(self, mb: MicroBatch, mini: MiniBatch, record: StepRecord) -> torch.Tensor:
        start = time.perf_counter()
        logp, _ = self._logprobs(self.module, mb, with_entropy=False)
        start = record.time("forward", start)
        share = self.objective.reference_share(logp, mb.old_logprobs, mb.mask, mini.counts, self.norm,
                                               as_pg=mb.advantages)
        record.add_parts(share.parts)
        record.time("loss", start)
        return share.loss

    def _add_grad(self, kind: str, loss: torch.Tensor, record: StepRecord) -> None:
        """Add d loss / d parameters to the record's gradient of `kind` (a diagnostic: one more backward)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        acc = record.grads.get(kind)
        record.grads[kind] = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]

    def _update(self, mini: MiniBatch, skip: bool, record: StepRecord, diagnose: bool = False) -> None:
        """One optimizer step on one mini-batch; with `diagnose`, also the gradient of each part."""
        start = time.perf_counter()
        fresh, reference = self._pack(mini, skip)
        micro = [*fresh, *reference]
        record.time("batching", start)
        steps = self.ranks.most(len(micro))  # every rank runs as many backward passes
        if not steps:
            return
        total = torch.zeros(())
        for i in range(steps):
            self.engine.set_gradient_accumulation_boundary(i == steps - 1)
            if i < len(micro):
                mb = micro[i]
                loss = self.share_loss(mb, mini, record)
                if diagnose:
                    self._add_grad(mb.kind, loss, record)
            else:
                loss = self._idle_loss(mini)
            start = time.perf_counter()
            # Shares already carry their weight in the mini-batch objective: no 1/GAS rescaling. Over
            # R ranks DeepSpeed averages the gradients: times R, the shares add up.
            self.engine.backward(loss * self.ranks.world, scale_wrt_gas=False)
            record.time("backward", start)
            total = total + loss.detach()
        record.loss.append(total)
        start = time.perf_counter()
        if self._plain_optimizer and not self._finite_update(total):
            self.engine.zero_grad()  # the gradients are dropped; weights and optimizer state stay as they were
            record.skipped += 1
        else:
            skipped_before = self.engine.skipped_steps
            self.engine.step()
            # DeepSpeed's ZeRO and bf16 optimizers skip a non-finite gradient norm themselves.
            record.skipped += self.engine.skipped_steps - skipped_before
        record.time("optimizer", start)

    @property
    def _plain_optimizer(self) -> bool:
        """ZeRO stage 0 in fp32: DeepSpeed steps torch's optimizer on whatever the gradients hold."""
        return self.engine.zero_optimization_stage() == 0 and not self.engine.bfloat16_enabled()

    def _finite_update(self, loss: torch.Tensor) -> bool:
        """Loss (this rank's) and gradients (reduced over the ranks, so alike on all) are finite."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return (self.ranks.world > 1 or bool(torch.isfinite(loss))) and all_finite(grads)

    def _idle_micro(self, mini: MiniBatch) -> MicroBatch:
        """One real sequence of `mini`, for the passes a rank runs only to match the others'."""
        seq = (mini.groups[0] if mini.groups else mini.reference)[:1]
        (mb,) = pack([seq], "fresh", 1 << 30, self.pad_id, share_prompts=False)
        return mb

    def _idle_loss(self, mini: MiniBatch) -> torch.Tensor:
        """Zero times the log-probs of one real sequence: a backward pass that adds nothing, for a rank
        with fewer micro-batches than the others, reaching the parameters in the usual order."""
        mb = self._idle_micro(mini)
        logp, _ = self._logprobs(self.module, mb, with_entropy=False)
        return (logp * mb.mask).sum() * 0.0

    def prepared(self, batch: Batch) -> PreparedBatch:
        """A screened batch as the updates take it: GRPO advantages, the objective's units, and the
        reference samples if the objective trains on them."""
        lc = self.loss_cfg
        reference = batch.reference if self.objective.uses_pool else []
        p = prepare(Batch(batch.version, batch.groups, reference, batch.drops), use_std=lc.use_std,
                    eps=lc.adv_eps, filter_zero_spread=lc.filter_zero_spread,
                    reference_pg_share=lc.reference_pg_share)
        p.groups, p.skipped_groups = self.objective.form_units(p.groups)
        return p

    @property
    def skip_zero_advantage(self) -> bool:
        # A learned critic gives a group with equal rewards per-token advantages too: none is skipped.
        return self.cfg.skip_zero_advantage and not self.objective.needs_every_fresh_token() and self.critic is None

    def train_step(self, batch: Batch) -> dict[str, float]:
        """Train on `batch` (mini_batches x epochs optimizer steps); the version advances by one.
        Returns the batch's metrics (on rank 0; the others return none)."""
        batch, removed = screen(batch, self.vocab)
        if self.ranks.main:
            self.ranks.send("train", batch)
        lc, cfg = self.loss_cfg, self.cfg
        start = time.perf_counter()
        record = StepRecord()
        staleness = [self.version - g.min_version for g in batch.groups]
        p = self.prepared(batch)
        skip = self.skip_zero_advantage
        rng = random.Random(f"{self.seed}/{self.version}")
        plans = [p.mini_batches(cfg.mini_batches, rng if epoch else None) for epoch in range(cfg.epochs)]
        record.time("batching", start)
        critic_metrics = self._critic_update(p.groups, record) if self.critic is not None else {}
        if self.updates_per_batch > 1 and lc.correction != "behavior":
            # Each rank runs its part of the first mini-batch first; over R ranks, a later epoch can give
            # a rank sequences another rank ran there, so it records those too.
            minis = plans[0][1:] if self.ranks.world == 1 else [m for plan in plans for m in plan][1:]
            self._record_prox(minis, skip, record)
        self.engine.train()
        diagnose = bool(cfg.diagnose_every) and self.version % cfg.diagnose_every == 0
        for epoch, plan in enumerate(plans):
            for k, mini in enumerate(plan):
                self._update(mini, skip, record, diagnose=diagnose and epoch == 0 and k == 0)
        # A batch that gave no update (every group filtered, or no DPO pair) still counts: the replay
        # admits rollouts by version, and would wait forever for a learner that never moves on.
        self.version += 1
        self.ranks.merge(record, [p for p in self.module.parameters() if p.requires_grad])
        if not self.ranks.main:
            return {}
        self.guard.after_batch(batch, record.skipped, self.version)
        metrics = self._metrics(batch, p, record, staleness)
        metrics["learner/screened_records"] = float(len(removed))
        metrics["learner/skipped_updates"] = float(record.skipped)
        metrics.update(critic_metrics)
        if self.kl_monitor is not None and self.kl_monitor.due(self.version):
            kl = self.kl_monitor.measure(self._measured_model(), [g.prompt_ids for g in batch.groups], self.version)
            metrics.update(kl.metrics())
        metrics["learner/step_seconds"] = time.perf_counter() - start
        metrics["learner/tokens_per_s"] = record.trained_tokens / metrics["learner/step_seconds"]
        return metrics

    def _metrics(self, batch: Batch, p: PreparedBatch, record: StepRecord, staleness: list[int]) -> dict[str, float]:
        comps = [c for g in batch.groups for c in g.completions]
        counts = p.counts
        updates = max(len(record.loss), 1)
        m: dict[str, float] = {
            "learner/version": float(self.version),
            "learner/optimizer_steps": float(self.engine.global_steps),
            "loss/total": float(sum(record.loss)) / updates,
            "batch/groups": float(len(batch.groups)),
            "batch/fresh_samples": float(counts.n_fresh),
            "batch/reference_samples": float(counts.n_reference),
            "batch/fresh_tokens": float(counts.fresh_tokens),
            "batch/trained_fresh_tokens": float(record.trained_tokens) / max(self.cfg.epochs, 1),
            "batch/filtered_groups": float(p.filtered_groups),
            "batch/scorer_failed": float(p.scorer_failed),
            "batch/skipped_groups": float(p.skipped_groups),
            "reward/mean": sum(c.reward.score for c in comps) / max(len(comps), 1),
            "reward/accuracy": sum(c.reward.correct for c in comps) / max(len(comps), 1),
            "batch/response_length": counts.fresh_tokens / max(counts.n_fresh, 1),
        }
        m.update({f"loss/{k}": float(sum(v)) / updates for k, v in record.parts.items()})
        m.update({f"time/{k}": v for k, v in record.seconds.items()})
        if staleness:
            m["staleness/mean"] = sum(staleness) / len(staleness)
            m["staleness/max"] = float(max(staleness))
        if record.grads:
            m.update(gradient_parts(record.grads))
        if record.tokens:
            outs, prox, mu, entropy = zip(*record.tokens, strict=True)
            out = PolicyLoss(*(torch.cat(parts, dim=1) for parts in zip(*outs, strict=True)))
            ones = torch.ones_like(out.ratio)
            diag = policy_diagnostics(out, ones, torch.cat(prox, 1), torch.cat(mu, 1), torch.cat(entropy, 1))
            m.update({f"policy/{k}": v for k, v in diag.items()})
        return m

    def _measured_model(self) -> torch.nn.Module:
        """The model the KL monitor samples from: the engine's own, or, when its forwards are
        collectives, a whole copy on rank 0 with the weights gathered from every rank."""
        if not self.collective_forwards:
            return self.module
        if self._whole is None:
            assert self.reference_model is not None  # built whenever the monitor is
            self._whole = copy.deepcopy(self.reference_model)
        self._whole.load_state_dict(self.whole_state())
        return self._whole

    # --- Whole weights and checkpoints ---------------------------------------------------------

    def whole_state(self) -> dict[str, Tensor]:
        """The model's state dict with whole tensors on rank 0 (the others return none). Under ZeRO-3
        every rank takes part in the gathers: rank 0 tells the others first."""
        if self.collective_forwards and self.ranks.main:
            self.ranks.send("gather")
        return zero3.full_state_dict(self.module, keep=self.ranks.main)

    def save_pretrained(self, out_dir: str) -> None:
        """The model, whole, in Hugging Face's layout (rank 0; under ZeRO-3 every rank gathers)."""
        self.module.save_pretrained(out_dir, state_dict=self.whole_state())

    def save(self, directory: Path, client_state: dict) -> None:
        """Every rank writes its part; rank 0's `client_state` is the one kept."""
        if self.ranks.main:
            self.ranks.send("save")
        critic = {} if self.critic is None else {"critic": self.critic.state_dict()}
        self.engine.save_checkpoint(str(directory), tag=f"v{self.version}",
                                    client_state={**client_state, **critic, "version": self.version})

    def load(self, directory: Path, tag: str) -> dict:
        """Model, optimizer, version and client state from checkpoint `tag` (`save`'s v<version>), read
        as state files (`learner.checkpoint_engine`): a file of another format is refused by name."""
        if self.ranks.main:
            self.ranks.send("load", tag=tag)
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if client_state is None:
            raise FileNotFoundError(f"no learner checkpoint {tag!r} in {directory}")
        version = client_state.get("version")
        if type(version) is not int or f"v{version}" != tag:  # the tag bounds it: what save wrote
            raise StateFileError(f"{directory / tag}: the checkpoint holds version {version!r}, its name says {tag}")
        self.version = version
        if self.critic is not None:
            self.critic.load_state_dict(client_state["critic"])
        return client_state

    def close(self) -> None:
        """Release the other ranks (they return from `learner.data_parallel.follow`), then the engine:
        its optimizer's gradient hooks hold it, so without `destroy` a process that builds the next
        run's trainer (a kept learner) would keep every earlier run's model and optimizer state."""
        if self.ranks.main:
            self.ranks.send("stop")
        self.engine.destroy()


def follow(trainer: Trainer, checkpoints: Path) -> int:
    """A rank other than 0: do what rank 0 says until it says stop. Returns the batches trained."""
    steps = 0
    while True:
        cmd, batch = trainer.ranks.receive()
        if cmd.op == "stop":
            return steps
        if cmd.op == "train":
            assert batch is not None
            trainer.train_step(batch)
            steps += 1
        elif cmd.op == "save":
            trainer.save(checkpoints, {})
        elif cmd.op == "gather":
            trainer.whole_state()
        else:
            trainer.load(checkpoints, cmd.tag)
