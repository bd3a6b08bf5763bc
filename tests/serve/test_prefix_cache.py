"""Prefix caching in the engine: prompts sharing a prefix give with the cache what they give without
it and what transformers computes for them (greedy tokens; seeded draws; log-probabilities), whether
they arrive together or one after another, past a partial block, and under a pool so small that it
evicts; a pinned block is never evicted; adapters never share blocks."""

from __future__ import annotations

import pytest
import torch

from lmforge.inference.cache import KVCache
from lmforge.inference.engine import Engine, EngineConfig, RequestParams
from lmforge.inference.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes
from lmforge.inference.sampling import SamplingParams
from lmforge.models import load_pretrained
from tests.conftest import make_hf_model
from tests.serve.test_engine import IdTokenizer

GREEDY = SamplingParams(temperature=0)
FAMILIES = ("gpt_neox", "llama_gqa", "gpt2", "mistral")  # mistral: a sliding window of 8 slots


@pytest.fixture(scope="module")
def models_(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for family in FAMILIES:
        hf = make_hf_model(family)
        hf.save_pretrained(root / family)
        model = load_pretrained(root / family)
        model.config.eos_token_id = None  # both end by max_tokens only
        hf.generation_config.eos_token_id = None
        out[family] = (model, hf)
    return out


def _prompts(prefix_len: int, tails: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 300, (prefix_len,), generator=g).tolist()
    return [
        prefix + torch.randint(1, 300, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 9, (tails,), generator=g)
    ]


def _run(model, prompts, together: bool, params, **config) -> tuple[list, Engine]:
    """Each request's (tokens, logprobs of them), submitted at once or each after the previous
    finished."""
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=4, max_context=96, **config))
    events: list[list] = [[] for _ in prompts]
    reqs = []
    for i, prompt in enumerate(prompts):
        reqs.append(engine.submit(prompt, params(i), events[i].append))
        while not together and reqs[-1].finish_reason is None:
            engine.step()
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    out = []
    for r, evs in zip(reqs, events):
        assert r.finish_reason == "length"
        out.append((r.output_ids, [lp.logprob for e in evs for lp in e.logprobs or ()]))
    return out, engine


def _greedy(i):
    return RequestParams(max_tokens=5, sampling=GREEDY, logprobs=0)


def _seeded(i):
    return RequestParams(max_tokens=5, sampling=SamplingParams(temperature=1.0), seed=i, logprobs=0)


def _hf_greedy(hf, prompt, n):
    """transformers' greedy tokens and their log-probabilities."""
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [s[0].float().log_softmax(-1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("together", [False, True])
def test_shared_prefix_greedy_equals_cache_off_and_transformers(family, together, models_):
    model, hf = models_[family]
    prompts = _prompts(2 * BLOCK_TOKENS + 5, 4)
    on, engine = _run(model, prompts, together, _greedy)
    off, _ = _run(model, prompts, together, _greedy, prefix_cache=False)
    # each later prompt reads the two shared blocks; queued together, the first is prefilled
    # alone and the others together after it
    assert engine.prefix.hit_tokens == 3 * 2 * BLOCK_TOKENS
    assert engine.prefills == (2 if together else 4)
    for prompt, (tokens, logprobs), (tokens_off, logprobs_off) in zip(prompts, on, off):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, 5)
        assert tokens == tokens_off == want_tokens
        assert logprobs == pytest.approx(logprobs_off, abs=1e-5)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "family", ["gemma2", "gemma3", "qwen2", "phi3", "gptj", "olmo2", "mixtral", "qwen3_moe"]
)
def test_every_family_reads_its_prefix_and_answers_as_transformers(family, tmp_path):
    """Soft-capped and alternating sliding-window layers (Gemma 2/3, Qwen2's upper layers), fused
    projections, parallel blocks, mixtures of experts: the cache holds every layer's keys."""
    hf = make_hf_model(family)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    model.config.eos_token_id = None
    prompts = _prompts(2 * BLOCK_TOKENS + 3, 3, seed=50)
    on, engine = _run(model, prompts, False, _greedy)
    off, _ = _run(model, prompts, False, _greedy, prefix_cache=False)
    assert engine.prefix.hit_tokens == 2 * 2 * BLOCK_TOKENS
    for prompt, (tokens, logprobs), (tokens_off, logprobs_off) in zip(prompts, on, off):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, 5)
        assert tokens == tokens_off == want_tokens
        assert logprobs == pytest.approx(logprobs_off, abs=1e-5)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_a_batch_of_rows_with_different_cached_prefixes(models_):
    """Rows prefilled together from prefixes of different lengths, next to rows that read none."""
    model, hf = models_["gpt2"]
    long, short = _prompts(3 * BLOCK_TOKENS, 2, seed=1), _prompts(BLOCK_TOKENS + 2, 2, seed=2)
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=6, max_context=96))
    for prompt in (long[0], short[0]):  # warm: their prefixes go to the pool
        r = engine.submit(prompt, _greedy(0), lambda e: None)
        while r.finish_reason is None:
            engine.step()
    batch = [long[1], short[1], _prompts(4, 1, seed=3)[0]]
    reqs = [engine.submit(p, _greedy(0), lambda e: None) for p in batch]
    hits = engine.prefix.hit_tokens
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    assert engine.prefix.hit_tokens - hits == 3 * BLOCK_TOKENS + BLOCK_TOKENS
    for prompt, r in zip(batch, reqs):
        assert r.output_ids == _hf_greedy(hf, prompt, 5)[0]


@pytest.mark.parametrize("together", [False, True])
def test_seeded_sampling_draws_the_same_tokens_with_the_cache_on_and_off(together, models_):
    model, _ = models_["llama_gqa"]
    prompts = _prompts(2 * BLOCK_TOKENS, 4, seed=4)
    on, _ = _run(model, prompts, together, _seeded)
    off, _ = _run(model, prompts, together, _seeded, prefix_cache=False)
    for (tokens, logprobs), (tokens_off, logprobs_off) in zip(on, off):
        assert tokens == tokens_off
        assert logprobs == pytest.approx(logprobs_off, abs=1e-5)


def test_a_partial_block_of_shared_prefix_is_computed_again(models_):
    """20 shared tokens: the whole block of 16 is read, the 4 after it computed."""
    model, hf = models_["gpt_neox"]
    prompts = _prompts(BLOCK_TOKENS + 4, 3, seed=5)
    on, engine = _run(model, prompts, False, _greedy)
    assert engine.prefix.hit_tokens == 2 * BLOCK_TOKENS
    total = sum(len(p) for p in prompts)
    assert engine.prefix.miss_tokens == total - 2 * BLOCK_TOKENS
    for prompt, (tokens, _) in zip(prompts, on):
        assert tokens == _hf_greedy(hf, prompt, 5)[0]


def test_a_prompt_of_whole_blocks_computes_its_last_token(models_):
    """The same 32-token prompt twice: the second reads one block only, since the first token's
    logits need the last prompt token computed."""
    model, hf = models_["gpt_neox"]
    prompt = _prompts(2 * BLOCK_TOKENS, 1, seed=6)[0][: 2 * BLOCK_TOKENS]
    on, engine = _run(model, [prompt, prompt], False, _greedy)
    assert engine.prefix.hit_tokens == BLOCK_TOKENS
    assert on[0][0] == on[1][0] == _hf_greedy(hf, prompt, 5)[0]


def test_eviction_under_a_tiny_bound_keeps_every_answer(models_):
    """A pool of 3 blocks for prefixes of 2 blocks taking turns: blocks are evicted and answers stay
    those of the cache off."""
    model, hf = models_["llama_gqa"]
    groups = [_prompts(2 * BLOCK_TOKENS, 2, seed=10 + g) for g in range(3)]
    prompts = [groups[g][i] for i in range(2) for g in range(3)]
    on, engine = _run(model, prompts, False, _greedy, prefix_cache_blocks=3)
    off, _ = _run(model, prompts, False, _greedy, prefix_cache=False)
    assert engine.prefix.evicted > 0 and engine.prefix.used <= 3
    for prompt, (tokens, logprobs), (tokens_off, logprobs_off) in zip(prompts, on, off):
        assert tokens == tokens_off == _hf_greedy(hf, prompt, 5)[0]
        assert logprobs == pytest.approx(logprobs_off, abs=1e-5)


def test_blocks_pinned_by_running_rows_are_never_evicted(models_):
    """Two rows decoding hold 4 blocks of a 4-block pool: a third prompt finds none to evict and
    keeps nothing; the pinned blocks still hold their prefixes, read by a later prompt."""
    model, hf = models_["gpt_neox"]
    a, b, c = (_prompts(2 * BLOCK_TOKENS, 2, seed=20 + i) for i in range(3))
    engine = Engine(
        model, IdTokenizer(), EngineConfig(max_batch=4, max_context=96, prefix_cache_blocks=4)
    )
    long = RequestParams(max_tokens=40, sampling=GREEDY)
    running = [engine.submit(p[0], long, lambda e: None) for p in (a, b)]
    engine.step()
    held = {n: engine.prefix.ids[n] for p in (a, b) for n in block_hashes(p[0])[:2]}
    assert len(held) == 4 and all(engine.prefix.refs[i] == 1 for i in held.values())
    third = engine.submit(c[0], _greedy(0), lambda e: None)
    while third.finish_reason is None:
        engine.step()
    assert {n: engine.prefix.ids.get(n) for n in held} == held and engine.prefix.evicted == 0
    assert all(n not in engine.prefix.ids for n in block_hashes(c[0]))
    later = engine.submit(a[1], _greedy(0), lambda e: None)
    hits = engine.prefix.hit_tokens
    while later.finish_reason is None:
        engine.step()
    assert engine.prefix.hit_tokens - hits == 2 * BLOCK_TOKENS
    assert later.output_ids == _hf_greedy(hf, a[1], 5)[0]
    assert all(r.finish_reason is None for r in running)


def test_prompts_under_different_adapters_share_no_block(models_):
    model, _ = models_["gpt_neox"]
    prompts = _prompts(2 * BLOCK_TOKENS, 3, seed=30)
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=4, max_context=96))
    hits = []
    for prompt, adapter in zip(prompts, ("sql", "chat", "sql")):
        params = _greedy(0)
        params.adapter = adapter  # the attribute the engine reads a request's adapter from
        r = engine.submit(prompt, params, lambda e: None)
        while r.finish_reason is None:
            engine.step()
        hits.append(engine.prefix.hit_tokens)
    assert hits == [0, 0, 2 * BLOCK_TOKENS]  # only the second "sql" prompt reads the first's
    assert (
        block_hashes(prompts[0], ("sql", None))[:2] != block_hashes(prompts[0], ("chat", None))[:2]
    )


def test_prompt_logprobs_are_computed_whole(models_):
    """echo's prompt log-probabilities need every prompt position: such a prompt reads no block
    and scores as it does with the cache off."""
    model, _ = models_["gpt_neox"]
    prompts = _prompts(2 * BLOCK_TOKENS, 2, seed=40)

    def scored(**config):
        engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=2, max_context=96, **config))
        got = []
        for prompt in prompts:
            events = []
            r = engine.submit(prompt, RequestParams(max_tokens=0, prompt_logprobs=1), events.append)
            while r.finish_reason is None:
                engine.step()
            got.append([lp.logprob for lp in events[0].prompt_logprobs[1:]])
        return got, engine

    on, engine = scored()
    off, _ = scored(prefix_cache=False)
    assert engine.prefix.hit_tokens == 0
    for a, b in zip(on, off):
        assert a == pytest.approx(b, abs=1e-6)


def test_lru_evicts_the_least_recently_released_and_tails_first(models_):
    cfg = models_["gpt_neox"][0].config
    pool = PrefixCache(KVCache(cfg, 1, 64, ring=False), 3)
    cache = KVCache(cfg, 1, 64, ring=False)
    x, y, z = object(), object(), object()
    pool.store(x, [b"x0", b"x1"], cache, 0)
    pool.release(x)
    pool.store(y, [b"y0"], cache, 0)
    pool.release(y)
    pool.store(z, [b"z0"], cache, 0)  # the oldest released block is x's last, x1
    assert set(pool.ids) == {b"x0", b"y0", b"z0"} and pool.evicted == 1
    assert pool.match(object(), [b"x0", b"x1"], 2 * BLOCK_TOKENS + 1) == [pool.ids[b"x0"]]
