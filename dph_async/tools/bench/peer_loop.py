"""A single-process GRPO loop: the floor any user can reproduce with transformers and torch alone.

Per step, on `prompts_per_step` prompts:
  1. generate  n completions each with Hugging Face `generate` (sampling at `temperature`, the full
               vocabulary, at most `max_tokens` new tokens; a completion ends at its first EOS)
  2. reward    score them with the project's scorer (the same rewards the actors use)
  3. forward   log pi(y_t) at the sampling temperature, one pass over [prompt | completion]
  4. backward  the project's GRPO loss (learner/losses.py): advantages (r - mean) / (std + eps)
               per group, the PPO loss with one update per batch (ratio 1: the policy gradient
               -A log pi), token-mean
  5. optimizer gradient clipping and a torch AdamW step

This is the same work as `dph-async run --preset grpo` at the same settings, without asynchrony,
actors or a replay. Run by `dph-async bench peer`:

    python -m dph_async.tools.bench.peer_loop SPEC.json OUT.json
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: start-up counts them, as it does for the peers

import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dph_async.config import LossConfig, RewardConfig  # noqa: E402
from dph_async.learner.losses import aggregate, grpo_advantages, policy_loss  # noqa: E402
from dph_async.rewards.scorer import make_scorer  # noqa: E402
from dph_async.tasks.dataset import load_prompts  # noqa: E402
from dph_async.tools.bench.peer_spec import PeerSpec  # noqa: E402


@dataclass
class StepTimes:
    step_s: float
    generate: float
    reward: float
    forward: float
    backward: float
    optimizer: float
    completions: int
    tokens: int
    reward_mean: float
    cpu_s: float  # the process's CPU-seconds in the step (every thread)


def completion_mask(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """[B, T] bool: the tokens of each completion up to and including its first EOS."""
    is_eos = ids == eos
    after = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    return ~after


def response_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ids: torch.Tensor,
                      mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] log pi(y_t | x, y_<t) at `temperature`; prompts are left-padded, completions right-padded."""
    attention = torch.cat([prompt_mask, mask.long()], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=torch.cat([prompt_ids, ids], 1), attention_mask=attention,
                   position_ids=positions).logits[:, prompt_ids.shape[1] - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]


def train(spec: PeerSpec, out: Path) -> None:
    torch.manual_seed(spec.seed)
    tok = AutoTokenizer.from_pretrained(spec.model)
    model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32, use_safetensors=True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    loss_cfg = LossConfig(objective="grpo", clip_high=0.2)  # the grpo preset's loss
    prompts = load_prompts(spec.data, tok, spec.max_prompt_tokens)
    random.Random(spec.seed).shuffle(prompts)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    steps: list[StepTimes] = []
    first_step = time.time()
    with make_scorer(RewardConfig()) as scorer:
        for step in range(spec.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            batch = [prompts[(step * spec.prompts_per_step + i) % len(prompts)] for i in range(spec.prompts_per_step)]
            width = max(len(p.prompt_ids) for p in batch)
            prompt_ids = torch.tensor([[pad] * (width - len(p.prompt_ids)) + list(p.prompt_ids) for p in batch])
            pads = torch.tensor([width - len(p.prompt_ids) for p in batch])
            prompt_mask = (torch.arange(width)[None] >= pads[:, None]).long()
            with torch.no_grad():
                seqs = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                                      temperature=spec.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=spec.max_tokens, num_return_sequences=spec.n,
                                      eos_token_id=eos, pad_token_id=pad)
            ids = seqs[:, width:]
            mask = completion_mask(ids, eos)
            ids = ids.masked_fill(~mask, pad)
            t1 = time.perf_counter()
            texts = tok.batch_decode(ids, skip_special_tokens=True)
            records = [p for p in batch for _ in range(spec.n)]
            rewards = [r.score for r in scorer.score_many([p.score_request(t) for p, t in zip(records, texts,
                                                                                               strict=True)])]
            adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float64).view(-1, spec.n),
                                  loss_cfg.use_std, loss_cfg.adv_eps).view(-1).float()
            t2 = time.perf_counter()
            rep = lambda t: t.repeat_interleave(spec.n, 0)  # noqa: E731
            logp = response_logprobs(model, rep(prompt_ids), rep(prompt_mask), ids, mask, spec.temperature)
            out_loss = policy_loss(logp, logp.detach(), adv, mask, loss_cfg)
            loss = aggregate(out_loss.loss, out_loss.mask, loss_cfg.aggregation)
            t3 = time.perf_counter()
            loss.backward()
            t4 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t5 = time.perf_counter()
            steps.append(StepTimes(t5 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, len(texts),
                                   int(mask.sum()), sum(rewards) / len(rewards), time.process_time() - c0))
    out.write_text(json.dumps({"system": "loop", "threads": torch.get_num_threads(),
                               "startup_s": first_step - T_START, "steps": [asdict(s) for s in steps],
                               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    train(PeerSpec(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))
