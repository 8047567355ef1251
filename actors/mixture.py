"""The DPO samplers: responses from pi_theta, from the frozen reference pi_ref, or from a mixture of
their logits, with each response's distribution and its log-probs under it recorded.

A sampler gives every completion of a group a policy weight a; completion j samples each token from

    pi_a(. | x, y_<t) = softmax((a z_theta + (1 - a) z_ref) / temperature)

(z_theta: the logits of the current weights, z_ref: those of pi_0, loaded once and never updated)
and records log pi_a(y_t | .) as its behaviour log-prob, and a as `Completion.policy_weight`:

    online  a = 1 for all           (on-policy DPO)
    ref     a = 0 for all           (vanilla DPO on reference samples)
    gshf    a = 1, 0, 1, 0, ...     (half from each)
    mixp    a = 1.5, 0.5, ...       (the samplers paper's mixture: pi_theta^1.5 pi_ref^-0.5 and
                                    pi_theta^0.5 pi_ref^0.5, normalised, at the logits level)

(the weights are the samplers' own, dph_async/samplers.py).

`MixtureEngine` runs both models with torch (the `Engine` interface, in-flight weight loads
included); `online` runs on vLLM and never needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from dph_async.actors.sampling import ForwardClock, Sample, SamplingSpec
from dph_async.samplers import sampler as sampler_named


def mixture_logprobs(z_policy: Tensor | None, z_ref: Tensor | None, weight: Tensor, temperature: float) -> Tensor:
    """log softmax((a z_theta + (1 - a) z_ref) / temperature) over the vocabulary, per row; a term
    whose weight is 0 in every row may be None (that model need not run)."""
    a = weight[:, None].to(torch.float32)
    mixed = 0.0
    if z_policy is not None:
        mixed = mixed + a * z_policy.float()
    if z_ref is not None:
        mixed = mixed + (1.0 - a) * z_ref.float()
    return torch.log_softmax(mixed / temperature, dim=-1)



@dataclass
class _Request:
    prompt: list[int]
    spec: SamplingSpec
    samples: list[Sample]
    weights: torch.Tensor  # [n] policy weight per completion
    live: list[int] = field(default_factory=list)  # indices of unfinished completions


class MixtureEngine:
    """pi_theta and pi_ref (Hugging Face causal LMs, same tokenizer) sampling a sampler's mixtures,
    one token per live completion per `step`. Plain torch without a KV cache: meant for the
    embedded task and small models; `online` uses vLLM."""

    def __init__(self, model_dir: str, sampler: str, *, dtype: str = "float32", seed: int = 0, threads: int = 1,
                 version: int = 0, eos_id: int | None = None) -> None:
        torch.set_num_threads(threads)
        self.sampler = sampler_named(sampler)  # an unknown sampler fails here
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, use_safetensors=True).eval()
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, use_safetensors=True)
        self.ref.eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = version
        self.eos_id = self.tokenizer.eos_token_id if eos_id is None else eos_id
        self.gen = torch.Generator().manual_seed(seed)
        self._live: dict[str, _Request] = {}
        self._clock = ForwardClock()
        self._clock.hook(self.policy, self.ref)

    @property
    def forward_seconds(self) -> float:
        return self._clock.seconds

    def add(self, key: str, prompt_ids: Sequence[int], spec: SamplingSpec, n: int = 1) -> None:
        if spec.temperature <= 0 or spec.top_p != 1.0 or spec.top_k != -1:
            raise ValueError("the DPO samplers sample the full support: temperature > 0, top_p 1, top_k -1")
        weights = torch.tensor(self.sampler.weights(n))
        self._live[key] = _Request(list(prompt_ids), spec, [Sample(key=f"{key}/{j}") for j in range(n)], weights,
                                   list(range(n)))

    @torch.no_grad()
    def _next_logprobs(self, req: _Request) -> Tensor:
        rows = [req.prompt + req.samples[j].token_ids for j in req.live]
        ids = torch.tensor(rows, dtype=torch.long)
        a = req.weights[req.live]
        z_policy = self.policy(input_ids=ids).logits[:, -1] if bool((a != 0).any()) else None
        z_ref = self.ref(input_ids=ids).logits[:, -1] if bool((a != 1).any()) else None
        return mixture_logprobs(z_policy, z_ref, a, req.spec.temperature)

    def step(self) -> list[Sample]:
        """One token for every live completion; returns the completions that finished."""
        done = []
        for key in list(self._live):
            req = self._live[key]
            logp = self._next_logprobs(req)
            tokens = torch.multinomial(logp.exp(), 1, generator=self.gen)[:, 0]
            still = []
            for row, j in enumerate(req.live):
                s, tok = req.samples[j], int(tokens[row])
                s.token_ids.append(tok)
                s.logprobs.append(float(logp[row, tok]))
                s.versions.append(self.version)
                s.policy_weight = float(req.weights[j])
                if tok == self.eos_id or len(s.token_ids) >= req.spec.max_tokens:
                    s.finish_reason = "stop" if tok == self.eos_id else "length"
                    s.text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                    done.append(s)
                else:
                    still.append(j)
            req.live = still
            if not still:
                del self._live[key]
        return done

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def abort(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._live.pop(k, None)

    shares_weights = False  # load_state_dict copies

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, keep: bool = False) -> bool:
        """New weights for pi_theta (pi_ref stays pi_0); running completions continue on them."""
        self.policy.load_state_dict(dict(tensors), strict=True)
        self.version = version
        return False

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> list[list[Sample]]:
        keys = [f"g{i}" for i in range(len(prompts))]
        for key, p in zip(keys, prompts, strict=True):
            self.add(key, p, spec, n=spec.n)
        out: dict[str, list[Sample]] = {k: [] for k in keys}
        while self.has_unfinished():
            for s in self.step():
                out[s.key.split("/")[0]].append(s)
        return [sorted(out[k], key=lambda s: int(s.key.split("/")[1])) for k in keys]
