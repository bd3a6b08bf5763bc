"""Special tokens a model writes mid-completion are left out of the text, as vLLM
(`skip_special_tokens=True`, its default), TGI and transformers' pipelines leave them out: in
`serve` (both OpenAI routes, streamed or not, the request field `skip_special_tokens` to keep
them) and in `generate_text`. A stop string that is the text of one special token ends the
completion at that token. The texts are transformers' tokenizer's decode of the same ids."""

from __future__ import annotations

import shutil

import openai
import pytest

from lmforge.inference import generate, generate_text
from lmforge.tokenizers import load_tokenizer
from tests.serve.conftest import serve, word_tokenizer

PROMPT = "t5 t17 t33 t2 t99"
N = 12


@pytest.fixture(scope="module")
def special(model_dir, reference, tmp_path_factory):
    """The served model with one word it writes greedily (not its first, nor the prompt's) made a
    special token of its tokenizer, as a chat model's <|im_start|> is: (folder, prompt ids,
    greedy ids, that word)."""
    model, tok = reference
    prompt = tok.encode(PROMPT)
    ids = generate(model, [prompt], N, do_sample=False, stop_token_ids=[])[0]
    words = [tok.decode([i]) for i in ids]
    end = next(w for w in words[1:-1] if w not in PROMPT.split() and w != words[0])
    folder = tmp_path_factory.mktemp("special") / model_dir.name
    shutil.copytree(model_dir, folder)
    t = word_tokenizer()
    t.add_special_tokens([end])
    t.save(str(folder / "tokenizer.json"))
    return folder, prompt, ids, end


def _hf_text(folder, prompt, ids, skip: bool) -> str:
    """The completion's text by transformers' tokenizer: the decode of prompt + completion past
    the prompt's."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    head = hf.decode(prompt, skip_special_tokens=skip)
    full = hf.decode([*prompt, *ids], skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def test_served_text_leaves_special_tokens_out_unless_asked(special):
    folder, prompt, ids, end = special
    skipped, kept = _hf_text(folder, prompt, ids, True), _hf_text(folder, prompt, ids, False)
    assert end in kept.split() and end not in skipped.split()
    with serve(folder) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=folder.name, prompt=PROMPT, max_tokens=N, temperature=0)
        assert c.completions.create(**kw).choices[0].text == skipped
        streamed = "".join(
            ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices
        )
        assert streamed == skipped
        assert (
            c.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
            == kept
        )
        # The special token's text as a stop string: the completion ends at that token.
        r = c.completions.create(**kw, stop=[end]).choices[0]
        cut = ids.index(load_tokenizer(folder).token_to_id(end))
        assert r.finish_reason == "stop" and r.text == _hf_text(folder, prompt, ids[:cut], True)
        chat = c.chat.completions.create(
            model=folder.name,
            messages=[{"role": "user", "content": "t5 t17"}],
            max_tokens=N,
            temperature=0,
        )
        content = chat.choices[0].message.content
        raw = c.chat.completions.create(
            model=folder.name,
            messages=[{"role": "user", "content": "t5 t17"}],
            max_tokens=N,
            temperature=0,
            extra_body={"skip_special_tokens": False},
        )
        assert [w for w in raw.choices[0].message.content.split() if w != end] == content.split()


def test_generate_text_leaves_special_tokens_out_unless_asked(special):
    from lmforge.models import load_pretrained

    folder, prompt, ids, end = special
    model, tok = load_pretrained(folder), load_tokenizer(folder)
    assert generate_text(model, tok, [PROMPT], N, do_sample=False)[0] == _hf_text(
        folder, prompt, ids, True
    )
    assert generate_text(model, tok, [PROMPT], N, do_sample=False, skip_special_tokens=False)[
        0
    ] == _hf_text(folder, prompt, ids, False)
    cut = ids.index(tok.token_to_id(end))
    assert generate_text(model, tok, [PROMPT], N, do_sample=False, stop=[end])[0] == _hf_text(
        folder, prompt, ids[:cut], True
    )
