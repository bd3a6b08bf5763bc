"""`lmforge compile` fills a persistent cache that the following run loads instead of compiling."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun
from tests.train.conftest import run_config


@pytest.mark.slow
def test_compile_step_then_run_step_hits_the_cache(tiny_corpus, tmp_path):
    args = [
        "model.preset=tiny-neox",
        f"data.paths=[{tiny_corpus}]",
        "data.seq_length=32",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=2",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "optim.warmup_steps=20",
        f"run_dir={tmp_path / 'run'}",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "compile", os.devnull, *args],
        capture_output=True,
        # same environment (threads) as this process: part
        # of the key
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # The warmup (20 steps) is the planned run's (1000 steps), not the 2 throwaway steps': nothing
    # to warn of.
    assert "optim.warmup_steps" not in r.stderr
    cache = tmp_path / "run" / "compile_cache"
    assert any(cache.rglob("*")) and not (tmp_path / "run" / ".compile-job").exists()

    from torch._dynamo.utils import counters

    counters.clear()
    # nothing compiled in this process: every graph must come from the disk cache
    torch._dynamo.reset()
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.compile=true",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
    )
    Trainer(cfg).fit()
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0


MODEL_PARALLEL = [
    "model.preset=tiny-neox",
    "data.seq_length=32",
    "trainer.max_steps=3",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "trainer.val_check_interval=3",
    "trainer.val_batches=1",
    "trainer.precision=fp32",
    "optim.lr=3e-3",
    "trainer.progress_bar=false",
    "cost.peak_flops=1e11",
]


def _curve(run) -> list[tuple]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(row["loss"], row["grad_norm"], row.get("val_loss")) for row in rows]


@pytest.fixture(scope="module")
def eager_one_process(tiny_corpus, tmp_path_factory):
    """The eager reference of the layouts below: one process at one thread (as each of their
    ranks runs), the same global batch. Every layout trains like one process to fp32 rounding
    (tests/train/test_parallel_training.py), so one eager run stands for each layout's own."""
    from lmforge.train.config import load_run_config

    run = tmp_path_factory.mktemp("compile") / "eager"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(
            load_run_config(
                None, [*MODEL_PARALLEL, f"data.paths=[{tiny_corpus}]", f"run_dir={run}"]
            )
        ).fit()
    finally:
        torch.set_num_threads(threads)
    return _curve(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.pipeline=2",),
        ("parallel.tensor=2",),
        ("parallel.tensor=2", "parallel.sequence_parallel=false"),
    ],
    ids=["pipeline2", "tensor2-sp", "tensor2"],
)
def test_compiled_blocks_under_model_parallelism_train_like_eager(
    layout, tiny_corpus, tmp_path, eager_one_process
):
    """Two pipeline or tensor-parallel ranks, each compiling the blocks it holds once laid out:
    the loss and gradient norm of every step equal the eager run's to fp32 rounding (Inductor
    fuses the elementwise work, so not bit for bit). Under tensor parallelism the blocks are
    traced with their DTensor plans; the embedding's gradient crosses into the first compiled
    block (it was lost while torch's async embedding reduce fed it: VocabParallelEmbedding)."""
    run = tmp_path / "compiled"
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            "pretrain",
            os.devnull,
            *MODEL_PARALLEL,
            f"data.paths=[{tiny_corpus}]",
            *layout,
            "trainer.compile=true",
            f"run_dir={run}",
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert any((run / "compile_cache").rglob("*.py"))  # Inductor's kernels: it compiled
    compiled = _curve(run)
    assert len(compiled) == len(eager_one_process) == 3
    for (le, ge, ve), (lc, gc, vc) in zip(eager_one_process, compiled, strict=True):
        assert lc == pytest.approx(le, rel=1e-5) and gc == pytest.approx(ge, rel=1e-4)
        assert (ve is None) == (vc is None) and (ve is None or vc == pytest.approx(ve, rel=1e-5))


@pytest.mark.slow
def test_a_compiled_mixture_of_experts_trains_like_eager(tiny_corpus, tmp_path):
    """trainer.compile on a MoE model: the blocks compile around the experts (their row counts
    are read on the host and torch's fake grouped_mm accepts bf16 only, so tracing them failed
    even in one process), and the loss, gradient norm and load-balancing loss of every step equal
    the eager run's."""
    import json

    from tests.train.conftest import run_args

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    curves = {}
    for mode in ("false", "true"):
        run = tmp_path / f"compile-{mode}"
        args = run_args(
            tiny_corpus,
            run,
            "model.preset=tiny-qwen3-moe",
            "model.router_aux_loss_coef=0.5",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            f"trainer.compile={mode}",
        )
        r = subprocess.run(
            [sys.executable, "-m", "lmforge.cli", "pretrain", os.devnull, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        curves[mode] = [(row["loss"], row["grad_norm"], row["aux_loss"]) for row in rows]
    # Inductor's kernels: it compiled
    assert any((tmp_path / "compile-true" / "compile_cache").rglob("*.py"))
    assert len(curves["true"]) == len(curves["false"]) == 3
    for eager, compiled in zip(curves["false"], curves["true"], strict=True):
        assert compiled == pytest.approx(eager, rel=1e-5)


FUSION_KEY = "cpp.max_horizontal_fusion_size"


@contextlib.contextmanager
def fusion_limit_restored():
    """Inductor's C++ config, its horizontal fusion limit put back on exit by torch's own
    `config.patch` (parallelize sets it for the process). Not pytest's monkeypatch: where that
    restores from the proxy's instance `__dict__` (pytest 9.1+) it deletes the key on undo, and
    torch then hides a deleted key."""
    from torch._inductor import config

    if not hasattr(config.cpp, FUSION_KEY.split(".")[1]):
        pytest.skip(f"this torch's Inductor has no {FUSION_KEY}")
    with config.patch({FUSION_KEY: config.cpp.max_horizontal_fusion_size}):
        yield config.cpp


@pytest.fixture
def inductor_fusion():
    with fusion_limit_restored() as cpp:
        yield cpp


def test_the_fusion_limit_reads_back_after_each_restore():
    """Two tests in a row that set the limit both find it: each restore puts back the value and
    leaves the key."""
    from torch._inductor import config

    default = config.cpp.max_horizontal_fusion_size
    for _ in range(2):
        with fusion_limit_restored() as cpp:
            cpp.max_horizontal_fusion_size = 1
        assert hasattr(config.cpp, "max_horizontal_fusion_size")
        assert config.cpp.max_horizontal_fusion_size == default


def test_the_inductor_workaround_is_a_no_op_where_torch_lacks_the_key():
    """On a torch whose Inductor has no C++ horizontal fusion limit, compiling in bf16 on the CPU
    sets nothing and raises nothing (torch hides a deleted key: hasattr is False, as on a torch
    without it)."""
    from torch._inductor import config

    from lmforge.models import build
    from lmforge.parallel.compose import work_around_inductor

    model = build("tiny-neox", device="meta", dtype=torch.bfloat16)
    default = config.cpp.max_horizontal_fusion_size
    del config.cpp.max_horizontal_fusion_size
    try:
        assert not hasattr(config.cpp, "max_horizontal_fusion_size")
        assert work_around_inductor(model, torch.device("cpu")) is False
    finally:
        config.cpp.max_horizontal_fusion_size = default  # a set unhides it


@pytest.mark.slow
def test_neox_blocks_compile_and_train_in_bf16_on_the_cpu(inductor_fusion):
    """bf16 weights (trainer.precision=bf16 / bf16-sr) and compiled blocks on the CPU: a NeoX
    step's gradients equal eager bf16's. torch 2.13's C++ code generator failed to build the
    backward (g++: "conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'") where one kernel
    stored the one column sum that is the gradient of both of NeoX's residual biases (attention
    and MLP output) twice; parallelize keeps those sums in kernels of their own."""
    from lmforge.models import build
    from lmforge.parallel import ParallelConfig
    from lmforge.parallel.compose import parallelize

    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    eager, compiled = (build("tiny-neox", dtype=torch.bfloat16, seed=0) for _ in range(2))
    pm = parallelize(compiled, ParallelConfig(), None, compile_block=lambda block: block.compile())
    for model in (eager, pm):
        model(ids).float().logsumexp(-1).mean().backward()
    assert inductor_fusion.max_horizontal_fusion_size == 1
    grads = {name: p.grad for name, p in compiled.named_parameters()}
    # The two residual biases, whose gradients broke the build, are the one column sum: equal to
    # each other.
    assert torch.equal(grads["layers.0.attn.proj.bias"], grads["layers.0.mlp.down.bias"])
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize(
    "dtype, mp_bf16, expected",
    [(torch.float32, False, False), (torch.bfloat16, False, True), (torch.float32, True, True)],
    ids=["fp32", "bf16", "bf16-mixed-fsdp"],
)
def test_the_inductor_workaround_is_only_for_bf16_on_the_cpu(
    inductor_fusion, dtype, mp_bf16, expected
):
    """Horizontal fusion goes off only where compiled blocks compute in bf16 on the CPU: bf16
    weights, or fp32 ones that FSDP2 gathers as bf16 (bf16-mixed); fp32 and one-process
    bf16-mixed compile as they always did."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lmforge.models import build
    from lmforge.parallel.compose import work_around_inductor

    default = inductor_fusion.max_horizontal_fusion_size
    assert default > 1
    model = build("tiny-neox", device="meta", dtype=dtype)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp_bf16 else None
    assert not work_around_inductor(model, torch.device("cuda"), policy)
    assert work_around_inductor(model, torch.device("cpu"), policy) == expected
    assert inductor_fusion.max_horizontal_fusion_size == (1 if expected else default)


def test_the_default_padding_multiple_is_logged_with_its_reason(caplog):
    """With data.pad_to_multiple_of unset, fine-tuning batches pad to 64 under trainer.compile
    and to 8 eager: an eager and a compiled run of one config compute different shapes, which the
    log says (and how to set it); a set value is used as given, without a word."""
    from lmforge.train.config import load_run_config
    from lmforge.train.tasks.base import pad_multiple

    def logged(*overrides: str) -> tuple[int, list[str]]:
        caplog.clear()
        with caplog.at_level("INFO", logger="lmforge.train.tasks.base"):
            multiple = pad_multiple(
                load_run_config(
                    None,
                    ["model.preset=tiny-gpt2", "data.task=sft", "data.seq_length=128", *overrides],
                )
            )
        return multiple, [r.getMessage() for r in caplog.records]

    multiple, lines = logged("trainer.compile=true")
    assert multiple == 64 and len(lines) == 1
    assert lines[0].startswith(
        "data.pad_to_multiple_of unset: batches padded to a multiple of 64 tokens "
        "(trainer.compile=true: few lengths, few graphs to compile; eager runs pad to 8)"
    )
    assert "data.pad_to_multiple_of=128 = data.seq_length" in lines[0]
    multiple, lines = logged("trainer.compile=false")
    assert (
        multiple == 8
        and "a multiple of 8 tokens (trainer.compile=false; compiled runs pad to 64" in lines[0]
    )
    assert logged("trainer.compile=true", "data.pad_to_multiple_of=16") == (16, [])
