"""A PEFT adapter against the base it is loaded onto: one of another width or depth is one line
naming the first tensor that does not fit (with both shapes) and the base the adapter records,
the model untouched (it was a RuntimeError traceback from permute_rotary's reshape); one of the
same shapes but another base folder warns; an adapter folder named as a training run's
model.init_from says what to do instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import load_pretrained
from lmforge.models.lora import lora_modules
from lmforge.models.peft_read import load_peft_adapter
from tests.conftest import hf_tiny_configs, make_hf_model

tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Each Hugging Face q/k/v layout once: grouped (NeoX), separate (Llama), fused rows and gate_up
# (Phi-3), Conv1D (GPT-2)
TARGETS = {
    "gpt_neox": ["query_key_value", "dense_4h_to_h"],
    "llama": ["q_proj", "v_proj", "down_proj"],
    "phi3": ["qkv_proj", "gate_up_proj"],
    "gpt2": ["c_attn", "c_proj"],
}


def peft_adapter(base: Path, out: Path, targets: list[str]) -> Path:
    """PEFT's own adapter folder over the HF folder `base`, B random (as after training): PEFT
    records `base` as its base_model_name_or_path."""
    model = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
    )
    model.save_pretrained(out)
    return out


def resized(family: str, out: Path, **changes) -> Path:
    """The tiny `family` model with config `changes` (hidden_size=128, num_hidden_layers=1 ...),
    saved at `out`."""
    cls, cfg = hf_tiny_configs()[family]
    settings = cfg.to_dict()
    if family == "gpt2" and "hidden_size" in changes:
        changes["n_embd"] = changes.pop("hidden_size")
    cls(type(cfg)(**{**settings, **changes})).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft_fit")
    out = {}
    for family in TARGETS:
        make_hf_model(family).save_pretrained(root / family)
        out[family] = root / family
    return out


@pytest.mark.parametrize("family", list(TARGETS))
def test_an_adapter_of_another_width_is_one_line_naming_the_tensor_and_its_base(
    family, bases, tmp_path
):
    adapter = peft_adapter(bases[family], tmp_path / "adapter", TARGETS[family])
    wide = load_pretrained(resized(family, tmp_path / "wide", hidden_size=128))
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(UserError) as e:
        load_peft_adapter(wide, adapter)
    message = str(e.value)
    head = f"'{adapter}' does not fit this {family} model: its "
    assert message.startswith(head) and "\n" not in message
    tensor = message.removeprefix(head).split(" ")[0]
    with open(adapter / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(bases[family])
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        shape = next(tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith(tensor))
    assert f"has shape {shape}, the layer it adapts here takes (" in message and 64 in shape
    assert message.endswith(
        f": load it onto the model it was trained on, {bases[family]} (its base_model_name_or_path)"
    )
    assert not list(lora_modules(wide))  # refused before anything was wrapped
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())


def test_an_adapter_of_a_deeper_model_names_a_module_the_base_lacks(bases, tmp_path):
    adapter = peft_adapter(bases["llama"], tmp_path / "adapter", TARGETS["llama"])
    shallow = load_pretrained(resized("llama", tmp_path / "shallow", num_hidden_layers=1))
    with pytest.raises(UserError) as e:
        load_peft_adapter(shallow, adapter)
    assert str(e.value) == (
        f"'{adapter}' holds 6 tensor(s) this llama model has no place for, first "
        "'model.layers.1.mlp.down_proj.lora_A.weight': is it an adapter of another model? Load it "
        f"onto the model it was trained on, {bases['llama']} (its base_model_name_or_path)"
    )
    assert not list(lora_modules(shallow))


def test_an_experts_adapter_of_another_count_of_experts_does_not_fit_by_chance(tmp_path):
    """PEFT's stacked-expert factors are (rank * experts, in): 4 experts at rank 4 has the rows
    of 8 at rank 2, so the rows are checked against the adapter's rank (r, rank_pattern) times
    this model's experts."""
    make_hf_model("mixtral").save_pretrained(tmp_path / "mixtral")
    model = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral"),
        peft.LoraConfig(
            r=4,
            target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,
        ),
    )
    model.save_pretrained(tmp_path / "adapter")
    # its own base
    assert load_peft_adapter(load_pretrained(tmp_path / "mixtral"), tmp_path / "adapter") == 2
    more = load_pretrained(resized("mixtral", tmp_path / "more", num_local_experts=8))
    with pytest.raises(UserError) as e:
        load_peft_adapter(more, tmp_path / "adapter")
    assert str(e.value).startswith(
        f"'{tmp_path / 'adapter'}' does not fit this mixtral model: its model.layers.0.mlp."
        "experts.base_layer.lora_A.weight has shape (16, 64), the layer it adapts here "
        "takes (32, 64): load it onto the model it was trained on, "
    )
    assert not list(lora_modules(more))


def test_a_lora_factor_without_its_pair_is_one_line(bases, tmp_path):
    from safetensors.torch import load_file, save_file

    adapter = peft_adapter(bases["gpt_neox"], tmp_path / "adapter", TARGETS["gpt_neox"])
    tensors = load_file(adapter / "adapter_model.safetensors")
    dropped = next(k for k in tensors if k.endswith("lora_B.weight"))
    del tensors[dropped]
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(UserError, match="without its lora_B: the adapter file is incomplete"):
        load_peft_adapter(load_pretrained(bases["gpt_neox"]), adapter)


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lmforge.models.peft_read" and r.levelname == "WARNING"
    ]


def test_an_adapter_loaded_onto_another_folder_of_the_same_shapes_warns(bases, tmp_path, caplog):
    from lmforge.models.hf import import_hf

    small = bases["gpt_neox"]
    adapter = peft_adapter(small, tmp_path / "adapter", TARGETS["gpt_neox"])
    # the same architecture and size, other weights (a fine-tune, another seed)
    other = tmp_path / "other"
    make_hf_model("gpt_neox", seed=1).save_pretrained(other)
    with caplog.at_level("WARNING", logger="lmforge.models.peft_read"):
        load_peft_adapter(load_pretrained(other), adapter)  # the folder as load_pretrained noted it
    assert _warnings(caplog) == [
        f"PEFT adapter {adapter} was trained on {small} (its base_model_name_or_path) but "
        f"is loaded onto {other}: the shapes fit, but unless that folder holds the same "
        f"weights the adapter computes something else there: give it its own base, {small}"
    ]
    caplog.clear()

    (tmp_path / "link").symlink_to(small)
    # an lmforge folder of the same weights: lmforge.json names its source
    import_hf(small, tmp_path / "imported")
    with caplog.at_level("WARNING", logger="lmforge.models.peft_read"):
        for same in (small, tmp_path / "link", tmp_path / "imported"):
            load_peft_adapter(load_pretrained(same), adapter)
        # the caller says which folder it read
        load_peft_adapter(load_pretrained(other), adapter, base=small)
    assert _warnings(caplog) == []


def test_an_adapter_named_as_model_init_from_says_to_start_from_its_base(bases, tmp_path, capsys):
    from lmforge.cli import main
    from lmforge.train.config import load_run_config

    adapter = peft_adapter(bases["gpt_neox"], tmp_path / "adapter", TARGETS["gpt_neox"])
    expected = (
        f"'{adapter}' is a PEFT adapter (adapter_config.json), not a model: point model.init_from at its base "
        f"model ({bases['gpt_neox']}); to train the adapter further, resume the run that wrote it"
    )
    with pytest.raises(UserError) as e:
        load_run_config(None, [f"model.init_from={adapter}"]).model.resolve()
    assert str(e.value) == expected

    recipe = Path(__file__).resolve().parents[2] / "configs" / "lora-pythia-410m.yaml"
    run = tmp_path / "run"
    capsys.readouterr()  # transformers' loading bar, building the adapter
    assert (
        main(
            [
                "finetune",
                str(recipe),
                f"model.init_from={adapter}",
                f"run_dir={run}",
                "trainer.device=cpu",
            ]
        )
        == 1
    )
    assert capsys.readouterr().err == f"error: {expected}\n"
    assert not run.exists()

    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": None})
    )
    with pytest.raises(
        UserError,
        match=r"point model.init_from at its base model \(the one it was trained on: its "
        r"adapter_config.json names none\)",
    ):
        load_run_config(None, [f"model.init_from={adapter}"]).model.resolve()
