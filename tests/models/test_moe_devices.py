"""The experts' grouped GEMMs against the CUDA kernel's rules, without a GPU.

torch's meta kernel of F.grouped_mm carries the checks of its CUDA kernel (bf16 operands; each operand row- or
column-major with every row stride a multiple of 16 bytes), and fake tensors run it. On fake tensors of the GPU
stand-in `lmforge plan` traces with (lmforge.parallel.fake), in bf16, with that device listed in
lmforge.models.moe.GROUPED_MM as CUDA would be, a mixture of experts' forward and backward (expert adapters
included) shows that every grouped GEMM lmforge asks for is one the CUDA kernel takes, and that a width the kernel
cannot take falls back to the loop over experts instead of failing. What the kernel computes is checked
on a GPU by scripts/gpu_check.py's `moe` check.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lmforge.models import ModelConfig
from lmforge.models import moe as moe_module
from lmforge.models.layers import ACTIVATIONS
from lmforge.models.lora_experts import LoRAExperts
from lmforge.models.moe import MoE
from lmforge.parallel.fake import TraceMode, trace_device

DEVICE, _ = trace_device("cuda")  # cuda where this torch has it, else the stand-in


def _meta_moe(hidden: int, inter: int, experts: int, k: int, ranks: dict[str, int] | None) -> MoE:
    """A MoE block (and its adapters, the experts then frozen) on the meta device, bf16."""
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=hidden, num_layers=1, num_heads=2,
                      intermediate_size=inter, moe_intermediate_size=inter, norm="rmsnorm", activation="silu",
                      gated_mlp=True, attention_bias=False, mlp_bias=False, num_experts=experts, experts_per_token=k)
    with torch.device("meta"):
        block = MoE(cfg, ACTIVATIONS["silu"]).to(torch.bfloat16).train()
        if ranks:
            block.experts = LoRAExperts(block.experts, ranks, {w: 2.0 * r for w, r in ranks.items()})
            block.experts.gate_up.requires_grad_(False)
            block.experts.down.requires_grad_(False)
    return block


def _forward_backward(block: MoE, tokens: int) -> torch.Tensor:
    """block's forward and backward on fake tensors of DEVICE (as lmforge plan traces a step); its output."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, TraceMode(DEVICE, fake):
        block.to_empty(device=DEVICE)
        x = torch.empty(tokens, block.router.in_features, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        out = block(x)
        out.float().sum().backward()
    return out


@pytest.fixture
def grouped_on_device(monkeypatch):
    """DEVICE treated as CUDA is: its bf16 experts through F.grouped_mm; the calls counted."""
    monkeypatch.setitem(moe_module.GROUPED_MM, DEVICE.type, (torch.bfloat16,))
    calls = []
    real = moe_module.F.grouped_mm

    def counted(a, b, **kw):
        calls.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
        return real(a, b, **kw)  # the meta kernel: raises where the CUDA kernel's checks fail

    monkeypatch.setattr(moe_module.F, "grouped_mm", counted)
    return calls


@pytest.mark.parametrize(("hidden", "inter", "experts", "k", "ranks"), [
    (256, 512, 8, 2, None),  # Mixtral-like
    (128, 64, 32, 8, None),  # Qwen3-MoE-like: many narrow experts
    (128, 64, 16, 4, {"gate_up": 16, "down": 16}),  # expert adapters whose rank rows are 32 bytes
])
def test_every_grouped_gemm_of_a_forward_and_backward_is_one_the_cuda_kernel_takes(
        grouped_on_device, monkeypatch, hidden, inter, experts, k, ranks):
    def no_loop(counts):
        raise AssertionError("the loop over experts ran where the grouped GEMM should")

    monkeypatch.setattr(moe_module, "_segments", no_loop)
    block = _meta_moe(hidden, inter, experts, k, ranks)
    out = _forward_backward(block, 512)
    assert out.shape == (512, hidden) and out.dtype == torch.bfloat16 and out.device == DEVICE
    trained = [p for p in block.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.shape == p.shape for p in trained)
    # Forward: gate_up and down (and each adapter's two through its rank); backward: the input and weight
    # gradients of each.
    gemms = 2 + 2 * len(ranks or {})
    assert len(grouped_on_device) >= 2 * gemms, grouped_on_device


def test_a_width_the_cuda_kernel_cannot_take_runs_the_loop_and_a_narrow_rank_only_its_own_gemms(grouped_on_device):
    _forward_backward(_meta_moe(hidden=100, inter=64, experts=4, k=2, ranks=None), 64)  # 200-byte rows
    assert grouped_on_device == []
    _forward_backward(_meta_moe(hidden=128, inter=64, experts=4, k=2, ranks={"down": 4}), 64)  # 8-byte rank rows
    assert grouped_on_device and all(4 not in shape[0][1:] + shape[2][1:] for shape in grouped_on_device)


def test_the_cpu_keeps_every_float_dtype_and_no_other_device_is_listed_before_a_gpu_check():
    assert moe_module.GROUPED_MM == {"cpu": (torch.float32, torch.bfloat16, torch.float16)}
