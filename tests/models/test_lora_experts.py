"""LoRA on a mixture of experts (lmforge.models.lora_experts): the grouped update against a dense
expert-by-expert reference, and the adapted model against PEFT's target_parameters adapters on
transformers' Mixtral and Qwen3-MoE (the adapted model, the merged one, PEFT's base + adapter
folder, lmforge reading it back and transformers' merged export compute the same logits); bad
targets are one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import UserError
from lmforge.models import build, load_pretrained
from lmforge.models.hf import export_hf
from lmforge.models.io import materialize, save_model
from lmforge.models.lora import LoRAConfig, adapters_disabled, apply_lora, merge_lora
from lmforge.models.lora_experts import LoRAExperts
from lmforge.models.lora_state import merged_state, split_state
from lmforge.models.peft import write_peft_adapter
from lmforge.models.peft_read import load_peft_adapter
from tests.models.test_moe import _moe_config

tf = pytest.importorskip("transformers")
TOL = 1e-5


def _ids():
    return torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3))


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def _trained(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Adapters as after training: B away from its zero init."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name or name.startswith("lora_B."):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _dense_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, its low-rank updates computed as written, x A_e^T B_e^T *
    scaling (not through a merged weight); each token's output the routing-weighted sum of its
    chosen experts'."""
    ex = moe.experts
    _, weights, chosen = moe.route(x)
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        h = F.linear(x, ex.gate_up[e].flatten(0, 1))
        if "gate_up" in ex.rank:
            h = h + ex.scaling["gate_up"] * F.linear(
                F.linear(x, ex.lora_A["gate_up"][e]), ex.lora_B["gate_up"][e].flatten(0, 1)
            )
        gate, up = h.chunk(2, dim=-1)
        a = moe.act(gate) * up
        y = F.linear(a, ex.down[e])
        if "down" in ex.rank:
            y = y + ex.scaling["down"] * F.linear(
                F.linear(a, ex.lora_A["down"][e]), ex.lora_B["down"][e]
            )
        out = out + (weights * (chosen == e)).sum(-1, keepdim=True).to(x.dtype) * y
    return out


@pytest.mark.parametrize("weights", [("gate_up", "down"), ("gate_up",), ("down",)])
# fp32 rank rows of 16 bytes: torch's grouped GEMM; 12 bytes: the loop
@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_adapted_experts_equal_the_dense_per_expert_reference(weights, rank, k):
    """Output and every gradient (x, router, each A and B) of the grouped pass equal the
    expert-by-expert reference: a dropped, duplicated or misrouted (token, expert) pair, or a
    factor applied to another expert's rows, would differ. Expert 0 is never chosen (test_moe's
    router trick): its factors' gradients must be exactly zero."""
    moe = build(_moe_config(experts_per_token=k), seed=3).layers[0].mlp
    moe.experts = LoRAExperts(
        moe.experts,
        dict.fromkeys(weights, rank),
        dict.fromkeys(weights, 2.0 * rank),
        torch.Generator().manual_seed(0),
    )
    _trained(moe.experts, 0.3)
    moe.experts.gate_up.requires_grad_(False)
    moe.experts.down.requires_grad_(False)
    x = torch.randn(3 * 11, 32, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 5.0 + x[:, 0].abs()
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0] = 0.0
        moe.router.weight[0, 0] = -100.0
    factors = [p for n, p in moe.experts.named_parameters() if n.startswith("lora_")]
    # fp64 to its rounding; fp32 to its summation noise, on the scale of the largest values compared
    # (a sum of large terms that cancel, as the router's gradient at k = 1, is noise of that scale:
    # 1.06e-6 where the CPU had AVX-512, against 1e-6 absolute before). A dropped or misrouted pair
    # differs by the values themselves.
    for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        moe = moe.to(dtype)
        xt = x.to(dtype).requires_grad_()
        params = [xt, moe.router.weight, *factors]
        out, ref = moe(xt), _dense_reference(moe, xt)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        ours, theirs = (
            torch.autograd.grad(out, params, grad),
            torch.autograd.grad(ref, params, grad),
        )
        scale = max(t.abs().max().item() for t in (ref, *theirs))
        for a, b in zip((out, *ours), (ref, *theirs), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=rel * scale)
        assert all(torch.count_nonzero(g[0]) == 0 for g in ours[2:])
        assert moe.experts.gate_up.grad is None and moe.experts.down.grad is None


def _peft_parity(family, targets, hf_dirs, tmp_path) -> dict:
    peft = pytest.importorskip("peft")
    ids = _ids()
    base = load_pretrained(hf_dirs[family])
    reference = _logits(base, ids)
    lora = LoRAConfig(rank=4, alpha=8, targets=targets)
    model = copy.deepcopy(base)
    apply_lora(model, lora, seed=0)
    assert torch.equal(_logits(model, ids), reference)  # B = 0: the base's output exactly
    adapted = _logits(_trained(model), ids)
    assert (adapted - reference).abs().max() > 1e-3
    with adapters_disabled(model):  # DPO's reference: the experts' adapters are off too
        assert torch.equal(_logits(model, ids), reference)

    errors = {"merged": _logits(merge_lora(copy.deepcopy(model)), ids)}
    _, adapters = split_state(model.state_dict())
    (tmp_path / "adapter").mkdir()
    write_peft_adapter(
        adapters,
        model.config,
        lora.rank,
        lora.alpha,
        0.0,
        tmp_path / "adapter",
        str(hf_dirs[family]),
    )
    hf_base = tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).eval()
    errors["PEFT"] = _logits(
        peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval(), ids
    )
    reloaded = copy.deepcopy(base)
    load_peft_adapter(reloaded, tmp_path / "adapter")
    errors["lmforge reading the PEFT folder"] = _logits(reloaded, ids)
    state = merged_state(dict(model.state_dict()), model.config, lora.scaling)
    save_model(materialize(model.config, state.items()), tmp_path / "merged")
    export_hf(tmp_path / "merged", tmp_path / "hf")
    errors["transformers merged"] = _logits(
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), ids
    )
    for name, logits in errors.items():
        assert (logits - adapted).abs().max().item() <= TOL, name
    return json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())


def test_expert_adapters_match_peft_and_merge_exactly(hf_dirs, tmp_path):
    config = _peft_parity("mixtral", "experts", hf_dirs, tmp_path)
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["target_modules"] == [] and config["rank_pattern"] == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "targets", "modules", "parameters"),
    [
        # all-linear on a MoE: the router and the experts too, gate_up at twice the rank (as PEFT's
        # all-linear).
        (
            "mixtral",
            "all-linear",
            ["k_proj", "o_proj", "q_proj", "v_proj"],
            ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"],
        ),
        # Qwen3-MoE's dense layer 1 (mlp_only_layers) too, its projections named as parameters.
        (
            "qwen3_moe",
            "all-linear",
            ["k_proj", "o_proj", "q_proj", "v_proj"],
            [
                "mlp.down_proj.weight",
                "mlp.experts.down_proj",
                "mlp.experts.gate_up_proj",
                "mlp.gate.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
            ],
        ),
        (
            "qwen3_moe",
            "gate,up,down",
            [],
            [
                "mlp.down_proj.weight",
                "mlp.experts.down_proj",
                "mlp.experts.gate_up_proj",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
            ],
        ),
        (
            "qwen3_moe",
            "experts.gate_up,router,o",
            ["o_proj"],
            ["mlp.experts.gate_up_proj", "mlp.gate.weight"],
        ),
        ("mixtral", "experts.down,q,v", ["q_proj", "v_proj"], ["mlp.experts.down_proj"]),
    ],
)
def test_every_target_mix_matches_peft(family, targets, modules, parameters, hf_dirs, tmp_path):
    config = _peft_parity(family, targets, hf_dirs, tmp_path)
    assert config["target_modules"] == modules and config["target_parameters"] == parameters
    doubled = "gate" in targets.split(",") or targets == "all-linear"
    assert config["rank_pattern"] == ({"mlp.experts.gate_up_proj": 8} if doubled else {})
    assert config["alpha_pattern"] == ({"mlp.experts.gate_up_proj": 16} if doubled else {})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_peft_all_linear_adapters_load_and_lmforge_all_linear_has_their_shapes(
    family, hf_dirs, tmp_path
):
    """An adapter PEFT made itself (LoraConfig(target_modules="all-linear") on transformers 5:
    the attention, the router, the experts with gate_up_proj at rank 2r and alpha 2a from its
    rank/alpha_pattern), trained B and all: lmforge computes what PEFT does with it. lmforge's
    all-linear holds the same tensors in the same shapes, beside Qwen3-MoE's dense-layer MLP,
    which lmforge's all-linear adapts and PEFT's conversion leaves out."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    ids = _ids()
    theirs = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family]),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_pretrained(hf_dirs[family])
    load_peft_adapter(ours, tmp_path / "peft")
    assert (_logits(ours, ids) - _logits(theirs.eval(), ids)).abs().max().item() <= TOL
    assert (_logits(merge_lora(ours), ids) - _logits(theirs, ids)).abs().max().item() <= TOL

    model = load_pretrained(hf_dirs[family])
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets="all-linear"))
    _, adapters = split_state(model.state_dict())
    (tmp_path / "ours").mkdir()
    write_peft_adapter(adapters, model.config, 4, 8, 0.0, tmp_path / "ours")
    shapes = {
        k: tuple(t.shape)
        for k, t in load_file(tmp_path / "ours" / "adapter_model.safetensors").items()
    }
    expected = {
        k: tuple(t.shape)
        for k, t in load_file(tmp_path / "peft" / "adapter_model.safetensors").items()
    }
    dense_mlp = {k for k in shapes if any(f".mlp.{p}_proj." in k for p in ("gate", "up", "down"))}
    assert shapes.keys() - dense_mlp == expected.keys() and dense_mlp == (
        set() if family == "mixtral" else {k for k in shapes if ".layers.1.mlp" in k}
    )
    assert all(shapes[k] == expected[k] for k in expected)


@pytest.mark.parametrize(
    ("model", "setting", "message"),
    [
        (
            "tiny-llama",
            {"targets": "q,experts"},
            r"^lora.targets: experts names a mixture of experts' stacked experts, "
            r"and this llama model has none \(model.num_experts=0\): drop it$",
        ),
        (
            "tiny-llama",
            {"targets": "router"},
            "^lora.targets: router matches no module of this llama model",
        ),
        (
            "tiny-mixtral",
            {"targets": "q,gate"},
            r"^lora.targets: mixtral's experts keep gate and up in one stacked "
            r"weight .*: target gate,up together, not gate alone$",
        ),
        (
            "tiny-qwen3-moe",
            {"targets": "experts,gate,up"},
            "^lora.targets: experts and gate both adapt the experts' gate_up weight: keep one$",
        ),
        (
            "tiny-mixtral",
            {"targets": "w1"},
            r"^lora.targets: mixtral's experts keep gate and up .*: target gate,up "
            r"together, not w1 \(read as gate\) alone$",
        ),
        (
            "tiny-mixtral",
            {"targets": "experts", "dropout": 0.1},
            r"^lora.dropout=0.1 with adapters on experts.down, "
            r"experts.gate_up: .* set lora.dropout=0, or target the "
            r"attention \(q,k,v,o\) only$",
        ),
        (
            "tiny-qwen3-moe",
            {"targets": "all-linear", "dropout": 0.1},
            "^lora.dropout=0.1 with adapters on experts.down, experts.gate_up, router: PEFT",
        ),
        (
            "tiny-mixtral",
            {"targets": "w4"},
            "^lora.targets: unknown target 'w4': choose from q, k, v, o, gate, up, down, "
            "router, experts, experts.gate_up, experts.down",
        ),
    ],
)
def test_bad_expert_targets_are_one_line(model, setting, message):
    with pytest.raises(UserError, match=message) as e:
        apply_lora(build(model, seed=0), LoRAConfig(**setting))
    assert "\n" not in str(e.value)


def test_only_the_adapters_get_gradients_and_gate_up_takes_twice_the_rank_from_gate_and_up():
    model = build("tiny-qwen3-moe", seed=0)
    trainable = apply_lora(model, LoRAConfig(rank=2, alpha=4, targets="gate,up,down"), seed=0)
    experts = model.layers[0].mlp.experts
    assert experts.rank == {"gate_up": 4, "down": 2} and experts.scaling == {
        "gate_up": 2.0,
        "down": 2.0,
    }
    assert isinstance(model.layers[0].mlp.experts, LoRAExperts)
    _trained(model)
    model.train()
    model(torch.randint(0, 1000, (2, 9))).float().logsumexp(-1).mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
