"""The prompt-file verbs: `lmforge data grpo-toy` and `lmforge data gsm8k-prompts`."""

from __future__ import annotations

import json

from lmforge.cli import main
from lmforge.rl.data import read_prompts
from lmforge.rl.toy import write_prompts
from lmforge.tokenizers import load_tokenizer


def test_grpo_toy_writes_the_demo_files(tmp_path, capsys):
    assert main(["data", "grpo-toy", str(tmp_path / "toy"), "--records", "5", "--target", "a"]) in (
        0,
        None,
    )
    assert "5 prompts" in capsys.readouterr().out
    assert (tmp_path / "toy/prompts.jsonl").read_text() == write_prompts(
        tmp_path / "ref.jsonl", 5, "a"
    ).read_text()
    from tokenizers import Tokenizer

    # the reference reader of the file
    tok = Tokenizer.from_file(str(tmp_path / "toy/tokenizer.json"))
    records = read_prompts(
        tmp_path / "toy/prompts.jsonl", load_tokenizer(tmp_path / "toy/tokenizer.json")
    )
    assert len(records) == 5 and tok.get_vocab_size() == 38


def test_grpo_toy_refuses_a_target_outside_its_vocabulary(tmp_path, capsys):
    assert main(["data", "grpo-toy", str(tmp_path / "toy"), "--target", "seven"]) == 1
    assert "no word of the toy vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "toy").exists()


def test_gsm8k_prompts_keep_the_answer_and_a_bad_record_writes_nothing(tmp_path, capsys):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": "1+1?", "answer": "so #### 2"}) + "\n")
    assert main(["data", "gsm8k-prompts", str(src), str(tmp_path / "p.jsonl")]) in (0, None)
    (record,) = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert record["answer"] == "so #### 2" and record["prompt"][-1] == {
        "role": "user",
        "content": "1+1?",
    }
    src.write_text(
        json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"q": 1}) + "\n"
    )
    assert main(["data", "gsm8k-prompts", str(src), str(tmp_path / "bad.jsonl")]) == 1
    assert f"{src}:2" in capsys.readouterr().err and not (tmp_path / "bad.jsonl").exists()
