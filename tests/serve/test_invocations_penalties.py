"""/invocations' TGI penalties: repetition_penalty decodes what transformers' generate decodes with
its RepetitionPenaltyLogitsProcessor, and frequency_penalty (with repetition_penalty, in one batch
with other requests) what /v1/completions gives for the same settings through the openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.serve.conftest import WORDS

PROMPT = "t5 t17 t33 t5 t17 t101 t7"
IDS = [5, 17, 33, 5, 17, 101, 7]


def _tgi(server, parameters: dict) -> str:
    r = httpx.post(
        server.url + "/invocations",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, **parameters}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()[0]["generated_text"]


def test_repetition_penalty_decodes_what_transformers_decodes(server, model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for penalty in (1.5, 0.7):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([IDS]),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=0,
            )[0, len(IDS) :].tolist()
        words = [WORDS[i] for i in out[: out.index(0) if 0 in out else len(out)]]
        assert _tgi(server, {"repetition_penalty": penalty}).split() == words


def test_frequency_penalty_equals_the_v1_routes_in_a_mixed_batch(server, model_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    settings = [
        {"frequency_penalty": 1.5},
        {"frequency_penalty": -1.0, "repetition_penalty": 1.3},
        {"frequency_penalty": 0.8, "presence_penalty": 0.5},
    ]

    def v1(s: dict) -> str:
        extra = {"repetition_penalty": s["repetition_penalty"]} if "repetition_penalty" in s else {}
        return (
            client.completions.create(
                model=model_dir.name,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                frequency_penalty=s["frequency_penalty"],
                presence_penalty=s.get("presence_penalty", 0.0),
                extra_body=extra,
            )
            .choices[0]
            .text
        )

    want = [v1(s) for s in settings]
    plain = _tgi(server, {})
    assert want[0] != plain  # the penalty changes this prompt's greedy text
    with ThreadPoolExecutor(len(settings)) as pool:
        got = list(pool.map(lambda s: _tgi(server, s), settings))
    assert got == want
    r = httpx.post(
        server.url + "/invocations",
        json={"inputs": PROMPT, "parameters": {"frequency_penalty": 3.0}},
        timeout=60,
    )
    assert r.status_code == 422 and "frequency_penalty" in r.json()["error"]
