"""The sides benchmarks/train.py times: a plain transformers loop and lmforge's Trainer, built from
one set of weights.

Each side is a `Side`: its name, the dtype whose peak its MFU counts against, and a step (() ->
loss). A CPU runs every side of a group alive at once, taking turns step by step (other load on the
machine then moves them alike); an accelerator builds, times and frees one side after another, since
six 1B-parameter sides with their optimizer states do not fit one GPU together, and a dedicated GPU
gives steady times without the interleaving.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.devices import (
    max_memory_allocated,
    memory_allocated,
    reset_peak_memory_stats,
    synchronize,
)
from lmforge.models import preset
from lmforge.train.config import load_run_config
from lmforge.train.metrics import bounded_cpu_peak
from lmforge.train.trainer import Trainer

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
FP8 = "fp8"  # the dtype key of a Float8 side's second MFU (against the FP8 peak)


@dataclass
class Side:
    name: str
    dtype: torch.dtype  # whose GEMM peak its MFU is measured against
    step: Callable[[], float] | None  # one training step, its loss; None once the side is freed
    state_bytes: Callable[[], int] | None = None  # bytes of its weights and optimizer state
    float8: bool = False  # its blocks' linears run in FP8: MFU against the FP8 peak is reported too
    rtol: float = 1e-4  # how far its first-step loss may be from the reference side's
    first_loss: float = float("nan")
    times: list[float] = field(default_factory=list)
    state: int = 0  # state_bytes() after its first step (the optimizer state exists then)
    # the most each timed step allocated above what it found
    step_bytes: list[int] = field(default_factory=list)
    # sequential runs: the most the side ever held at once (state + one step)
    whole_peak: int | None = None
    # an lmforge side's (the profile rebuilds its step as it was before)
    trainer: Trainer | None = None

    @property
    def peak_bytes(self) -> int:
        """Its own state plus the most one of its steps allocated on top (the other sides' state
        left out)."""
        return self.whole_peak if self.whole_peak is not None else self.state + max(self.step_bytes)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def hf_shape(name: str) -> dict:
    """transformers' GPTNeoXConfig keywords of an lmforge GPT-NeoX preset (pythia-70m ...
    pythia-12b, tiny-neox)."""
    cfg = preset(name)
    if cfg.family != "gpt_neox":
        raise SystemExit(
            f"--shape {name}: a GPT-NeoX preset is needed (pythia-70m, pythia-1b, ...)"
        )
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        rotary_pct=cfg.rotary_pct,
        max_position_embeddings=cfg.max_position_embeddings,
    )


def device_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the best large GEMM: 2048^3 on a CPU (bounded_cpu_peak), 8192^3 on an
    accelerator."""
    if device.type == "cpu":
        return bounded_cpu_peak(dtype, time_limit=float("inf"))[0]
    n = 8192
    a, b = (
        torch.randn(n, n, dtype=dtype, device=device),
        torch.randn(n, n, dtype=dtype, device=device),
    )
    fastest = float("inf")
    for _ in range(4):  # the first one warms the kernels up, and times them too
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * n**3 / fastest


def state_bytes(model: torch.nn.Module, optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    # lmforge's optimizer may wrap several
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        tensors += [
            t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ]
    return sum(t.numel() * t.element_size() for t in tensors)


def hf_model(folder: Path, shape: dict | None = None, device: torch.device | str = "cpu"):
    import transformers as tf

    if shape is not None:  # build once, save; every side then loads these same weights
        torch.manual_seed(0)
        tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
        ).save_pretrained(folder)
    return (
        tf.GPTNeoXForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        )
        .to(device)
        .train()
    )


def hf_side(
    name: str, folder: Path, ids: torch.Tensor, autocast: bool, compile_: bool = False
) -> Side:
    """The plain loop a transformers user writes (on the device of `ids`): SDPA attention,
    torch's AdamW (fused on an accelerator, as a user there would pick it), bf16 autocast over
    fp32 weights; `compile_`: the model wrapped in torch.compile."""
    model = hf_model(folder, device=ids.device)
    fused = True if ids.device.type != "cpu" else None  # None: torch's default (foreach) on the CPU
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=fused
    )
    forward = torch.compile(model) if compile_ else model

    def step() -> float:
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return Side(
        name, torch.bfloat16 if autocast else torch.float32, step, lambda: state_bytes(model, opt)
    )


def lmforge_trainer(
    args, tmp: Path, precision: str, compile_: bool, weights: dict, float8: str | None = None
) -> Trainer:
    extra = ["trainer.float8=true", f"trainer.float8_recipe={float8}"] if float8 else []
    cfg = load_run_config(
        None,
        [
            f"model.preset={args.preset}",
            f"data.paths=[{tmp / 'corpus'}]",
            f"data.seq_length={args.seq}",
            f"trainer.global_batch_size={args.batch}",
            f"trainer.micro_batch_size={args.batch}",
            f"trainer.precision={precision}",
            f"trainer.compile={compile_}",
            "trainer.val_check_interval=0",
            f"trainer.device={args.device}",
            f"trainer.compile_cache_dir={Path(tempfile.gettempdir()) / 'lmforge-bench-train-compile'}",
            "trainer.max_steps=2",
            "trainer.progress_bar=false",
            "trainer.grad_clip=1.0",
            # a CPU's is measured unless given
            *(["cost.peak_flops=1e12"] if args.device.type == "cpu" else []),
            f"optim.lr={LR}",
            f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
            f"optim.weight_decay={WEIGHT_DECAY}",
            f"run_dir={tmp / f'run-{precision}-{compile_}-{float8}'}",
            *extra,
        ],
    )
    trainer = Trainer(cfg)
    # the imported transformers weights (cast to bf16 for bf16-sr)
    trainer.model.load_state_dict(weights)
    return trainer


def lmforge_side(
    name: str, trainer: Trainer, batch: dict, dtype: torch.dtype, float8: bool = False
) -> Side:
    batches = itertools.repeat(batch)
    return Side(
        name,
        dtype,
        lambda: trainer.train_step(batches)["loss"],
        lambda: state_bytes(trainer.model, trainer.optimizer),
        float8=float8,
        trainer=trainer,
    )


def float8_ready(device: torch.device) -> str | None:
    """Why a Float8 side cannot run here, or None when it can (CUDA 8.9+, torchao importable)."""
    if device.type != "cuda":
        return "Float8 needs a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "Float8 needs compute capability 8.9+"
    if importlib.util.find_spec("torchao") is None:
        return "Float8 needs torchao (pip install torchao)"
    return None


def write_corpus(prefix: Path, vocab: int, tokens: int) -> None:
    """A small random corpus: Trainer needs data to set up; the timed steps reuse one fixed
    batch."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16 if vocab < 65500 else np.int32) as writer:
        for _ in range(max(4, tokens // 2000)):
            writer.add_document(rng.integers(0, vocab, 2000))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _warm_up(side: Side, device: torch.device) -> None:
    synchronize(device)
    t0 = time.perf_counter()
    side.first_loss = side.step()
    synchronize(device)
    side.state = side.state_bytes()
    log(f"  {side.name}: first step {time.perf_counter() - t0:.1f} s, loss {side.first_loss:.5f}")


def _timed_step(side: Side, device: torch.device) -> None:
    before = memory_allocated(device)
    if side.whole_peak is None:
        reset_peak_memory_stats(device)
    synchronize(device)
    t0 = time.perf_counter()
    side.step()
    synchronize(device)
    side.times.append(time.perf_counter() - t0)
    if before is not None:
        side.step_bytes.append(max_memory_allocated(device) - before)


def _check_first_loss(sides: list[Side]) -> None:
    ref = sides[0]
    for side in sides[1:]:
        if abs(side.first_loss - ref.first_loss) > side.rtol * abs(ref.first_loss):
            raise SystemExit(
                f"first-step loss of {side.name} ({side.first_loss:.6f}) differs from {ref.name} "
                f"({ref.first_loss:.6f}) by more than {side.rtol:g} (relative): not benchmarking"
            )


def run_interleaved(sides: list[Side], repeats: int, peaks: dict, device: torch.device) -> None:
    """Warm up each side once (its first-step loss, compilation), check the losses agree, then time
    one step per side per repeat, taking turns in a rotated order, with the peaks re-measured."""
    for side in sides:
        _warm_up(side, device)
    _check_first_loss(sides)
    for r in range(repeats):
        for dtype in peaks:
            peaks[dtype] = max(peaks[dtype], device_peak(dtype, device))
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            _timed_step(side, device)
        log(
            f"  repeat {r + 1}/{repeats}: "
            + ", ".join(f"{s.name} {s.times[-1]:.2f} s" for s in sides)
            + f" (load {os.getloadavg()[0]:.1f})"
        )


def run_sequential(
    builders: list[Callable[[], Side]],
    repeats: int,
    device: torch.device,
    profile: Callable[[Side], None] | None = None,
) -> list[Side]:
    """One side at a time: build, warm up, time `repeats` steps, free it; each side's peak memory
    is the most it held at once above what was allocated before it was built (the batch and the
    shared inputs). `profile(side)`, if given, runs after the timed steps, while the side is
    alive (its extra steps are not timed)."""
    sides = []
    for build in builders:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        base = memory_allocated(device) or 0
        reset_peak_memory_stats(device)
        side = build()
        side.whole_peak = 0
        _warm_up(side, device)
        for _ in range(repeats):
            _timed_step(side, device)
        side.whole_peak = (max_memory_allocated(device) or 0) - base
        log(
            f"  {side.name}: median {side.seconds:.4f} s over {repeats} steps, peak {side.whole_peak / 2**30:.2f} "
            "GiB"
        )
        if profile is not None:
            profile(side)
        # frees its model and optimizer before the next is built
        side.step = side.state_bytes = side.trainer = None
        sides.append(side)
        _check_first_loss(sides)
    return sides
