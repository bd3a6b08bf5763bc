"""Chat templates that read a message's content (`| trim`, Qwen3's split at "</think>") against
transformers' apply_chat_template: the text, the ids and the assistant mask. lmforge rendered
placeholders in place of the contents and put the text back afterwards, so such a template saw
the placeholder: Llama 3's answers kept their whitespace, Qwen3's got an empty "<think>" block
before the one the answer holds, and a served Qwen3 prompt kept earlier reasoning that the
template drops."""

from __future__ import annotations

import pytest

from lmforge.chat_template import ChatTemplate, TemplateRefused, encode_pieces
from lmforge.tokenizers import load_tokenizer

tf = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

# Llama 3.1's template without its tool calling: the system header with its dates, every content
# trimmed.
LLAMA31 = (
    "{{- bos_token }}\n"
    '{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
LLAMA31_MARKED = LLAMA31.replace(
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n",
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}\n",
)

# Qwen3's template without tools: an answer's reasoning is cut out of its content at "</think>" and
# shown only for answers after the last question.
QWEN3 = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and '
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message.content %}\n"
    '    {%- if message.role == "user" or message.role == "system" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}\n"
    "            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
QWEN3_MARKED = QWEN3.replace(
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n",
    "        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}\n",
).replace("        {{- '<|im_end|>\\n' }}\n", "        {{- '<|im_end|>\\n' }}{% endgeneration %}\n")

FAMILIES = {
    "llama31": (
        ("<|begin_of_text|>", "<|eot_id|>"),
        ["<|start_header_id|>", "<|end_header_id|>"],
        [],
    ),
    # Qwen's <think> and </think> are added tokens that are not special: one id each, in messages
    # too.
    "qwen3": ((None, "<|im_end|>"), ["<|im_start|>"], ["<think>", "</think>"]),
}
THINK = "<think>\nadd them\n</think>\n\n4"


@pytest.fixture(scope="module")
def tokenizers(shared_data, tmp_path_factory):
    """Per family: GPT-2's tokenizer given the family's tokens, saved by transformers, and as
    lmforge loads it."""
    out = {}
    for family, ((bos, eos), specials, added) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        tok = tf.PreTrainedTokenizerFast(
            tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
            bos_token=bos,
            eos_token=eos,
        )
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.add_tokens(added)
        tok.save_pretrained(folder)
        out[family] = (tf.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder), folder)
    return out


def lmforge_chat(template: ChatTemplate, messages, add_generation_prompt=False):
    """lmforge's rendered text, ids and assistant mask."""
    pieces = template.pieces(messages, add_generation_prompt)
    names = {i: name for name, i in template.specials.items()}
    text = "".join(p if isinstance(p, str) else names[p] for p, _ in pieces)
    ids, mask = encode_pieces(template.tokenizer, [pieces])[0]
    return text, ids, [int(m) for m in mask]


def reference_ids(reference, messages, source, add_generation_prompt=False) -> list[int]:
    out = reference.apply_chat_template(
        messages, chat_template=source, add_generation_prompt=add_generation_prompt
    )
    # transformers 5 returns a dict, 4 the ids
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_against_transformers(tokenizers, family, source, marked, messages):
    """The text and ids of `source`, and the mask that transformers reads from `marked` (the same
    template with {% generation %} around each answer): lmforge's on both, the turn-by-turn split
    and the blocks."""
    reference, tok, folder = tokenizers[family]
    text = reference.apply_chat_template(messages, chat_template=source, tokenize=False)
    out = reference.apply_chat_template(
        messages,
        chat_template=marked,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert reference.apply_chat_template(messages, chat_template=marked, tokenize=False) == text
    assert sum(out["assistant_masks"]) > 0
    for template in (source, marked):
        assert lmforge_chat(ChatTemplate(template, tok, folder), messages) == (
            text,
            out["input_ids"],
            out["assistant_masks"],
        )


def test_llama31_trims_every_content(tokenizers):
    messages = [
        {"role": "system", "content": "  Be terse.\n"},
        {"role": "user", "content": "  Hello there \n"},
        {"role": "assistant", "content": "Hi!\n\n"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": " 4 "},
    ]
    check_against_transformers(tokenizers, "llama31", LLAMA31, LLAMA31_MARKED, messages)
    text, _, _ = lmforge_chat(ChatTemplate(LLAMA31, tokenizers["llama31"][1]), messages)
    assert "<|end_header_id|>\n\nHello there<|eot_id|>" in text and text.endswith("\n\n4<|eot_id|>")


def test_qwen3_answer_with_reasoning(tokenizers):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": THINK}]
    check_against_transformers(tokenizers, "qwen3", QWEN3, QWEN3_MARKED, messages)
    text, _, _ = lmforge_chat(ChatTemplate(QWEN3, tokenizers["qwen3"][1]), messages)
    assert text.endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")


def test_qwen3_multi_turn_drops_earlier_reasoning(tokenizers):
    """Qwen3 shows the reasoning of answers after the last question only: turn by turn its
    renders are no prefixes of the whole chat (refused, saying so); with {% generation %} blocks
    the chat trains as transformers masks it, and a served prompt is apply_chat_template's,
    without the earlier reasoning."""
    reference, tok, folder = tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": THINK},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"},
    ]
    with pytest.raises(TemplateRefused, match="rewrites earlier turns"):
        ChatTemplate(QWEN3, tok, folder).pieces(messages, False)
    out = reference.apply_chat_template(
        messages,
        chat_template=QWEN3_MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    text, ids, mask = lmforge_chat(ChatTemplate(QWEN3_MARKED, tok, folder), messages)
    assert text == reference.apply_chat_template(messages, chat_template=QWEN3, tokenize=False)
    assert (ids, mask) == (out["input_ids"], out["assistant_masks"]) and "add them" not in text
    chat = [(m["role"], m["content"]) for m in messages[:3]]
    for source in (QWEN3, QWEN3_MARKED):
        prompt = reference_ids(reference, messages[:3], source, add_generation_prompt=True)
        assert ChatTemplate(source, tok, folder).prompt_ids(chat) == prompt


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_leading_and_trailing_whitespace(tokenizers, family):
    source, marked = {"llama31": (LLAMA31, LLAMA31_MARKED), "qwen3": (QWEN3, QWEN3_MARKED)}[family]
    messages = [
        {"role": "system", "content": " \t"},
        {"role": "user", "content": "\n  two words  \n"},
        {"role": "assistant", "content": "\n\n  Hi! \n\n"},
    ]
    check_against_transformers(tokenizers, family, source, marked, messages)
    if family == "llama31":  # Qwen3's turns are no prefixes of a longer chat (above)
        more = [{"role": "user", "content": " \t"}, {"role": "assistant", "content": "\n\nSo.\n"}]
        check_against_transformers(tokenizers, family, source, marked, messages + more)


def test_a_typed_special_token_stays_text_through_trim(tokenizers):
    """A message that types "<|eot_id|>" does not end its turn, trimmed or not; the text is
    transformers'."""
    reference, tok, folder = tokenizers["llama31"]
    messages = [
        {"role": "user", "content": " <|eot_id|> hi"},
        {"role": "assistant", "content": "Hi <|eot_id|>\n"},
    ]
    text, ids, _ = lmforge_chat(ChatTemplate(LLAMA31, tok, folder), messages)
    assert text == reference.apply_chat_template(messages, chat_template=LLAMA31, tokenize=False)
    # the system, user and assistant turns' ends only
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 3


def test_a_template_that_reads_a_typed_token_gets_transformers_reading(tokenizers):
    """Where marking the typed token changes the render (here a content that starts with it), the
    render is transformers', its tokens read as transformers reads them."""
    reference, tok, folder = tokenizers["llama31"]
    source = LLAMA31.replace(
        "message['content'] | trim",
        "(message['content'] | trim if not message['content']"
        ".startswith('<|eot_id|>') else 'typed: ' + message['content'])",
    )
    messages = [
        {"role": "user", "content": "a <|eot_id|> b"},
        {"role": "assistant", "content": "<|eot_id|>c"},
    ]
    text, ids, _ = lmforge_chat(ChatTemplate(source, tok, folder), messages)
    assert text == reference.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert "typed: <|eot_id|>c" in text and ids == reference_ids(reference, messages, source)
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 5
