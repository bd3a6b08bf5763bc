"""GRPO's prompts file on the real GPT-2 tokenizer: text prompts as transformers tokenizes them,
chat prompts as its apply_chat_template(add_generation_prompt=True) renders them, the other
fields kept for the rewards."""

from __future__ import annotations

import json

import pytest

from lmforge.chat_template import ChatTemplate
from lmforge.errors import UserError
from lmforge.rl.data import read_prompts, reward_completions, reward_inputs
from lmforge.tokenizers import load_tokenizer

tf = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}{{ '<|endoftext|>' + m['role'] + '\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|endoftext|>assistant\\n' }}{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}]


@pytest.fixture(scope="module")
def gpt2(shared_data):
    return load_tokenizer(shared_data / "tokenizers" / "gpt2" / "tokenizer.json")


@pytest.fixture(scope="module")
def reference(shared_data):
    return tf.PreTrainedTokenizerFast(
        tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
    )


def _write(tmp_path, records) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
        encoding="utf-8",
    )
    return str(path)


def test_text_and_chat_prompts_equal_transformers(tmp_path, gpt2, reference):
    path = _write(
        tmp_path,
        [
            {"prompt": "Question: what is 6 x 7?\nAnswer:", "answer": "#### 42", "level": 1},
            {"prompt": CHAT, "answer": "42"},
            "",
            {"messages": CHAT[1:], "answer": "42", "tests": ["assert f(1) == 2"]},
        ],
    )
    records = read_prompts(path, gpt2, ChatTemplate(CHATML, gpt2))
    assert records[0].ids == reference("Question: what is 6 x 7?\nAnswer:")["input_ids"]
    assert (
        records[1].ids
        == reference.apply_chat_template(
            CHAT, chat_template=CHATML, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert (
        records[2].ids
        == reference.apply_chat_template(
            CHAT[1:],
            chat_template=CHATML,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    assert [r.chat for r in records] == [False, True, True]
    assert records[1].prompt == CHAT  # what the reward functions get as `prompts`
    prompts, columns = reward_inputs(records, 2)
    assert prompts == [records[0].prompt] * 2 + [CHAT] * 2 + [CHAT[1:]] * 2
    assert columns == {
        "answer": ["#### 42"] * 2 + ["42"] * 4,
        "level": [1, 1, None, None, None, None],
        "tests": [None] * 4 + [["assert f(1) == 2"]] * 2,
    }


def test_completions_reach_the_rewards_as_text_or_one_assistant_message(tmp_path, gpt2):
    records = read_prompts(
        _write(tmp_path, [{"prompt": "6 x 7 ="}, {"prompt": CHAT}]),
        gpt2,
        ChatTemplate(CHATML, gpt2),
    )
    ids = gpt2.encode(" 42")
    got = reward_completions(
        gpt2, records, [ids + [50256], ids, ids, ids + [50256]], 2, stop_token_ids=[50256]
    )
    assert got[:2] == [" 42", " 42"]
    assert got[2:] == [[{"role": "assistant", "content": " 42"}]] * 2


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"question": "2 + 2?", "answer": "4"},
            "prompts.jsonl:1: the record has no 'prompt' (text or chat messages) "
            "or 'messages' (fields: answer, question): give each record its prompt",
        ),
        ({"prompt": ""}, "the prompt is empty"),
        (
            {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "ends with an assistant message",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 must be"),
        ("[1, 2]", "not a JSON object"),
        ("{oops", "not a JSON object"),
    ],
)
def test_a_bad_record_is_one_line_naming_its_line(tmp_path, gpt2, record, message):
    with pytest.raises(UserError, match="prompts.jsonl:1: ") as e:
        read_prompts(_write(tmp_path, [record]), gpt2, ChatTemplate(CHATML, gpt2))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_chat_without_template_context_overflow_and_missing_file(tmp_path, gpt2):
    with pytest.raises(UserError, match="needs a chat template"):
        read_prompts(_write(tmp_path, [{"prompt": CHAT}]), gpt2)
    with pytest.raises(UserError, match="do not fit the model's context of 16"):
        read_prompts(
            _write(tmp_path, [{"prompt": "one two three four"}]),
            gpt2,
            context=16,
            max_completion_length=13,
        )
    with pytest.raises(UserError, match="not found"):
        read_prompts(tmp_path / "none.jsonl", gpt2)
    with pytest.raises(UserError, match="has no records"):
        read_prompts(_write(tmp_path, [""]), gpt2)
