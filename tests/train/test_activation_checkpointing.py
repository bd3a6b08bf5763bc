"""trainer.activation_checkpointing=none|selective|full: the same gradients bit for bit, less
activation memory (full < selective < none, traced by lmforge plan on fake CUDA, FSDP2 included),
under torch.compile too, and the old true/false switch still read."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build
from lmforge.train.config import load_run_config
from lmforge.train.setup import apply_activation_checkpointing
from lmforge.train.tasks import get_task
from tests.conftest import needs_torch
from tests.models.test_documents import packed
from tests.train.test_plan import CONFIGS, _case, _run

MODES = ("none", "selective", "full")


def _grads(
    preset: str,
    mode: str,
    compiled: bool = False,
    lora: str | None = None,
    **inputs,
) -> dict[str, torch.Tensor]:
    model = build(preset, seed=0)
    # adapters on lora.base_dtype `lora` (B drawn away from zero, so that they matter)
    if lora is not None:
        from lmforge.models.lora import LoRAConfig, apply_lora

        apply_lora(
            model, LoRAConfig(rank=2, targets="all-linear", dropout=0.0, base_dtype=lora), seed=0
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(
                        torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                        * 0.05
                    )
    apply_activation_checkpointing(model, mode)
    if compiled:
        for block in model.layers:
            block.compile()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=gen)
    batch = {"tokens": ids, "labels": torch.roll(ids, -1, 1)}
    if inputs:  # a packed SFT batch: documents, positions restarting
        batch = {"input_ids": ids, "labels": ids.clone(), **inputs}
    loss, count, _ = get_task("sft" if inputs else "pretrain").loss(model, batch)
    (loss / count).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("preset", "lora"),
    [
        ("tiny-llama", None),
        ("tiny-neox", None),
        ("tiny-gemma2", None),
        ("tiny-qwen3-moe", None),
        ("tiny-qwen3-moe", "fp32"),
        pytest.param(
            "tiny-mixtral",
            "nf4",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("torchao") is None, reason="torchao not installed"
            ),
        ),
    ],
)
def test_recomputed_gradients_equal_kept_ones_bit_for_bit(preset, lora):
    """Adapters on a mixture of experts too (their grouped pass added the low-rank update into
    the grouped GEMM's output in place, which selective checkpointing keeps and refused as
    changed), over an NF4 base as well."""
    kept = _grads(preset, "none", lora=lora)
    assert kept
    for mode in ("selective", "full"):
        grads = _grads(preset, mode, lora=lora)
        assert grads.keys() == kept.keys()
        for name, grad in kept.items():
            assert torch.equal(grads[name], grad), (mode, name)


def test_packed_documents_recompute_alike():
    segments, positions = packed([[20, 12, 9], [40]], seq=48)
    inputs = {"segment_ids": segments, "position_ids": positions}
    kept = _grads("tiny-mistral", "none", **inputs)
    grads = _grads("tiny-mistral", "selective", **inputs)
    assert all(torch.equal(grads[n], g) for n, g in kept.items())


@pytest.mark.slow
def test_selective_checkpointing_under_compile_gives_the_eager_gradients():
    eager = _grads("tiny-llama", "none")
    for mode in ("selective", "full"):
        compiled = _grads("tiny-llama", mode, compiled=True)
        for name, grad in eager.items():  # Inductor fuses differently: fp32 rounding only
            assert (compiled[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), (mode, name)


def test_the_old_switch_and_a_bad_mode():
    def mode(value):
        return load_run_config(
            str(CONFIGS / "tiny-neox.yaml"), [f"trainer.activation_checkpointing={value}"]
        ).trainer.activation_checkpointing

    assert (mode("true"), mode("false"), mode("selective")) == ("full", "none", "selective")
    with pytest.raises(UserError, match="trainer.activation_checkpointing"):
        mode("some")


@pytest.mark.slow
class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of every tensor storage made under it that is still alive."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = ref
        return out

    def live(self) -> int:
        return sum(
            torch.UntypedStorage._new_with_weak_ptr(k).nbytes()
            for k, r in self.refs.items()
            if not r.expired()
        )


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_a_mixture_of_experts_frees_each_recomputed_block_in_backward(preset):
    """The recompute of a checkpointed MoE block stored its router logits on the layer, as a
    training forward does for the router losses, and they held that block's recomputed graph: by
    the end of backward every block's activations were alive again (Qwen3-30B-A3B QLoRA: 47.4 GiB
    planned, 36.1 without). What a step holds when its backward ends (gradients, the forward's
    router logits) must not depend on the mode."""
    held = {}
    for mode in MODES:
        model = build(preset, seed=0).train()
        apply_activation_checkpointing(model, mode)
        ids = torch.randint(
            0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
        )
        with _LiveBytes() as live:
            loss, count, _ = get_task("pretrain").loss(
                model, {"tokens": ids, "labels": torch.roll(ids, -1, 1)}
            )
            (loss / count).backward()
            held[mode] = live.live()
    # (checkpointing's own bookkeeping: ~0.1%; the recomputed blocks were ~30% here)
    assert abs(held["selective"] - held["none"]) < 0.01 * held["none"], held
    assert abs(held["full"] - held["none"]) < 0.01 * held["none"], held


@needs_torch((2, 10), "lmforge plan of a CUDA run on a machine without one")
def test_activation_memory_full_below_selective_below_none(tmp_path):
    """One step traced on fake CUDA (lmforge plan): one process, and two FSDP2 ranks."""
    cases = {
        f"{world}/{mode}": _case(
            world,
            f"trainer.activation_checkpointing={mode}",
            "data.seq_length=128",
            "trainer.data_parallel=fsdp",
        )
        for world in (1, 2)
        for mode in MODES
    }
    planned = _run(cases, tmp_path)
    for world in (1, 2):
        memory = {}
        for mode in MODES:
            assert "plan" in planned[f"{world}/{mode}"], planned[f"{world}/{mode}"]
            memory[mode] = planned[f"{world}/{mode}"]["plan"]["ranks"][0]["activations"]
        assert memory["full"] < memory["selective"] < memory["none"], (world, memory)


def test_selective_recomputes_a_lora_adapters_full_width_product(monkeypatch):
    """A LoRA linear's output is its base product plus B's product of the rank-r activations:
    selective checkpointing kept both full-width outputs (the Llama-3.1-8B QLoRA recipe: 46.3 GiB
    of activations planned, 25.3 recomputing B's), where B's costs 2r FLOPs an element to
    recompute. The gradients stay those of no checkpointing, bit for bit (the test above)."""
    from lmforge.models.lora import LoRAConfig, apply_lora
    from lmforge.train import setup

    def kept(widening: int) -> int:
        monkeypatch.setattr(setup, "WIDENING", widening)
        model = build("tiny-llama", seed=0).train()
        apply_lora(model, LoRAConfig(rank=2, targets="all-linear", dropout=0.0), seed=0)
        apply_activation_checkpointing(model, "selective")
        ids = torch.randint(
            0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
        )
        with _LiveBytes() as live:
            hidden = model.hidden_states(ids)
            held = live.live() - hidden.numel() * hidden.element_size()
        return held

    # 10**9: no product counts as widening (every product kept)
    base_only, with_b = kept(8), kept(10**9)
    width = build("tiny-llama", device="meta").config
    # Per token and block, B's outputs are the widths of q, k, v, o, gate, up and down, in fp32.
    per_token = (
        width.hidden_size * 2
        + 2 * width.num_kv_heads * width.hidden_size // width.num_heads
        + 2 * width.intermediate_size
        + width.hidden_size
    ) * 4
    assert with_b - base_only == 2 * 64 * width.num_layers * per_token, (with_b, base_only)
