"""PPO's learned critic: a value model over the policy's hidden states, and its per-batch targets.

    V(s_t) = MLP(h_t),  h_t = the policy's final hidden state that predicts response token t (detached)

At the start of every batch the learner runs the policy body and the critic over every fresh
sequence (no grad) and computes V_old, GAE advantages and returns from them (`prepare_targets`):
an actor's values would come from weights up to `max_staleness` versions old, so none are taken
from the rollouts. The value model shares no parameter with the policy and reads detached hidden
states: its gradient never reaches the policy, so a poor critic cannot wreck a small model, and
its own AdamW (`learner.critic.lr`) lets it learn faster than the policy moves. It stays on the
learner (only the policy's weights are published).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dph_async.config.loss import CriticConfig
from learner import losses as L
from learner.batching import MicroBatch


class ValueModel(nn.Module):
    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, hidden: Tensor) -> Tensor:
        """[B, T, H] -> [B, T]"""
        return self.net(hidden.float()).squeeze(-1)


class Critic:
    def __init__(self, cfg: CriticConfig, hidden_size: int, grad_clip: float, seed: int) -> None:
        self.cfg, self.grad_clip = cfg, grad_clip
        with torch.random.fork_rng():  # its initialisation leaves the policy's random stream alone
            torch.manual_seed(seed)
            self.model = ValueModel(hidden_size, cfg.hidden)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def values(self, hidden: Tensor) -> Tensor:
        return self.model(hidden.detach())

    def prepare_targets(self, micro: list[tuple[MicroBatch, Tensor]]) -> dict[str, float]:
        """Set V_old, returns and advantages on every sequence of these micro-batches, given each
        one's hidden states; advantages are whitened over all their tokens. Returns the batch's
        critic metrics, the explained variance of V_old measured before the critic trains on it."""
        cfg = self.cfg
        with torch.no_grad():
            per_mb = []
            for mb, hidden in micro:
                values = self.values(hidden)
                adv, ret = L.gae(terminal_rewards(mb), values, mb.mask, cfg.gamma, cfg.lam)
                per_mb.append((mb, values, adv, ret))
            # Whitening takes the whole batch's tokens: flat [N] per quantity, micro-batch after micro-batch.
            mask, values, adv, ret = (torch.cat([t.reshape(-1) for t in ts])
                                      for ts in zip(*[(mb.mask, v, a, r) for mb, v, a, r in per_mb], strict=True))
            scaled = L.whiten(adv, mask) if cfg.whiten else adv * mask
            offset = 0
            for mb, v, a, r in per_mb:
                scaled_mb = scaled[offset: offset + a.numel()].view_as(a)
                offset += a.numel()
                for i, s in enumerate(mb.sequences):
                    t = len(s.response_ids)
                    s.values, s.returns = v[i, :t].clone(), r[i, :t].clone()
                    s.token_advantages = scaled_mb[i, :t].clone()
        m = mask.to(values.dtype)
        return {"critic/explained_variance": float(L.explained_variance(values, ret, mask)),
                "critic/value_mean": float(L.masked_mean(values, m)),
                "critic/return_mean": float(L.masked_mean(ret, m)),
                "critic/advantage_abs_mean": float(L.masked_mean(adv.abs(), m))}

    def loss(self, mb: MicroBatch, hidden: Tensor, fresh_tokens: int) -> Tensor:
        """value_coeff x this micro-batch's share of the token-mean clipped value loss of its mini-batch."""
        values = self.values(hidden)
        per_token = L.value_loss(values, mb.token_field("values"), mb.token_field("returns"), self.cfg.value_clip)
        return self.cfg.value_coeff * L.aggregate(per_token, mb.mask, "token-mean", count=fresh_tokens)

    def step(self) -> None:
        nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

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

