"""Prefix caching through the HTTP API, read by the official openai client: completions sharing a
long prefix answer what transformers computes for each prompt (greedy tokens and their
log-probabilities), with /metrics counting the prompt tokens read from the cache and those
computed."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch

from lmforge.inference.prefix_cache import BLOCK_TOKENS
from tests.serve.conftest import WORDS

SHARED = torch.randint(2, 300, (3 * BLOCK_TOKENS + 7,), generator=torch.Generator().manual_seed(1))


def _counters(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        name: float(value)
        for name, value in re.findall(r"^(lmforge_prefix_cache_\w+) (\S+)$", text, re.M)
    }


def test_completions_sharing_a_prefix_equal_transformers_and_count_hits(server, model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf.generation_config.eos_token_id = None
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    g = torch.Generator().manual_seed(0)
    prompts = [
        SHARED.tolist() + torch.randint(2, 300, (3 + i,), generator=g).tolist() for i in range(3)
    ]
    before = _counters(server)
    assert before["lmforge_prefix_cache_blocks"] >= 4
    for prompt in prompts:
        r = client.completions.create(
            model=model_dir.name,
            prompt=" ".join(f"t{i}" for i in prompt),
            max_tokens=4,
            temperature=0,
            logprobs=0,
        )
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=4,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        want = out.sequences[0, len(prompt) :].tolist()
        lp = r.choices[0].logprobs
        shown = want.index(0) if 0 in want else len(want)  # the server stops at eos (id 0)
        assert lp.tokens[:shown] == [WORDS[i] for i in want[:shown]]
        for got, score, token in zip(lp.token_logprobs, out.scores, want):
            assert got == pytest.approx(score[0].log_softmax(-1)[token].item(), abs=1e-4)
    after = _counters(server)
    hits = (
        after["lmforge_prefix_cache_hit_tokens_total"]
        - before["lmforge_prefix_cache_hit_tokens_total"]
    )
    misses = (
        after["lmforge_prefix_cache_miss_tokens_total"]
        - before["lmforge_prefix_cache_miss_tokens_total"]
    )
    # the first computes everything; each later one reads the 3 whole shared blocks
    assert hits == 2 * 3 * BLOCK_TOKENS
    assert misses == sum(len(p) for p in prompts) - hits


def test_requests_with_different_cache_salts_share_no_block(server, model_dir):
    """vLLM's cache_salt: a tenant's requests read only the blocks its own salt left."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ids = torch.randint(2, 300, (2 * BLOCK_TOKENS + 3,), generator=torch.Generator().manual_seed(2))
    prompt = " ".join(f"t{i}" for i in ids.tolist())
    hits = []
    answers = []
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        before = _counters(server)["lmforge_prefix_cache_hit_tokens_total"]
        r = client.completions.create(
            model=model_dir.name,
            prompt=prompt,
            max_tokens=3,
            temperature=0,
            extra_body={} if salt is None else {"cache_salt": salt},
        )
        answers.append(r.choices[0].text)
        hits.append(_counters(server)["lmforge_prefix_cache_hit_tokens_total"] - before)
    assert hits == [0, 0, 2 * BLOCK_TOKENS, 0]
    assert len(set(answers)) == 1
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": prompt, "cache_salt": ""}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_a_multi_turn_chat_reads_its_earlier_turns_and_answers_as_transformers(server, model_dir):
    """Each turn reads the blocks of the previous turn's prompt and reply (the row held all but
    the reply's last token), and answers what transformers' greedy generate gives for its ids."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    g = torch.Generator().manual_seed(3)

    def words(n: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(2, 300, (n,), generator=g).tolist())

    messages = [{"role": "system", "content": words(30)}, {"role": "user", "content": words(9)}]
    held: list[int] = []  # the tokens the previous turn's row held
    prompt_blocks, past_prompts = 0, 0  # the previous prompt's whole blocks; turns reading past
    for _ in range(3):
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        before = _counters(server)
        r = client.chat.completions.create(
            model=model_dir.name, messages=messages, max_tokens=12, temperature=0
        )
        after = _counters(server)
        hits = (
            after["lmforge_prefix_cache_hit_tokens_total"]
            - before["lmforge_prefix_cache_hit_tokens_total"]
        )
        common = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), len(held))
        assert hits == min(common, len(ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        past_prompts += hits > prompt_blocks * BLOCK_TOKENS  # a reply's blocks read too
        prompt_blocks = len(ids) // BLOCK_TOKENS
        assert r.usage.prompt_tokens == len(ids)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        reply = out[0, len(ids) :].tolist()
        reply = reply[: reply.index(0) + 1] if 0 in reply else reply  # the server stops at eos
        assert r.choices[0].message.content.split() == [WORDS[i] for i in reply if i != 0]
        held = (ids + reply)[: len(ids) + len(reply) - 1]
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": words(5)},
        ]
    assert past_prompts == 2
