"""KV-cache generation against transformers' generate, and against our own model without a cache."""

from __future__ import annotations

import argparse

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from lmforge.cli.generate import add_arguments, run
from lmforge.errors import UserError
from lmforge.inference import KVCache, generate, generate_text, left_pad
from lmforge.models import load_pretrained
from tests.conftest import hf_tiny_configs, make_hf_model

pytest.importorskip("transformers")

DECODERS = [f for f in hf_tiny_configs() if not f.endswith("_cls") and not f.startswith("bert")]
PROMPTS = [[5, 17, 33, 2, 99, 150, 7, 41, 8], [8, 9, 10], [250, 1, 2, 3, 4, 77]]
TOL = 1e-5


@pytest.fixture(scope="module")
def models_(hf_dirs):
    """(ours loaded from the HF folder, the transformers reference) per decoder family."""
    return {f: (load_pretrained(hf_dirs[f]), make_hf_model(f)) for f in DECODERS}


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_matches_transformers_single_and_batched(family, models_):
    ours, ref = models_[family]
    n = 16
    single = generate(ours, PROMPTS[:1], n, do_sample=False, stop_token_ids=[])
    expected = ref.generate(
        torch.tensor(PROMPTS[:1]),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert single == expected[:, len(PROMPTS[0]) :].tolist()
    # A batch of different lengths, left-padded, with the same attention mask for both.
    ids, mask = left_pad(PROMPTS, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    batched = generate(ours, PROMPTS, n, do_sample=False, stop_token_ids=[])
    assert batched == expected[:, ids.shape[1] :].tolist()
    assert batched[0] == single[0]  # a row generates the same alone or in a batch
    # The same through a tensor + mask, and with temperature 0 instead of do_sample=False.
    assert generate(ours, ids, n, attention_mask=mask, temperature=0, stop_token_ids=[]) == batched


def _cached_logits(model, ids, mask, new_tokens, spare_slots=3, ring=True):
    """Last-position logits after the prompt and after each teacher-forced new token, through the
    cache."""
    b, s = ids.shape
    n = new_tokens.shape[1]
    # empty slots past the end must stay masked
    cache = KVCache.for_model(model, b, s + n + spare_slots, ring)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        steps = [model(ids, mask, pos, cache, torch.arange(s))[:, -1]]
        for t in range(n):
            step = model(
                new_tokens[:, t : t + 1], None, pos[:, -1:] + 1 + t, cache, torch.tensor([s + t])
            )
            steps.append(step[:, -1])
    return torch.stack(steps, 1)


def _full_logits(model, ids, mask, new_tokens):
    """The same logits, each step recomputed from scratch over the whole sequence, no cache."""
    steps = []
    with torch.no_grad():
        for t in range(new_tokens.shape[1] + 1):
            full = torch.cat([ids, new_tokens[:, :t]], 1)
            full_mask = torch.cat([mask, torch.ones_like(new_tokens[:, :t])], 1)
            pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
            steps.append(model(full, full_mask, pos)[:, -1])
    return torch.stack(steps, 1)


@pytest.mark.parametrize("family", DECODERS)
def test_cached_decode_equals_full_recomputation_and_transformers(family, models_):
    ours, ref = models_[family]
    ids, mask = left_pad(PROMPTS, 0)
    out = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new_tokens = out.sequences[:, ids.shape[1] :]
    cached = _cached_logits(ours, ids, mask, new_tokens)
    full = _full_logits(ours, ids, mask, new_tokens)
    assert (cached - full).abs().max().item() <= TOL
    # transformers' own logits at each of its steps (the last token's logits are never computed
    # there).
    hf_steps = torch.stack(out.logits, 1)
    assert (cached[:, :-1] - hf_steps).abs().max().item() <= TOL


# Families with sliding-window layers (an 8-token window in the tiny configs): Mistral, Mixtral
# every layer, Gemma 2/3 alternating local and global layers.
WINDOWED = ["mistral", "mixtral", "gemma2", "gemma3"]
# Prompts of 21, 13 and 3 tokens, left-padded, then 40 new ones: every row ends far past the window.
LONG_PROMPTS = [
    [(7 * i + 3) % 290 + 5 for i in range(21)],
    [(11 * i + 1) % 290 + 5 for i in range(13)],
    [8, 9, 10],
]


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_layers_keep_a_ring_of_window_slots(family, models_):
    ours, _ = models_[family]
    cache, flat = KVCache.for_model(ours, 3, 100), KVCache.for_model(ours, 3, 100, ring=False)
    windows = [ours.config.window(i) for i in range(ours.config.num_layers)]
    assert any(windows)
    for k, v, w in zip(cache.k, cache.v, windows, strict=True):
        assert k.shape[2] == v.shape[2] == (w or 100)
    assert all(k.shape[2] == 100 for k in flat.k)
    local = sum(w is not None for w in windows) / len(windows)
    assert cache.nbytes == pytest.approx(flat.nbytes * (1 - local + local * 8 / 100))


@pytest.mark.parametrize("family", WINDOWED)
def test_greedy_far_past_the_window_matches_transformers(family, models_):
    """A ring of 8 slots, prompts of up to 21 tokens (the prefill writes more than the ring
    holds) and 40 new tokens: transformers' tokens, alone and left-padded in a batch."""
    ours, ref = models_[family]
    n = 40
    ids, mask = left_pad(LONG_PROMPTS, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )[:, ids.shape[1] :].tolist()
    assert generate(ours, LONG_PROMPTS, n, do_sample=False, stop_token_ids=[]) == expected
    alone = ref.generate(
        torch.tensor(LONG_PROMPTS[1:2]),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )[:, len(LONG_PROMPTS[1]) :].tolist()
    assert generate(ours, LONG_PROMPTS[1:2], n, do_sample=False, stop_token_ids=[]) == alone


@pytest.mark.parametrize("family", WINDOWED)
def test_ring_decode_equals_the_full_cache_and_recomputation(family, models_):
    """Teacher-forced logits through the ring, through a cache of every slot, and recomputed
    without a cache."""
    ours, _ = models_[family]
    ids, mask = left_pad(LONG_PROMPTS, 0)
    new_tokens = torch.randint(1, 300, (3, 30), generator=torch.Generator().manual_seed(0))
    ring = _cached_logits(ours, ids, mask, new_tokens)
    flat = _cached_logits(ours, ids, mask, new_tokens, ring=False)
    full = _full_logits(ours, ids, mask, new_tokens)
    assert (ring - flat).abs().max().item() <= TOL
    assert (ring - full).abs().max().item() <= TOL


def test_a_reused_ring_row_never_sees_its_previous_tokens(models_):
    """A row used again from slot 0 (a server handing it to a new request, a throwaway token
    decoded at slot 0 in a free row between): the ring's stale keys, at the new prompt's very
    slots included, stay unseen."""
    ours, _ = models_["mistral"]

    def run(cache, prompt, steps):
        n, out = len(prompt), []
        h = ours.hidden_states(
            torch.tensor([prompt]), None, None, cache.view(slice(0, 1), n), torch.arange(n)
        )
        for t in range(steps + 1):
            out.append(ours.logits(h[:, -1]))
            pos = torch.tensor([[n + t]])  # per-row slots, as the engine decodes
            h = ours.hidden_states(
                out[-1].argmax(-1)[:, None], None, pos, cache.view(slice(0, 1), n + t + 1), pos
            )
        return torch.stack(out)

    with torch.no_grad():
        fresh = run(KVCache.for_model(ours, 1, 64), [3, 4], 12)
        cache = KVCache.for_model(ours, 1, 64)
        run(cache, list(range(5, 25)), 5)
        slot0 = torch.tensor([[0]])
        # a throwaway
        ours.hidden_states(torch.tensor([[7]]), None, slot0, cache.view(slice(0, 1), 26), slot0)
        cache.valid[0].zero_()
        assert torch.equal(run(cache, [3, 4], 12), fresh)
        cache.reset()
        assert torch.equal(run(cache, [3, 4], 12), fresh)


def test_bf16_cached_decode_stays_close_to_recomputation(hf_dirs):
    ours = load_pretrained(hf_dirs["llama_gqa"], dtype=torch.bfloat16)
    ids, mask = left_pad(PROMPTS, 0)
    new_tokens = torch.tensor(generate(ours, PROMPTS, 6, temperature=0, stop_token_ids=[]))
    cached, full = (
        _cached_logits(ours, ids, mask, new_tokens).float(),
        _full_logits(ours, ids, mask, new_tokens),
    )
    assert torch.isfinite(cached).all()
    assert (cached - full.float()).abs().max().item() < 0.05 * full.float().abs().max().item()


@pytest.mark.parametrize("family", ["gpt_neox", "llama_gqa"])
def test_sampling_matches_transformers_under_the_same_seed(family, models_):
    """Same processors in the same order and one multinomial draw per step: identical tokens."""
    ours, ref = models_[family]
    # equal lengths: HF would penalise padding ids too
    prompts = [PROMPTS[0], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    kw = dict(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(3)
    got = generate(ours, prompts, 24, stop_token_ids=[], **kw)
    torch.manual_seed(3)
    expected = ref.generate(
        torch.tensor(prompts),
        do_sample=True,
        max_new_tokens=24,
        pad_token_id=0,
        eos_token_id=None,
        **kw,
    )
    assert got == expected[:, len(prompts[0]) :].tolist()


def test_seeded_sampling_is_reproducible_and_seeds_differ(models_):
    ours, _ = models_["llama"]
    runs = [generate(ours, PROMPTS, 20, seed=seed, stop_token_ids=[]) for seed in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    torch.manual_seed(123)  # a seed argument uses its own generator, not the global RNG
    assert generate(ours, PROMPTS, 20, seed=0, stop_token_ids=[]) == runs[0]
    greedy = generate(ours, PROMPTS, 20, do_sample=False, stop_token_ids=[])
    assert generate(ours, PROMPTS, 20, temperature=0, seed=5, stop_token_ids=[]) == greedy
    assert generate(ours, PROMPTS, 20, top_k=1, seed=5, stop_token_ids=[]) == greedy


def _count_steps(model):
    """A counter of forward passes (prefill + decode steps) of the model."""
    calls = []
    handle = model.norm.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def test_eos_stops_a_row_and_all_rows_end_generation(models_):
    ours, ref = models_["gpt_neox"]
    greedy = generate(ours, PROMPTS, 12, do_sample=False, stop_token_ids=[])
    k = next(i for i in range(2, 12) if greedy[0][i] not in greedy[0][:i])  # a token new at step k
    eos = greedy[0][k]
    got = generate(ours, PROMPTS, 12, do_sample=False, stop_token_ids=[eos])
    ids, mask = left_pad(PROMPTS, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=0,
        eos_token_id=eos,
    )
    expected = expected[:, ids.shape[1] :].tolist()
    for row, hf_row in zip(got, expected):
        end = hf_row.index(eos) + 1 if eos in hf_row else len(hf_row)
        assert row == hf_row[:end]  # stop token kept last, nothing after it (HF pads there)
    assert got[0] == greedy[0][: k + 1]
    # Once every row has stopped, no more forward passes run.
    calls, handle = _count_steps(ours)
    try:
        assert generate(ours, PROMPTS[:1], 50, do_sample=False, stop_token_ids=[eos]) == got[:1]
    finally:
        handle.remove()
    # prefill (gives the first token) + one decode step per further token
    assert len(calls) == k + 1


@pytest.mark.slow
# partial rotary + parallel residual; GQA + RMSNorm; a ring of 8 slots beside a full layer
@pytest.mark.parametrize("family", ["gpt_neox", "llama_gqa", "gemma2"])
def test_compiled_decode_gives_transformers_tokens_without_recompiling_per_call(family, models_):
    """compile=True: the same greedy tokens as transformers, with and without padding, with stop
    tokens; one graph serves every step of a call and calls of other lengths within the same
    cache size (power of two)."""
    from torch._dynamo.utils import counters

    ours, ref = models_[family]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]  # a process-wide count
    ids, mask = left_pad(PROMPTS, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=0,
        eos_token_id=None,
    )[:, ids.shape[1] :].tolist()
    assert generate(ours, PROMPTS, 20, do_sample=False, stop_token_ids=[], compile=True) == expected
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 1
    # 30 new tokens: the cache still fits in the same 128 slots, so the graph is reused (the number
    # of filled slots is the one symbolic size); a stop token ends rows early as in eager.
    eager = generate(ours, PROMPTS, 30, do_sample=False, stop_token_ids=[expected[1][3]])
    assert (
        generate(ours, PROMPTS, 30, do_sample=False, stop_token_ids=[expected[1][3]], compile=True)
        == eager
    )
    assert counters["stats"]["unique_graphs"] == graphs
    assert (
        generate(ours, PROMPTS[:1], 20, do_sample=False, stop_token_ids=[], compile=True)
        == expected[:1]
    )


@pytest.mark.slow
# + a sliding window over the static cache
@pytest.mark.parametrize("family", ["gpt_neox", "llama_gqa", "mistral"])
def test_static_decode_for_cuda_graphs_equals_eager_in_one_graph(family, models_):
    """compile="reduce-overhead": the static-shape step (the whole preallocated cache, positions
    as tensors) gives eager's and transformers' greedy tokens; it compiles into one graph without
    a graph break, and nothing recompiles across its steps (dynamic=False: a shape that changed
    would) nor across calls of other prompt and generation lengths within the cache size, which
    replay into the cache the model keeps between calls."""
    from torch._dynamo.utils import counters

    from lmforge.inference.decode_step import HELD_CACHE

    ours, ref = models_[family]
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    ids, mask = left_pad(PROMPTS, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=0,
        eos_token_id=None,
    )[:, ids.shape[1] :].tolist()
    assert generate(ours, PROMPTS, 20, do_sample=False, stop_token_ids=[]) == expected
    assert (
        generate(ours, PROMPTS, 20, do_sample=False, stop_token_ids=[], compile="reduce-overhead")
        == expected
    )
    assert (
        counters["stats"]["unique_graphs"] - graphs == 1
        and sum(counters["graph_break"].values()) == breaks
    )
    cache = getattr(ours, HELD_CACHE)
    assert cache.valid.shape == (3, 128)  # 9 + 20 slots rounded up to the smallest compiled cache
    shorter = [p[:4] for p in PROMPTS]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts, n, stop in ((shorter, 40, []), (PROMPTS, 30, [expected[1][3]])):
            eager = generate(ours, prompts, n, do_sample=False, stop_token_ids=stop)
            assert (
                generate(
                    ours,
                    prompts,
                    n,
                    do_sample=False,
                    stop_token_ids=stop,
                    compile="reduce-overhead",
                )
                == eager
            )
    assert getattr(ours, HELD_CACHE) is cache and counters["stats"]["unique_graphs"] - graphs == 1


def test_compile_modes_refused(models_):
    ours, _ = models_["gpt_neox"]
    with pytest.raises(
        UserError, match="compile must be True/False or one of default, reduce-overhead"
    ):
        generate(ours, PROMPTS, 4, compile="fast")
    moe, _ = models_["mixtral"]
    with pytest.raises(
        UserError, match="mixture-of-experts model cannot decode with compile='reduce-overhead'"
    ):
        generate(moe, PROMPTS, 4, compile="reduce-overhead")
    args = _cli(["model", "--prompt", "x", "--compile"])
    assert (
        args.compile == "default"
        and _cli(["m", "--prompt", "x", "--compile", "reduce-overhead"]).compile
        == "reduce-overhead"
        and _cli(["m", "--prompt", "x"]).compile is None
    )


def test_default_stop_is_the_config_eos(models_):
    ours, _ = models_["gpt_neox"]
    greedy = generate(ours, PROMPTS, 12, do_sample=False, stop_token_ids=[])
    eos = greedy[1][2]
    old = ours.config.eos_token_id
    ours.config.eos_token_id = eos
    try:
        row = generate(ours, PROMPTS, 12, do_sample=False)[1]
    finally:
        ours.config.eos_token_id = old
    assert row == greedy[1][: greedy[1].index(eos) + 1]


def test_user_errors(models_, hf_dirs):
    ours, _ = models_["gpt2"]
    with pytest.raises(UserError, match="empty"):
        generate(ours, [[1, 2], []], 4)
    # One rule for every model (and for the server): prompt + new tokens <= the context, else one
    # line saying how many would fit. A rotary model once went past its positions without a word.
    for family in ("gpt2", "gpt_neox"):  # learned positions; rotary
        model = models_[family][0]
        with pytest.raises(
            UserError, match=r"context is 128 tokens.*max_new_tokens to at most 126"
        ):
            generate(model, [[1, 2], [3]], 127)
        # fills all 128 positions
        assert len(generate(model, [[1, 2]], 126, stop_token_ids=[])[0]) == 126
    with pytest.raises(UserError, match="shorten the prompt"):
        generate(ours, [list(range(1, 129))], 1)
    with pytest.raises(UserError, match="vocabulary"):
        generate(ours, [[1, 300]], 4)
    with pytest.raises(UserError, match="top_p"):
        generate(ours, [[1, 2]], 4, top_p=0.0)
    with pytest.raises(UserError, match="decoder language model"):
        generate(load_pretrained(hf_dirs["bert"]), [[1, 2]], 4)
    with pytest.raises(UserError, match="left padding"):
        generate(ours, torch.tensor([[1, 2, 0]]), 4, attention_mask=torch.tensor([[1, 1, 0]]))
    assert generate(ours, [[1, 2], [3]], 0) == [[], []]


# ---------------------------------------------------------------- text level: tokenizer, stop
# strings, CLI

WORDS = ["<|endoftext|>", "<unk>"] + [f"t{i}" for i in range(2, 300)]


def _word_tokenizer() -> Tokenizer:
    """One token per word 't<id>' (id 0 = <|endoftext|>, the eos of the NeoX config): every
    prefix of the ids decodes to a prefix of the text, so expected stop positions are easy to
    compute."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


@pytest.fixture(scope="module")
def text_model(hf_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "neox"
    folder.mkdir()
    for f in hf_dirs["gpt_neox"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _word_tokenizer().save(str(folder / "tokenizer.json"))
    from lmforge.tokenizers import load_tokenizer

    return folder, load_pretrained(folder), load_tokenizer(folder)


def test_stop_strings_cut_the_text_and_end_generation(text_model):
    _, model, tok = text_model
    prompts = ["t5 t17 t33 t2 t99", "t8 t9 t10"]
    encoded = tok.encode_batch(prompts)
    ids = generate(model, encoded, 20, do_sample=False, stop_token_ids=[])
    texts = [tok.decode(row) for row in ids]
    assert generate_text(model, tok, prompts, 20, do_sample=False, stop_token_ids=[]) == [
        " " + t for t in texts
    ]
    words = texts[0].split()
    stop = f"{words[4]} {words[5]}"
    first = texts[0].find(stop)
    # the token that completes the stop string
    expected_tokens = len(texts[0][: first + len(stop)].split())
    calls, handle = _count_steps(model)
    try:
        got = generate_text(
            model,
            tok,
            prompts[:1],
            20,
            do_sample=False,
            stop=[stop, "never there"],
            stop_token_ids=[],
        )
    finally:
        handle.remove()
    assert got == [" " + texts[0][:first]]
    assert len(calls) == expected_tokens  # generation stopped right at the stop string
    # In a batch only the row containing the stop string is cut.
    both = generate_text(model, tok, prompts, 20, do_sample=False, stop=stop, stop_token_ids=[])
    assert both[0] == got[0]
    assert both[1] == (" " + texts[1]).split(stop)[0]


def test_eos_is_not_part_of_the_text(text_model):
    _, model, tok = text_model
    ids = generate(model, tok.encode_batch(["t5 t17 t33"]), 12, do_sample=False, stop_token_ids=[])[
        0
    ]
    eos = ids[3]
    text = generate_text(model, tok, "t5 t17 t33", 12, do_sample=False, stop_token_ids=[eos])
    assert text == [" " + tok.decode(ids[: ids.index(eos)])]


def _cli(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(args)


def test_cli_run_prints_the_completions(text_model, capsys):
    folder, model, tok = text_model
    prompts = ["t5 t17 t33 t2 t99", "t8 t9 t10"]
    expected = generate_text(
        model, tok, prompts, 8, temperature=0.8, top_k=20, top_p=0.9, seed=7, repetition_penalty=1.2
    )
    run(
        _cli(
            [
                str(folder),
                "--prompt",
                prompts[0],
                "--prompt",
                prompts[1],
                "--max-new-tokens",
                "8",
                "--temperature",
                "0.8",
                "--top-k",
                "20",
                "--top-p",
                "0.9",
                "--seed",
                "7",
                "--repetition-penalty",
                "1.2",
            ]
        )
    )
    out = capsys.readouterr().out
    assert (
        out
        == f"--- completion 1 of 2 ---\n{expected[0]}\n--- completion 2 of 2 ---\n{expected[1]}\n"
    )
    run(
        _cli(
            [
                str(folder),
                "--prompt",
                prompts[0],
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
                "--dtype",
                "bfloat16",
            ]
        )
    )
    assert capsys.readouterr().out.count("\n") == 1


def test_cli_user_errors(text_model, hf_dirs, tmp_path):
    folder, _, _ = text_model
    with pytest.raises(UserError, match=f"model folder '{tmp_path / 'nope'}' does not exist"):
        run(_cli([str(tmp_path / "nope"), "--prompt", "t5"]))
    with pytest.raises(
        UserError, match="context is 128 tokens.*lower --max-new-tokens to at most 126"
    ):
        # as serve answers 400
        run(_cli([str(folder), "--prompt", "t5 t6", "--max-new-tokens", "500"]))
    with pytest.raises(UserError, match="temperature must be a finite number"):
        run(_cli([str(folder), "--prompt", "t5", "--temperature", "nan"]))
    with pytest.raises(UserError, match="seed"):
        run(_cli([str(folder), "--prompt", "t5", "--seed", str(2**64)]))
    with pytest.raises(UserError, match="tokenizer"):
        run(_cli([str(hf_dirs["gpt_neox"]), "--prompt", "t5"]))  # no tokenizer files there
    with pytest.raises(UserError, match="temperature"):
        run(_cli([str(folder), "--prompt", "t5", "--temperature", "-1"]))
    with pytest.raises(UserError, match="empty"):
        run(_cli([str(folder), "--prompt", ""]))
