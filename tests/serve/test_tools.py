"""Tool calling through the official openai client, on a random-weights model whose chat template
writes each format (Hermes/Qwen's <tool_call>, Llama 3's JSON, Mistral's [TOOL_CALLS]): with
tool_choice "required" or a named function the grammar, not the model, makes every answer a call
whose arguments validate against the function's parameters (jsonschema, the reference validator);
streamed calls arrive as OpenAI streams them and add up to the same calls; rows without tools
decoded beside a forced row get transformers' greedy tokens alone."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.serve.conftest import serve

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
NOW = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "time_now", "parameters": NOW}},
]
SCHEMAS = {"get_weather": WEATHER, "time_now": NOW}
MESSAGES = [{"role": "user", "content": "weather?"}]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "<|python_tag|>"]
# The turns of each format, the tools named in the prompt; each template holds its format's marker.
_TURNS = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TOOLS = "{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}{% endif %}"
_ARGS = "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
TEMPLATES = {
    "hermes": _TOOLS
    + _TURNS.replace("CALL", "{{ '<tool_call>\\n' }}" + _ARGS + "{{ '\\n</tool_call>' }}"),
    "llama3_json": _TOOLS
    + _TURNS.replace(
        "CALL",
        "{{ '<|python_tag|>' }}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}",
    ),
    "mistral": _TOOLS + _TURNS.replace("CALL", "{{ '[TOOL_CALLS]' }}" + _ARGS),
    "none": _TOOLS + _TURNS.replace("CALL", ""),
}


def tool_tokenizer() -> Tokenizer:
    """One token per printable ASCII character, space and newline (byte-level BPE), the formats'
    special tokens, and Qwen's <tool_call> tags as added text tokens (special=False, as Qwen has
    them)."""
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    tok = Tokenizer(models.BPE({"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


@pytest.fixture(scope="module")
def tool_model_dirs(tmp_path_factory):
    """A random GPT-NeoX with room for a prompt and a call (512 positions), one folder per
    format's template."""
    import torch

    from tests.conftest import hf_tiny_configs

    cls, cfg = hf_tiny_configs()["gpt_neox"]
    cfg.max_position_embeddings = 512
    torch.manual_seed(0)
    model = cls(cfg).eval()
    dirs = {}
    for name, template in TEMPLATES.items():
        folder = tmp_path_factory.mktemp("tools") / f"tiny-{name}"
        model.save_pretrained(folder)
        tool_tokenizer().save(str(folder / "tokenizer.json"))
        (folder / "chat_template.jinja").write_text(template)
        dirs[name] = folder
    return dirs


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def servers(tool_model_dirs):
    """The live server of a format's folder, started at its first test."""
    opened = {}
    with ExitStack() as stack:

        def get(name):
            if name not in opened:
                opened[name] = stack.enter_context(serve(tool_model_dirs[name], max_batch=4))
            return opened[name]

        yield get


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def check_call(call, names=SCHEMAS):
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_makes_a_random_model_call_a_tool(servers, fmt, temperature):
    r = client(servers(fmt)).chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=temperature,
        seed=4,
        n=3,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called(servers, fmt):
    r = client(servers(fmt)).chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
        temperature=1.0,
        seed=1,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert {c.function.name for c in choice.message.tool_calls} == {"get_weather"}
        for call in choice.message.tool_calls:
            check_call(call)


def test_parallel_calls_each_validate(servers):
    r = client(servers("hermes")).chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=400,
        temperature=1.0,
        seed=0,
        n=4,
    )
    for choice in r.choices:
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            check_call(call)


def test_a_streamed_call_adds_up_to_the_same_call(servers, fmt):
    c = client(servers(fmt))
    body = dict(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.8,
        seed=7,
    )
    whole = c.chat.completions.create(**body).choices[0].message.tool_calls
    calls, reasons, content = {}, [], ""
    for chunk in c.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call's first chunk names it
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and content == ""
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole
    ]


def test_auto_reads_no_call_where_the_model_writes_none(servers, fmt):
    """A random model writes text: it stays the content, equal to tool_choice none's (the same
    prompt, the tools rendered in both)."""
    c = client(servers(fmt))
    body = dict(model="", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    auto, none = (
        c.chat.completions.create(**body, tool_choice=t).choices[0] for t in ("auto", "none")
    )
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")
    assert auto.message.content == none.message.content and auto.message.content


def test_a_history_of_calls_and_results_is_accepted(servers, fmt):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "time_now", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = client(servers(fmt)).chat.completions.create(
        model="", messages=history, tools=TOOLS, max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client(servers(fmt)).chat.completions.create(
            model="", messages=[*history[:2], {"role": "tool", "content": "x"}], max_tokens=1
        )
    assert e.value.param == "messages.2.tool_call_id"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "a b"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string", "not": {}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "not",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(servers, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client(servers("hermes")).chat.completions.create(
            model="", messages=MESSAGES, max_tokens=2, **body
        )
    assert e.value.param == param and words in e.value.message, e.value.message


def test_a_template_with_no_known_format_is_one_400_naming_the_flag(servers):
    c = client(servers("none"))
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=2)
    assert (
        e.value.param == "tools" and "--tool-parser hermes|llama3_json|mistral" in e.value.message
    )
    # tool_choice none reads nothing: no format needed
    r = c.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.choices[0].message.tool_calls is None


def test_the_tool_parser_option_serves_such_a_template(tool_model_dirs):
    with serve(tool_model_dirs["none"], tool_parser="hermes") as s:
        r = client(s).chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200
        )
    assert r.choices[0].finish_reason == "tool_calls"
    check_call(r.choices[0].message.tool_calls[0])


def test_tools_without_a_chat_template_are_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model="", messages=[{"role": "user", "content": "t5"}], tools=TOOLS
        )
    assert e.value.param == "tools" and "no chat template" in e.value.message


def test_rows_without_tools_beside_a_forced_row_get_their_tokens_alone(tool_model_dirs):
    """Greedy rows without a grammar, decoded in one batch with rows forced to a call, equal
    transformers' greedy generate on each prompt alone; the forced rows' calls validate."""
    import torch

    from lmforge.inference.engine import Engine, EngineConfig
    from lmforge.inference.requests import RequestParams
    from lmforge.inference.sampling import SamplingParams
    from lmforge.models import load_pretrained
    from lmforge.serve.protocol import ChatRequest, parse
    from lmforge.serve.tools import ToolRequest
    from lmforge.tokenizers import load_tokenizer

    folder = tool_model_dirs["hermes"]
    tokenizer = load_tokenizer(folder)
    engine = Engine(load_pretrained(folder), tokenizer, EngineConfig(max_batch=4))
    body = parse(ChatRequest, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})

    class Chat:  # what ToolRequest reads of the server's chat format
        chat = type("T", (), {"source": TEMPLATES["hermes"]})()

    tools = ToolRequest.of(body, Chat, None)
    grammar = tools._compile(engine, body)
    prompts = [tokenizer.encode(t) for t in ("abc", "x=1,", "hello", "{q}")]
    reqs = []
    for i, ids in enumerate(prompts):
        forced = i % 2 == 1
        params = RequestParams(
            100 if forced else 12,
            SamplingParams(temperature=0.8 if forced else 0),
            seed=i,
            grammar=grammar if forced else None,
            ignore_eos=not forced,
        )
        reqs.append(engine.submit(ids, params, lambda ev: None))
    while reqs[0].finish_reason is None or reqs[2].finish_reason is None:
        engine.step()
    assert engine.rows_decoded / engine.steps > 2.5  # the four rows did decode together
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for i in (0, 2):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompts[i]]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert reqs[i].output_ids == ref[0, len(prompts[i]) :].tolist()
    for i in (1, 3):
        assert reqs[i].finish_reason == "stop"
        content, calls = tools.read(tokenizer.decode(reqs[i].output_ids, skip_special_tokens=True))
        assert content is None and len(calls) == 1
        jsonschema.validate(
            json.loads(calls[0]["function"]["arguments"]), SCHEMAS[calls[0]["function"]["name"]]
        )
