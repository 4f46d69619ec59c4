"""Chats of random words, and the tokenizer the SFT tests train on them with: one token per character, Gemma 4's
control tokens and gemport's Gemma 4 training template."""

import numpy as np
from tiny_tokenizers import GEMMA4_CONTROL, char_tokenizer

from gemport.data.training_template import gemma4_training_template

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def chats(n=10, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        chat = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            chat.append({"role": "user", "content": " ".join(rng.choice(WORDS, rng.integers(1, 4)))})
            chat.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, rng.integers(1, 5)))})
        out.append({"messages": chat})
    return out


def tokenizer():
    t = char_tokenizer(GEMMA4_CONTROL)
    t.chat_template = gemma4_training_template()
    return t
