"""Settings a fine-tuning run does not use are said, not silently dropped; and how many epochs
the steps make."""

from __future__ import annotations

import json
import logging

from lmforge.tokenizers import load_tokenizer
from lmforge.train.config import load_run_config
from lmforge.train.tasks import get_task


def _warnings(caplog, task: str, tokenizer, *overrides) -> list[str]:
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny-llama",
            f"data.task={task}",
            "data.seq_length=64",
            "trainer.max_steps=5",
            "trainer.global_batch_size=8",
            *overrides,
        ],
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        get_task(task).build_data(cfg, tokenizer)
    return [r.getMessage() for r in caplog.records]


def test_unused_settings_are_said(tiny_llama, chats, tmp_path, caplog):
    tokenizer = load_tokenizer(tiny_llama)
    sft = f"data.train_file={chats}"
    lines = _warnings(
        caplog,
        "sft",
        tokenizer,
        sft,
        "data.chat_template=chatml",
        "data.prompt_template='Q: {instruction}'",
        "dpo.beta=0.5",
    )
    assert any(line.startswith("data.prompt_template is not used") for line in lines)
    assert any(line.startswith("dpo.beta is not used") for line in lines)
    assert any(
        line.startswith("the chat template's turn marker <|im_end|> is no token of this tokenizer")
        for line in
        # GPT-2's tokenizer has no ChatML tokens (TRL's setup_chat_format
        # would add them)
        lines
    )
    # 5 steps x 8 = 40 samples of the 64 chats.
    assert (
        "trainer.max_steps x global_batch_size = 40 samples: 0.62 epochs of the 64 examples"
        in lines
    )
    # nothing set in vain
    assert not [w for w in _warnings(caplog, "sft", tokenizer, sft) if "not used" in w]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"{a} plus 1 is", "chosen": f" {a + 1}", "rejected": " 0"}) + "\n"
            for a in range(16)
        )
    )
    lines = _warnings(caplog, "dpo", tokenizer, f"data.train_file={pairs}")
    assert any(line.endswith("2.50 epochs of the 16 pairs") for line in lines)
