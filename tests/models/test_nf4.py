"""QLoRA's NF4 base (lora.base_dtype=nf4) beyond the linears of tests/models/test_lora.py:
lmforge's chunked dequantization and NF4 linear give torchao's values and products bit for bit;
on a mixture of experts the stacked expert weights in NF4 (held 2-D) compute exactly what their
dequantized bf16 weights compute, forward and backward, without keeping a dequantized copy for
backward; the merged export holds them stacked in bf16; a meta model read a block at a time holds
the same bits as quantizing the whole model."""

from __future__ import annotations

import pytest
import torch

from lmforge.models import build, load_pretrained
from lmforge.models.io import save_model
from lmforge.models.lora import LoRAConfig, apply_lora, merge_lora
from lmforge.models.lora_experts import LoRAExperts
from lmforge.models.lora_state import merged_state
from tests.models.test_lora_experts import _ids, _logits, _trained

pytest.importorskip("transformers")
QLORA = LoRAConfig(rank=2, targets="all-linear", base_dtype="nf4")


def _qlora(folder) -> torch.nn.Module:
    model = load_pretrained(folder)
    apply_lora(model, QLORA, seed=0)
    return _trained(model)


def _saved(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[bool, torch.Size]]:
    """(NF4 or not, shape) of every tensor a training forward keeps for backward."""
    from lmforge.models.nf4 import is_nf4

    kept = []

    def pack(t):
        kept.append((is_nf4(t), t.shape))
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).float().logsumexp(-1).mean().backward()
    return kept


@pytest.mark.slow  # torchao's import and NF4's Python-level ops
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_nf4_experts_compute_their_dequantized_weights_and_keep_only_nf4_for_backward(
    family, hf_dirs, monkeypatch
):
    pytest.importorskip("torchao")
    from torch.multiprocessing.reductions import StorageWeakRef

    from lmforge.models import moe
    from lmforge.models.moe import stacked
    from lmforge.models.nf4 import is_nf4

    quantized = _qlora(hf_dirs[family])
    experts = {n: m for n, m in quantized.named_modules() if isinstance(m, LoRAExperts)}
    assert experts and all(
        is_nf4(m.gate_up) and is_nf4(m.down) and m.gate_up.dim() == 2 for m in experts.values()
    )
    # The same model with each expert weight dequantized into a plain stacked bf16 tensor (the
    # linears stay NF4).
    plain = _qlora(hf_dirs[family])
    for m in plain.modules():
        if isinstance(m, LoRAExperts):
            m.gate_up, m.down = (
                torch.nn.Parameter(w, requires_grad=False) for w in stacked(m.gate_up, m.down)
            )
    sizes = {
        m.gate_up.shape[0] * 2 * m.gate_up.shape[2] * m.gate_up.shape[3]
        for m in plain.modules()
        if isinstance(m, LoRAExperts)
    } | {m.down.numel() for m in plain.modules() if isinstance(m, LoRAExperts)}
    ids = _ids()
    # A layer's experts are dequantized one weight at a time, forward and backward: each dequantized
    # copy is gone before the next is made (a stacked weight is most of a layer: Mixtral 8x7B's
    # gate_up is 1.75 GiB in bf16).
    made, dequantize = [], moe.dequantize

    def one_at_a_time(w, dtype=None):
        assert all(ref.expired() for ref in made), "a dequantized expert weight is still alive"
        out = dequantize(w, dtype)
        made.append(StorageWeakRef(out.untyped_storage()))
        return out

    monkeypatch.setattr(moe, "dequantize", one_at_a_time)
    # Forward and backward bit for bit: the logits and every adapter's gradient (the experts' and
    # the linears').
    kept = {name: _saved(model, ids) for name, model in (("nf4", quantized), ("bf16", plain))}
    assert len(made) == 4 * len(experts)  # gate_up and down, forward and backward
    monkeypatch.undo()
    assert torch.equal(_logits(quantized, ids), _logits(plain, ids))
    grads = [
        {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        for model in (quantized, plain)
    ]
    assert grads[0].keys() == grads[1].keys() and any(".experts.lora_" in n for n in grads[0])
    for n, g in grads[0].items():
        assert torch.equal(g, grads[1][n]), n
    # Backward keeps the NF4 experts and dequantizes them again; a dense copy of a layer's experts
    # is never kept (the check sees the plain model's).
    assert not any(shape.numel() in sizes for nf4, shape in kept["nf4"] if not nf4)
    assert any(shape.numel() in sizes for nf4, shape in kept["bf16"] if not nf4)
    assert sum(
        nf4 and len(shape) == 2 and shape.numel() in sizes for nf4, shape in kept["nf4"]
    ) == 2 * len(experts)
    # Merged: the experts stacked again in bf16, as an export writes them, and the same function as
    # merge_lora's.
    quantized.eval()
    state = merged_state(dict(quantized.state_dict()), quantized.config, QLORA.scaling)
    assert not any(is_nf4(t) for t in state.values())
    reference = build(quantized.config, device="meta")
    for name, t in reference.state_dict().items():
        assert state[name].shape == t.shape, name
    merged = merge_lora(quantized)
    assert not any(is_nf4(p) for n, p in merged.named_parameters() if ".experts." in n)
    merged_logits = _logits(merged, ids)
    loaded = load_pretrained(hf_dirs[family]).to(torch.bfloat16)
    loaded.load_state_dict(state)
    assert torch.equal(_logits(loaded.eval(), ids).float(), merged_logits.float())


@pytest.mark.slow  # torchao's import
def test_nf4_experts_read_onto_a_meta_model_equal_the_whole_models_quantization(hf_dirs, tmp_path):
    """read_nf4_base on a LoRA-wrapped meta Mixtral, from its HF folder and from an lmforge
    folder: the stacked experts are read a block at a time and quantized to the bits quantizing
    the whole bf16 model gives."""
    pytest.importorskip("torchao")
    from lmforge.models.nf4 import is_nf4
    from lmforge.parallel.load import read_nf4_base

    whole = load_pretrained(hf_dirs["mixtral"], dtype=torch.bfloat16)
    apply_lora(whole, QLORA, seed=0)
    theirs = {n: p for n, p in whole.named_parameters() if is_nf4(p)}
    assert any(".experts.gate_up" in n for n in theirs) and any(
        ".experts.down" in n for n in theirs
    )
    save_model(load_pretrained(hf_dirs["mixtral"]), tmp_path / "lmforge")
    for source in (hf_dirs["mixtral"], tmp_path / "lmforge"):
        model = build(whole.config, device="meta")
        apply_lora(model, QLORA, seed=0)
        read_nf4_base(model, source, torch.device("cpu"))
        ours = {n: p for n, p in model.named_parameters() if not p.is_meta}
        assert ours.keys() == theirs.keys()
        for name, p in ours.items():
            for inner in p.__tensor_flatten__()[0]:
                assert torch.equal(getattr(p, inner), getattr(theirs[name], inner)), (name, inner)


@pytest.mark.slow  # torchao's import
def test_dequantize_gives_torchaos_values_a_chunk_at_a_time(monkeypatch):
    """lmforge.models.nf4.dequantize (which the experts use: torchao's own dequantization holds
    ~14 bytes a weight of intermediates) equals NF4Tensor.get_original_weight bit for bit,
    whatever the chunk, in bf16 and in fp32."""
    pytest.importorskip("torchao")
    from lmforge.models import nf4

    g = torch.Generator().manual_seed(0)
    for shape in [(768, 64), (256, 96), (2048, 256), (3, 64)]:
        w = nf4.to_nf4_parameter(torch.randn(shape, generator=g).to(torch.bfloat16)).data
        theirs = w.get_original_weight()
        for chunk in (1 << 23, 96, 32):  # whole, across scale blocks, one block of bytes
            monkeypatch.setattr(nf4, "DEQUANTIZE_CHUNK", chunk)
            ours = nf4.dequantize(w)
            assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs), (
                shape,
                chunk,
            )
            assert torch.equal(nf4.dequantize(w, torch.float32), theirs.float())


@pytest.mark.slow  # torchao's import
def test_the_nf4_linear_computes_torchaos_products_bit_for_bit():
    """lmforge.models.nf4.nf4_linear (LoRALinear's frozen NF4 base) against F.linear on torchao's
    NF4 weight: the output and the input's gradient equal, fp32 and under bf16 autocast, with a
    bias too; and a LoRA-wrapped QLoRA model takes it (its forward never calls torchao's
    dequantization)."""
    pytest.importorskip("torchao")
    from lmforge.models import nf4

    g = torch.Generator().manual_seed(1)
    w = nf4.to_nf4_parameter(torch.randn(96, 64, generator=g).to(torch.bfloat16))
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    for autocast in (False, True):
        for b in (None, bias):
            outs = []
            for linear in (torch.nn.functional.linear, nf4.nf4_linear):
                x = torch.randn(
                    3, 5, 64, generator=torch.Generator().manual_seed(2), requires_grad=True
                )
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = linear(x, w, b)
                y.float().pow(2).sum().backward()
                outs.append((y, x.grad))
            assert outs[0][0].dtype == outs[1][0].dtype
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (
                autocast,
                b,
            )
    calls = []
    original = type(w.data).get_original_weight
    model = build("tiny-llama", seed=0)
    apply_lora(model, QLORA, seed=0)
    type(w.data).get_original_weight = lambda self: calls.append(1) or original(self)
    try:
        model(torch.randint(0, 100, (1, 7))).sum().backward()
    finally:
        type(w.data).get_original_weight = original
    assert not calls


def test_a_torchao_that_does_not_import_is_one_line(monkeypatch):
    """Installed but built for another torch (or damaged): its ImportError became a traceback."""
    import sys

    from lmforge.errors import UserError
    from lmforge.models.nf4 import nf4_api

    for module in ("torchao.quantization.quantize_.workflows.nf4", "torchao.dtypes"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    with pytest.raises(
        UserError,
        match=r"^torchao does not import \(.*\): pip install a torchao release built for "
        r"torch \d+\.\d+",
    ):
        nf4_api()
