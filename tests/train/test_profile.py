"""lmforge.train.profile: every op's self time lands in exactly one category, by what it is part
of."""

from __future__ import annotations

import pytest
import torch

from lmforge.models import build
from lmforge.train.profile import OP_CATEGORIES, categorize, profile_step, profile_table
from lmforge.train.tasks import get_task


def test_a_step_is_split_into_categories_that_add_up():
    model = build("tiny-neox", seed=0)
    # per-tensor ops: mul_, lerp_ ...
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, 1000, (2, 32))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}

    def step():
        loss, count, _ = get_task("pretrain").loss(model, batch)
        (loss / count).backward()
        opt.step()
        opt.zero_grad()

    step()
    with torch.profiler.profile() as prof:
        step()
    parts = categorize(prof.events())
    gemms, _ = OP_CATEGORIES[0]
    loss_part, _ = OP_CATEGORIES[2]
    assert parts[gemms] > 0 and parts[loss_part] > 0 and parts["optimizer step"] > 0
    # The optimizer's elementwise ops count as the optimizer, not as "other ops".
    lerp = (
        sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith("aten::lerp_")) / 1e6
    )
    assert 0 < lerp < parts["optimizer step"]
    # Nothing is counted twice or dropped: the categories add up to the events' total self time.
    total = sum(e.self_cpu_time_total for e in prof.events()) / 1e6
    assert sum(parts.values()) == pytest.approx(total, rel=1e-9)
    table = profile_table({"a": parts, "b": profile_step(step)})
    assert "| **step (profiled)** |" in table and gemms in table


def _event(id, name, parent=None, device=False, span=(0.0, 0.0), linked=0, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(
        id=id,
        name=name,
        cpu_parent=parent,
        linked_correlation_id=linked,
        device_type=DeviceType.CUDA if device else DeviceType.CPU,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(start=span[0], end=span[1]),
    )


def test_device_kernels_go_to_their_launching_op_or_else_their_name_and_idle_is_the_step_less_their_union():
    from lmforge.train.profile import COMMUNICATION, OTHER, device_profile_table, summarize_device

    gemm, attention, loss, casts, fills = (OP_CATEGORIES[i][0] for i in range(5))
    opt = _event(1, "Optimizer.step#AdamWSR.step")
    graph = _event(4, "CompiledFunction")
    cpu = [
        opt,
        _event(2, "triton_poi_fused_mul_sub_0", opt),
        _event(3, "aten::mm"),
        graph,
        _event(5, "triton_red_fused__log_softmax_1", graph),
        _event(6, "triton_poi_fused__to_copy_2", graph),
        _event(7, "nccl:all_reduce"),
        _event(8, "aten::add_"),
        _event(9, "aten::_scaled_dot_product_flash_attention"),
        _event(10, "aten::mm", opt),
    ]
    kernels = [  # (name, launching op's id, start us, end us)
        # a compiled optimizer's kernel: the optimizer, not "fused"
        ("triton_poi_fused_mul_sub_0", 2, 0, 100),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", 3, 100, 400),
        ("triton_red_fused__log_softmax_1", 5, 400, 450),
        ("triton_poi_fused__to_copy_2", 6, 450, 470),
        # on its own stream, overlapping the cast
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7, 460, 560),
        ("Memset (Device)", 0, 600, 601),  # launched by no op the profiler saw: by its name
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >",
            8,
            601,
            611,
        ),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", 9, 700, 800),
        # a GEMM in the optimizer
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 10, 800, 810),
    ]
    events = cpu + [
        _event(100 + i, n, device=True, span=(a, b), linked=link)
        for i, (n, link, a, b) in enumerate(kernels)
    ]
    events.append(
        _event(200, "Optimizer.step#AdamWSR.step", device=True, span=(0, 810), annotation=True)
    )
    p = summarize_device(events, wall=1e-3)
    expected = {
        "optimizer step": 110,
        gemm: 300,
        loss: 50,
        casts: 20,
        COMMUNICATION: 100,
        fills: 1,
        OTHER: 10,
        attention: 100,
    }
    assert p.categories == pytest.approx({k: v / 1e6 for k, v in expected.items()})
    # the device-side mirror of a record_function range is not a kernel
    assert p.kernels == len(kernels)
    # Union in time: 0-560 (the overlap counted once), 600-611, 700-810.
    assert p.busy == pytest.approx((560 + 11 + 110) / 1e6)
    assert [t[0] for t in p.top[:2]] == [kernels[1][0], kernels[0][0]]
    assert len(p.top) == 8 and "Memset (Device)" not in [t[0] for t in p.top]  # the 8 longest of 9
    every = summarize_device(events, wall=1e-3, top=100).top
    assert sum(s for _, _, s in every) == pytest.approx(sum(p.categories.values()))
    table = device_profile_table({"a": p}, gemm_flops=3e11)
    idle = next(line for line in table.splitlines() if "device idle" in line)
    assert "| 0.3 | 32% |" in idle  # 1.0 ms step, 0.681 ms busy
    # 3e11 / 300 us
    assert "| 1,000 | " in next(line for line in table.splitlines() if "GEMM kernels' rate" in line)


def test_optimizer_kernels_are_known_by_name_where_no_op_launched_them():
    """A Triton kernel launched by hand (AdamWSR's multi-tensor update) has no aten op to say
    what it is: its name does, as torch's fused AdamW's multi_tensor_apply does."""
    from lmforge.train.profile import kernel_category

    assert kernel_category("adamwsr_multi_tensor") == "optimizer step"
    assert (
        kernel_category(
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor"
            "<float, 4, ADAM_MODE::ADAMW, false> >"
        )
        == "optimizer step"
    )


def test_a_device_profile_on_the_cpu_has_the_step_and_no_kernels():
    from lmforge.train.profile import device_profile_table, profile_device_step

    calls = []
    p = profile_device_step(
        lambda: calls.append(torch.ones(64, 64) @ torch.ones(64, 64)), torch.device("cpu")
    )
    assert len(calls) == 2 and p.wall > 0 and p.kernels == 0 and p.busy == 0 and not p.categories
    assert "none recorded" in device_profile_table({"cpu": p})
