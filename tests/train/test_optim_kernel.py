"""AdamWSR's compiled CPU update (lmforge.train.optim_kernel) gives the eager update's bits, and
stands aside where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from lmforge.train import optim_kernel
from lmforge.train.optim import AdamWSR, correct_sqrt


def _params(seed: int = 0) -> list[dict]:
    """Two decay groups of bf16 tensors: matrices (one non-contiguous, one of 2M elements: the
    kernel's threads, and enough values that a rare 1-ulp difference in fp32 shows in bf16),
    vectors of odd lengths, a scalar, an empty shard; and one fp32 tensor, which the eager update
    takes."""
    gen = torch.Generator().manual_seed(seed)

    def bf16(*shape):
        return torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16())

    transposed = torch.nn.Parameter(
        torch.randn(64, 33, generator=gen).bfloat16().t().contiguous().t()
    )
    fp32 = torch.nn.Parameter(torch.randn(37, generator=gen))
    return [
        {"params": [bf16(64, 33), transposed, bf16(1000, 2001), fp32], "weight_decay": 0.1},
        {"params": [bf16(7), bf16(), bf16(0), bf16(1001)], "weight_decay": 0.0},
    ]


def _run(
    compiled: bool, steps: int = 3, threads: int = 1, resume_at: int | None = None, **kw
) -> list[torch.Tensor]:
    """Weights and moments after `steps` steps on the same gradients (optionally resumed from a
    state dict)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        groups = _params()
        params = [p for g in groups for p in g["params"]]
        gen = torch.Generator().manual_seed(1)
        grads = [
            [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)
        ]
        opt = AdamWSR(groups, lr=1e-2, eps=1e-6, seed=5, compiled=compiled, **kw)
        for i, step in enumerate(grads):
            # a new optimizer over copies of the weights, loaded from the state dict
            if i == resume_at:
                saved = opt.state_dict()
                copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
                it = iter(copies)
                groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
                params = copies
                opt = AdamWSR(groups, lr=1e-2, eps=1e-6, seed=5, compiled=compiled, **kw)
                opt.load_state_dict(saved)
            for p, g in zip(params, step, strict=True):
                p.grad = g
            opt.step()
        return [
            x.detach().clone()
            for p in params
            for x in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        ]
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stochastic_rounding", "betas"),
    [(True, (0.9, 0.95)), (False, (0.9, 0.95)), (True, (0.3, 0.99))],
)
def test_the_compiled_cpu_update_gives_the_eager_bits(stochastic_rounding, betas):
    """Weights and both moments equal the eager update bit for bit after three steps: stochastic
    rounding (the same noise at the same counters, across tensors and groups), round-to-nearest,
    a lerp weight >= 0.5 (torch's other formula), on one thread and on two (the kernel splits
    large tensors across threads)."""
    assert optim_kernel.cpu_kernel() is not None, "no C++ compiler for Inductor on this machine"
    eager = _run(compiled=False, stochastic_rounding=stochastic_rounding, betas=betas)
    for threads in (1, 2):
        compiled = _run(
            compiled=True, threads=threads, stochastic_rounding=stochastic_rounding, betas=betas
        )
        for a, b in zip(eager, compiled, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.equal(eager[0], _params()[0]["params"][0])  # and the weights did move


@pytest.mark.slow
def test_the_compiled_cpu_update_resumes_bit_exact():
    """The noise is a function of the saved state (seed, step, position): a run resumed from the
    optimizer's state dict at step 2 ends on the same bits as one that was not interrupted."""
    full = _run(compiled=True, steps=4)
    resumed = _run(compiled=True, steps=4, resume_at=2)
    assert all(torch.equal(a, b) for a, b in zip(full, resumed, strict=True))


def test_without_a_compiler_the_eager_update_runs_with_one_warning(monkeypatch, caplog):
    """Where the loop cannot be built (here: no compiler), AdamWSR warns once and updates
    eagerly, and small optimizers do not build it at all unless asked (compiled=None)."""
    built = []

    def no_compiler():
        built.append(1)
        return None, 0.01, "CppCompileError: no C++ compiler found"

    monkeypatch.setattr(optim_kernel, "build_kernel", no_compiler)
    optim_kernel.cpu_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            # 100k parameters: below KERNEL_MIN_PARAMS
            assert _run(compiled=None, steps=1) and not built
            eager = _run(compiled=False, steps=2)
            fallback = _run(compiled=True, steps=2)
        assert (
            built == [1]
            and caplog.text.count("could not be built (CppCompileError: no C++ compiler") == 1
        )
        assert all(torch.equal(a, b) for a, b in zip(eager, fallback, strict=True))
    finally:
        optim_kernel.cpu_kernel.cache_clear()


def test_the_square_root_is_correctly_rounded_as_in_the_compiled_update():
    """AdamW's denominator takes the IEEE square root (numpy's fp32 sqrt is the hardware's,
    correctly rounded) on every machine: torch's CPU sqrt is one ulp off for ~20% of inputs on
    MKL builds, which would make the eager update's bits differ from the compiled loop's (and
    from one torch build to another)."""
    np = pytest.importorskip("numpy")
    x = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) * torch.logspace(
        -12, 4, 1 << 20
    )
    want = torch.from_numpy(np.sqrt(x.numpy()))
    assert torch.equal(correct_sqrt(x, out=torch.empty_like(x)), want)
    assert torch.equal(
        correct_sqrt(x[:7], out=torch.empty(7), work=torch.empty(7, dtype=torch.float64)), want[:7]
    )


@pytest.mark.slow
def test_the_gpu_update_compiled_here_gives_the_eager_bits(monkeypatch):
    """On a GPU, AdamWSR's update from 4M parameters on is torch.compile of
    optim_kernel.torch_update (one Triton kernel per tensor). The same path, with the CPU listed
    as such a device, compiles to C++ here: weights and moments equal the eager update's bit for
    bit after three steps, with stochastic and nearest rounding and both of torch's lerp
    formulas; the fp32 tensor and the empty one go their own ways."""
    monkeypatch.setattr(optim_kernel, "COMPILED_DEVICES", ("cpu",))
    optim_kernel.compiled_update.cache_clear()
    try:
        for stochastic_rounding, betas in [
            (True, (0.9, 0.95)),
            (False, (0.9, 0.95)),
            (True, (0.3, 0.99)),
        ]:
            eager = _run(compiled=False, stochastic_rounding=stochastic_rounding, betas=betas)
            compiled = _run(compiled=True, stochastic_rounding=stochastic_rounding, betas=betas)
            for a, b in zip(eager, compiled, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
    finally:
        optim_kernel.compiled_update.cache_clear()


def test_a_gpu_takes_the_compiled_update_and_falls_back_once_when_it_fails(monkeypatch, caplog):
    """A CUDA tensor's step goes to torch.compile's update (from KERNEL_MIN_PARAMS parameters, or
    compiled=True), never below the threshold nor for lmforge plan's fake trace; when that
    compile fails (a Triton error), the step and every later one run the eager update, with one
    warning, giving its bits."""
    calls = []

    def compiled_update(device_type):
        def update(*args):
            calls.append(args[0].numel())
            raise RuntimeError("triton: PassManager::run failed\nlong log")

        return update

    monkeypatch.setattr(optim_kernel, "compiled_update", compiled_update)
    opt = AdamWSR(_params(), lr=1e-2, compiled=None)  # ~2.1M parameters: below the threshold
    assert opt._kernel(torch.device("cuda")) is None and opt._kernel(torch.device("mps")) is None
    opt.compiled = True
    assert opt._kernel(torch.device("cuda")) is not None
    opt.first_chunk_only = True
    assert opt._kernel(torch.device("cuda")) is None

    # the same path, run on this machine's tensors
    monkeypatch.setattr(optim_kernel, "COMPILED_DEVICES", ("cpu",))
    eager = _run(compiled=False)
    with caplog.at_level(logging.WARNING):
        fallback = _run(compiled=True)
    assert calls == [64 * 33]  # tried once, on the first bf16 tensor
    assert (
        caplog.text.count(
            "the compiled update failed on cpu (RuntimeError: triton: PassManager::run failed)"
        )
        == 1
    )
    assert all(torch.equal(a, b) for a, b in zip(eager, fallback, strict=True))


def test_without_triton_a_gpu_runs_the_eager_update_with_one_warning(monkeypatch, caplog):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    optim_kernel.compiled_update.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert (
                optim_kernel.compiled_update("cuda") is None
                and optim_kernel.compiled_update("cuda") is None
            )
        assert caplog.text.count("Triton is not installed") == 1
    finally:
        optim_kernel.compiled_update.cache_clear()


@pytest.mark.slow
def test_the_gpu_update_compiles_a_few_graphs_whatever_the_number_of_tensors(monkeypatch):
    """torch.compile of the update is dynamic in the tensor's length: a model's hundreds of
    tensors share one graph (plus one for single-element tensors, and the first call's). Each
    row's noise keys were a view into one table at its own offset, and the compiler guarded on
    offsets that equalled another input's size: 5 graphs here, each a compile (seconds on a GPU),
    and nothing bounded them below dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(optim_kernel, "COMPILED_DEVICES", ("cpu",))
    optim_kernel.compiled_update.cache_clear()
    torch._dynamo.reset()
    try:
        gen = torch.Generator().manual_seed(0)
        shapes = [
            (64, 33),
            (1000,),
            (7,),
            (1,),
            (300, 20),
            (5, 5),
            (128,),
            (129,),
            (4096,),
            (17, 3),
            (999,),
            (2,),
            *((n,) for n in range(3, 43)),
        ]
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16()) for shape in shapes
        ]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt = AdamWSR(
            [{"params": params[:6]}, {"params": params[6:], "weight_decay": 0.0}],
            lr=1e-3,
            compiled=True,
        )
        before = counters["stats"]["unique_graphs"]
        for _ in range(2):
            opt.step()
        assert not opt._compile_failed and counters["stats"]["unique_graphs"] - before <= 3
    finally:
        optim_kernel.compiled_update.cache_clear()
