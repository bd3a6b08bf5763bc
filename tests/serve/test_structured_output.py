"""response_format (json_object, json_schema) on a random-weights model: what it returns parses
(json.loads) and validates against the schema (jsonschema, the reference validator), so the token
mask, not the model, does the work; requests without a format beside it get exactly their tokens
alone (transformers' greedy generate)."""

from __future__ import annotations

import json
import sys
import threading

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.conftest import make_hf_model
from tests.serve.conftest import serve

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "role": {"enum": ["admin", "editor", "viewer"]},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["role", "address", "tags"],
        "additionalProperties": False,
    },
    "ref_anyof": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "at": {"$ref": "#/$defs/point"},
            "label": {"anyOf": [{"type": "null"}, {"const": "here"}]},
        },
        "required": ["at", "label"],
        "additionalProperties": False,
    },
}
MESSAGES = [{"role": "user", "content": "give me json"}]


def ascii_tokenizer() -> Tokenizer:
    """A byte-level BPE of one token per printable ASCII character (0 = <|endoftext|>, the NeoX
    config's eos): every JSON text has tokens, and few enough that a random model's sampled
    strings end."""
    chars = [chr(c) for c in range(33, 127)] + ["Ġ"]  # Ġ: byte-level BPE's space
    tok = Tokenizer(models.BPE({"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured") / "tiny-neox-ascii"
    make_hf_model("gpt_neox").save_pretrained(folder)
    ascii_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def json_server(json_model_dir):
    with serve(json_model_dir, max_batch=4) as s:
        yield s


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_answers_validate_against_their_schema(json_server, json_model_dir, name, temperature):
    r = client(json_server).chat.completions.create(
        model=json_model_dir.name,
        messages=MESSAGES,
        max_tokens=100,
        temperature=temperature,
        seed=3,
        n=2,
        response_format=schema_format(SCHEMAS[name]),
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_the_same_request_without_a_format_is_not_json(json_server, json_model_dir):
    r = client(json_server).chat.completions.create(
        model=json_model_dir.name, messages=MESSAGES, max_tokens=40, temperature=0
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_json_object_mode_returns_objects(json_server, json_model_dir):
    r = client(json_server).chat.completions.create(
        model=json_model_dir.name,
        messages=MESSAGES,
        max_tokens=100,
        temperature=0.3,
        seed=0,
        n=4,
        response_format={"type": "json_object"},
    )  # an object's keys are free strings: hotter, they outrun 100 tokens
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert isinstance(json.loads(c.message.content), dict)


def test_completions_and_streaming_validate_too(json_server, json_model_dir):
    c, schema = client(json_server), SCHEMAS["nested"]
    r = c.completions.create(
        model=json_model_dir.name,
        prompt="json:",
        max_tokens=100,
        temperature=0.7,
        seed=1,
        extra_body={"response_format": schema_format(schema)},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    text, reasons = "", []
    for chunk in c.chat.completions.create(
        model=json_model_dir.name,
        messages=MESSAGES,
        max_tokens=100,
        temperature=0.7,
        seed=2,
        stream=True,
        response_format=schema_format(schema),
    ):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_max_tokens_cutting_the_json_is_length(json_server, json_model_dir):
    r = client(json_server).chat.completions.create(
        model=json_model_dir.name,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        response_format=schema_format(SCHEMAS["flat"]),
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ],
)
def test_an_unsupported_schema_keyword_is_a_400_naming_it(
    json_server, json_model_dir, schema, keyword
):
    with pytest.raises(openai.BadRequestError) as e:
        client(json_server).chat.completions.create(
            model=json_model_dir.name,
            messages=MESSAGES,
            max_tokens=4,
            response_format=schema_format(schema),
        )
    assert e.value.param == "response_format" and keyword in e.value.message


def test_without_llguidance_a_format_is_a_400_naming_the_install(
    json_server, json_model_dir, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    with pytest.raises(openai.BadRequestError) as e:
        client(json_server).chat.completions.create(
            model=json_model_dir.name,
            messages=MESSAGES,
            max_tokens=4,
            response_format={"type": "json_object"},
        )
    assert "pip install 'lmforge[structured]'" in e.value.message


def test_a_tokenizer_llguidance_cannot_read_is_a_400_not_a_500(server, model_dir):
    """The package's word-level tokenizer has no decoder: llguidance cannot map its tokens to
    bytes."""
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model=model_dir.name,
            messages=MESSAGES,
            max_tokens=4,
            response_format={"type": "json_object"},
        )
    assert e.value.param == "response_format" and "tokenizer" in e.value.message


def test_unconstrained_rows_beside_constrained_ones_get_their_tokens_alone(json_model_dir):
    """Greedy rows without a format, decoded in one batch with rows that have one, equal
    transformers' greedy generate on each prompt alone; the constrained rows validate."""
    import torch
    import transformers

    from lmforge.inference.engine import Engine, EngineConfig
    from lmforge.inference.requests import RequestParams
    from lmforge.inference.sampling import SamplingParams
    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(json_model_dir)
    engine = Engine(load_pretrained(json_model_dir), tokenizer, EngineConfig(max_batch=4))
    schema = SCHEMAS["flat"]
    grammar = engine.grammars.compile(schema_format(schema))
    prompts = [tokenizer.encode(t) for t in ("abc", "x=1,", "hello", "{q}")]
    reqs = []
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(temperature=0 if i % 2 == 0 else 0.8)
        params = RequestParams(
            12, sampling, seed=i, grammar=grammar if i % 2 else None, ignore_eos=i % 2 == 0
        )
        reqs.append(engine.submit(ids, params, lambda ev: None))
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    assert engine.rows_decoded / engine.steps > 2  # they did decode together
    hf = transformers.AutoModelForCausalLM.from_pretrained(json_model_dir).eval()
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
        text = tokenizer.decode(reqs[i].output_ids, skip_special_tokens=True)
        if reqs[i].finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:  # 12 tokens may be too few for the object: still a prefix of one
            assert text.startswith('{"name":"')


def test_compiled_grammars_are_cached_by_schema(json_server):
    grammars = json_server.engine.grammars
    fmt = schema_format(SCHEMAS["flat"])
    same = dict(fmt, json_schema={**fmt["json_schema"], "name": "other"})
    results = []
    threads = [
        threading.Thread(target=lambda f=f: results.append(grammars.compile(f)))
        for f in (fmt, same)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0].grammar == results[1].grammar and grammars.compile(fmt) is grammars.compile(
        same
    )


def test_eos_is_allowed_exactly_where_the_text_is_a_complete_valid_answer(json_model_dir):
    """Along the tokens of a valid instance, the mask allows end-of-sequence at a prefix iff
    json.loads parses it and jsonschema accepts it; each next token of the instance is always
    allowed."""
    from lmforge.inference.grammar import Grammars, RowGrammar, allowed_tokens
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(json_model_dir)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["n"],
    }
    row = RowGrammar(Grammars(tokenizer, 300, {0}).compile(schema_format(schema)))
    ids = tokenizer.encode('{"n":12,"s":"ab"}')
    for k in range(len(ids) + 1):
        allowed = allowed_tokens([row], 300)[0]
        text = tokenizer.decode(ids[:k])
        try:
            jsonschema.validate(json.loads(text), schema)
            complete = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            complete = False
        assert bool(allowed[0]) == complete, text
        if k < len(ids):
            assert allowed[ids[k]], text
            row.accept(ids[k])
