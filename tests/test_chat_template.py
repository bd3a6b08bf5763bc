"""Assistant spans of chat templates against transformers'
apply_chat_template(return_assistant_tokens_mask=True), on the real GPT-2 tokenizer: {%
generation %} blocks, the turn-by-turn split, the built-ins."""

from __future__ import annotations

import pytest

from lmforge.chat_template import ChatTemplate, TemplateRefused, builtin_template, encode_pieces
from lmforge.tokenizers import load_tokenizer

tf = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

# ChatML's shape with GPT-2's one special token as the turn marker; the answer and its end marker
# are the span.
MARKED = (
    "{% for m in messages %}{{ '<|endoftext|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|endoftext|>' }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|endoftext|>assistant\\n' }}{% endif %}"
)
UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2? Say <|endoftext|> too."},
    {"role": "assistant", "content": " 4, and <|endoftext|>."},
]


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


def _ids_and_mask(template: ChatTemplate, messages) -> tuple[list[int], list[int]]:
    ids, mask = encode_pieces(template.tokenizer, [template.pieces(messages, False)])[0]
    return ids, [int(m) for m in mask]


def test_assistant_mask_equals_transformers(gpt2, reference):
    # transformers parses '<|endoftext|>' typed inside a message as the control token; lmforge keeps
    # it text, so the reference is taken on the same chat without it, and the typed one checked to
    # stay text.
    plain = [{**m, "content": m["content"].replace("<|endoftext|>", "eos")} for m in MESSAGES]
    out = reference.apply_chat_template(
        plain,
        chat_template=MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = _ids_and_mask(ChatTemplate(MARKED, gpt2), plain)
    assert ids == out["input_ids"] and mask == out["assistant_masks"]
    assert (
        sum(mask)
        == len(gpt2.encode("Hello! How can I help?")) + len(gpt2.encode(" 4, and eos.")) + 2
    )
    typed, _ = _ids_and_mask(ChatTemplate(MARKED, gpt2), MESSAGES)
    assert typed.count(50256) == ids.count(50256)


def test_turn_by_turn_split_equals_generation_blocks(gpt2):
    """Without {% generation %} blocks, an answer's span is what rendering its turn adds after
    the generation prompt: here exactly what the blocks mark."""
    assert _ids_and_mask(ChatTemplate(UNMARKED, gpt2), MESSAGES) == _ids_and_mask(
        ChatTemplate(MARKED, gpt2), MESSAGES
    )


def test_serving_prompt_is_the_training_prefix(gpt2):
    for source in (MARKED, UNMARKED):
        template = ChatTemplate(source, gpt2)
        ids, mask = _ids_and_mask(template, MESSAGES)
        second = len(mask) - mask[::-1].index(0)  # where the last answer starts
        prompt = template.prompt_ids([(m["role"], m["content"]) for m in MESSAGES[:4]])
        assert prompt == ids[:second]


def test_a_template_that_rewrites_earlier_turns_is_refused(gpt2):
    # Only the last answer is shown in full (as reasoning templates drop earlier thoughts): no
    # turn-by-turn split.
    rewriting = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ 'A: ...\\n' }}"
        "{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(TemplateRefused, match="rewrites earlier turns"):
        ChatTemplate(rewriting, gpt2).pieces(MESSAGES, False)
    # Serving still works: the prompt is cut at special tokens only, as transformers does.
    assert ChatTemplate(rewriting, gpt2).prompt_ids([("user", "hi")]) == gpt2.encode(
        "user: hi\nassistant: "
    )


def test_builtins(gpt2):
    lmforge = ChatTemplate(builtin_template("lmforge", gpt2.add_bos_token), gpt2)
    ids, mask = _ids_and_mask(lmforge, MESSAGES[1:3])
    answer = gpt2.encode("Hello! How can I help?") + [50256]
    assert ids == gpt2.encode("<|user|>\nHi there\n<|assistant|>\n") + answer + gpt2.encode("\n")
    assert [i for i, m in zip(ids, mask) if m] == answer
    # ChatML on a tokenizer without its tokens: the markers are text, and serving stops at the end
    # marker.
    chatml = ChatTemplate(builtin_template("chatml", False), gpt2)
    assert chatml.stop_strings == ("<|im_end|>",)
    assert chatml.prompt_ids([("user", "hi")]) == gpt2.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_import_and_export_keep_the_chat_template(hf_dirs, tmp_path):
    import shutil

    from lmforge.chat_template import read_chat_template
    from lmforge.models.hf import export_hf, import_hf

    source = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"], source)
    (source / "chat_template.jinja").write_text(MARKED)
    import_hf(source, tmp_path / "lmforge")
    export_hf(tmp_path / "lmforge", tmp_path / "back")
    assert (
        read_chat_template(tmp_path / "lmforge") == read_chat_template(tmp_path / "back") == MARKED
    )


def test_llama2_chat_equals_metas_reference_tokenization(shared_data):
    """Meta's llama generation code encodes each turn whole, `sp.encode(f"[INST] {user} [/INST]
    {answer} ")` between bos and eos. Its template, rendered and tokenized by lmforge, gives
    those ids; the answer starts with "▁The", where encoding it apart from its turn gave
    SentencePiece's prefix space again ("▁", "▁The") on every answer."""
    import sentencepiece as spm

    path = shared_data / "tokenizers" / "llama2" / "tokenizer.model"
    sp = spm.SentencePieceProcessor(model_file=str(path))
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + "
        "' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    )
    turns = [("Hi there", "The answer is 4."), ("And in French?", "La réponse est 4.")]
    messages = [
        {"role": r, "content": c}
        for user, answer in turns
        for r, c in (("user", user), ("assistant", answer))
    ]
    chat = ChatTemplate(template, load_tokenizer(path))
    ids, mask = _ids_and_mask(chat, messages)
    expected, answers = [], []
    for user, answer in turns:
        head = sp.encode(f"[INST] {user} [/INST]")
        turn = sp.encode(f"[INST] {user} [/INST] {answer} ")
        assert turn[: len(head)] == head  # the answer starts at a token boundary here
        expected += [1, *turn, 2]
        answers += [*turn[len(head) :], 2]
    assert ids == expected
    assert [i for i, m in zip(ids, mask) if m] == answers
    assert sp.id_to_piece(answers[0]) == "▁The"


def test_a_prefix_space_only_at_the_start_is_matched(shared_data, tmp_path):
    """transformers 5 converts Llama's tokenizer.model to a tokenizer.json whose Metaspace puts
    the prefix space only at the start of an input ("first"): after "<s>" its "[INST]" starts
    with "[", where each text run encoded apart gave "▁[". The ids, and the assistant mask, now
    equal apply_chat_template's."""
    import shutil

    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(shared_data / "tokenizers" / "llama2" / "tokenizer.model", folder)
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", '
        '"eos_token": "</s>", "unk_token": "<unk>"}'
    )
    reference = tf.AutoTokenizer.from_pretrained(folder)
    reference.save_pretrained(tmp_path / "fast")
    assert "prepend_scheme=first" in str(reference.backend_tokenizer.pre_tokenizer)
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + "
        "' [/INST]' }}{% elif m['role'] == 'assistant' %}{% generation %}{{ ' ' + m['content'] + ' ' + "
        "eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "The answer is 4."},
        {"role": "user", "content": "And in French?"},
        {"role": "assistant", "content": "La réponse est 4."},
    ]
    out = reference.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = _ids_and_mask(
        ChatTemplate(template, load_tokenizer(tmp_path / "fast" / "tokenizer.json")), messages
    )
    assert ids == out["input_ids"] and mask == out["assistant_masks"]


# Chat templates in the shape of three families' own, each with its turn markers as special tokens.
FAMILIES = {
    "llama3": (
        ("<|begin_of_text|>", "<|eot_id|>"),
        ["<|start_header_id|>", "<|end_header_id|>"],
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
        "+ m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
    "gemma": (
        ("<bos>", "<eos>"),
        ["<start_of_turn>", "<end_of_turn>"],
        "{{ bos_token }}{% for m in messages %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    ),
    "phi3": (
        ("<s>", "<|endoftext|>"),
        ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ),
}


def saved_by_transformers(shared_data, folder, bos_eos, specials, template):
    """GPT-2's tokenizer given a family's special tokens and chat template, saved by transformers
    5: the config lists them under extra_special_tokens and has no added_tokens_decoder;
    tokenizer.json holds them."""
    import json

    tok = tf.PreTrainedTokenizerFast(
        tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
        bos_token=bos_eos[0],
        eos_token=bos_eos[1],
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" in config and "added_tokens_decoder" not in config
    return tf.AutoTokenizer.from_pretrained(folder)


def _input_ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_special_tokens_of_a_transformers_5_tokenizer(family, shared_data, tmp_path):
    """Fine-tuning ids and a served prompt equal apply_chat_template's: the turn markers, which a
    tokenizer saved by transformers 5 declares only in tokenizer.json and extra_special_tokens,
    are single ids (they were characters)."""
    import json

    from lmforge.data.sft import SFTDataset
    from lmforge.serve.chat import ChatFormat

    folder = tmp_path / family
    reference = saved_by_transformers(shared_data, folder, *FAMILIES[family])
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    tok = load_tokenizer(folder)
    data = SFTDataset(
        tmp_path / "chat.jsonl", tok, 256, chat_template=ChatTemplate.from_folder(tok, folder)
    )
    expected = _input_ids(reference.apply_chat_template(messages, tokenize=True))
    assert data.examples[0][0].tolist() == expected
    prompt = ChatFormat(tok, folder).encode([(m["role"], m["content"]) for m in messages[:3]])
    assert prompt == _input_ids(
        reference.apply_chat_template(messages[:3], tokenize=True, add_generation_prompt=True)
    )
    # a marker is one id
    assert expected.count(tok.token_to_id(FAMILIES[family][1][-1])) == len(messages)


def test_phi3_template_that_closes_a_chat_with_eos(shared_data, tmp_path):
    """Phi-3's template writes eos after the last turn where there is no generation prompt, so a
    turn rendered alone is no prefix of a longer chat; it was refused for every multi-turn
    record. That eos is in no span: the trained tokens equal return_assistant_tokens_mask's on
    the template with {% generation %} around each answer and its <|end|>, and the ids are
    apply_chat_template's up to that closing eos."""
    import json

    from lmforge.data.collate import IGNORE_INDEX
    from lmforge.data.sft import SFTDataset
    from lmforge.serve.chat import ChatFormat

    phi3 = FAMILIES["phi3"][2].replace("{% endif %}", "{% else %}{{ eos_token }}{% endif %}")
    marked = phi3.replace(
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}",
        "{% if m['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}{% generation %}"
        "{{ m['content'] + '<|end|>\\n' }}{% endgeneration %}{% else %}"
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endif %}",
    )
    folder = tmp_path / "phi3"
    reference = saved_by_transformers(shared_data, folder, *FAMILIES["phi3"][:2], phi3)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    tok = load_tokenizer(folder)
    data = SFTDataset(
        tmp_path / "chat.jsonl", tok, 256, chat_template=ChatTemplate.from_folder(tok, folder)
    )
    ids, labels = data.examples[0]
    whole = _input_ids(reference.apply_chat_template(messages, tokenize=True))
    assert whole[-1] == tok.eos_id and ids.tolist() == whole[:-1]
    out = reference.apply_chat_template(
        messages,
        chat_template=marked,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert out["input_ids"] == whole
    assert (labels != IGNORE_INDEX).astype(int).tolist() == out["assistant_masks"][:-1]
    prompt = ChatFormat(tok, folder).encode([(m["role"], m["content"]) for m in messages[:4]])
    assert prompt == _input_ids(
        reference.apply_chat_template(messages[:4], tokenize=True, add_generation_prompt=True)
    )


def test_refusals_say_where_the_renders_part(gpt2):
    # The generation prompt is "Bot: " where an answer's turn starts "A: ": no turn-by-turn split of
    # the answer.
    source = (
        "{% for m in messages %}{{ ('A: ' if m['role'] == 'assistant' else 'U: ') + m['content'] + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Bot: ' }}{% endif %}"
    )
    with pytest.raises(
        TemplateRefused,
        match=r"not how the template starts assistant message 2 "
        r"\(the prompt has 'Bot: ' where the answer has 'A: \{message 2\}\\n'\)",
    ):
        ChatTemplate(source, gpt2).pieces(MESSAGES, False)


def test_bos_token_is_what_the_tokenizer_files_declare(shared_data, tmp_path):
    """OLMo 2's tokenizer_config.json names no bos: transformers renders {{ bos_token }} as "",
    where lmforge wrote <|endoftext|> (its bos fallback) before every prompt and training
    example. A bare tokenizer.json declares nothing: there the tokens are those lmforge's export
    declares for it, so AutoTokenizer on the export agrees."""
    import json
    import shutil

    from lmforge.models.hf.tokenizer import write_tokenizer_files
    from lmforge.serve.chat import ChatFormat

    template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    messages = [("user", "Hi"), ("assistant", "Hello."), ("user", "2+2?")]
    chat = [{"role": r, "content": c} for r, c in messages]
    olmo, bare = tmp_path / "olmo", tmp_path / "bare"
    for folder in (olmo, bare):
        folder.mkdir()
        shutil.copy(shared_data / "tokenizers" / "gpt2" / "tokenizer.json", folder)
        (folder / "chat_template.jinja").write_text(template)
    (olmo / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    reference = tf.AutoTokenizer.from_pretrained(olmo)
    assert reference.bos_token is None
    ids = ChatFormat(load_tokenizer(olmo), olmo).encode(messages)
    assert ids == _input_ids(
        reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    )
    assert ids[0] != 50256
    tok = load_tokenizer(bare)
    ids = ChatFormat(tok, bare).encode(messages)
    write_tokenizer_files(tok, bare, 128, None)  # what an export of this folder carries
    reference = tf.AutoTokenizer.from_pretrained(bare)
    assert ids == _input_ids(
        reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    )
    assert ids[0] == 50256


def test_a_template_without_a_system_turn_says_once_that_system_messages_are_left_out(
    gpt2, tmp_path, caplog
):
    """Alpaca's format has no system turn: `generate --chat --system ...` and a served system
    message vanished from the prompt without a word. The prompt stays transformers' (the template
    decides); the log says it once."""
    from lmforge.serve.chat import ChatFormat

    said = "leaves system messages out of the prompt"
    alpaca = ChatFormat(gpt2, tmp_path, ChatTemplate(builtin_template("alpaca", False), gpt2))
    with caplog.at_level("WARNING", logger="lmforge.serve.chat"):
        # no system message: nothing to say, and nothing checked yet
        alpaca.encode([("user", "Hi")])
        assert said not in caplog.text
        dropped = alpaca.encode([("system", "Be terse."), ("user", "Hi")])
        assert dropped == alpaca.encode([("user", "Hi")]) and caplog.text.count(said) == 1
        alpaca.encode([("system", "Be terse."), ("user", "Hi")])
        assert caplog.text.count(said) == 1  # once
        caplog.clear()
        lmforge = ChatFormat(gpt2, tmp_path, ChatTemplate(builtin_template("lmforge", False), gpt2))
        lmforge.encode([("system", "Be terse."), ("user", "Hi")])
    assert said not in caplog.text  # a template with a system turn keeps it
