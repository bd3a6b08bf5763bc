"""AdamWSR's multi-tensor Triton update (lmforge.train.optim_triton): the eager update's bits in
Triton's interpreter on the CPU, one launch per group, 16-byte accesses and IEEE arithmetic in
the code compiled for a Hopper GPU, and the per-tensor path after a failure. Skipped without
Triton (`pip install triton`: a CPU machine runs the interpreter)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip(
    "triton",
    reason="Triton is not installed (pip install triton): the multi-tensor kernel's tests "
    "run in its interpreter on the CPU",
)

from lmforge.train import optim_kernel, optim_triton  # noqa: E402
from tests.train import test_optim_kernel  # noqa: E402
from tests.train.test_optim_kernel import _params as _kernel_params  # noqa: E402
from tests.train.test_optim_kernel import _run  # noqa: E402


def _params(seed: int = 0) -> list[dict]:
    """test_optim_kernel's groups with a 200 x 301 matrix for its 1000 x 2001 one (the C++ loop's
    threads need that size; Triton's interpreter runs a block at a time in numpy): 59 blocks for
    two slots to stride over."""
    groups = _kernel_params(seed)
    groups[0]["params"][2] = torch.nn.Parameter(
        torch.randn(200, 301, generator=torch.Generator().manual_seed(seed + 7)).bfloat16()
    )
    return groups


@pytest.fixture
def multi_tensor_on_cpu(monkeypatch):
    """The GPU's path on this machine's tensors: the kernel runs in Triton's interpreter; the
    per-tensor kernel refuses to run, so every bf16 row must go through the multi-tensor one;
    launches are counted."""
    monkeypatch.setattr(optim_triton, "usable", lambda device: True)
    monkeypatch.setattr(optim_triton, "MAX_SLOTS", 2)  # slots striding over a tensor's 59 blocks
    monkeypatch.setattr(test_optim_kernel, "_params", _params)

    def no_per_tensor_kernel():
        def refuse(*args):
            raise AssertionError("a bf16 row went to the per-tensor kernel")

        return refuse

    monkeypatch.setattr(optim_kernel, "cpu_kernel", no_per_tensor_kernel)
    launches = []
    real = optim_triton.update_rows
    monkeypatch.setattr(
        optim_triton, "update_rows", lambda rows, *a: launches.append(len(rows)) or real(rows, *a)
    )
    return launches


@pytest.mark.parametrize(
    ("stochastic_rounding", "betas"),
    [(True, (0.9, 0.95)), (False, (0.9, 0.95)), (True, (0.3, 0.99))],
)
def test_the_multi_tensor_kernel_gives_the_eager_bits(
    multi_tensor_on_cpu, stochastic_rounding, betas
):
    """Weights and both moments after three steps equal the eager update's bit for bit: the same
    noise at the same counters across tensors and groups, round-to-nearest, both of torch's lerp
    formulas; aligned rows (16-byte loads) and others (lengths 7 and 1001, a scalar) in their own
    launches, the empty and fp32 tensors their own way; two slots striding over a 60,200-element
    tensor's 59 blocks. One update_rows call per group and step."""
    eager = _run(compiled=False, stochastic_rounding=stochastic_rounding, betas=betas)
    multi = _run(compiled=True, stochastic_rounding=stochastic_rounding, betas=betas)
    for a, b in zip(eager, multi, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # each group's three non-empty bf16 tensors, three steps
    assert multi_tensor_on_cpu == [3, 3] * 3


def test_the_multi_tensor_kernel_resumes_bit_exact(multi_tensor_on_cpu):
    full = _run(compiled=True, steps=3)
    resumed = _run(compiled=True, steps=3, resume_at=2)
    assert all(torch.equal(a, b) for a, b in zip(full, resumed, strict=True))


def test_a_failing_launch_leaves_the_per_tensor_update_with_one_warning(monkeypatch, caplog):
    """A Triton error (compiling or launching) is logged once; that step and every later one take
    the per-tensor compiled update: the same results as an optimizer that never tried."""
    monkeypatch.setattr(optim_triton, "usable", lambda device: True)
    tried = []

    def failing(rows, take, *args):
        tried.append(len(take))
        raise RuntimeError("PTX .version 9.1 does not support .target sm_120\nlong log")

    monkeypatch.setattr(optim_triton, "_launch", failing)

    # the eager update in torch ops: a per-tensor kernel with known results
    def per_tensor_kernel():
        return lambda w, g, m, v, s, k, n, sr: optim_kernel.torch_update(w, g, m, v, s, k, bool(sr))

    monkeypatch.setattr(optim_kernel, "cpu_kernel", per_tensor_kernel)
    never = _run(compiled=True, multi_tensor=False)
    with caplog.at_level(logging.WARNING):
        fallback = _run(compiled=True)
    # the first launch (the first group's three rows, all aligned) failed: none stepped twice
    assert tried == [3]
    assert (
        caplog.text.count(
            "the multi-tensor Triton update failed on cpu (RuntimeError: PTX .version 9.1"
        )
        == 1
    )
    assert all(torch.equal(a, b) for a, b in zip(never, fallback, strict=True))


def test_it_is_off_without_a_gpu_or_when_the_environment_says_so(monkeypatch):
    assert not optim_triton.usable(torch.device("cpu")) and not optim_triton.usable(
        torch.device("mps")
    )
    # Triton imports here; no GPU is needed to say so
    assert optim_triton.usable(torch.device("cuda"))
    monkeypatch.setenv("LMFORGE_ADAMWSR_MULTI_TENSOR", "0")
    assert not optim_triton.usable(torch.device("cuda"))


@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_the_hopper_code_has_16_byte_accesses_and_ieee_arithmetic(stochastic_rounding):
    """Compiled for sm_90 (Triton's own ptxas; no GPU needed): aligned rows load each of w, g, m,
    v and store each of w, m, v as 16-byte vectors (8 values a thread), the others element by
    element; the square root and both divisions are IEEE (`.rn`: Triton's defaults are
    approximate) and the only fused multiply-adds are the two written (no contraction): the
    arithmetic of the CPU loop, whose bits the tests above compare."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "ptrs": "*i64",
        "sizes": "*i64",
        "keys": "*i32",
        "s": "*fp32",
        **dict.fromkeys(("C1", "C2", "SR", "ALIGNED", "BLOCK"), "constexpr"),
    }
    ptx = {}
    for aligned in (True, False):
        source = ASTSource(
            fn=optim_triton.kernel(False),
            signature=signature,
            constexprs={
                "C1": optim_kernel.HASH_C1 & 0xFFFFFFFF,
                "C2": optim_kernel.HASH_C2 & 0xFFFFFFFF,
                "SR": stochastic_rounding,
                "ALIGNED": aligned,
                "BLOCK": optim_triton.BLOCK,
            },
        )
        ptx[aligned] = triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4, "enable_fp_fusion": False},
        ).asm["ptx"]
    per_thread = optim_triton.BLOCK // (4 * 32)  # values a thread holds: 8 bf16, 16 bytes
    assert ptx[True].count("ld.global.v4.b32") == 4 and ptx[True].count("st.global.v4.b32") == 3
    assert "ld.global.v4" not in ptx[False] and ptx[False].count("st.global.b16") == 3 * per_thread
    for code in ptx.values():
        assert (
            code.count("sqrt.rn.f32") == per_thread and code.count("div.rn.f32") == 2 * per_thread
        )
        assert code.count("fma.rn.f32") == 2 * per_thread
        assert not any(op in code for op in ("sqrt.approx", "div.full", "div.approx", "rcp.approx"))


def _mixed_group_run(steps: int = 3, **kw) -> list[torch.Tensor]:
    """One group holding 16-byte-aligned tensors and others (two launches a step): weights and
    moments after `steps` steps."""
    from lmforge.train.optim import AdamWSR

    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (13,), (1000, 24)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16()) for shape in shapes]
    opt = AdamWSR(params, lr=1e-2, eps=1e-6, seed=5, compiled=True, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    return [
        x.detach().clone()
        for p in params
        for x in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
    ]


@pytest.mark.slow
def test_a_launch_failing_after_another_leaves_the_rows_it_stepped_alone(monkeypatch, caplog):
    """In a group of aligned and unaligned tensors the aligned rows' launch runs and the others'
    fails: the rows it stepped are not stepped again by the per-tensor update that takes the rest
    (and every later step): the results are the per-tensor update's bits (the C++ loop's, which
    the kernel gives too), no row updated twice."""
    assert optim_kernel.cpu_kernel() is not None, "no C++ compiler for Inductor on this machine"
    per_tensor = _mixed_group_run()  # on the CPU: the C++ loop, per tensor
    monkeypatch.setattr(optim_triton, "usable", lambda device: True)
    real, launches = optim_triton._launch, []

    def unaligned_fails(rows, take, scalars, keys, sr, aligned, *args):
        launches.append((len(take), aligned))
        if not aligned:
            raise RuntimeError("out of resources: shared memory")
        real(rows, take, scalars, keys, sr, aligned, *args)

    monkeypatch.setattr(optim_triton, "_launch", unaligned_fails)
    with caplog.at_level(logging.WARNING):
        partly = _mixed_group_run()
    # the first step's two launches; the per-tensor update from then on
    assert launches == [(2, True), (1, False)]
    assert (
        caplog.text.count(
            "the multi-tensor Triton update failed on cpu (RuntimeError: out of resources"
        )
        == 1
    )
    assert all(torch.equal(a, b) for a, b in zip(per_tensor, partly, strict=True))
