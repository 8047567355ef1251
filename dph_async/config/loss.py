"""Loss configuration: advantages, the PPO-style policy loss with off-policy correction, DPH divergences.

Formulas live in the docstrings of `learner/losses.py`; docs/losses.md explains the choices.
"""

from typing import Literal

from pydantic import Field

from dph_async.config.base import Section

Correction = Literal["behavior", "decoupled", "masked", "areal", "areal_sequence"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-sum-norm"]


class LossConfig(Section):
    # GRPO advantage: (r - mean) / (std + eps), or (r - mean) with use_std=False (Dr. GRPO).
    use_std: bool = True
    adv_eps: float = Field(1e-6, gt=0)
    # DAPO dynamic filtering: drop groups whose rewards have zero spread (they carry no signal).
    filter_zero_spread: bool = False

    # PPO clip with clip-higher and dual clip (dual_clip=None disables it).
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(3.0, gt=1)

    # Off-policy correction of pi_prox / pi_mu with cap C = is_cap: decoupled truncates at C, masked
    # drops tokens (or sequences) outside [1/C, C], areal / areal_sequence are AReaL's rules (zero
    # above C per token / by the sequence's geometric mean). learner/losses.py has the table.
    correction: Correction = "decoupled"
    is_cap: float = Field(2.0, gt=1)
    mask_level: Literal["token", "sequence"] = "token"

    # The training objective: grpo, dapo, reverse_kl, forward, js_low_var, js, alpha, and online DPO's
    # dpo, ipo, dpo_rev_kl (learner/objectives.py registers them and says
    # what each needs). coeff is its divergence's coefficient (the DPH-RL scripts' sft_loss_coeff, kl_loss_coef
    # for reverse_kl/dapo, beta for the DPO objectives); None takes the
    # objective's reference default. A divergence on preserved samples enters with weight coeff x their
    # share of the step's samples, as in the reference implementation (docs/losses.md).
    objective: str = "js_low_var"
    coeff: float | None = Field(None, ge=0)
    alpha: float = Field(0.2, gt=0, lt=1)
    # `js` only: share of fresh micro-batches that get the online half in the reference (its default
    # 1/10); here every fresh token gets it with weight coeff x this share, the same expectation.
    js_online_fraction: float = Field(0.1, ge=0, le=1)
    # The official script as run (docs/losses.md, "As run"): this share of each batch's reference
    # samples is trained as policy gradient at advantage +1 against pi_0's log-probs, instead of the
    # divergence, as its mixed micro-batches do (learner/as_run.py gives the share of its settings).
    # 0 is the method as written; objectives without reference samples ignore it. `dpef_pg` trains
    # only that term (no divergence): the control.
    reference_pg_share: float = Field(0.0, ge=0, le=1)

    aggregation: Aggregation = "token-mean"
    # Constant for `seq-sum-norm` (Dr. GRPO uses the maximum response length); None means sampling.max_tokens.
    aggregation_norm: int | None = Field(None, gt=0)
    # Entropy bonus on fresh tokens (0 in all the reference's scripts).
    entropy_coeff: float = 0.0


class CriticConfig(Section):
    """PPO with a learned critic (learner/critic.py), in place of GRPO's group baseline: per-token
    advantages by GAE from a separate value model that the learner runs at the start of every batch
    (never an actor's, stale, values)."""

    enabled: bool = False
    # GAE(gamma, lambda). The verifier's reward comes at the last token: gamma = lam = 1 gives
    # A_t = R - V(s_t), unbiased whatever the critic, which a critic trained from scratch needs.
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    # Advantages whitened over the batch's tokens: an untrained critic's offset (R - V > 0 everywhere)
    # would otherwise push up every sampled token.
    whiten: bool = True
    # PPO's value clipping: one update moves V at most this far from the batch's V_old (None: off).
    value_clip: float | None = Field(0.2, gt=0)
    # Weight of the value loss in the critic's objective (its own optimizer: it shares no parameter
    # with the policy, so the coefficient scales the critic's gradient before clipping at grad_clip).
    value_coeff: float = Field(0.5, gt=0)
    # The value model: a copy of pi_0's decoder body with a scalar head, trained by AdamW with
    # `epochs` steps on each batch.
    lr: float = Field(1e-3, gt=0)
    epochs: int = Field(4, ge=1)
