"""Training objectives: one registered class per mode, owning what it needs and how its terms combine.

Every objective has the same shape, the DPH-RL objective of the reference implementation:

    L = [n_f (L_pg - c_H H + c_f D_fresh) + n_r eta D_ref] / (n_f + n_r)

L_pg: the PPO policy loss on n_f fresh samples (`losses.policy_loss`, aggregated); H: their mean
entropy (c_H = entropy_coeff); D_fresh: a divergence on the fresh tokens against a frozen reference
model (c_f); D_ref: a divergence on n_r preserved reference samples against their stored pi_0
log-probs (eta = the coefficient). An objective declares which of the two divergences it has, and
so what the run must provide: a reference pool (pre-sampling; RL on D_exp by default) or a frozen
reference model in the learner.

Why n-weighted: the reference gives each micro-batch one sample type and averages the micro-batches'
losses, so each part enters with its share of the samples (256 reference per 2,048 fresh in its
scripts: D_ref weighs eta * 256 / 2,304). Keeping that keeps the meaning of the DPH-RL scripts' coefficient
ranges. The objective is linear in its parts, so a micro-batch's loss is its own share of the
(mini-)batch objective: `fresh_share` and `reference_share` return it, with batch-wide denominators.

Adding a divergence is one subclass here, registered with @register, and one test against its
closed form (tests/test_objectives.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dph_async.config.loss import LossConfig
from dph_async.lazy_import import lazy_module

if TYPE_CHECKING:
    from torch import Tensor

    from dph_async.learner.batching import Counts, Unit

# torch loads with the first loss computed, not with the registry (a driver only reads the classes).
dpo = lazy_module("dph_async.learner.dpo")
L = lazy_module("dph_async.learner.losses")


@dataclass
class Share:
    """A micro-batch's share of the objective (to backpropagate), and its share of each unweighted
    part (detached, to log: summed over a mini-batch's micro-batches they give the part's value;
    tensors, so that logging costs no host sync per micro-batch)."""

    loss: Tensor
    parts: dict[str, Tensor]


class Objective:
    """GRPO's objective: the PPO policy loss on fresh tokens, no divergence.

    Subclasses set the class attributes and override `reference_divergence` (uses_pool) and/or
    `fresh_divergence` (uses_reference_model), each a per-token function to minimise.
    """

    name: ClassVar[str] = "grpo"
    # D_ref on preserved D_pef samples: the run pre-samples pi_0, and RL trains on D_exp by default.
    uses_pool: ClassVar[bool] = False
    # D_fresh against a frozen copy of pi_0 held by the learner.
    uses_reference_model: ClassVar[bool] = False
    # The reference implementation's coefficient (script default or headline row), and the values
    # `dph-async ablate divergence` tries by default (the ends of the DPH-RL README range, except
    # where a subclass says otherwise).
    default_coeff: ClassVar[float] = 0.0
    sweep_coeffs: ClassVar[tuple[float, ...]] = ()
    # The loss couples the sequences of a unit (a DPO pair): a unit is never split across rows or
    # micro-batches.
    whole_units: ClassVar[bool] = False
    # Trains nothing on its pool unless learner.loss.reference_pg_share > 0 (`dpef_pg`).
    needs_pg_share: ClassVar[bool] = False

    @classmethod
    def has_divergence(cls) -> bool:
        """Whether the objective has a coefficient to set (a divergence term)."""
        return (cls.uses_pool and not cls.needs_pg_share) or cls.uses_reference_model

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.coeff = self.default_coeff if cfg.coeff is None else cfg.coeff

    @property
    def fresh_coeff(self) -> float:
        """c_f, the weight of D_fresh inside the fresh part."""
        return self.coeff

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        raise NotImplementedError(f"objective {self.name!r} has no divergence on reference samples")

    def fresh_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        raise NotImplementedError(f"objective {self.name!r} has no divergence on fresh tokens")

    def form_units(self, groups: list[Unit]) -> tuple[list[Unit], int]:
        """The fresh units to train on, from the batch's groups, and how many groups were skipped."""
        return groups, 0

    def needs_every_fresh_token(self) -> bool:
        """Whether tokens with zero advantage still carry a gradient (so none may be skipped)."""
        return self.uses_reference_model or self.cfg.entropy_coeff != 0

    def fresh_share(self, out: L.PolicyLoss, mask: Tensor, counts: Counts, norm: float,
                    entropy: Tensor | None = None, logp: Tensor | None = None,
                    logp_ref: Tensor | None = None, advantages: Tensor | None = None) -> Share:
        """n_f / (n_f + n_r) * (L_pg - c_H H + c_f D_fresh) for one micro-batch of fresh tokens, with
        the (mini-)batch's denominators. logp and logp_ref (the frozen model's) for D_fresh;
        advantages [B] for objectives whose loss is not the PPO one (DPO)."""
        lc = self.cfg
        count = counts.fresh_denominator(lc.aggregation)
        pg = L.aggregate(out.loss, mask, lc.aggregation, norm, count=count)
        total, parts = pg, {"pg": pg.detach()}
        if lc.entropy_coeff and entropy is not None:
            ent = L.aggregate(entropy, mask, "token-mean", count=counts.fresh_tokens)
            total = total - lc.entropy_coeff * ent
            parts["entropy"] = ent.detach()
        if self.uses_reference_model:
            if logp is None or logp_ref is None:
                raise ValueError(f"objective {self.name!r} needs the frozen reference model's log-probs")
            div = L.aggregate(self.fresh_divergence(logp, logp_ref), mask, lc.aggregation, norm, count=count)
            total = total + self.fresh_coeff * div
            parts["divergence_fresh"] = div.detach()
        w = counts.fresh_weight
        return Share(w * total, parts)

    def reference_share(self, logp: Tensor, logp_ref: Tensor, mask: Tensor, counts: Counts, norm: float,
                        as_pg: Tensor | None = None) -> Share:
        """n_r / (n_f + n_r) * (eta * D_ref + PG_ref) for one micro-batch of reference samples.

        as_pg [B]: the samples trained as the official script's mixed micro-batches train them
        (`losses.reference_pg`, weight 1 like a fresh sample's PG) instead of by the divergence; both
        parts keep the whole reference denominator, so their shares add up to the reference part."""
        lc = self.cfg
        count = counts.reference_denominator(lc.aggregation)
        w = counts.reference_weight
        mask = mask.bool()
        on_pg = mask & (mask.new_zeros(mask.shape[0]) if as_pg is None else as_pg > 0)[:, None]
        div = L.aggregate(self.reference_divergence(logp, logp_ref), mask & ~on_pg, lc.aggregation, norm, count=count)
        parts = {"divergence_ref": div.detach()}
        total = self.coeff * div
        if lc.reference_pg_share:
            pg = L.aggregate(L.reference_pg(logp, logp_ref, lc.clip_low, lc.clip_high), on_pg, lc.aggregation,
                             norm, count=count)
            total = total + pg
            parts["pg_ref"] = pg.detach()
        return Share(w * total, parts)


OBJECTIVES: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    if cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.name!r} registered twice")
    OBJECTIVES[cls.name] = cls
    return cls


register(Objective)


@register
class ReverseKL(Objective):
    """RKL: k3 of KL(pi_theta || pi_ref) on fresh tokens against a frozen pi_0 (verl's KL loss)."""

    name = "reverse_kl"
    uses_reference_model = True
    default_coeff = 0.01  # kl_loss_coef; README range 0.01-0.05
    # 0.1 is above the DPH-RL README's range: the coefficient docs/ablations.md measured against the DPH modes.
    sweep_coeffs = (0.01, 0.1)

    def fresh_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.reverse_kl(logp, logp_ref)


@register
class DAPO(ReverseKL):
    """The DPH-RL repository's DAPO: GRPO with clip-higher (the preset sets clip_high 0.28) and the k3
    KL loss at 0.01 on every prompt. The same terms as reverse_kl at its default, kept as its own mode
    because the paper reports it as its own row; DAPO's dynamic sampling is
    `learner.loss.filter_zero_spread`, off here as in that script."""

    name = "dapo"
    sweep_coeffs = (0.01,)


@register
class Forward(Objective):
    """DPH-F: KL(pi_0 || pi_theta) on preserved samples, k3(u) = u - log u - 1."""

    name = "forward"
    uses_pool = True
    default_coeff = 0.01  # forward_kl.sh; README range 0.01-0.05
    sweep_coeffs = (0.01, 0.05)

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.forward_kl(logp, logp_ref)


@register
class JSLowVar(Objective):
    """DPH-JS, the "JS generator": u log u - (u + 1) log((u + 1) / 2) on preserved samples."""

    name = "js_low_var"
    uses_pool = True
    default_coeff = 0.2  # the paper's headline DPH-JS row; README range 0.05-0.2
    sweep_coeffs = (0.05, 0.2)

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.js_low_var(logp, logp_ref)


@register
class JS(Objective):
    """The "JS definition": KL(pi_0 || M) on preserved samples plus KL(pi_theta || M') on fresh tokens
    against a frozen pi_0, the online half weighted by js_online_fraction (its expectation in the
    reference, which adds it to that share of fresh micro-batches at random)."""

    name = "js"
    uses_pool = True
    uses_reference_model = True
    default_coeff = 0.2
    sweep_coeffs = (0.05, 0.2)

    @property
    def fresh_coeff(self) -> float:
        return self.coeff * self.cfg.js_online_fraction

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.js_reference_half(logp, logp_ref)

    def fresh_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.js_online_half(logp, logp_ref)


@register
class Alpha(Objective):
    """The alpha-divergence on preserved samples, alpha = learner.loss.alpha (0.2; the paper: 0.2-0.8)."""

    name = "alpha"
    uses_pool = True
    default_coeff = 0.01  # alpha.sh
    sweep_coeffs = (0.01, 0.05)

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return L.alpha_divergence(logp, logp_ref, self.cfg.alpha)


@register
class DPO(Objective):
    """Online DPO with the sigmoid loss (learner/dpo.py): one pair per rollout group, highest against
    lowest reward, h from pi_theta's and the frozen pi_ref's sequence log-probs; the coefficient is
    beta. The loss is the mean over the (mini-)batch's pairs; no PPO term, no aggregation choice."""

    name = "dpo"
    uses_reference_model = True
    whole_units = True
    default_coeff = 0.1  # beta, as in DPO and the samplers paper's scripts
    sweep_coeffs = (0.1, 0.5)

    def pair_loss(self, h: Tensor, reward_margin: Tensor) -> Tensor:
        return dpo.sigmoid_loss(h, self.coeff)

    def form_units(self, groups: list[Unit]) -> tuple[list[Unit], int]:
        return dpo.form_pairs(groups)

    def fresh_share(self, out: L.PolicyLoss, mask: Tensor, counts: Counts, norm: float,
                    entropy: Tensor | None = None, logp: Tensor | None = None,
                    logp_ref: Tensor | None = None, advantages: Tensor | None = None) -> Share:
        """sum over this micro-batch's pairs of the pair loss / pairs in the (mini-)batch."""
        if logp is None or logp_ref is None or advantages is None:
            raise ValueError(f"objective {self.name!r} needs logp, the reference model's logp and the pairs")
        logp, logp_ref = L.upcast(logp, logp_ref)
        m = mask.to(logp.dtype)
        seq, seq_ref = (logp * m).sum(1), (logp_ref * m).sum(1)
        (w, l, margin), (w_ref, l_ref, _) = dpo.split_pairs(seq, advantages), dpo.split_pairs(seq_ref, advantages)
        h = dpo.pair_log_ratio(w, w_ref, l, l_ref)
        pairs = max(counts.n_fresh // 2, 1)
        loss = self.pair_loss(h, margin).sum() / pairs
        parts = {"dpo": loss.detach(), "dpo_accuracy": (h > 0).to(h.dtype).sum().detach() / pairs,
                 "dpo_log_ratio": h.sum().detach() / pairs}
        return Share(counts.fresh_weight * loss, parts)


@register
class IPO(DPO):
    """Online IPO: (h - 1 / (2 beta))^2 on the same pairs."""

    name = "ipo"

    def pair_loss(self, h: Tensor, reward_margin: Tensor) -> Tensor:
        return dpo.ipo_loss(h, self.coeff)


@register
class DPORevKL(DPO):
    """The samplers paper's DPO variant (`rev_kl`): cross-entropy to the Bradley-Terry preference of the
    pair's rewards, sigma(r_w - r_l), instead of a hard label."""

    name = "dpo_rev_kl"

    def pair_loss(self, h: Tensor, reward_margin: Tensor) -> Tensor:
        return dpo.rev_kl_loss(h, self.coeff, reward_margin)


@register
class DpefPG(Objective):
    """The control of the official script's accident: GRPO on fresh samples plus only the policy
    gradient at A = +1 against pi_0 on `learner.loss.reference_pg_share` of the reference samples
    (`losses.reference_pg`), no divergence: a replay of pi_0's correct samples."""

    name = "dpef_pg"
    uses_pool = True
    needs_pg_share = True

    def reference_divergence(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return logp.new_zeros(logp.shape)


class UnknownObjective(ValueError):
    """The configured objective is not registered; the message lists the registered ones."""


def objective_class(name: str) -> type[Objective]:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise UnknownObjective(f"learner.loss.objective: unknown objective {name!r}; "
                               f"registered: {', '.join(OBJECTIVES)}") from None


def make_objective(cfg: LossConfig) -> Objective:
    return objective_class(cfg.objective)(cfg)
