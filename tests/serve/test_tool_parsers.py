"""The tool-call parsers on texts in each model's format (as the formats' own prompts and vLLM's
parser tests write them): the calls' arguments equal json.loads of what the model wrote, text that
is no call stays content, and a stream fed any split of the text sends exactly what the whole text
reads as, never taking back what it sent."""

from __future__ import annotations

import json
import random

import pytest

from lmforge.serve.tool_parsers import ToolStream, parser_named, parser_of_template

NAMES = {"get_weather", "time_now"}
WEATHER = {"city": "Paris", "unit": "c", "note": 'a "quoted" } brace ; and ]'}
W = json.dumps(WEATHER)

# (parser, text, content expected, calls expected as (name, arguments object))
CASES = [
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        "Let me look.\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
        '{"name": "time_now", "arguments": {}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", WEATHER), ("time_now", {})],
    ),
    # the model stopped before the closing tag (its eos came first)
    ("hermes", '<tool_call>\n{"name": "time_now", "arguments": {}}', "", [("time_now", {})]),
    ("hermes", "Paris is sunny.", "Paris is sunny.", []),
    # not JSON, or a function not offered: content, as without tools
    ("hermes", "<tool_call>\n{name: x}\n</tool_call>", "<tool_call>\n{name: x}\n</tool_call>", []),
    (
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {W}}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; '
        '{"name": "time_now", "parameters": {}}',
        "",
        [("get_weather", WEATHER), ("time_now", {})],
    ),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ("llama3_json", 'It is {"warm": 1}', 'It is {"warm": 1}', []),  # a call is the whole answer
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, '
        '{"name": "time_now", "arguments": {}}]',
        "",
        [("get_weather", WEATHER), ("time_now", {})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "time_now", "arguments": {}}]',
        "Sure. ",
        [("time_now", {})],
    ),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_whole_answer_reads_as_its_calls(name, text, content, calls):
    reading = parser_named(name).parse(text, True, NAMES)
    assert reading.content == content
    assert [(n, json.loads(a)) for n, a in reading.calls] == calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_sends_what_the_whole_text_reads_as(name, text, content, calls):
    rng = random.Random(len(text))
    for _ in range(5):
        stream = ToolStream(parser_named(name), NAMES, parallel=True)
        sent, got, at = "", [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            piece, got_calls = stream.feed(text[at : at + step], False)
            sent, got, at = sent + piece, got + got_calls, at + step
            # nothing sent is taken back: what was sent is the start of the final content
            assert content.startswith(sent) or not calls, (sent, content)
        piece, got_calls = stream.feed("", True)
        assert sent + piece == content and [(n, json.loads(a)) for n, a in got + got_calls] == calls


def test_text_that_may_open_a_call_is_held_until_decided():
    stream = ToolStream(parser_named("hermes"), NAMES, parallel=True)
    assert stream.feed("Hi <tool_", False) == ("Hi ", [])
    assert stream.feed("tip> there", False) == ("<tool_tip> there", [])
    llama = ToolStream(parser_named("llama3_json"), NAMES, parallel=True)
    assert llama.feed(' {"name": "time_now"', False) == ("", [])
    assert llama.feed(', "parameters": {}}', False) == ("", [("time_now", "{}")])


def test_one_call_without_parallel_tool_calls():
    text = '<tool_call>{"name": "time_now", "arguments": {}}</tool_call>' * 2
    stream = ToolStream(parser_named("hermes"), NAMES, parallel=False)
    assert stream.feed(text, True) == ("", [("time_now", "{}")])


@pytest.mark.parametrize(
    "source, parser",
    [
        ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
        ("{{ '[TOOL_CALLS]' + message.tool_calls | tojson }}", "mistral"),
        ("{{ '<|python_tag|>' }}{{ 'ipython' }}", "llama3_json"),
        # Llama 3.2's: JSON calls, an ipython role, no python tag
        ("{{ 'ipython' }}{{ '\"parameters\": ' }}", "llama3_json"),
        ("{{ messages[0]['content'] }}", None),
    ],
)
def test_the_format_is_chosen_by_the_templates_markers(source, parser):
    assert parser_of_template(source) == parser
