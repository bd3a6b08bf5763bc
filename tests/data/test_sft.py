"""SFT examples checked against tokenizing each example whole with the tokenizers library, on
Alpaca's real data.

The Alpaca templates are spelled out again here from tatsu-lab/stanford_alpaca train.py
(PROMPT_DICT), so a change to the library's copy shows up as a failure, not as a silently different
prompt.
"""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.chat_template import ChatTemplate
from lmforge.data.collate import IGNORE_INDEX
from lmforge.data.sft import SFTDataset, pack_first_fit
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer

ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
SEQ = 512


@pytest.fixture(scope="module")
def alpaca(shared_data) -> Path:
    return shared_data / "instruct" / "alpaca" / "alpaca_subset_2k.json"


@pytest.fixture(scope="module")
def records(alpaca) -> list[dict]:
    return json.loads(alpaca.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gpt2(shared_data):
    return load_tokenizer(shared_data / "tokenizers" / "gpt2")


@pytest.fixture(scope="module")
def expected(records, gpt2) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per record, as Stanford's train.py and transformers make them: prompt and
    response tokenized as one text (55 of these 2,000 answers start with punctuation that merges
    with the prompt's last ':'), the loss on every token that covers a character of the response,
    and on eos."""
    prompts = [(ALPACA_INPUT if r["input"] else ALPACA_NO_INPUT).format(**r) for r in records]
    out, eos = [], 50256
    for prompt, record in zip(prompts, records):
        whole = gpt2._tok.encode(prompt + record["output"], add_special_tokens=False)
        labels = [
            i if end > len(prompt) else IGNORE_INDEX
            for i, (_, end) in zip(whole.ids, whole.offsets)
        ]
        out.append((whole.ids + [eos], labels + [eos]))
    return out


@pytest.fixture(scope="module")
def unpacked(alpaca, gpt2) -> SFTDataset:
    # the longest answers go: the labels compared are whole
    return SFTDataset(alpaca, gpt2, SEQ, truncate="drop")


@pytest.fixture(scope="module")
def packed(alpaca, gpt2) -> SFTDataset:
    # the same examples as `unpacked`
    return SFTDataset(alpaca, gpt2, SEQ, packing=True, truncate="drop")


def test_alpaca_labels_are_ignored_exactly_on_the_prompt(records, expected, unpacked):
    assert len(records) == 2000
    kept = [e for e in expected if len(e[0]) <= SEQ]
    # a few Alpaca answers are longer than 512 tokens
    assert unpacked.num_dropped == 2000 - len(kept) > 0
    assert len(unpacked) == len(kept)
    for i, (ids, labels) in enumerate(kept):
        item = unpacked[i]
        assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
        assert item["input_ids"].tolist() == ids
        assert item["labels"].tolist() == labels
        assert item["attention_mask"].tolist() == [1] * len(ids)
    # GPT-2 has no bos distinct from <|endoftext|>: none is added.
    assert unpacked[0]["input_ids"][0].item() != 50256


def test_max_records_keeps_the_first_records_exactly(alpaca, gpt2, expected):
    first = SFTDataset(alpaca, gpt2, SEQ, truncate="drop", max_records=16)
    kept = [e for e in expected[:16] if len(e[0]) <= SEQ]
    assert len(first) == len(kept) == 16
    assert [first[i]["input_ids"].tolist() for i in range(16)] == [ids for ids, _ in kept]


def test_max_train_examples_below_one_is_refused():
    from lmforge.train.config import DataConfig

    with pytest.raises(UserError, match="data.max_train_examples must be >= 1"):
        DataConfig(max_train_examples=0)


def test_llama_adds_bos_and_ends_responses_with_eos(shared_data, alpaca, records):
    llama = load_tokenizer(shared_data / "tokenizers" / "llama2" / "tokenizer.model")
    ds = SFTDataset(alpaca, llama, 4096)
    assert len(ds) == 2000 and ds.pad_id == 2  # no pad in Llama's tokenizer: eos pads
    for i in range(0, 2000, 97):
        r = records[i]
        prompt = (ALPACA_INPUT if r["input"] else ALPACA_NO_INPUT).format(**r)
        # One text, as Stanford's train.py tokenizes it: the answer right after "### Response:" has
        # no prefix space (tokenized alone, SentencePiece gave it one).
        whole = llama.encode(prompt + r["output"])
        ((same, offsets),) = llama.encode_batch_offsets([prompt + r["output"]])
        assert same == whole
        in_prompt = sum(end <= len(prompt) for _, end in offsets)
        item = ds[i]
        assert item["input_ids"].tolist() == [1, *whole, 2]
        assert item["labels"].tolist() == [IGNORE_INDEX] * (1 + in_prompt) + whole[in_prompt:] + [2]
    # Served through the exported template, a chat's user message is prompted as an Alpaca
    # instruction.
    r = next(r for r in records if not r["input"])
    served = ChatTemplate(ds.export_template, llama).prompt_ids([("user", r["instruction"])])
    assert served == [1, *llama.encode(ALPACA_NO_INPUT.format(**r))]


def test_packing_keeps_every_example_whole_within_seq_length(unpacked, packed):
    assert len(packed) < len(unpacked) / 3  # Alpaca examples average ~110 GPT-2 tokens
    assert packed.packing_efficiency > 0.9
    seen = []
    for i in range(len(packed)):
        item = packed[i]
        assert all(v.shape == (SEQ,) and v.dtype == torch.int64 for v in item.values())
        seg = item["segment_ids"]
        assert item["attention_mask"].tolist() == (seg > 0).long().tolist()
        members = packed.packs[i]
        assert members == sorted(members)  # examples keep their order inside a sequence
        start = 0
        for s, e in enumerate(members, start=1):
            ref = unpacked[e]
            n = len(ref["input_ids"])
            assert (seg[start : start + n] == s).all()
            assert torch.equal(item["input_ids"][start : start + n], ref["input_ids"])
            assert torch.equal(item["labels"][start : start + n], ref["labels"])
            assert item["position_ids"][start : start + n].tolist() == list(range(n))
            # A sequence's first token never predicts across an example boundary.
            assert item["labels"][start] == IGNORE_INDEX
            start += n
        assert (seg[start:] == 0).all() and (item["labels"][start:] == IGNORE_INDEX).all()
        assert (item["input_ids"][start:] == packed.pad_id).all()
        seen += members
    assert sorted(seen) == list(range(len(unpacked)))  # each example exactly once


def reference_first_fit(lengths, capacity):
    bins = []
    for i, n in enumerate(lengths):
        for b in bins:
            if b[0] >= n:
                b[0] -= n
                b[1].append(i)
                break
        else:
            bins.append([capacity - n, [i]])
    return [b[1] for b in bins]


def test_first_fit_matches_a_plain_reference():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=500).tolist()
    assert pack_first_fit(lengths, 256) == reference_first_fit(lengths, 256)
    assert pack_first_fit([256, 1, 255], 256) == [[0], [1, 2]]


def test_unpacked_batches_pad_right_with_eos_and_ignored_labels(unpacked):
    items = [unpacked[i] for i in range(8)]
    batch = unpacked.collate(items)
    longest = max(len(x["input_ids"]) for x in items)
    assert (
        batch["input_ids"].shape
        == batch["labels"].shape
        == batch["attention_mask"].shape
        == (8, longest)
    )
    for row, x in enumerate(items):
        n = len(x["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], x["input_ids"])
        assert torch.equal(batch["labels"][row, :n], x["labels"])
        assert (batch["input_ids"][row, n:] == 50256).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (longest - n)


def test_truncate_cut_keeps_a_prefix_and_drops_examples_left_without_labels(
    tmp_path, records, gpt2, expected
):
    path = tmp_path / "first300.json"
    path.write_text(json.dumps(records[:300]), encoding="utf-8")
    ds = SFTDataset(path, gpt2, 96, truncate="cut")
    expected = expected[:300]
    kept = []
    for ids, labels in expected:
        if len(ids) > 96 and all(x == IGNORE_INDEX for x in labels[:96]):
            continue
        kept.append((ids[:96], labels[:96]))
    assert ds.num_cut == sum(len(ids) > 96 for ids, _ in expected) - ds.num_dropped
    assert ds.num_dropped == len(expected) - len(kept) > 0
    assert [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))] == kept


def test_chat_trains_only_on_assistant_turns(tmp_path, gpt2):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "Thanks"},  # after the last answer: left out
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    item = SFTDataset(path, gpt2, 256)[0]
    pieces = [
        ("<|system|>\nYou are terse.\n<|user|>\nCapital of France?\n<|assistant|>\n", False),
        ("Paris.", True),
        ("\n<|user|>\nAnd of Italy?\n<|assistant|>\n", False),
        ("Rome.", True),
    ]
    ids, labels = [], []
    for text, train in pieces:
        piece = gpt2.encode(text) + ([50256] if train else [])
        ids += piece
        labels += piece if train else [IGNORE_INDEX] * len(piece)
    assert item["input_ids"].tolist() == ids
    assert item["labels"].tolist() == labels
    trained = item["labels"][item["labels"] != IGNORE_INDEX].tolist()
    assert gpt2.decode(trained) == "Paris.<|endoftext|>Rome.<|endoftext|>"
    # Serving: the prompt for the second answer is the training ids up to that answer, token for
    # token.
    before_rome = len(ids) - len(gpt2.encode("Rome.")) - 1
    served = ChatTemplate(SFTDataset(path, gpt2, 256).export_template, gpt2)
    assert served.prompt_ids([(m["role"], m["content"]) for m in messages[:4]]) == ids[:before_rome]


def test_seed_tasks_instances_are_examples(shared_data, gpt2):
    path = shared_data / "instruct" / "alpaca" / "seed_tasks.jsonl"
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    ds = SFTDataset(path, gpt2, 4096)
    assert len(ds) == 175  # 175 seed tasks, one instance each
    item = ds[0]
    response = item["input_ids"][item["labels"] != IGNORE_INDEX].tolist()
    assert gpt2.decode(response) == first["instances"][0]["output"] + "<|endoftext|>"


def test_user_prompt_template(tmp_path, gpt2):
    path = tmp_path / "a.jsonl"
    path.write_text(
        json.dumps({"instruction": "Add", "input": "2 and 3", "output": "5"}) + "\n",
        encoding="utf-8",
    )
    item = SFTDataset(path, gpt2, 64, prompt_template="Q: {instruction} {{{input}}}\nA:")[0]
    prompt = gpt2.encode("Q: Add {2 and 3}\nA:")
    assert item["input_ids"].tolist() == prompt + gpt2.encode("5") + [50256]
    assert item["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + gpt2.encode("5") + [50256]


@pytest.mark.parametrize(
    "content, match",
    [
        (
            '{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"\n',
            # the column on its own line
            r"bad\.jsonl:2: malformed JSON \(Expecting ',' delimiter at column 35\)",
        ),
        (
            '{"instruction": "a", "answer": "b"}\n',
            r"bad\.jsonl:1: unknown record kind with keys \['answer', 'instr",
        ),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
            r"bad\.jsonl:1: unknown record kind .* or prompt/completion \(prompt/chosen/rejected is DPO data: set "
            r"data.task=dpo\)$",
        ),
        ('{"instruction": "a", "output": 3}\n', r"bad\.jsonl:1: .* must be strings"),
        ("\n\n", r"holds no records"),
        (
            '[{"instruction": "a", "output": "b"}, 3]',
            r"bad\.jsonl: record 2: a record must be a JSON object",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}\n',
            r"bad\.jsonl:1: the chat has no assistant message",
        ),
        ('{"messages": [{"role": "bot", "content": "hi"}]}\n', r"bad\.jsonl:1: message 0 must be"),
        (
            '{"prompt": "a", "completion": 3}\n',
            r"bad\.jsonl:1: 'completion' must be a string or a list",
        ),
    ],
)
def test_bad_files_are_one_line_user_errors(tmp_path, gpt2, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=match) as e:
        SFTDataset(path, gpt2, 64)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt_template": "{question}"}, "needs {instruction}"),
        ({"prompt_template": "{instruction"}, "not a valid template"),
        ({"chat_template": "vicuna"}, "unknown chat template 'vicuna'"),
        ({"truncate": "left"}, "truncate must be one of drop, cut"),
        ({"seq_length": 4}, "no example fits seq_length 4"),
    ],
)
def test_bad_settings_are_user_errors(tmp_path, gpt2, kwargs, match):
    path = tmp_path / "a.jsonl"
    path.write_text(
        json.dumps({"instruction": "Add 2 and 3", "output": "5"}) + "\n", encoding="utf-8"
    )
    with pytest.raises(UserError, match=match):
        SFTDataset(path, gpt2, **{"seq_length": 64, **kwargs})


CHATML_GPT2 = (
    "{% for m in messages %}{{ '<|endoftext|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|endoftext|>' }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|endoftext|>assistant\\n' }}{% endif %}"
)


def test_every_record_kind_goes_through_the_models_chat_template(tmp_path, shared_data):
    """A folder with a chat template: chats, Alpaca and prompt/completion records all render with
    it (Alpaca's input after a blank line), the loss on the assistant's tokens only, or on all
    with assistant_only_loss=False."""
    import shutil

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copyfile(
        shared_data / "tokenizers" / "gpt2" / "tokenizer.json", folder / "tokenizer.json"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_GPT2}))
    tok = load_tokenizer(folder)
    path = tmp_path / "mixed.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
            ]
        },
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"prompt": "Capital of France?", "completion": "Paris."},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    from lmforge.data.sft import resolve_chat_template

    template = resolve_chat_template("model", tok, folder)
    ds = SFTDataset(path, tok, 64, chat_template=template)
    assert ds.export_template == CHATML_GPT2
    for i, (user, answer) in enumerate(
        [("Hi", "Hello."), ("Add\n\n2 and 3", "5"), ("Capital of France?", "Paris.")]
    ):
        prompt = [50256, *tok.encode(f"user\n{user}\n"), 50256, *tok.encode("assistant\n")]
        reply = [*tok.encode(answer), 50256]
        assert ds[i]["input_ids"].tolist() == prompt + reply
        assert ds[i]["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + reply
    every = SFTDataset(path, tok, 64, chat_template=template, assistant_only_loss=False)[0]
    assert every["labels"].tolist() == [IGNORE_INDEX, *every["input_ids"][1:].tolist()]
    with pytest.raises(UserError, match="has no chat template"):
        resolve_chat_template("model", tok, tmp_path)


def test_prompt_completion_without_a_template_is_plain_text(tmp_path, gpt2):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n", encoding="utf-8")
    ds = SFTDataset(path, gpt2, 64)
    assert ds[0]["input_ids"].tolist() == gpt2.encode("2+2=") + gpt2.encode("4") + [50256]
    assert ds[0]["labels"].tolist() == [IGNORE_INDEX] * len(gpt2.encode("2+2=")) + gpt2.encode(
        "4"
    ) + [50256]
    assert ChatTemplate(ds.export_template, gpt2).prompt_ids([("user", "2+2=")]) == gpt2.encode(
        "2+2="
    )


def test_mixed_record_kinds_without_a_template_say_which_one_the_export_serves(
    tmp_path, gpt2, caplog
):
    """A walkthrough mixed Alpaca records and chats: each trained in its own built-in, the export
    carried the chats' alone, and nothing said so."""
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    ] * 2 + [{"instruction": "Add 2 and 2.", "output": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="lmforge.data.sft"):
        SFTDataset(path, gpt2, 128)
    assert (
        "mixes record kinds (2 chat, 1 alpaca)" in caplog.text
        and "set data.chat_template=NAME" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmforge.data.sft"):
        # one template renders all: nothing to say
        SFTDataset(path, gpt2, 128, chat_template="chatml")
    assert "mixes" not in caplog.text


def test_formats_that_train_what_serving_cannot_reproduce_are_said(gpt2, tmp_path, caplog):
    """An Alpaca record's input (Stanford's with-input prompt, which a chat request cannot
    select) and a template that ends answers with no end-of-turn token (the model never learns to
    stop) train silently otherwise."""
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"instruction": "Add.", "input": "2 and 3", "output": "5"},
                {"instruction": "Say hi.", "input": "", "output": "Hi."},
            ]
        )
    )
    with caplog.at_level(logging.WARNING, logger="lmforge.data.sft"):
        SFTDataset(alpaca, gpt2, 128)
        # instruction and input as one message: as served
        SFTDataset(alpaca, gpt2, 128, chat_template="alpaca")
    assert [r.getMessage().split(": ", 1)[1][:38] for r in caplog.records] == [
        "1 Alpaca records have an input, traine"
    ]
    caplog.clear()
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    endless = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with caplog.at_level(logging.WARNING, logger="lmforge.data.sft"):
        SFTDataset(chats, gpt2, 128, chat_template=ChatTemplate(endless, gpt2))
        SFTDataset(chats, gpt2, 128)  # the built-in ends the answer with eos
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no answer ends in an end-of-turn token" in line


# Qwen's ChatML
@pytest.mark.parametrize(
    "start, end, eos",
    [
        ("<|im_start|>", "<|im_end|>", "<|im_end|>"),
        # Gemma's
        ("<start_of_turn>", "<end_of_turn>", "<eos>"),
    ],
)
def test_an_end_of_turn_token_then_a_newline_is_learnt_stopping(
    start, end, eos, shared_data, tmp_path, caplog
):
    """The answer's span ends "<|im_end|>\\n" (the turn as the template writes it): the
    end-of-turn token is trained, and the warning that the model does not learn to stop, which
    looked at the newline, is not given."""
    import tokenizers as hf

    raw = hf.Tokenizer.from_file(str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"))
    raw.add_special_tokens([start, end, eos])
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    tok = load_tokenizer(tmp_path / "tok")
    template = (
        "{% for m in messages %}{{ '"
        + start
        + "' + m['role'] + '\\n' + m['content'] + '"
        + end
        + "\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '" + start + "assistant\\n' }}{% endif %}"
    )
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="lmforge.data.sft"):
        data = SFTDataset(chats, tok, 128, chat_template=ChatTemplate(template, tok))
    _, labels = data.examples[0]
    assert labels[labels != IGNORE_INDEX].tolist() == [
        *tok.encode("hello"),
        tok.token_to_id(end),
        *tok.encode("\n"),
    ]
    assert "learn to stop" not in caplog.text
