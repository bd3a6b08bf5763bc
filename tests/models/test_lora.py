"""LoRA adapters against PEFT, per family: the adapted model, the merged one, PEFT's base +
adapter folder and transformers' merged export compute the same logits; an adapter starts as a
no-op; bad targets are one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build, load_pretrained
from lmforge.models.hf import export_hf
from lmforge.models.io import materialize, save_model
from lmforge.models.lora import LoRAConfig, apply_lora, merge_lora
from lmforge.models.lora_state import merged_state, split_state
from lmforge.models.peft import write_peft_adapter
from lmforge.models.peft_read import load_peft_adapter

tf = pytest.importorskip("transformers")
TOL = 1e-5
# Each decoder family once, with the q/k/v layouts Hugging Face has: separate (Llama, GQA too;
# GPT-J), grouped (GPT-NeoX, partial rotary), stacked Conv1D (GPT-2) and fused rows (Phi-3, whose
# gate_up_proj also holds two of lmforge's projections).
FAMILIES = ["llama_gqa", "gpt_neox", "gpt2", "gptj", "phi3"]


def _ids():
    return torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3))


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """Adapters as after training: B away from its zero init."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_an_adapter_starts_as_the_base_and_merges_exactly(hf_dirs, tmp_path):
    ids = _ids()
    base = load_pretrained(hf_dirs["llama_gqa"])
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(rank=4, targets="all-linear"), seed=0)
    assert torch.equal(_logits(model, ids), _logits(base, ids))
    adapted = _logits(_trained(model), ids)
    assert (_logits(merge_lora(copy.deepcopy(model)), ids) - adapted).abs().max() <= TOL
    _, adapters = split_state(model.state_dict())
    write_peft_adapter(adapters, model.config, 4, 16.0, 0.0, tmp_path)
    load_peft_adapter(base, tmp_path)  # PEFT's format and back: the same adapters
    assert (_logits(base, ids) - adapted).abs().max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_match_peft_and_merge_exactly(family, hf_dirs, tmp_path):
    peft = pytest.importorskip("peft")
    ids = _ids()
    base = load_pretrained(hf_dirs[family])
    reference = _logits(base, ids)
    lora = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    model = copy.deepcopy(base)
    apply_lora(model, lora, seed=0)
    assert (_logits(model, ids) - reference).abs().max() == 0  # B = 0: the base's output exactly
    adapted = _logits(_trained(model), ids)
    assert (adapted - reference).abs().max() > 1e-3

    merged = _logits(merge_lora(copy.deepcopy(model)), ids)
    assert (merged - adapted).abs().max() <= TOL

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
    with_peft = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    assert (_logits(with_peft, ids) - adapted).abs().max() <= TOL

    reloaded = copy.deepcopy(base)
    load_peft_adapter(reloaded, tmp_path / "adapter")
    assert (_logits(reloaded, ids) - adapted).abs().max() <= TOL

    state = merged_state(dict(model.state_dict()), model.config, lora.scaling)
    save_model(materialize(model.config, state.items()), tmp_path / "merged")
    export_hf(tmp_path / "merged", tmp_path / "hf")
    hf_merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (_logits(hf_merged, ids) - adapted).abs().max() <= TOL


@pytest.mark.parametrize(
    "family, targets",
    [
        ("llama_gqa", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
        ("phi3", ["qkv_proj", "gate_up_proj", "down_proj"]),
    ],
)
def test_an_adapter_made_by_peft_loads_as_peft_computes_it(family, targets, hf_dirs, tmp_path):
    """The reading direction against PEFT itself: PEFT's adapter (one A shared by Phi-3's fused
    gate and up rows, where lmforge adapts each apart) gives lmforge the logits PEFT computes."""
    peft = pytest.importorskip("peft")
    ids = _ids()
    theirs = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family]),
        peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False),
    )
    theirs.eval().save_pretrained(tmp_path)
    ours = load_pretrained(hf_dirs[family])
    base = _logits(ours, ids)
    load_peft_adapter(ours, tmp_path)
    expected = _logits(theirs, ids)
    assert (expected - base).abs().max() > 1e-3
    assert (_logits(ours, ids) - expected).abs().max() <= TOL


def test_lora_counts_modules_as_peft_does(hf_dirs, caplog):
    with caplog.at_level("INFO", logger="lmforge.models.lora"):
        apply_lora(
            load_pretrained(hf_dirs["llama_gqa"]), LoRAConfig(rank=2, targets="all-linear"), seed=0
        )
        apply_lora(
            load_pretrained(hf_dirs["phi3"]), LoRAConfig(rank=2, targets="all-linear"), seed=0
        )
    llama, phi3 = [r.getMessage() for r in caplog.records if "LoRA rank" in r.getMessage()]
    # q, k, v, o, gate, up, down in each
    assert "in 2 blocks (14 modules as PEFT counts them)" in llama
    # qkv_proj, o_proj, gate_up_proj, down_proj
    assert "in 2 blocks (8 modules as PEFT counts them)" in phi3


def test_targets_and_trainable_parameters(hf_dirs):
    model = load_pretrained(hf_dirs["llama_gqa"])
    trainable = apply_lora(model, LoRAConfig(rank=2, targets="q,v"), seed=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    cfg = model.config
    per_layer = 2 * (cfg.hidden_size + cfg.num_heads * cfg.head_dim) + 2 * (
        cfg.hidden_size + cfg.num_kv_heads * cfg.head_dim
    )
    # q and v, rank 2: as PEFT's r=2 on q_proj, v_proj
    assert trainable == cfg.num_layers * per_layer
    assert "layers.0.attn.qkv.weight" in dict(model.named_parameters())  # the base keeps its names
    # PEFT's own target_modules, Hugging Face's module names, mean the same adapters.
    assert LoRAConfig(targets="q_proj,v_proj").targets == ["q", "v"]
    assert LoRAConfig(targets=["query_key_value", "dense_4h_to_h"]).targets == [
        "q",
        "k",
        "v",
        "down",
    ]
    assert LoRAConfig(targets="c_attn,c_proj").targets == ["q", "k", "v", "o", "down"]
    # Mixtral's experts, as PEFT names them
    assert LoRAConfig(targets="w1,w3,w2").targets == ["gate", "up", "down"]


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"rank": 0}, "lora.rank must be >= 1, got 0"),
        ({"targets": "q,query"}, "lora.targets: unknown target 'query'"),
        ({"targets": "gate"}, "lora.targets: gate matches no module of this gpt_neox model"),
        ({"targets": "q,v"}, "gpt_neox keeps q, k and v in one projection"),
        # PEFT's names are echoed as written, with what they were read as and the name that works.
        (
            {"targets": "q_proj"},
            r"^lora.targets: gpt_neox keeps q, k and v in one projection \(as Hugging Face does: "
            r"query_key_value\), .*: target q,k,v together \(or query_key_value\), not q_proj "
            r"\(read as q\)$",
        ),
        (
            {"targets": "gate_proj"},
            r"^lora.targets: gate_proj \(read as gate\) matches no module of this gpt_neox model "
            r"\(it has q, k, v, o, up, down\): drop it$",
        ),
    ],
)
def test_bad_settings_are_one_line(setting, message, hf_dirs):
    with pytest.raises(UserError, match=message) as e:
        apply_lora(load_pretrained(hf_dirs["gpt_neox"]), LoRAConfig(**setting))
    assert "\n" not in str(e.value)


def test_a_bf16_base_trains_fp32_adapters(hf_dirs):
    model = load_pretrained(hf_dirs["llama_gqa"])
    apply_lora(model, LoRAConfig(rank=2, targets="all-linear", bf16_base=True), seed=0)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    model(_ids()).float().logsumexp(-1).mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_peft_target_modules_are_short_names_only_where_unambiguous():
    from lmforge.models import preset
    from lmforge.models.peft import target_names

    gpt2 = preset("tiny-gpt2")
    attn_out = ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]
    assert target_names(attn_out, gpt2) == attn_out  # "c_proj" would also take mlp.c_proj
    every = attn_out + ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]
    assert target_names(every, gpt2) == ["c_proj"]


@pytest.mark.slow  # torchao's import and NF4's Python-level ops: ~20 s here
def test_an_nf4_base_trains_adapters_and_merges_close_to_the_bf16_base(hf_dirs):
    """QLoRA on the CPU: the blocks' linear weights in torchao's NF4, fp32 adapters that get
    gradients, and a merged model that computes what the NF4 base + adapter computes (to bf16
    rounding) and stays close to the bf16 base."""
    pytest.importorskip("torchao")
    from lmforge.models.nf4 import dense, nf4_api

    _, nf4_tensor = nf4_api()
    bf16 = load_pretrained(hf_dirs["llama_gqa"])
    apply_lora(bf16, LoRAConfig(rank=2, targets="all-linear", base_dtype="bf16"), seed=0)
    _trained(bf16)
    nf4 = load_pretrained(hf_dirs["llama_gqa"])
    apply_lora(nf4, LoRAConfig(rank=2, targets="all-linear", base_dtype="nf4"), seed=0)
    nf4.load_state_dict({k: v for k, v in bf16.state_dict().items() if ".lora_" in k}, strict=False)
    quantized = {n for n, p in nf4.named_parameters() if isinstance(p, nf4_tensor)}
    assert quantized and all(n.startswith("layers.") and n.endswith(".weight") for n in quantized)
    # Each NF4 weight is its bf16 weight to within half the widest gap of the 16 NF4 levels (0.1519
    # of a 64-weight block's absmax; the absmax itself is stored in 8 bits, hence the margin).
    params = dict(bf16.named_parameters())
    for n in quantized:
        w, q = params[n].float(), dense(dict(nf4.named_parameters())[n]).float()
        absmax = w.reshape(-1, 64).abs().amax(-1, keepdim=True)
        assert ((q - w).reshape(-1, 64).abs() <= 0.16 * absmax * 1.05).all(), n
    # Gradients reach the fp32 adapters through the NF4 weights, and nothing else.
    ids = _ids()
    nf4.train()
    nf4(ids).float().logsumexp(-1).mean().backward()
    grads = {n for n, p in nf4.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in nf4.named_parameters() if p.requires_grad} and grads
    assert all(p.grad.dtype == torch.float32 for p in nf4.parameters() if p.grad is not None)
    nf4.eval()
    bf16.eval()
    adapted = _logits(nf4, ids).float()
    # what a run's model/ and hf/ get
    exported = merged_state(dict(nf4.state_dict()), nf4.config, 16 / 2)
    assert not any(isinstance(t, nf4_tensor) for t in exported.values())
    # in place: torchao cannot deepcopy a small NF4 weight
    merged = _logits(merge_lora(nf4), ids).float()
    plain = load_pretrained(hf_dirs["llama_gqa"]).to(torch.bfloat16)
    plain.load_state_dict(exported)
    assert torch.equal(_logits(plain, ids).float(), merged)
    reference = _logits(bf16, ids).float()
    scale = reference.abs().max().item()
    # Merging folds the update into the dequantized bf16 weight: the same function up to bf16
    # rounding (2^-8 relative, a few roundings deep).
    assert (merged - adapted).abs().max().item() <= 0.02 * scale
    # Against the unquantized bf16 base + the same adapters, as a relative error of the logits (a
    # tiny random model has no outliers to hide behind, so the bound is relative, not absolute): NF4
    # must do about as well as the plain 4-bit alternative, round-to-nearest on 15 evenly spaced
    # levels per 64-weight absmax block (QLoRA's Int4 baseline), applied to the same weights.
    int4 = copy.deepcopy(bf16)
    with torch.no_grad():
        for n, p in int4.named_parameters():
            if n in quantized:
                w = p.float().reshape(-1, 64)
                absmax = w.abs().amax(-1, keepdim=True)
                p.copy_(((w / absmax * 7).round() / 7 * absmax).reshape(p.shape))

    def rel(x):
        return ((x - reference).norm() / reference.norm()).item()

    # Measured: 0.217 (NF4) and 0.212 (Int4) on this tiny random model, whose scales are themselves
    # quantized in 16-block groups; 10% room over Int4.
    assert rel(merged) <= 1.1 * rel(_logits(int4, ids).float())


@pytest.mark.parametrize(
    "preset_name,targets",
    [
        ("tiny-llama", "all-linear"),
        ("tiny-llama", "q,v"),
        ("tiny-llama", "k,o,down"),
        ("tiny-mixtral", "all-linear"),
        ("tiny-qwen3-moe", "q,experts.down"),
        ("tiny-qwen3-moe", "gate,up,down,router"),
    ],
)
def test_adapters_of_a_meta_model_start_as_a_whole_models(preset_name, targets):
    """A model wrapped on the meta device (a layout that shards it), then allocated, its base
    initialised without the adapters and init_adapters called, holds what apply_lora on the whole
    model holds, bit for bit: the same A drawn from the seed in the same order (nn.ParameterDict
    sorts a fused qkv's parts: k before q; the stacked experts' adapters after every linear's), B
    zeros."""
    from lmforge.models import init_weights
    from lmforge.models.lora import init_adapters, is_adapter

    lora = LoRAConfig(rank=3, targets=targets, base_dtype="bf16")
    whole = build(preset_name, seed=5)
    apply_lora(whole, lora, seed=11)
    meta = build(preset_name, device="meta")
    apply_lora(meta, lora, seed=11)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="does not know how to initialise .*lora_A"):
        init_weights(meta, meta.config, seed=5)
    init_weights(meta, meta.config, seed=5, skip=is_adapter)
    init_adapters([meta], lora, seed=11)
    assert meta.state_dict().keys() == whole.state_dict().keys()
    for name, t in whole.state_dict().items():
        got = meta.state_dict()[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    a = [t for n, t in whole.state_dict().items() if ".lora_A." in n]
    assert a and all(t.abs().max() > 0 for t in a) and len({t.sum().item() for t in a}) == len(a)


@pytest.mark.slow  # torchao's import
def test_an_nf4_base_read_onto_a_meta_model_equals_the_whole_models_quantization(hf_dirs, tmp_path):
    """QLoRA's base as a run builds it (lmforge.parallel.load.read_nf4_base): a LoRA-wrapped meta
    model whose linear weights are read block by block from an HF or lmforge folder and
    quantized, the rest filled after. Every NF4 weight holds the same bits as apply_lora's
    quantization of the whole bf16 model, and the logits are equal."""
    pytest.importorskip("torchao")
    from lmforge.models.build import materialize_meta
    from lmforge.models.nf4 import is_nf4, nf4_weights, scaler_block
    from lmforge.parallel.load import read_nf4_base

    lora = LoRAConfig(rank=2, targets="all-linear", base_dtype="nf4")
    whole = load_pretrained(hf_dirs["llama_gqa"], dtype=torch.bfloat16)
    apply_lora(whole, lora, seed=0)
    save_model(load_pretrained(hf_dirs["llama_gqa"]), tmp_path / "lmforge")
    for source in (hf_dirs["llama_gqa"], tmp_path / "lmforge"):
        model = build(whole.config, device="meta")
        apply_lora(model, lora, seed=0)
        assert not any(is_nf4(p) for p in model.parameters())  # on meta: nothing quantized yet
        read_nf4_base(model, source, torch.device("cpu"))
        assert {n for n, p in model.named_parameters() if not p.is_meta} == {
            # only the NF4 weights are read before the layout
            n
            for n, p in whole.named_parameters()
            if is_nf4(p)
        }
        materialize_meta(model, torch.device("cpu"))
        model.load_state_dict(
            {k: v for k, v in whole.state_dict().items() if not is_nf4(v)}, strict=False
        )
        for module in model.modules():
            if module._non_persistent_buffers_set:
                module.reset_parameters()
        theirs = dict(whole.named_parameters())
        for name, p in model.named_parameters():
            if is_nf4(p):
                for inner in p.__tensor_flatten__()[0]:
                    assert torch.equal(getattr(p, inner), getattr(theirs[name], inner)), (
                        name,
                        inner,
                    )
        assert torch.equal(_logits(model.eval(), _ids()), _logits(whole.eval(), _ids()))
    # The scale groups come in multiples of 64 where a weight's size allows, so FSDP2 over 2..64
    # ranks splits each (torchao splits along whole groups); large weights keep QLoRA's 256.
    assert [scaler_block(b) for b in (8, 512, 1792, 9216, 131072, 262144, 12)] == [
        1,
        8,
        28,
        144,
        256,
        256,
        3,
    ]
    quantized, _ = nf4_weights(whole)
    assert all(getattr(*site).quantization_factor.numel() % 8 == 0 for site in quantized.values())


@pytest.mark.slow  # torchao's import
def test_an_nf4_base_is_read_a_block_at_a_time_never_whole_in_bf16(tmp_path):
    """read_nf4_base holds the NF4 weights plus one block's weights in bf16 (and the source
    tensor being copied), where quantizing a whole model held its whole bf16 base beside the NF4
    one: 8 blocks of linears here."""
    pytest.importorskip("torchao")
    from lmforge.models.nf4 import nf4_weights
    from lmforge.parallel.load import read_nf4_base
    from tests.parallel.meter import AllocationMeter

    cfg = {
        **build("tiny-llama", device="meta").config.__dict__,
        "vocab_size": 128,
        "hidden_size": 256,
        "num_heads": 4,
        "num_kv_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1024,
        "num_layers": 8,
    }
    save_model(build(cfg, seed=0), tmp_path / "model")
    model = build(cfg, device="meta")
    lora = LoRAConfig(rank=2, targets="all-linear", base_dtype="nf4")
    apply_lora(model, lora, seed=0)
    linears = sum(getattr(*site).numel() for site in nf4_weights(model)[0].values())
    with AllocationMeter() as meter:
        read_nf4_base(model, tmp_path / "model", torch.device("cpu"))
    nf4 = sum(
        sum(getattr(w, n).nbytes for n in w.__tensor_flatten__()[0])
        for w in (getattr(*site) for site in nf4_weights(model)[0].values())
    )
    block = linears // 8
    # The meter counts the mapped safetensors file whole (page cache, not the process's own memory):
    # less that, the NF4 weights (~0.53 bytes a weight), one block in bf16 and the source slice
    # being copied: ~5 MB here, against the whole bf16 base's 16.8 MB (+ the NF4 weights) that
    # quantizing a whole model holds.
    held = meter.peak - (tmp_path / "model" / "model.safetensors").stat().st_size
    assert held <= nf4 + block * 2 * 2 + (1 << 20), (held, nf4, linears * 2)
    assert held < linears * 2 // 2


def _classifier(family: str, hf_dirs) -> torch.nn.Module:
    """lmforge's classifier of 3 labels over the family's folder: BERT's as saved (pooler and
    classifier), a decoder's a new score head (seeded) on its language model, as `lmforge
    finetune data.task=classification` builds it."""
    from lmforge.train.setup import with_head

    if family == "bert_cls":
        return load_pretrained(hf_dirs[family]).eval()
    return with_head(load_pretrained(hf_dirs[family]), 3, seed=0).eval()


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2", "bert_cls"])
def test_a_classifier_trains_its_head_whole_as_pefts_seq_cls_task(family, hf_dirs, tmp_path):
    """PEFT's SEQ_CLS task keeps the classification head trainable and saves it whole
    (modules_to_save); lmforge's LoRA on a classifier does the same: the adapted model, PEFT's
    base + adapter folder, lmforge's base + the same folder and transformers' merged export give
    the same class logits; the BERT pooler stays frozen, as in PEFT."""
    peft = pytest.importorskip("peft")
    # no 0: PEFT's side pads by 0
    ids = torch.randint(1, 300, (2, 19), generator=torch.Generator().manual_seed(3))
    lora = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    model = _classifier(family, hf_dirs)
    reference = _logits(model, ids)
    apply_lora(model, lora, seed=0)
    head = "classifier" if family == "bert_cls" else "score"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if ".lora_" not in n} == {
        n for n, _ in model.named_parameters() if n.startswith(head + ".")
    }
    assert torch.equal(_logits(model, ids), reference)
    _trained(model)
    with torch.no_grad():
        getattr(model, head).weight.add_(torch.randn_like(getattr(model, head).weight) * 0.5)
    adapted = _logits(model, ids)
    assert adapted.shape == (2, 3) and (adapted - reference).abs().max() > 1e-3

    state = dict(model.state_dict())
    base_state, adapters = split_state(state)
    write_peft_adapter(
        adapters,
        model.config,
        lora.rank,
        lora.alpha,
        0.0,
        tmp_path,
        str(hf_dirs[family]),
        heads={n: t for n, t in base_state.items() if n.startswith(head + ".")},
    )
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == [head]
    hf_base = tf.AutoModelForSequenceClassification.from_pretrained(
        hf_dirs[family], num_labels=3, pad_token_id=0
    )
    with_peft = peft.PeftModel.from_pretrained(hf_base.eval(), tmp_path).eval()
    assert (_logits(with_peft, ids) - adapted).abs().max() <= TOL

    reloaded = _classifier(family, hf_dirs)
    load_peft_adapter(reloaded, tmp_path)  # the adapters and the head, from PEFT's folder
    assert (_logits(reloaded, ids) - adapted).abs().max() <= TOL
    # serve
    with pytest.raises(
        UserError, match="a sequence classifier's adapter .* not into a language model"
    ):
        load_peft_adapter(load_pretrained(hf_dirs[family.removesuffix("_cls")]), tmp_path)

    save_model(
        materialize(model.config, merged_state(state, model.config, lora.scaling).items()),
        tmp_path / "m",
    )
    export_hf(tmp_path / "m", tmp_path / "hf")
    hf_merged = tf.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", pad_token_id=0
    ).eval()
    assert (_logits(hf_merged, ids) - adapted).abs().max() <= TOL


def test_under_autocast_a_bf16_base_feeds_the_adapters_without_an_fp32_round_trip(monkeypatch):
    """A bf16 base's activations went to the fp32 adapters' dtype and autocast cast them straight
    back (two activation-sized copies forward, one backward). Now they go in as they are: the
    same output, input gradient and adapter gradients, bit for bit, as with the round trip, and
    no activation-sized cast."""
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmforge.models.lora import LoRALinear

    torch.manual_seed(0)
    base = nn.Linear(256, 512).bfloat16().requires_grad_(False)
    module = LoRALinear(base, ["all"], 16, 32, 0.0)
    with torch.no_grad():
        for b in module.lora_B.values():
            b.normal_()
    x0 = torch.randn(4, 64, 256).bfloat16()

    class Casts(TorchDispatchMode):
        sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy:
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    def step(round_trip: bool) -> list[torch.Tensor]:
        real = torch.is_autocast_enabled
        if round_trip:  # what the module did before: x cast to the adapters' fp32
            monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False)
        x = x0.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16), Casts() as casts:
            y = module(x)
            (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        monkeypatch.setattr(torch, "is_autocast_enabled", real)
        step.casts = casts.sizes[:]
        casts.sizes.clear()
        return [y.detach(), x.grad, *(p.grad for p in module.parameters() if p.requires_grad)]

    before = step(round_trip=True)
    # x to fp32 and back to bf16; its gradient the same two ways
    assert step.casts.count(x0.numel()) == 4
    after = step(round_trip=False)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the adapters' weights are cast (and the test's loss), not x
    assert x0.numel() not in step.casts
