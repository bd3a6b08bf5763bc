"""The mixture-of-experts check: the experts' GEMMs through torch's grouped GEMM on the device,
against the loop."""

from __future__ import annotations

import statistics
import time

import torch

from gpu_checks.base import Context, check

# (name, hidden, expert width, experts, experts per token); --quick: a tenth of the tokens, narrower
# experts
SHAPES = [("mixtral-like", 1024, 2048, 8, 2), ("qwen3-moe-like", 1024, 512, 64, 8)]


def _block(hidden: int, width: int, experts: int, k: int, lora: bool):
    from lmforge.models import ModelConfig
    from lmforge.models.layers import ACTIVATIONS
    from lmforge.models.lora_experts import LoRAExperts
    from lmforge.models.moe import MoE

    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=64,
        hidden_size=hidden,
        num_layers=1,
        num_heads=8,
        intermediate_size=width,
        moe_intermediate_size=width,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        attention_bias=False,
        mlp_bias=False,
        num_experts=experts,
        experts_per_token=k,
    )
    block = MoE(cfg, ACTIVATIONS["silu"]).train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if lora:  # expert adapters, B non-zero so that their path computes something
        block.experts = LoRAExperts(
            block.experts, {"gate_up": 16, "down": 16}, {"gate_up": 32.0, "down": 32.0}
        )
        with torch.no_grad():
            for f in [*block.experts.lora_A.values(), *block.experts.lora_B.values()]:
                f.copy_(torch.randn(f.shape, generator=gen) * 0.02)
    return block


def _run(block, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, then the gradients of the input and of every parameter."""
    x = x.detach().requires_grad_()
    out = block(x)
    params = [p for p in block.parameters() if p.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, [x, *params], grad)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        (a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max().clamp_min(1e-30)
    ).item()


@check
def check_moe(ctx: Context) -> tuple[str, dict]:
    """A MoE layer's forward and backward (with and without expert adapters) on the device: in
    fp32 with its experts looped, against an fp32 CPU reference; in its training dtype (bf16;
    fp32 on the CPU) through torch's grouped GEMM (F.grouped_mm) against the loop in that dtype,
    and the time of each. Before lmforge.models.moe.GROUPED_MM names a device, this check must
    pass on it.

    bf16 is not compared with the fp32 reference: the router's top-k in bf16 picks another expert
    wherever two scores are within bf16's rounding (on the H200, 0.3-0.7 max relative error, the
    same for loop and grouped), so only the two ways in one dtype (one routing) show what the
    grouped GEMM changes."""
    from lmforge.models import moe

    dev = ctx.device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    # another device's fp32 kernels sum in other orders
    fp32_tol = 1e-4 if dev.type == "cpu" else 1e-3
    tokens = 512 if ctx.quick else 8192
    fig, bad = {}, []
    listed = dict(moe.GROUPED_MM)
    try:
        for name, hidden, width, experts, k in SHAPES:
            if ctx.quick:
                hidden, width = hidden // 8, width // 8
            for lora in (False, True):
                key = f"{name}{' +lora' if lora else ''}"
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(tokens, hidden, generator=gen)
                grad = torch.randn(tokens, hidden, generator=gen)
                moe.GROUPED_MM.clear()
                ref = _run(_block(hidden, width, experts, k, lora), x, grad)  # fp32 on the CPU
                fp32 = _run(
                    _block(hidden, width, experts, k, lora).to(dev), x.to(dev), grad.to(dev)
                )
                block = _block(hidden, width, experts, k, lora).to(dev, dtype)
                xd, gd = x.to(dev, dtype), grad.to(dev, dtype)
                results, times = {}, {}
                for way in ("loop", "grouped"):
                    moe.GROUPED_MM.clear()
                    if way == "grouped":
                        moe.GROUPED_MM.update({**listed, dev.type: (dtype,)})
                    results[way] = _run(block, xd, gd)
                    spent = []
                    for _ in range(3 if ctx.quick else 10):
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        t0 = time.perf_counter()
                        _run(block, xd, gd)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        spent.append(time.perf_counter() - t0)
                    times[way] = statistics.median(spent) * 1e3
                errors = {
                    "fp32 loop vs fp32 CPU": max(
                        _rel(a, b) for a, b in zip(fp32, ref, strict=True)
                    ),
                    "grouped vs loop": max(
                        _rel(a, b) for a, b in zip(results["grouped"], results["loop"], strict=True)
                    ),
                }
                fig[key] = {
                    "loop_ms": times["loop"],
                    "grouped_ms": times["grouped"],
                    "rel_err": errors,
                }
                for what, err, limit in zip(errors, errors.values(), (fp32_tol, tol)):
                    if err > limit:
                        bad.append(f"{key} {what}: {err:.1e} (tolerance {limit:g})")
    finally:
        moe.GROUPED_MM.clear()
        moe.GROUPED_MM.update(listed)
    if bad:
        raise AssertionError("MoE experts differ: " + "; ".join(bad))
    speed = ", ".join(f"{k} {v['loop_ms'] / v['grouped_ms']:.2f}x" for k, v in fig.items())
    return (
        f"fp32 loop = fp32 CPU reference, {str(dtype).removeprefix('torch.')} grouped = loop (output, gradients) "
        f"at {tokens} tokens; grouped vs loop: {speed}"
    ), fig
