"""A toy verifiable task that a tiny random model learns by GRPO on a CPU in minutes (the offline demo and the tests).

The vocabulary is 38 words (`<eos>`, `<pad>`, the digits, the letters), so a fresh model already writes the target
word now and then and every group's rewards differ; the reward is the fraction of a completion's words that are the
record's `target`. It checks the loop learns, nothing about language.

    lmforge data grpo-toy OUT_DIR [--records N] [--target 7]    # OUT_DIR/tokenizer.json and prompts.jsonl
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from lmforge.rl.rewards import completion_text

WORDS = ["<eos>", "<pad>", *"0123456789", *"abcdefghijklmnopqrstuvwxyz"]


def write_tokenizer(path: str | Path) -> Path:
    """A word-level tokenizer.json over WORDS (`<eos>` is id 0, tiny-neox's eos): one id per
    space-separated word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.add_special_tokens(["<eos>", "<pad>"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_prompts(path: str | Path, records: int = 64, target: str = "7", seed: int = 0) -> Path:
    """`records` prompts of 3 to 6 random letters, each with its `target` word."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(records):
            prompt = " ".join(rng.choice(WORDS[12:]) for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    return path


def target_fraction(completions: Sequence, target: Sequence[str], **kwargs) -> list[float]:
    """The share of each completion's words equal to its record's target (0 for an empty
    completion)."""
    out = []
    for completion, want in zip(completions, target):
        words = completion_text(completion).split()
        out.append(sum(w == want for w in words) / len(words) if words else 0.0)
    return out
