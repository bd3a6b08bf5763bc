"""/tokenize and /detokenize in vLLM's shape, against the tokenizers' own encode/decode
(Hugging Face `tokenizers`, SentencePiece on the real Llama 2 model) and
transformers' apply_chat_template on the real GPT-2 tokenizer; under the server's key and limits."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.serve.conftest import API_KEY, serve

tf = pytest.importorskip("transformers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|endoftext|>' + m['role'] + '\\n' + m['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|endoftext|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 2+2?"}]


def _post(server, route, body, **kw):
    return httpx.post(server.url + route, json=body, timeout=30, **kw)


def test_a_prompt_tokenizes_as_its_tokenizer_encodes_it(server, model_dir):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "t5 t17 <|endoftext|> t33 t299"
    r = _post(server, "/tokenize", {"prompt": text, "model": model_dir.name})
    assert r.status_code == 200, r.text
    want = ref.encode(text).ids
    assert r.json() == {
        "count": len(want),
        "max_model_len": server.engine.context,
        "tokens": want,
        "token_strs": None,
    }
    r = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.json()["token_strs"] == [ref.id_to_token(i) for i in want]
    r = _post(server, "/detokenize", {"tokens": want})
    assert r.status_code == 200 and r.json() == {
        "prompt": ref.decode(want, skip_special_tokens=False)
    }


def test_bad_bodies_are_400s_naming_the_field(server):
    for route, body, param in (
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "t5", "messages": [{"role": "user", "content": "t5"}]}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": ["t5"]}, "tokens.0"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ):
        r = _post(server, route, body)
        assert r.status_code == 400, (route, body, r.text)
        assert r.json()["error"]["param"] == param
    assert _post(server, "/tokenize", {"prompt": "t5", "model": "other"}).status_code == 404


def test_the_routes_need_the_key_like_the_others(secured):
    body = {"prompt": "t5 t6"}
    assert _post(secured, "/tokenize", body).status_code == 401
    assert _post(secured, "/detokenize", {"tokens": [5]}).status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert _post(secured, "/tokenize", body, headers=auth).json()["tokens"] == [5, 6]
    r = httpx.post(secured.url + "/tokenize", content=json.dumps(body), timeout=30, headers=auth)
    assert r.status_code == 415  # JSON bodies only, as the other POST routes


@pytest.fixture(scope="module")
def llama_dir(model_dir, shared_data, tmp_path_factory):
    """The tiny model beside Llama 2's SentencePiece tokenizer (prompts start with <s>)."""
    out = tmp_path_factory.mktemp("tok") / "llama-tok"
    shutil.copytree(model_dir, out)
    (out / "tokenizer.json").unlink()
    shutil.copyfile(
        shared_data / "tokenizers" / "llama2" / "tokenizer.model", out / "tokenizer.model"
    )
    return out


def test_add_special_tokens_adds_bos_as_sentencepiece_writes_it(llama_dir):
    spm = pytest.importorskip("sentencepiece")
    ref = spm.SentencePieceProcessor(model_file=str(llama_dir / "tokenizer.model"))
    text = "Hello world, this is a test."
    with serve(llama_dir) as s:
        for add in (True, False):
            r = _post(s, "/tokenize", {"prompt": text, "add_special_tokens": add})
            assert r.json()["tokens"] == ref.encode(text, add_bos=add)
        assert _post(s, "/tokenize", {"prompt": text}).json()["tokens"][0] == ref.bos_id()
        ids = ref.encode(text)
        r = _post(s, "/detokenize", {"tokens": ids})
        assert r.json() == {"prompt": ref.decode(ids)}, r.text


@pytest.fixture(scope="module")
def chat_dir(model_dir, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "gpt2-chat"
    shutil.copytree(model_dir, out)
    shutil.copyfile(shared_data / "tokenizers" / "gpt2" / "tokenizer.json", out / "tokenizer.json")
    config = {"chat_template": TEMPLATE, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_messages_tokenize_as_apply_chat_template(chat_dir):
    pytest.importorskip("jinja2")
    ref = tf.PreTrainedTokenizerFast(
        tokenizer_file=str(chat_dir / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
    )
    with serve(chat_dir) as s:
        for opened in (True, False):
            want = ref.apply_chat_template(
                MESSAGES, chat_template=TEMPLATE, add_generation_prompt=opened, tokenize=True
            )
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            r = _post(s, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": opened})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == want and r.json()["count"] == len(want)
        r = _post(s, "/detokenize", {"tokens": want[:5]})
        assert r.json()["prompt"] == ref.decode(want[:5])
