"""PPO's learned critic: a separate small value model, and its per-batch targets and update.

    V(s_t) = w . h'_t + b,  h'_t = the value model's final hidden state that reads x, y_<t

The value model is a copy of the policy's decoder body at the start of the run (pi_0's) with a
scalar head, trained by its own AdamW. Sharing no parameter with the policy, its gradient never
reaches the policy, so a poor critic cannot wreck a small model; with a body of its own it learns
features for the value. (An MLP head on the policy's detached hidden states, widths 128 and 256,
step sizes 1e-3 and 3e-3, 1 to 8 steps per batch, still explained about none of the returns'
variance after 40 batches on the embedded task; this one explained about a tenth.)
At the start of every batch the learner runs it over every fresh sequence and computes V_old, GAE
advantages and returns (`Critic.update`): an actor's values would come from weights up to
`max_staleness` versions old, so none are taken from the rollouts. It stays on the learner: only
the policy's weights are published.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dph_async.config.loss import CriticConfig
from dph_async.learner import losses as L
from dph_async.learner.batching import MicroBatch
from dph_async.learner.logprobs import response_hidden


class ValueModel(nn.Module):
    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)

    def forward(self, mb: MicroBatch) -> Tensor:
        """[B, T]: V of the state before each response token."""
        return self.head(response_hidden(self.body, mb).float()).squeeze(-1)


class Critic:
    def __init__(self, cfg: CriticConfig, policy: nn.Module, grad_clip: float, seed: int) -> None:
        """`policy`: a Hugging Face causal LM; its body is copied, not shared."""
        self.cfg, self.grad_clip = cfg, grad_clip
        with torch.random.fork_rng():  # its initialisation leaves the policy's random stream alone
            torch.manual_seed(seed)
            body = copy.deepcopy(policy.model).float().requires_grad_(True)
            self.model = ValueModel(body, policy.config.hidden_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def update(self, micro: list[MicroBatch]) -> dict[str, float]:
        """A batch's critic work on its fresh micro-batches: V_old, GAE returns and advantages
        (whitened over all the batch's tokens), the advantages set on every sequence; then `epochs`
        AdamW steps on the batch's clipped value loss, value_coeff x token-mean (every micro-batch's
        gradient accumulated into each step), which leave the advantages already set as they are.
        Returns the batch's critic metrics, measured with V_old: before the critic trained on it."""
        cfg = self.cfg
        self.model.eval()
        with torch.no_grad():
            targets = []
            for mb in micro:
                values = self.model(mb)
                adv, ret = L.gae(terminal_rewards(mb), values, mb.mask, cfg.gamma, cfg.lam)
                targets.append((values, adv, ret))
            # Flat [N] over the batch's tokens, micro-batch after micro-batch.
            mask, values, adv, ret = (torch.cat([t.reshape(-1) for t in ts])
                                      for ts in zip(*[(mb.mask, *t) for mb, t in zip(micro, targets, strict=True)],
                                                    strict=True))
            scaled = L.whiten(adv, mask) if cfg.whiten else adv * mask
            offset = 0
            for mb in micro:
                scaled_mb = scaled[offset: offset + mb.mask.numel()].view(mb.mask.shape)
                offset += mb.mask.numel()
                for i, s in enumerate(mb.sequences):
                    s.token_advantages = scaled_mb[i, :len(s.response_ids)].clone()
        m = mask.to(values.dtype)
        metrics = {"critic/explained_variance": float(L.explained_variance(values, ret, mask)),
                   "critic/value_loss": float(L.masked_mean(L.value_loss(values, values, ret, None), m)),
                   "critic/value_mean": float(L.masked_mean(values, m)),
                   "critic/return_mean": float(L.masked_mean(ret, m))}
        tokens = int(mask.sum())
        self.model.train()
        for _ in range(cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for mb, (v_old, _, g) in zip(micro, targets, strict=True):
                per_token = L.value_loss(self.model(mb), v_old, g, cfg.value_clip)
                (cfg.value_coeff * L.aggregate(per_token, mb.mask, "token-mean", count=tokens)).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
        return metrics

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def terminal_rewards(mb: MicroBatch) -> Tensor:
    """[B, T]: each sequence's reward on its last token, 0 elsewhere (the verifier scores the whole
    response)."""
    rewards = torch.zeros(mb.mask.shape, dtype=torch.float32)
    last = mb.mask.sum(1) - 1
    rewards[torch.arange(len(last)), last] = torch.tensor([s.reward for s in mb.sequences], dtype=torch.float32)
    return rewards
