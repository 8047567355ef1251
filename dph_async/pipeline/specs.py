"""What one RL run of a pipeline, a comparison or an ablation trains: an objective, its coefficient,
and the training prompts, written `OBJECTIVE[:COEFF][@PROMPTS]`:

    grpo                 GRPO on every training prompt
    grpo@d_exp           GRPO on D_exp only: the control that separates a DPH term from its prompt set
    forward              DPH-F at its reference coefficient (learner/objectives.py), on D_exp
    js_low_var:0.05      DPH-JS at coefficient 0.05

The objective (learner/objectives.py) says what else the run needs: a reference pool, so the
pipeline pre-samples; a frozen reference model, which the learner holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dph_async.config import ConfigError, RunConfig
from dph_async.learner.objectives import Objective, UnknownObjective, objective_class

Prompts = Literal["auto", "all", "d_exp"]
_SPEC = re.compile(r"^(?P<objective>[a-z_0-9]+)(:(?P<coeff>[0-9.eE+-]+))?(@(?P<prompts>all|d_exp))?$")


@dataclass(frozen=True)
class RunSpec:
    objective: str
    coeff: float | None = None  # None: the objective's reference default
    prompts: Prompts = "auto"

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        m = _SPEC.match(text.strip())
        if m is None:
            raise ConfigError(f"{text!r} is not OBJECTIVE[:COEFF][@all|@d_exp] (e.g. grpo, forward:0.05, grpo@d_exp)")
        try:
            coeff = None if m["coeff"] is None else float(m["coeff"])
        except ValueError:
            raise ConfigError(f"{text!r}: the coefficient {m['coeff']!r} is not a number") from None
        spec = cls(m["objective"], coeff, m["prompts"] or "auto")
        spec.objective_class()  # an unknown objective fails here, before anything runs
        return spec

    @classmethod
    def of(cls, cfg: RunConfig) -> RunSpec:
        """The run a config describes on its own."""
        spec = cls(cfg.learner.loss.objective, cfg.learner.loss.coeff, cfg.task.prompts)
        spec.objective_class()
        return spec

    def objective_class(self) -> type[Objective]:
        try:
            return objective_class(self.objective)
        except UnknownObjective as e:
            raise ConfigError(str(e)) from None

    @property
    def uses_pool(self) -> bool:
        return self.objective_class().uses_pool

    @property
    def trains_on_d_exp(self) -> bool:
        return self.prompts == "d_exp" or (self.prompts == "auto" and self.uses_pool)

    @property
    def needs_presampling(self) -> bool:
        return self.uses_pool or self.trains_on_d_exp

    @property
    def name(self) -> str:
        """The spec in canonical form: a label in reports, and (with `slug`) a directory name."""
        text = self.objective
        if self.coeff is not None:
            text += f":{self.coeff:g}"
        if self.prompts != "auto":
            text += f"@{self.prompts}"
        return text

    @property
    def slug(self) -> str:
        return self.name.replace(":", "-c").replace("@", "-on-")

    @property
    def effective_coeff(self) -> float:
        return self.objective_class().default_coeff if self.coeff is None else self.coeff

    def apply(self, cfg: RunConfig) -> RunConfig:
        out = cfg.model_copy(deep=True)
        out.learner.loss.objective = self.objective
        out.learner.loss.coeff = self.coeff
        out.task.prompts = self.prompts
        return out
