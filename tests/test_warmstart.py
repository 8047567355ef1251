"""The warm start's batches: prompt and target encoded as the tokenizer encodes them, the loss on the
target only, whether an encoding is computed or remembered."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F

from dph_async.config import load_config
from dph_async.pipeline.warmstart import _batch, _encoder, pieces, warm_start, warm_start_tiny
from dph_async.tasks import catalog
from dph_async.tasks.embedded import ALPHABET, make_splits
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer


@pytest.mark.parametrize("task", sorted(catalog.SPLITS))
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_batches_hold_the_tokenizers_encoding_and_mask_the_target(noise, task):
    tok = build_tokenizer(catalog.ALPHABETS[task])
    problems = catalog.make_splits(task, random.randrange(1000), 16, 8)["warmstart"]
    encode = _encoder(tok)
    seed = random.randrange(1 << 30)
    for _ in range(3):  # the same problems again: every encoding is now remembered
        rng, again = random.Random(seed), random.Random(seed)
        picked = rng.sample(problems, 8)
        assert again.sample(problems, 8) == picked
        ids, mask = _batch(picked, tok, encode, rng, noise)
        assert mask.dtype == torch.float32  # the loss's weights, not counts
        width = ids.shape[1]
        for row, m, p in zip(ids.tolist(), mask.tolist(), picked, strict=True):
            # The answer drawn as _batch draws it, from a generator in the same state.
            answer = p.wrong_answer(again) if again.random() < noise else again.choice(p.solutions())
            prompt = [tok.bos_token_id, *tok.encode(p.prompt, add_special_tokens=False)]
            target = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
            pad = width - len(prompt) - len(target)
            assert row == prompt + target + [tok.pad_token_id] * pad
            assert m == [0.0] * len(prompt) + [1.0] * len(target) + [0.0] * pad


def _tiny_cfg(steps: int, seed: int):
    return load_config("default", [f"warmstart.steps={steps}", "warmstart.batch_size=4", "model.tiny_hidden=32",
                                   "model.tiny_layers=1", "model.tiny_heads=1", f"seed={seed}"])


@pytest.mark.parametrize("steps", [1, 10, 20, 21])
def test_a_warm_start_of_any_length_trains_that_many_steps(tmp_path, steps):
    """Short ones too: at 10 steps the one-cycle schedule's warm-up was one step, where torch divides
    by zero; under 20 the lr stays constant, from 20 it rises and falls."""
    cfg = _tiny_cfg(steps, 0)
    lrs = []
    step = torch.optim.AdamW.step

    def record(opt, *a, **kw):
        lrs.append(opt.param_groups[0]["lr"])
        return step(opt, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", record)
        losses = warm_start_tiny(cfg, make_splits(0, 16, 4)["warmstart"], tmp_path / "base")
    assert len(losses) == len(lrs) == steps and all(math.isfinite(x) for x in losses)
    assert (tmp_path / "base" / "config.json").is_file()
    if steps < 20:
        assert lrs == [cfg.warmstart.lr] * steps
    else:
        # a tenth of the steps warming up: the peak by the third step
        assert 0.9 * cfg.warmstart.lr < max(lrs) <= cfg.warmstart.lr and lrs.index(max(lrs)) <= 2 and lrs[-1] < lrs[-2]


def test_a_warm_start_step_is_the_masked_mean_nll_and_one_clipped_adamw_step(tmp_path):
    """Against a float64 loss and a reference step made here: the loss is the mean NLL over the target
    tokens only, of the batch the run's generator (seed + 1) draws; the step clips the gradient's norm
    to 1 and is AdamW's at warmstart.lr with weight decay 0.01. The model lands in a new nested
    directory, and again in the same one."""
    cfg = _tiny_cfg(1, random.randrange(1000))
    tok = build_tokenizer(ALPHABET)
    problems = make_splits(cfg.seed, 32, 4)["warmstart"]
    model = build_tiny_llama(cfg.model, len(tok), cfg.seed)
    before = copy.deepcopy(model)
    rng = random.Random(cfg.seed + 1)
    ids, mask = _batch(rng.sample(problems, 4), tok, _encoder(tok), rng, 0.0)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(input_ids=ids).logits[:, :-1]
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    with torch.no_grad():
        want = loss_of(copy.deepcopy(before).double()).item()
    ref = copy.deepcopy(before).train()
    loss_of(ref).backward()
    assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0) > 1.0  # the clip changes this step
    torch.optim.AdamW(ref.parameters(), lr=cfg.warmstart.lr, weight_decay=0.01).step()

    losses = warm_start(model, tok, problems, cfg, tmp_path / "a" / "base")
    assert losses[0] == pytest.approx(want, rel=1e-5)
    for (name, got), (_, exp) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-7, msg=name)
    warm_start(build_tiny_llama(cfg.model, len(tok), cfg.seed), tok, problems, cfg, tmp_path / "a" / "base")
    assert (tmp_path / "a" / "base" / "config.json").is_file()


def test_a_wrong_answer_joins_two_or_three_of_the_problems_digits_two_for_a_difference():
    """A difference of three numbers is another problem's shape; sums and products take two or three."""
    rng = random.Random(random.randrange(1 << 30))
    problems = make_splits(rng.randrange(1000), 64, 4)["warmstart"]
    sizes: dict[bool, set[int]] = {True: set(), False: set()}
    for p in problems * 4:
        parts = p.wrong_answer(rng).split(p.op)
        assert set(parts) <= {str(d) for d in p.digits}
        sizes[p.op == "-"].add(len(parts))
    assert sizes[True] == {2} and sizes[False] == {2, 3}


def test_a_long_tailed_batch_in_pieces_has_the_whole_batchs_loss_and_gradient():
    """Against the whole padded batch in float64: each row in exactly one piece, each piece within
    the budget (or one row alone), the pieces' summed shares the masked mean and its gradient."""
    tok = build_tokenizer(catalog.ALPHABETS["stride"])
    rng = random.Random(random.randrange(1 << 30))
    problems = catalog.make_splits("stride", rng.randrange(1000), 16, 8)["warmstart"]
    long = [p for p in problems if len(p.terms()) > 60][:2]  # the tail in the batch
    ids, mask = _batch(long + rng.sample(problems, 30), tok, _encoder(tok), rng, 0.5)
    budget = 1024
    parts = pieces(ids, mask, budget)
    assert len(parts) > 1 and all(len(p) == 1 or p.numel() <= budget for p, _ in parts)
    def unpadded(i: torch.Tensor, m: torch.Tensor) -> list[tuple[int, ...]]:
        return sorted(tuple(r[:int(rm.nonzero()[-1]) + 1].tolist()) for r, rm in zip(i, m, strict=True))

    assert sorted(r for i, m in parts for r in unpadded(i, m)) == unpadded(ids, mask)
    (whole_ids, whole_mask), = pieces(ids, mask, ids.numel())  # whole when it fits: the digit tasks' path
    assert whole_ids is ids and whole_mask is mask
    model = build_tiny_llama(_tiny_cfg(1, 0).model.model_copy(update={"max_model_len": 512}), len(tok), 0).double()

    def loss_of(i: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        nll = F.cross_entropy(model(input_ids=i).logits[:, :-1].transpose(1, 2), i[:, 1:], reduction="none")
        return (nll * m[:, 1:]).sum() / mask[:, 1:].sum()

    whole = loss_of(ids, mask)
    grads = torch.autograd.grad(whole, list(model.parameters()))
    split = [loss_of(i, m) for i, m in parts]
    assert sum(x.item() for x in split) == pytest.approx(whole.item(), rel=1e-12)
    for g, h in zip(grads, torch.autograd.grad(sum(split), list(model.parameters())), strict=True):
        torch.testing.assert_close(h, g, rtol=1e-10, atol=1e-12)
