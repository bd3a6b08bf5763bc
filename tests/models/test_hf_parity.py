"""Every family against transformers: logits after import, reload after export, bit-exact round trips."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmforge.models import load_pretrained
from lmforge.models.hf import export_hf, import_hf
from tests.conftest import hf_tiny_configs, make_hf_model

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
    with torch.no_grad():
        out, expected = ours(ids, attention_mask=mask), _ref_logits(ref, ids, attention_mask=mask)
    if family == "bert_cls":
        assert (out - expected).abs().max().item() <= TOL
    else:
        valid = mask.bool()
        assert (out[valid] - expected[valid]).abs().max().item() <= TOL
    if family in DECODERS:
        left = torch.ones_like(ids)
        left[1, :9] = 0
        pos = (left.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = ours(ids, attention_mask=left, position_ids=pos)
            expected = _ref_logits(ref, ids, attention_mask=left, position_ids=pos)
        valid = left.bool()
        assert (out[valid] - expected[valid]).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_identical_weights_and_logits(family, imported, hf_dirs, tmp_path):
    out_dir = tmp_path / "hf"
    export_hf(imported[family][1], out_dir)
    cls = tf.AutoModelForMaskedLM if family == "bert" else tf.AutoModelForCausalLM
    if family == "bert_cls":
        cls = tf.AutoModelForSequenceClassification
    model, info = cls.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # Tensors are byte-identical to what transformers itself saved.
    original, exported = load_file(hf_dirs[family] / "model.safetensors"), load_file(out_dir / "model.safetensors")
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
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == before["architectures"]


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
        "lmforge.models.hf.write_safetensors", lambda t, f, d=None: original(t, f, d, max_shard_bytes=50_000)
    )
    export_hf(imported["gpt_neox"][1], tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 300, (1, 11))
    assert torch.equal(_ref_logits(model.eval(), ids), _ref_logits(make_hf_model("gpt_neox"), ids))
