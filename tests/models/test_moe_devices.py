"""The experts' grouped GEMMs against the CUDA kernel's rules, without a GPU.

torch's meta kernel of F.grouped_mm carries the checks of its CUDA kernel (bf16 operands; each
operand row- or column-major with every row stride a multiple of 16 bytes), and fake tensors run it.
On fake tensors of the GPU stand-in `lmforge plan` traces with (lmforge.parallel.fake), in bf16,
with that device listed in lmforge.models.moe.GROUPED_MM as CUDA would be, a mixture of experts'
forward and backward (expert adapters included) shows that every grouped GEMM lmforge asks for is
one the CUDA kernel takes, and that a width the kernel cannot take falls back to the loop over
experts instead of failing. What the kernel computes is checked on a GPU by scripts/gpu_check.py's
`moe` check.

The stand-in is a backend registered for the whole process, after which torch reports an
accelerator: each case runs in a process of its own (spawned), as lmforge plan's traces do.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from lmforge.models import moe as moe_module


def _grouped_calls(
    hidden: int, inter: int, experts: int, k: int, ranks: dict[str, int] | None, forbid_loop: bool
) -> dict:
    """In a child process: a MoE block (adapters on its experts if `ranks`, the experts then
    frozen) forward and backward on fake bf16 tensors of the stand-in GPU listed in GROUPED_MM;
    the grouped GEMMs it asked for (their operands' shapes), and what came out. `forbid_loop`:
    the loop over experts raises."""
    from lmforge.parallel.fake import trace_device
    from lmforge.train.plan_tasks import as_traced

    device, _ = trace_device("cuda")  # the stand-in
    moe_module.GROUPED_MM[device.type] = (torch.bfloat16,)
    calls = []
    real = moe_module.F.grouped_mm

    def counted(a, b, **kw):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kw)  # the meta kernel: raises where the CUDA kernel's checks fail

    def no_loop(counts):
        raise AssertionError("the loop over experts ran where the grouped GEMM should")

    segments = moe_module._segments
    moe_module.F.grouped_mm = counted
    if forbid_loop:
        moe_module._segments = no_loop
    try:
        # fake routing has no values to count: even, as lmforge plan traces it
        with as_traced(None):
            return _forward_backward(device, hidden, inter, experts, k, ranks, calls)
    finally:  # the pool's process runs the next case
        moe_module.F.grouped_mm, moe_module._segments = real, segments


def _forward_backward(device, hidden, inter, experts, k, ranks, calls) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmforge.models import ModelConfig
    from lmforge.models.layers import ACTIVATIONS
    from lmforge.models.lora_experts import LoRAExperts
    from lmforge.models.moe import MoE
    from lmforge.parallel.fake import TraceMode

    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=64,
        hidden_size=hidden,
        num_layers=1,
        num_heads=2,
        intermediate_size=inter,
        moe_intermediate_size=inter,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        attention_bias=False,
        mlp_bias=False,
        num_experts=experts,
        experts_per_token=k,
    )
    with torch.device("meta"):
        block = MoE(cfg, ACTIVATIONS["silu"]).to(torch.bfloat16).train()
        if ranks:
            block.experts = LoRAExperts(
                block.experts, ranks, {w: 2.0 * r for w, r in ranks.items()}
            )
            block.experts.gate_up.requires_grad_(False)
            block.experts.down.requires_grad_(False)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, TraceMode(device, fake):
        block.to_empty(device=device)
        x = torch.empty(512, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = block(x)
        out.float().sum().backward()
    trained = [p for p in block.parameters() if p.requires_grad]
    return {
        "calls": calls,
        "out": (tuple(out.shape), str(out.dtype), out.device == device),
        "grads": all(p.grad is not None and p.grad.shape == p.shape for p in trained),
    }


@pytest.fixture(scope="module")
def child():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda *args: pool.submit(_grouped_calls, *args).result(timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hidden", "inter", "experts", "k", "ranks"),
    [
        (256, 512, 8, 2, None),  # Mixtral-like
        (128, 64, 32, 8, None),  # Qwen3-MoE-like: many narrow experts
        (
            128,
            64,
            16,
            4,
            {"gate_up": 16, "down": 16},
        ),  # expert adapters whose rank rows are 32 bytes
    ],
)
def test_every_grouped_gemm_of_a_forward_and_backward_is_one_the_cuda_kernel_takes(
    child, hidden, inter, experts, k, ranks
):
    got = child(hidden, inter, experts, k, ranks, True)
    assert got["out"] == ((512, hidden), "torch.bfloat16", True) and got["grads"]
    # Forward: gate_up and down (and each adapter's two through its rank); backward: the input and
    # weight gradients of each.
    gemms = 2 + 2 * len(ranks or {})
    assert len(got["calls"]) >= 2 * gemms, got["calls"]


@pytest.mark.slow
def test_a_width_the_cuda_kernel_cannot_take_runs_the_loop_and_a_narrow_rank_only_its_own_gemms(
    child,
):
    assert child(100, 64, 4, 2, None, False)["calls"] == []  # 200-byte rows: not a multiple of 16
    calls = child(128, 64, 4, 2, {"down": 4}, False)["calls"]  # 8-byte rank rows: their GEMMs loop
    assert calls and all(4 not in a[1:] + b[1:] for a, b in calls)


def test_the_cpu_keeps_every_float_dtype_and_cuda_bf16_where_the_gpu_check_passed():
    """CUDA joined after scripts/gpu_check.py's moe check passed on an H200 (capability 9.0):
    bf16 there, the loop on older GPUs and in other dtypes."""
    assert moe_module.GROUPED_MM == {
        "cpu": (torch.float32, torch.bfloat16, torch.float16),
        "cuda": (torch.bfloat16,),
    }
    assert moe_module.GROUPED_MM_CUDA_CAPABILITY == (9, 0)


@pytest.mark.parametrize("capability,grouped", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_cuda_experts_go_grouped_from_the_capability_the_gpu_check_passed_on(
    capability, grouped, monkeypatch
):
    """A100s (8.0) keep the loop (the check has not run on one); Hopper and later take the
    grouped GEMM in bf16. CPU: fake CUDA tensors, the capability faked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(moe_module, "_capability", lambda device: capability)
    with FakeTensorMode(allow_non_fake_inputs=True):
        rows = torch.empty(12, 64, dtype=torch.bfloat16, device="cuda")
        offsets = moe_module._grouped_offsets(rows, [5, 0, 7], 64, 128)
        fp32 = moe_module._grouped_offsets(rows.float(), [5, 0, 7], 64, 128)
    assert (offsets is not None) == grouped
    assert fp32 is None
