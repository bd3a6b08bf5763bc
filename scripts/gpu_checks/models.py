"""Every family against transformers on the device: logits (fp32 and bf16, at late positions),
greedy generation (eager and compiled), and the serving engine's batched greedy against generate
alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from gpu_checks.base import Context, check

LONG = 2048  # positions of the parity configs: logits are compared up to position LONG - 1
# Query/key projections (every family's names), scaled so that attention is sharp: a random model's
# scores are ~0.2, near-uniform attention over which rotary errors would not show.
QUERY_KEY = (
    "q_proj",
    "k_proj",
    "query_key_value",
    "qkv_proj",
    "c_attn",
    "attention.self.query",
    "attention.self.key",
)


def tiny_models(ctx: Context) -> dict[str, tuple[type, Path]]:
    """Every family's tiny transformers model (tests/conftest.py's configs, 2048 positions, sharp
    attention), saved once."""

    def make():
        from tests.conftest import hf_tiny_configs

        out = {}
        for name, (cls, cfg) in hf_tiny_configs().items():
            for key in (
                "max_position_embeddings",
                "n_positions",
                "original_max_position_embeddings",
            ):
                if getattr(cfg, key, None) is not None:
                    setattr(cfg, key, LONG)
            torch.manual_seed(0)
            model = cls(cfg)
            # every parameter, biases and norms too, away from its initial value
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.add_(torch.randn_like(p) * 0.05)
                    if n.endswith("weight") and any(k in n for k in QUERY_KEY):
                        p.mul_(6.0)
            model.save_pretrained(ctx.tmp / "tiny" / name)
            out[name] = (cls, ctx.tmp / "tiny" / name)
        return out

    return ctx.once("tiny", make)


def reference(cls, folder: Path, dtype: torch.dtype, device: torch.device):
    """The transformers model of `folder` in eval mode on `device`. Soft-capped attention scores
    (Gemma 2) in its eager attention: transformers 5.17 (the H200 machine's) runs Gemma 2 through
    SDPA by default, which drops the cap without a word (2.2 max |logit| from its own eager path,
    on the CPU too); 5.24 makes eager Gemma 2's default."""
    capped = (
        json.loads((folder / "config.json").read_text()).get("attn_logit_softcapping") is not None
    )
    extra = {"attn_implementation": "eager"} if capped else {}
    return cls.from_pretrained(folder, dtype=dtype, **extra).to(device).eval()


def is_decoder_lm(name: str) -> bool:
    return not name.startswith("bert") and not name.endswith("_cls")


@check
def check_parity(ctx: Context) -> tuple[str, dict]:
    from lmforge.models import load_pretrained
    from lmforge.models.hf import ADAPTERS

    dev, models = ctx.device, tiny_models(ctx)
    length = 64 if ctx.quick else LONG
    gen = torch.Generator().manual_seed(1)
    fig, bad = {}, []
    for name, (cls, folder) in models.items():
        ids = torch.randint(1, 300, (2, length), generator=gen).to(dev)
        # the last ones: 2047 at the end
        positions = torch.arange(LONG - length, LONG, device=dev).expand(2, length)
        with torch.no_grad():
            ref = reference(cls, folder, torch.float32, dev)(ids, position_ids=positions).logits
            ref16 = reference(cls, folder, torch.bfloat16, dev)(ids, position_ids=positions)
            ours = load_pretrained(folder, device=dev)(ids, position_ids=positions)
            ours16 = load_pretrained(folder, device=dev, dtype=torch.bfloat16)(
                ids, position_ids=positions
            )
        fp32 = (ours - ref).abs().max().item()
        hf16, lm16 = (
            (ref16.logits.float() - ref).abs().mean().item(),
            (ours16.float() - ref).abs().mean().item(),
        )
        # bf16: lmforge's error against the fp32 reference may not exceed transformers' own bf16
        # error by much. Rotary positions rounded to bf16 give ~30x (any length); bf16 frequencies
        # 3-15x over 2048 tokens (the full-length run), where the keys far back are off by radians.
        ok = fp32 <= ctx.fp32_tol * max(1.0, ref.abs().max().item()) and lm16 <= 1.5 * hf16 + 1e-3
        fig[name] = {
            "fp32_max_abs": fp32,
            "bf16_mean_abs": lm16,
            "transformers_bf16_mean_abs": hf16,
            "ok": ok,
        }
        if not ok:
            bad.append(f"{name} (fp32 {fp32:.1e}, bf16 {lm16:.1e} vs transformers' {hf16:.1e})")
    covered = {
        json.loads((folder / "config.json").read_text())["model_type"]
        for _, folder in models.values()
    }
    missing = sorted(set(ADAPTERS) - covered)
    fig["model_types_without_a_tiny_config"] = missing
    if bad:
        raise AssertionError("logits differ: " + "; ".join(bad))
    worst = max(v["fp32_max_abs"] for v in fig.values() if isinstance(v, dict))
    ratio = max(
        v["bf16_mean_abs"] / max(v["transformers_bf16_mean_abs"], 1e-9)
        for v in fig.values()
        if isinstance(v, dict)
    )
    note = f"; no tiny config in tests/conftest.py for {', '.join(missing)}" if missing else ""
    return (
        f"{len(models)} configs, {len(covered)} model types, positions {LONG - length}-{LONG - 1}: fp32 max "
        f"|diff| {worst:.1e}; bf16 error <= {ratio:.2f}x transformers' own{note}"
    ), fig


def top2_gap(model, ids: list[int]) -> float:
    """How far apart the two likeliest next tokens after `ids` are (lmforge's fp32 logits)."""
    with torch.no_grad():
        top = (
            model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1]
            .float()
            .topk(2)
            .values
        )
    return (top[0] - top[1]).item()


def compare_greedy(
    model, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]], tie: float
) -> tuple[int, int, list[str]]:
    """(rows equal, rows that part where the reference's top two logits are within `tie`, the
    other rows).

    Two fp32 implementations differ in the last bits (kernels sum in other orders); where two
    tokens are that close either is the greedy choice, and the rows then part for good. Any other
    difference is a failure."""
    equal, ties, bad = 0, 0, []
    for row, (prompt, g, e) in enumerate(zip(prompts, got, expected)):
        step = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None)
        if step is None:
            equal += len(g) == len(e)
            if len(g) != len(e):
                bad.append(f"row {row}: {len(g)} tokens, expected {len(e)}")
            continue
        gap = top2_gap(model, prompt + e[:step])
        if gap <= tie:
            ties += 1
        else:
            bad.append(f"row {row} parts at token {step} (top-2 gap {gap:.1e})")
    return equal, ties, bad


@check
def check_generate(ctx: Context) -> tuple[str, dict]:
    from torch._dynamo.utils import counters

    from lmforge.inference import generate, left_pad
    from lmforge.models import load_pretrained

    dev, models = ctx.device, tiny_models(ctx)
    # the last: static-shape step
    modes = {"eager": False, "compiled": True, "cuda graphs": "reduce-overhead"}
    compiled = ["gpt_neox"] if ctx.quick else ["gpt_neox", "llama_gqa", "gpt2"]
    # long prompts: late positions
    lengths, new = ([9, 3, 6], 8) if ctx.quick else ([1900, 1500, 1000], 64)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lengths]
    fig, bad, ties = {}, [], 0
    for name, (cls, folder) in models.items():
        if not is_decoder_lm(name):
            continue
        ref = reference(cls, folder, torch.float32, dev)
        ids, mask = left_pad(prompts, 0, dev)
        with torch.no_grad():
            out = ref.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                pad_token_id=0,
                eos_token_id=None,
            )
        expected = out[:, ids.shape[1] :].tolist()
        ours = load_pretrained(folder, device=dev)
        for side in modes if name in compiled else ("eager",):
            start, skips = time.perf_counter(), counters["inductor"]["cudagraph_skips"]
            got = generate(
                ours, prompts, new, do_sample=False, stop_token_ids=[], compile=modes[side]
            )
            if (
                side == "cuda graphs"
                and dev.type == "cuda"
                and counters["inductor"]["cudagraph_skips"] > skips
            ):
                bad.append(
                    f"{name} {side}: Inductor skipped CUDA graphs (run with TORCH_LOGS=perf_hints for why)"
                )
            equal, tied, problems = compare_greedy(ours, prompts, got, expected, ctx.fp32_tol)
            fig[f"{name} {side}"] = {
                "rows_equal": equal,
                "rows_parting_at_a_tie": tied,
                "problems": problems,
                "seconds": time.perf_counter() - start,
            }
            ties += tied
            bad += [f"{name} {side} {p}" for p in problems]
    if bad:
        raise AssertionError("greedy tokens differ from transformers': " + "; ".join(bad))
    note = f" ({ties} rows part at a top-2 tie within {ctx.fp32_tol:g})" if ties else ""
    return (
        f"{sum(k.endswith('eager') for k in fig)} families eager + {len(compiled)} compiled and static-shape "
        f"(compile='reduce-overhead'{', CUDA graphs' if dev.type == 'cuda' else ''}) ({', '.join(compiled)})"
        f": {len(prompts)} rows x {new} tokens equal{note}; prompts of {max(lengths)} to {min(lengths)} "
        "tokens"
    ), fig


class IdTokenizer:
    """Ids as words, no eos: only max_tokens ends a request."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)

    def token_to_id(self, text):  # no token is special: a stop string is text
        return None

    # no ids of its own: the model config's stand
    def model_special_ids(self, declared, classifier=False):
        return {k: declared.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


@check
def check_engine(ctx: Context) -> tuple[str, dict]:
    from lmforge.inference import generate
    from lmforge.inference.engine import Engine, EngineConfig, RequestParams
    from lmforge.inference.sampling import SamplingParams
    from lmforge.models import load_pretrained

    models, fig = tiny_models(ctx), {}
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(2, 40, (7,), generator=gen).tolist()
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lengths]
    # partial rotary, GQA, learned positions, a window
    for name in ("gpt_neox", "llama_gqa", "gpt2", "mistral"):
        model = load_pretrained(models[name][1], device=ctx.device)
        model.config.eos_token_id = None
        engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=3, max_context=128))
        reqs = []
        for i, prompt in enumerate(prompts):  # requests join a running batch between decode steps
            reqs.append(
                engine.submit(
                    prompt, RequestParams(6 + 3 * i, SamplingParams(temperature=0)), lambda e: None
                )
            )
            for _ in range(1 + i % 3):
                engine.step()
        while engine.step():
            pass
        alone = [
            generate(model, [p], r.params.max_tokens, do_sample=False, stop_token_ids=[])[0]
            for p, r in zip(prompts, reqs)
        ]
        equal, tied, problems = compare_greedy(
            model, prompts, [r.output_ids for r in reqs], alone, ctx.fp32_tol
        )
        fig[name] = {
            "rows_equal": equal,
            "rows_parting_at_a_tie": tied,
            "problems": problems,
            "requests": len(reqs),
            "mean_batch": engine.rows_decoded / engine.steps,
        }
        assert not problems, f"{name}: requests differ from generate alone: {'; '.join(problems)}"
    batch = min(v["mean_batch"] for v in fig.values())
    ties = sum(v["rows_parting_at_a_tie"] for v in fig.values())
    note = f" ({ties} part at a top-2 tie within {ctx.fp32_tol:g})" if ties else ""
    return (
        f"{len(fig)} families x {len(prompts)} requests joining mid-decode (mean batch >= {batch:.1f}): "
        f"= generate alone{note}"
    ), fig


@check
def check_documents(ctx: Context) -> tuple[str, dict]:
    """Packed documents (lmforge.models.documents): logits and gradients of each backend the
    device can run ("split"; "flex" where FlexAttention trains: not the CPU), eager and in
    compiled blocks, against the dense mask; and an unpacked batch (flex: the causal block mask
    narrowed to each window, the cap as a score_mod) against the dense band mask. Before
    lmforge.models.documents.FLEX_DEVICES names a device, this check must pass on it."""
    from lmforge.models import documents, load_pretrained
    from lmforge.models.documents import document_mask, flex_available

    dev, models = ctx.device, tiny_models(ctx)
    seq = 256 if ctx.quick else LONG
    gen = torch.Generator().manual_seed(5)
    segments = torch.zeros(2, seq, dtype=torch.long)
    positions = torch.zeros_like(segments)
    for r in range(2):  # documents of 5-400 tokens, then padding
        start, d = 0, 1
        while start < seq - 40:
            n = min(
                int(torch.randint(5, min(400, seq // 3), (1,), generator=gen)), seq - 40 - start
            )
            segments[r, start : start + n], positions[r, start : start + n] = d, torch.arange(n)
            start, d = start + n, d + 1
    segments, positions = segments.to(dev), positions.to(dev)
    backends = ["split"] + (["flex"] if dev.type in ("cuda", "xpu") and flex_available() else [])
    fig, bad = {}, []
    for name in ("llama_gqa", "mistral", "gemma2"):  # GQA, a sliding window, soft-capped scores
        model = load_pretrained(models[name][1], device=dev).float()
        ids = torch.randint(1, 300, segments.shape, generator=gen).to(dev)

        def run(model=model, ids=ids, position_ids=positions, **inputs):
            model.zero_grad(set_to_none=True)
            logits = model(ids, position_ids=position_ids, **inputs)
            logits.float().logsumexp(-1).sum().backward()
            return logits.detach(), [p.grad.clone() for p in model.parameters()]

        ref, ref_grads = run(attention_mask=document_mask(segments))
        # an unpacked batch: dense band mask / capped scores
        causal_ref, causal_grads = run(position_ids=None)
        for compiled in (False, True):
            if compiled:
                for block in model.layers:
                    block.compile(backend=ctx.compile_backend)
            for backend in backends:
                original = documents.document_backend  # what the decoder's Documents.of asks
                documents.document_backend = lambda device, _b=backend: _b
                # packed documents; then the unpacked batch (flex:
                # Documents.causal's block masks)
                try:
                    results = {
                        "": (run(segment_ids=segments), (ref, ref_grads)),
                        "/causal": (run(position_ids=None), (causal_ref, causal_grads)),
                    }
                finally:
                    documents.document_backend = original
                for kind, ((logits, grads), (want, want_grads)) in results.items():
                    err = (logits - want).abs().max().item()
                    gerr = max(
                        ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                        for g, r in zip(grads, want_grads, strict=True)
                    )
                    key = f"{name}/{backend}{kind}{'/compiled' if compiled else ''}"
                    fig[key] = {"logits": err, "grads_rel": gerr}
                    if err > ctx.fp32_tol or gerr > 1e-3:
                        bad.append(f"{key}: logits {err:.1e}, gradients {gerr:.1e} (relative)")
        torch.compiler.reset()
    if bad:
        raise AssertionError("packed documents differ from the dense mask: " + "; ".join(bad))
    return (
        f"{', '.join(backends)} = dense mask (logits, grads), packed and unpacked, eager and compiled, at {seq} "
        "tokens"
    ), fig
