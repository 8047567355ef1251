"""The warm start's batches: prompt and target encoded as the tokenizer encodes them, the loss on the
target only, whether an encoding is computed or remembered."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dph_async.app.warmstart import _batch, _encoder, _wrong_answer
from dph_async.tasks.embedded import ALPHABET, make_splits
from dph_async.tasks.tiny_model import build_tokenizer


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_batches_hold_the_tokenizers_encoding_and_mask_the_target(noise):
    tok = build_tokenizer(ALPHABET)
    problems = make_splits(random.randrange(1000), 16, 4)["warmstart"]
    encode = _encoder(tok)
    seed = random.randrange(1 << 30)
    for _ in range(3):  # the same problems again: every encoding is now remembered
        rng, again = random.Random(seed), random.Random(seed)
        picked = rng.sample(problems, 8)
        assert again.sample(problems, 8) == picked
        ids, mask = _batch(picked, tok, encode, rng, noise)
        width = ids.shape[1]
        for row, m, p in zip(ids.tolist(), mask.tolist(), picked, strict=True):
            # The answer drawn as _batch draws it, from a generator in the same state.
            answer = _wrong_answer(p, again) if again.random() < noise else again.choice(p.solutions())
            prompt = [tok.bos_token_id, *tok.encode(p.prompt, add_special_tokens=False)]
            target = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
            pad = width - len(prompt) - len(target)
            assert row == prompt + target + [tok.pad_token_id] * pad
            assert m == [0.0] * len(prompt) + [1.0] * len(target) + [0.0] * pad


@pytest.mark.parametrize("steps", [1, 10, 20, 21])
def test_a_warm_start_of_any_length_trains_that_many_steps(tmp_path, steps):
    """Short ones too: at 10 steps the one-cycle schedule's warm-up was one step, where torch divides
    by zero; under 20 the lr stays constant, from 20 it rises and falls."""
    from dph_async.app.warmstart import warm_start_tiny
    from dph_async.config import load_config

    cfg = load_config("default", [f"warmstart.steps={steps}", "warmstart.batch_size=2", "model.tiny_hidden=32",
                                  "model.tiny_layers=1", "model.tiny_heads=1"])
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
        assert 0.9 * cfg.warmstart.lr < max(lrs) <= cfg.warmstart.lr and lrs[0] < lrs[1] and lrs[-1] < lrs[-2]
