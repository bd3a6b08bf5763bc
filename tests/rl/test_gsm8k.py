"""The GSM8K recipe's data: lmforge.rl.gsm8k's prompt records read by read_prompts with a chat
template, and the recipe's rewards (accuracy, format) giving GSM8K's own reference solution, put
in the asked format, full marks."""

from __future__ import annotations

import json
import re

from lmforge.chat_template import ChatTemplate, builtin_template
from lmforge.rl.data import read_prompts, reward_inputs
from lmforge.rl.gsm8k import SYSTEM, convert
from lmforge.rl.rewards import Rewards
from lmforge.tokenizers import load_tokenizer


def test_gsm8k_records_become_prompts_the_rewards_score(shared_data, tmp_path):
    source = shared_data / "rl" / "gsm8k" / "test.jsonl"
    out = tmp_path / "prompts.jsonl"
    assert convert(source, out, limit=20) == 20
    tokenizer = load_tokenizer(shared_data / "tokenizers" / "gpt2" / "tokenizer.json")
    template = ChatTemplate(builtin_template("chatml", False), tokenizer)
    records = read_prompts(out, tokenizer, template)
    originals = [json.loads(line) for line in source.read_text().splitlines()[:20]]
    assert [r.prompt[1]["content"] for r in records] == [o["question"] for o in originals]
    assert all(r.prompt[0] == {"role": "system", "content": SYSTEM} and r.chat for r in records)
    assert "<|im_start|>assistant" in tokenizer.decode(records[0].ids)  # the generation prompt
    # GSM8K's reference solutions: the number after ####, answered in DeepSeek-R1's format; the
    # first is 18.
    finals = [re.search(r"####\s*(.+)$", o["answer"]).group(1).strip() for o in originals]
    assert finals[0] == "18"
    right = [
        [{"role": "assistant", "content": f"<think>{o['answer']}</think> <answer>{n}</answer>"}]
        for o, n in zip(originals, finals)
    ]
    wrong = [[{"role": "assistant", "content": f"<answer>{n}1</answer>"}] for n in finals]
    prompts, columns = reward_inputs(records, 1)
    rewards = Rewards(["accuracy", "format"], [1.0, 0.5])
    scores = rewards(prompts, right + wrong, [[1]] * 40, {k: v + v for k, v in columns.items()})
    assert scores.per_function[:20].tolist() == [[1.0, 1.0]] * 20
    assert scores.per_function[20:].tolist() == [[0.0, 0.0]] * 20
    assert scores.total[:20].tolist() == [1.5] * 20
