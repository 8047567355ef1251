"""A real tokenizer made locally: a byte-level BPE of 32k tokens trained with `tokenizers` on random
words, with a chat template, as a user's model would have (nothing is downloaded). `bench scale`
builds its models over it; the tests check a run on a user's model with it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing transformers costs seconds; the command line reads VOCAB
    from transformers import PreTrainedTokenizerFast

VOCAB = 32768
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def corpus(seed: int, words: int = 400_000) -> list[str]:
    """Random words over letters, digits and signs: enough distinct pairs for 32k merges."""
    rng = random.Random(seed)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789+-="
    lines, line = [], []
    for _ in range(words):
        line.append("".join(rng.choice(chars) for _ in range(rng.randint(2, 9))))
        if len(line) == 16:
            lines.append(" ".join(line))
            line = []
    return lines


def build_bpe(seed: int, vocab: int = VOCAB, words: int = 400_000, texts: Sequence[str] = ()
              ) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab` tokens (pad, BOS, EOS at ids 0, 1, 2) with CHAT_TEMPLATE, trained on
    `words` random words and `texts` (a domain's own lines, whose frequent strings become tokens);
    about 12 s of one core at 32k."""
    # heavy (transformers, seconds): the command line reads VOCAB from this module without them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*corpus(seed, words), *texts], trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=SPECIAL[3:])
    out.chat_template = CHAT_TEMPLATE
    return out
