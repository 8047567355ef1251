"""One DeepSpeed optimizer step on a replay batch: log-probs through the fused kernels, the losses,
diagnostics. The policy version is the number of optimizer steps applied.

Micro-batches accumulate gradients up to one optimizer step: each contributes its share of the
batch objective (the aggregation's batch-wide denominators and the DPH sample-share weighting), so
their sum is the batch loss whatever the packing. One step per batch also makes the proximal policy
the current weights: log pi_prox is log pi_theta before the step, detached.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dph_async.config import LearnerConfig
from dph_async.protocol import Batch
from learner.batching import MicroBatch, PreparedBatch, prepare
from learner.diagnostics import policy_diagnostics
from learner.logprobs import response_logprobs
from learner.losses import (
    REFERENCE_MODEL_MODES,
    PolicyLoss,
    aggregate,
    divergence,
    dph_objective,
    fresh_divergence,
    policy_loss,
)


def deepspeed_config(cfg: LearnerConfig, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's FusedAdam would compile an extension first (35-70 s on the CPU).
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                   "betas": [0.9, 0.999], "torch_adam": True}},
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def init_distributed() -> None:
    """A single learner rank over gloo; the environment says where its (trivial) group lives."""
    import deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")


@dataclass
class _Collected:
    """Detached per-token values of one step's fresh tokens, for the diagnostics."""

    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, **tensors: torch.Tensor) -> None:
        for k, v in tensors.items():
            self.parts.setdefault(k, []).append(v.detach().reshape(1, -1))

    def cat(self, key: str) -> torch.Tensor:
        return torch.cat(self.parts[key], dim=1)


class Trainer:
    def __init__(self, model_dir: str, cfg: LearnerConfig, *, temperature: float, dtype: str, pad_id: int,
                 max_response_tokens: int) -> None:
        import deepspeed

        if cfg.zero_stage > 2:
            raise ValueError("learner.zero_stage: 3 is not supported with the fused log-prob kernels "
                             "(they read the whole LM head); use 0, 1 or 2")
        init_distributed()
        self.cfg, self.loss_cfg = cfg, cfg.loss
        self.temperature, self.pad_id = temperature, pad_id
        self.norm = cfg.loss.aggregation_norm or max_response_tokens
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        # reverse_kl and js need log-probs of a frozen reference model on fresh tokens.
        self.reference_model = None
        if cfg.loss.divergence in REFERENCE_MODEL_MODES:
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=deepspeed_config(cfg, dtype))
        self.version = 0

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _logprobs(self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return response_logprobs(model, mb, self.temperature, with_entropy=with_entropy, impl=self.cfg.kernel)

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        with torch.no_grad():
            return self._logprobs(self.reference_model, mb, with_entropy=False)[0]

    def _fresh_loss(self, mb: MicroBatch, p: PreparedBatch, seen: _Collected) -> torch.Tensor:
        lc = self.loss_cfg
        logp, entropy = self._logprobs(self.module, mb, with_entropy=True)
        out: PolicyLoss = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.mask, lc)
        count = p.fresh_tokens if lc.aggregation == "token-mean" else p.n_fresh
        pg = aggregate(out.loss, out.mask, lc.aggregation, self.norm, count=count)
        ent = aggregate(entropy, mb.mask, "token-mean", count=p.fresh_tokens)
        div_fresh = None
        if lc.divergence in REFERENCE_MODEL_MODES:
            per_tok = fresh_divergence(lc.divergence, logp, self._reference_logprobs(mb))
            div_fresh = aggregate(per_tok, mb.mask, lc.aggregation, self.norm, count=count)
        m = mb.mask
        seen.add(logp=logp[m], mu=mb.old_logprobs[m], w=out.is_weight[m], ratio=out.ratio[m],
                 clipped=out.clipped[m], dual=out.dual_clipped[m], kept=out.mask[m], entropy=entropy[m])
        zero = pg.new_zeros(())
        has_ref = lc.divergence not in ("none", "reverse_kl") and p.n_reference > 0
        return dph_objective(pg, p.n_fresh, lc, div_ref=zero if has_ref else None, n_ref=p.n_reference,
                             div_fresh=div_fresh, entropy=ent)

    def _reference_loss(self, mb: MicroBatch, p: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        lc = self.loss_cfg
        logp, _ = self._logprobs(self.module, mb, with_entropy=False)
        per_tok = divergence(lc.divergence, logp, mb.old_logprobs, lc.alpha)
        count = p.reference_tokens if lc.aggregation == "token-mean" else p.n_reference
        div = aggregate(per_tok, mb.mask, lc.aggregation, self.norm, count=count)
        zero = div.new_zeros(())
        fresh_div = zero if lc.divergence in REFERENCE_MODEL_MODES else None
        return dph_objective(zero, p.n_fresh, lc, div_ref=div, n_ref=p.n_reference, div_fresh=fresh_div), div

    def train_step(self, batch: Batch) -> dict[str, float]:
        """Apply one optimizer step on `batch`; returns the step's metrics."""
        lc = self.loss_cfg
        start = time.perf_counter()
        staleness = [self.version - g.min_version for g in batch.groups]
        use_reference = lc.divergence not in ("none", "reverse_kl")
        if not use_reference:
            batch.reference = []
        p = prepare(batch, use_std=lc.use_std, eps=lc.adv_eps, filter_zero_spread=lc.filter_zero_spread,
                    token_budget=self.cfg.micro_token_budget, pad_id=self.pad_id)
        micro = [*p.fresh, *p.reference]
        seen = _Collected()
        total = 0.0
        div_ref = 0.0
        self.engine.train()
        for i, mb in enumerate(micro):
            self.engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            if mb.kind == "fresh":
                loss = self._fresh_loss(mb, p, seen)
            else:
                loss, div = self._reference_loss(mb, p)
                div_ref += div.detach().item()
            # Partials already carry their share of the batch objective: no 1/GAS rescaling.
            self.engine.backward(loss, scale_wrt_gas=False)
            total += loss.detach().item()
        if micro:
            self.engine.step()
            self.version += 1
        metrics = self._metrics(batch, p, seen, total, div_ref, staleness)
        metrics["learner/step_seconds"] = time.perf_counter() - start
        metrics["learner/tokens_per_s"] = (p.fresh_tokens + p.reference_tokens) / metrics["learner/step_seconds"]
        return metrics

    def _metrics(self, batch: Batch, p: PreparedBatch, seen: _Collected, loss: float, div_ref: float,
                 staleness: list[int]) -> dict[str, float]:
        comps = [c for g in batch.groups for c in g.completions]
        m: dict[str, float] = {
            "learner/version": float(self.version),
            "loss/total": loss,
            "loss/divergence_ref": div_ref,
            "batch/groups": float(len(batch.groups)),
            "batch/fresh_samples": float(p.n_fresh),
            "batch/reference_samples": float(p.n_reference),
            "batch/fresh_tokens": float(p.fresh_tokens),
            "batch/filtered_groups": float(p.filtered_groups),
            "batch/micro_batches": float(len(p.fresh) + len(p.reference)),
            "reward/mean": sum(c.reward.score for c in comps) / max(len(comps), 1),
            "reward/accuracy": sum(c.reward.correct for c in comps) / max(len(comps), 1),
            "batch/response_length": p.fresh_tokens / max(p.n_fresh, 1),
        }
        if staleness:
            m["staleness/mean"] = sum(staleness) / len(staleness)
            m["staleness/max"] = float(max(staleness))
        if seen.parts:
            ones = torch.ones_like(seen.cat("logp"))
            out = PolicyLoss(loss=ones, mask=seen.cat("kept").float(), ratio=seen.cat("ratio"),
                             is_weight=seen.cat("w"), clipped=seen.cat("clipped"), dual_clipped=seen.cat("dual"))
            diag = policy_diagnostics(out, ones, seen.cat("logp"), seen.cat("mu"), seen.cat("entropy"))
            m.update({f"policy/{k}": v for k, v in diag.items()})
        return m

    # --- Checkpoints ---------------------------------------------------------------------------

    def save(self, directory: Path, client_state: dict) -> None:
        self.engine.save_checkpoint(str(directory), tag=f"v{self.version}",
                                    client_state={**client_state, "version": self.version})

    def load(self, directory: Path, tag: str) -> dict:
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if client_state is None:
            raise FileNotFoundError(f"no learner checkpoint {tag!r} in {directory}")
        self.version = int(client_state["version"])
        return client_state
