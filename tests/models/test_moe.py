"""Mixture of experts: the grouped experts against the dense, expert-by-expert computation, and
the router losses against transformers'."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import ModelConfig, build, load_pretrained
from lmforge.models.moe import dense_reference, grouped_experts
from lmforge.models.router_losses import router_losses
from tests.conftest import make_hf_model


def _moe_config(**kw) -> ModelConfig:
    base = dict(
        family="mixtral",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=48,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        attention_bias=False,
        mlp_bias=False,
        num_experts=6,
        experts_per_token=2,
    )
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("norm_topk", "activation"), [(True, "silu"), (False, "silu"), (True, "gelu_tanh")]
)
@pytest.mark.parametrize("k", [1, 2, 6])
def test_grouped_experts_equal_the_dense_reference_in_output_and_gradients(
    k, norm_topk, activation
):
    """Every token's output is the weighted sum of exactly its chosen experts' outputs: a
    dropped, duplicated or misrouted (token, expert) pair changes the output or a gradient. With
    k < 6, expert 0 is never chosen (every token's feature 0 is large and only expert 0's router
    row reads it, negatively), so an expert with no tokens is covered: its gradient must be
    exactly zero."""
    cfg = _moe_config(experts_per_token=k, router_norm_topk=norm_topk, activation=activation)
    moe = build(cfg, seed=3).layers[0].mlp.double()
    x = torch.randn(3, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[..., 0] = 5.0 + x[..., 0].abs()
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0] = 0.0
        moe.router.weight[0, 0] = -100.0
    x.requires_grad_()
    params = [x, moe.router.weight, moe.experts.gate_up, moe.experts.down]
    out, ref = moe(x), dense_reference(moe, x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    ours, theirs = torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    if k < 6:
        assert torch.count_nonzero(ours[2][0]) == 0 and torch.count_nonzero(ours[3][0]) == 0
    # fp32 runs torch's grouped GEMM on the CPU (fp64 the loop over experts): the same sums, to fp32
    # rounding.
    moe, x = moe.float(), x.detach().float().requires_grad_()
    params = [x, moe.router.weight, moe.experts.gate_up, moe.experts.down]
    out, ref = moe(x), dense_reference(moe, x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    ours = torch.autograd.grad(out, params, grad.float())
    for a, b in zip(ours, torch.autograd.grad(ref, params, grad.float()), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    if k < 6:
        assert torch.count_nonzero(ours[2][0]) == 0 and torch.count_nonzero(ours[3][0]) == 0


def test_a_pair_dropped_or_duplicated_breaks_the_equality():
    """The reference comparison above can tell: routing one pair of a token twice, or not at all,
    differs."""
    cfg = _moe_config()
    moe = build(cfg, seed=1).layers[0].mlp
    x = torch.randn(10, 32)
    _, weights, chosen = moe.route(x)
    act = moe.act
    good = grouped_experts(x, chosen, weights, moe.experts.gate_up, moe.experts.down, act)
    assert torch.allclose(good, dense_reference(moe, x), atol=1e-6)
    duplicated = chosen.clone()
    duplicated[4, 1] = duplicated[4, 0]
    dropped = weights.clone()
    dropped[7, 1] = 0.0
    for c, w in ((duplicated, weights), (chosen, dropped)):
        bad = grouped_experts(x, c, w, moe.experts.gate_up, moe.experts.down, act)
        assert not torch.allclose(bad, good, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("padded", [False, True])
def test_router_losses_equal_transformers_aux_loss(family, padded, hf_dirs):
    ref = make_hf_model(family).train()
    ours = load_pretrained(hf_dirs[family]).train()
    ids = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 13:] = 0
        mask[2, 5:] = 0
    out = ref(ids, attention_mask=mask, output_router_logits=True)
    ours(ids, attention_mask=mask)
    losses = router_losses(ours, ours.config, mask)
    assert abs(losses.aux_loss.item() - out.aux_loss.item()) <= 1e-6
    # The router's gradient from the aux loss is transformers' too.
    router = ref.model.layers[0].mlp.gate.weight
    expected = torch.autograd.grad(out.aux_loss, router)[0]
    got = torch.autograd.grad(losses.aux_loss, ours.layers[0].mlp.router.weight)[0]
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    # z-loss: ST-MoE's mean squared logsumexp over the layers' (unmasked) tokens of transformers'
    # router logits.
    keep = mask.reshape(-1).bool()
    lse = torch.cat([torch.logsumexp(g.float()[keep], -1) for g in out.router_logits])
    assert abs(losses.z_loss.item() - lse.square().mean().item()) <= 1e-5
    assert abs(losses.loss.item() - ours.config.router_aux_loss_coef * out.aux_loss.item()) <= 1e-7


def test_router_logits_are_kept_in_training_only_and_released_once_read():
    model = build(_moe_config(), seed=0)
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    model(ids)
    assert router_losses(model, model.config) is None
    model.train()
    with torch.no_grad():
        model(ids)
    assert router_losses(model, model.config) is None
    model(ids)
    assert router_losses(model, model.config) is not None
    assert router_losses(model, model.config) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"experts_per_token": 7}, "experts_per_token 7 must be between 1 and num_experts 6"),
        ({"experts_per_token": 0}, "experts_per_token 0 must be between 1"),
        ({"gated_mlp": False}, "gated_mlp=true and mlp_bias=false"),
        ({"moe_every": 3}, "no layer is a MoE layer"),
        ({"dense_layers": [2]}, "dense_layers names layer 2"),
        ({"num_experts": -1}, "num_experts must be >= 0"),
    ],
)
def test_an_impossible_moe_config_fails_in_one_line_when_read(fields, message):
    with pytest.raises(UserError, match=message):
        _moe_config(**fields)


def test_moe_layers_follow_moe_every_and_dense_layers():
    cfg = _moe_config(num_layers=6, moe_every=2, dense_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    model = build(cfg, device="meta")
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "MLP",
        "MoE",
        "MLP",
        "MLP",
        "MLP",
        "MoE",
    ]


def test_a_folder_with_the_earlier_gate_up_layout_loads(tmp_path):
    """lmforge folders written before gate_up had its (experts, 2, inter, hidden) shape hold it
    as (experts, 2 * inter, hidden), the same values in the same order: the whole-model reader
    and the sharded loader take both, to the same model."""
    from safetensors.torch import load_file, save_file

    from lmforge.models.io import save_model
    from lmforge.parallel import ParallelConfig, load_sharded, meta_model, parallelize

    model = build("tiny-qwen3-moe", seed=4)
    folder = save_model(model, tmp_path / "m")
    files = list(folder.glob("*.safetensors"))
    for f in files:
        state = load_file(f)
        state = {
            n: t.flatten(1, 2) if n.endswith("experts.gate_up") else t for n, t in state.items()
        }
        assert any(t.dim() == 3 for n, t in state.items() if n.endswith("experts.gate_up"))
        save_file(state, f, metadata={"format": "pt"})
    expected = dict(model.named_parameters())
    whole = dict(load_pretrained(folder).named_parameters())
    pm = parallelize(meta_model(folder), ParallelConfig(), None)
    load_sharded(pm, folder)
    sharded = dict(pm.parts[0].named_parameters())
    for name, p in expected.items():
        assert torch.equal(whole[name], p) and torch.equal(sharded[name], p), name
