"""Every family against transformers: logits after import, reload after export, bit-exact round
trips."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lmforge.errors import UserError
from lmforge.models import load_pretrained
from lmforge.models.hf import export_hf, import_hf
from tests.conftest import edited_copy, hf_tiny_configs, make_hf_model

tf = pytest.importorskip("transformers")

FAMILIES = list(hf_tiny_configs())
DECODERS = [f for f in FAMILIES if not f.startswith("bert")]
TOL = 1e-5


def _ref_logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.fixture(scope="module")
def imported(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lmforge")
    return {name: (import_hf(hf_dirs[name], root / name), root / name) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers_logits(family, imported):
    ref = make_hf_model(family)
    ours = load_pretrained(imported[family][1])
    ids = torch.randint(0, 300, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ours(ids)
    expected = _ref_logits(ref, ids)
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_with_padding_mask(family, imported):
    """Right padding (every family) and left padding with explicit positions (decoders)."""
    ref = make_hf_model(family)
    ours = load_pretrained(imported[family][1])
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding on the second row
    ids[mask == 0] = 0  # the pad id, where a config names one
    with torch.no_grad():
        out, expected = ours(ids, attention_mask=mask), _ref_logits(ref, ids, attention_mask=mask)
    if family.endswith("_cls"):
        assert (out - expected).abs().max().item() <= TOL
    else:
        valid = mask.bool()
        assert (out[valid] - expected[valid]).abs().max().item() <= TOL
    if family in DECODERS:
        left = torch.ones_like(ids)
        left[1, :9] = 0
        pos = (left.cumsum(-1) - 1).clamp(min=0)
        ids = torch.where(left.bool(), ids.clamp(min=1), 0)
        with torch.no_grad():
            out = ours(ids, attention_mask=left, position_ids=pos)
            expected = _ref_logits(ref, ids, attention_mask=left, position_ids=pos)
        valid = left.bool() if out.dim() == 3 else slice(None)
        assert (out[valid] - expected[valid]).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_identical_weights_and_logits(
    family, imported, hf_dirs, tmp_path
):
    out_dir = tmp_path / "hf"
    export_hf(imported[family][1], out_dir)
    cls = tf.AutoModelForMaskedLM if family == "bert" else tf.AutoModelForCausalLM
    if family.endswith("_cls"):
        cls = tf.AutoModelForSequenceClassification
    model, info = cls.from_pretrained(out_dir, output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ), info
    # Tensors are byte-identical to what transformers itself saved.
    original, exported = (
        load_file(hf_dirs[family] / "model.safetensors"),
        load_file(out_dir / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for k in original:
        assert torch.equal(original[k], exported[k]), k
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_ref_logits(model.eval(), ids), _ref_logits(make_hf_model(family), ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_fields_round_trip(family, imported, hf_dirs, tmp_path):
    export_hf(imported[family][1], tmp_path / "hf")
    before = tf.AutoConfig.from_pretrained(hf_dirs[family]).to_dict()
    after = tf.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    ignore = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
    keys = (before.keys() | after.keys()) - ignore
    differ = {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}
    assert not differ
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == before["architectures"]
    # The weights' dtype, as save_pretrained writes it (transformers 4 and vLLM take an absent one
    # for float32).
    assert written["torch_dtype"] == written["dtype"] == "float32" and after["dtype"] == "float32"


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_import_is_bit_exact(family, imported, tmp_path):
    export_hf(imported[family][1], tmp_path / "hf")
    cfg2 = import_hf(tmp_path / "hf", tmp_path / "again")
    assert cfg2 == imported[family][0]
    first = load_file(imported[family][1] / "model.safetensors")
    second = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    for k in first:
        assert torch.equal(first[k], second[k]), k


def test_vocabulary_padding_never_leaks(imported):
    """GPT-2's 300-token vocab is padded to 384 rows; logits and exports see only 300."""
    cfg, path = imported["gpt2"]
    assert cfg.padded_vocab_size == 384
    weights = load_file(path / "model.safetensors")
    assert weights["embed.weight"].shape[0] == 384
    assert torch.count_nonzero(weights["embed.weight"][300:]) == 0
    assert load_pretrained(path)(torch.tensor([[1, 2, 3]])).shape[-1] == 300


def test_sharded_safetensors_and_weights_only_bin(hf_dirs, tmp_path):
    model = make_hf_model("llama_gqa")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((hf_dirs["llama_gqa"] / "config.json").read_text())
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    reference = load_file(hf_dirs["llama_gqa"] / "model.safetensors")
    for src in ("sharded", "bin"):
        import_hf(tmp_path / src, tmp_path / f"{src}_lm")
        export_hf(tmp_path / f"{src}_lm", tmp_path / f"{src}_hf")
        again = load_file(tmp_path / f"{src}_hf" / "model.safetensors")
        assert all(torch.equal(reference[k], again[k]) for k in reference)


def test_large_export_is_written_in_shards(imported, tmp_path, monkeypatch):
    from lmforge.models import io

    original = io.write_safetensors
    monkeypatch.setattr(
        "lmforge.models.hf.write_safetensors",
        lambda t, f, d=None: original(t, f, d, max_shard_bytes=50_000),
    )
    export_hf(imported["gpt_neox"][1], tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 300, (1, 11))
    assert torch.equal(_ref_logits(model.eval(), ids), _ref_logits(make_hf_model("gpt_neox"), ids))


def _legacy_neox(w):
    """Pythia checkpoints on the Hub carry causal-mask and rotary buffers next to the weights."""
    for i in range(2):
        w[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(
            1, 1, 128, 128, dtype=torch.bool
        ).tril()
        w[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        w[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    return w


def _v4_neox_config(c):
    """transformers 4.x wrote rotary_pct / rotary_emb_base instead of rope_parameters."""
    rope = c.pop("rope_parameters")
    c["rotary_pct"], c["rotary_emb_base"] = rope["partial_rotary_factor"], rope["rope_theta"]


def _openai_gpt2(w):
    """The original GPT-2 conversion has no 'transformer.' prefix and keeps attn.bias buffers."""
    w = {k.removeprefix("transformer."): v for k, v in w.items()}
    w["h.0.attn.bias"] = torch.ones(1, 1, 128, 128).tril()
    return w


def _google_bert(w):
    """Google's BERT conversion: LayerNorm gamma/beta, plus the next-sentence head and pooler."""
    w = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in w.items()
    }
    w["cls.seq_relationship.weight"] = torch.zeros(2, 64)
    w["bert.pooler.dense.weight"] = torch.zeros(64, 64)
    return w


@pytest.mark.parametrize(
    ("family", "edit_weights", "edit_config"),
    [
        ("gpt_neox", _legacy_neox, _v4_neox_config),
        ("gpt2", _openai_gpt2, None),
        ("bert", _google_bert, None),
    ],
)
def test_older_checkpoint_layouts_import_to_the_same_model(
    family, edit_weights, edit_config, hf_dirs, imported, tmp_path
):
    legacy = edited_copy(hf_dirs[family], tmp_path / "legacy", edit_config, edit_weights)
    cfg = import_hf(legacy, tmp_path / "lm")
    assert cfg == imported[family][0]
    first = load_file(imported[family][1] / "model.safetensors")
    again = load_file(tmp_path / "lm" / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_tokenizer_files_travel_through_import_and_export(hf_dirs, shared_data, tmp_path):
    src = tmp_path / "with_tok"
    src.mkdir()
    for f in hf_dirs["gpt2"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (src / name).write_bytes((shared_data / "tokenizers" / "gpt2" / name).read_bytes())
    import_hf(src, tmp_path / "lm")
    export_hf(tmp_path / "lm", tmp_path / "hf")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes()
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("The quick brown fox")["input_ids"] == [464, 2068, 7586, 21831]


def test_a_tokenizer_under_its_own_name_is_exported_as_tokenizer_json(
    imported, shared_data, tmp_path
):
    """A run trained with data.tokenizer=.../20B_tokenizer.json saves it under that name;
    transformers reads only tokenizer.json (and otherwise loads an empty tokenizer without a
    word)."""
    from lmforge.tokenizers import load_tokenizer

    neox = shared_data / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json"
    model_dir = tmp_path / "lm"
    shutil.copytree(imported["gpt_neox"][1], model_dir)
    load_tokenizer(neox).save(model_dir)
    export_hf(model_dir, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == neox.read_bytes()
    text = "def main():\n    return 0  # Ünïcödé"
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == load_tokenizer(
        neox
    ).encode(text)


def test_bf16_load_runs_and_stays_close(imported):
    ours32 = load_pretrained(imported["llama_gqa"][1])
    ours16 = load_pretrained(imported["llama_gqa"][1], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = ours32(ids), ours16(ids).float()
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def _saved(model, folder):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(folder)
    return folder


def test_a_switch_the_family_hard_wires_is_refused_at_export(imported, tmp_path):
    import dataclasses

    from lmforge.models.io import write_config

    cfg, path = imported["qwen2"]
    folder = tmp_path / "lm"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    write_config(folder, dataclasses.replace(cfg, attention_bias=True))
    with pytest.raises(
        UserError, match=r"a qwen2 checkpoint has attention_bias=False, this model has True"
    ):
        export_hf(folder, tmp_path / "hf")


def test_qwen2_window_on_the_upper_layers_only(tmp_path):
    """use_sliding_window with max_window_layers 1: layer 0 sees everything, layer 1 an 8-token
    window."""
    from lmforge.inference import generate, left_pad

    torch.manual_seed(0)
    config = tf.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    ref = tf.Qwen2ForCausalLM(config)
    cfg = import_hf(_saved(ref, tmp_path / "hf"), tmp_path / "lm")
    assert [cfg.window(i) for i in range(2)] == [None, 8]
    ours = load_pretrained(tmp_path / "lm")
    ids = torch.randint(0, 300, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (ours(ids) - _ref_logits(ref, ids)).abs().max().item() <= TOL
    prompts = [[5, 17, 33, 2, 99, 150, 7, 41, 8, 3, 4], [8, 9, 10]]
    ids, mask = left_pad(prompts, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert (
        generate(ours, prompts, 12, do_sample=False, stop_token_ids=[])
        == expected[:, ids.shape[1] :].tolist()
    )
    export_hf(tmp_path / "lm", tmp_path / "out")
    before = tf.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    after = tf.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        assert before[key] == after[key], key


# Rotary decoders whose transformers model takes any position id (GPT-J reads a fixed sin/cos
# table).
LONG_POSITIONS = [f for f in DECODERS if not f.startswith(("gpt2", "gptj"))]


@pytest.mark.parametrize("family", LONG_POSITIONS)
def test_bf16_logits_at_long_positions_are_as_close_to_fp32_as_transformers_bf16(family, imported):
    """At positions 4000+, where a rounded rotary angle is off by radians, our bf16 model is as
    close to the fp32 reference as transformers' own bf16 model (mean |error|; each rounds
    differently, neither is exact)."""
    ref = make_hf_model(family)
    ids = torch.randint(1, 300, (4, 64), generator=torch.Generator().manual_seed(6))
    pos = (4000 + torch.arange(64)).expand(4, 64)
    with torch.no_grad():
        exact = _ref_logits(ref, ids, position_ids=pos)
        theirs = _ref_logits(ref.to(torch.bfloat16), ids, position_ids=pos).float()
        ours = load_pretrained(imported[family][1], dtype=torch.bfloat16)(
            ids, position_ids=pos
        ).float()
    their_err, our_err = (theirs - exact).abs().mean().item(), (ours - exact).abs().mean().item()
    assert our_err <= 1.15 * their_err, (our_err, their_err)


def test_gemma3_as_published_imports_its_language_model(tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: the text model comes out of it (vision
    tower left behind), equals the multimodal model on text, and exports as a Gemma3ForCausalLM
    folder."""
    _, text = hf_tiny_configs()["gemma3"]
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(0)
    config = tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    ref = tf.Gemma3ForConditionalGeneration(config)
    cfg = import_hf(_saved(ref, tmp_path / "hf"), tmp_path / "lm")
    assert cfg.family == "gemma3_text" and cfg.rotary_base_local == 10000.0
    ids = torch.randint(0, 290, (2, 37), generator=torch.Generator().manual_seed(7))
    expected = _ref_logits(ref, ids)
    with torch.no_grad():
        assert (load_pretrained(tmp_path / "lm")(ids) - expected).abs().max().item() <= TOL
    export_hf(tmp_path / "lm", tmp_path / "out")
    text_model, info = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not any(info.values()), info
    assert (_ref_logits(text_model.eval(), ids) - expected).abs().max().item() <= TOL


def test_a_config_transformers_would_reject_fails_when_read(hf_dirs, tmp_path):
    folder = edited_copy(
        hf_dirs["gemma2"], tmp_path / "odd", lambda c: c.update(num_attention_heads=3)
    )
    with pytest.raises(
        UserError,
        match=r"^hidden_size 64 is not divisible by num_heads 3 \(transformers rejects such "
        r"a gemma2 config, even with head_dim set\): use num_heads=4 or "
        r"hidden_size=66 \(a Hugging Face config.json: num_attention_heads\)$",
    ):
        import_hf(folder, tmp_path / "lm")


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        (
            "mixtral",
            {"num_experts_per_tok": 5},
            r"^experts_per_token 5 must be between 1 and num_experts 4: ",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [0, 1]},
            r"^num_experts is 8 but no layer is a MoE layer ",
        ),
        (
            "mixtral",
            {"router_jitter_noise": 0.1},
            r"^router_jitter_noise 0.1 in config.json is not supported",
        ),
    ],
)
def test_an_impossible_moe_config_json_fails_when_read(family, edit, message, hf_dirs, tmp_path):
    folder = edited_copy(hf_dirs[family], tmp_path / "odd", lambda c: c.update(edit))
    with pytest.raises(UserError, match=message):
        import_hf(folder, tmp_path / "lm")
    assert not (tmp_path / "lm").exists()


@pytest.mark.parametrize(
    "family",
    [
        f
        for f in DECODERS
        if f.startswith(("llama", "qwen", "mistral", "gemma", "olmo2", "phi3", "mixtral"))
    ],
)
def test_a_null_attention_dropout_in_config_json_reads_as_no_dropout(family, hf_dirs):
    """`"attention_dropout": null` (written by some conversions) read as 0.0 for Gemma but
    stopped the Llama-named families with a TypeError (None <= 1.0) once their shared reader took
    the field as it was."""
    from lmforge.models.hf import adapter_for, read_hf_config
    from lmforge.models.hf.weights import HFWeights

    hf = read_hf_config(hf_dirs[family])
    keys = HFWeights(hf_dirs[family]).keys()
    adapter = adapter_for(hf["model_type"])
    assert adapter.config_from_hf(
        {**hf, "attention_dropout": None}, keys
    ) == adapter.config_from_hf({**hf, "attention_dropout": 0.0}, keys)
