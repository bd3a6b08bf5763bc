"""Tools and tool-call histories rendered by real chat templates (Qwen2.5's and Llama 3.1's, as TRL
ships them) equal transformers' apply_chat_template(tools=...), token for token, on the real GPT-2
tokenizer given each family's special tokens: the OpenAI request's calls (arguments as JSON text)
and results reach the template as transformers' chat format has them."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from lmforge.serve.chat import ChatFormat
from lmforge.serve.protocol import ChatRequest, parse
from lmforge.serve.tools import ToolRequest, template_messages
from lmforge.tokenizers import load_tokenizer
from tests.test_chat_template import saved_by_transformers

tf = pytest.importorskip("transformers")
pytest.importorskip("trl")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {"function": {"name": "time_now", "parameters": {"type": "object"}}, "type": "function"},
]
# As OpenAI clients send a history: the call's arguments a JSON text, its result a tool message.
HISTORY = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
FAMILIES = {
    # name: bos and eos, special tokens, added text tokens (Qwen's <tool_call> is not special)
    "qwen2_5": (
        (None, "<|im_end|>"),
        ["<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>"],
    ),
    "llama3_1": (
        ("<|begin_of_text|>", "<|eot_id|>"),
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        [],
    ),
}
PARSERS = {"qwen2_5": "hermes", "llama3_1": "llama3_json"}


def trl_template(name: str) -> str:
    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def transformers_history() -> list[dict]:
    """HISTORY as transformers' chat format has it: each call's arguments an object."""
    out = json.loads(json.dumps(HISTORY))
    for call in out[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("turns", [2, 4])
def test_tools_and_tool_history_render_as_transformers_does(family, turns, shared_data, tmp_path):
    bos_eos, specials, added = FAMILIES[family]
    folder = tmp_path / family
    reference = saved_by_transformers(shared_data, folder, bos_eos, specials, trl_template(family))
    if added:  # Qwen's tool tags: added tokens, not special ones
        reference.add_tokens(added)
        reference.save_pretrained(folder)
    expected = reference.apply_chat_template(
        transformers_history()[:turns], tools=TOOLS, add_generation_prompt=True, tokenize=True
    )
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    body = parse(ChatRequest, {"messages": HISTORY[:turns], "tools": TOOLS})
    chat = ChatFormat(load_tokenizer(folder), folder)
    try:
        tools = ToolRequest.of(body, chat, None)
        got = chat.encode(template_messages(body), tools=tools.tools)
    finally:
        chat.close()
    assert tools.parser.name == PARSERS[family]  # the template's markers name its format
    assert got == expected
    text = reference.decode(expected)
    assert "get_weather" in text and "time_now" in text  # the tools are in the prompt
