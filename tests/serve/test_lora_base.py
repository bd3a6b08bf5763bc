"""`generate` and `serve` with --lora against the model they load: another base's adapter is one
line naming the tensor and the adapter's own base (it was a RuntimeError traceback), the same
shapes from another folder warn, and an adapter folder given as the model says to pass its base
with --lora."""

from __future__ import annotations

import socket

import pytest

from lmforge.cli import main
from tests.conftest import hf_tiny_configs

peft = pytest.importorskip("peft")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wide_adapter(tmp_path_factory):
    """(PEFT's adapter of a NeoX twice model_dir's width, that wider base's folder)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("wide")
    cls, cfg = hf_tiny_configs()["gpt_neox"]
    cls(type(cfg)(**{**cfg.to_dict(), "hidden_size": 128})).save_pretrained(root / "base")
    model = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(root / "base"),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["query_key_value", "dense"], init_lora_weights=False
        ),
    )
    model.save_pretrained(root / "adapter")
    return root / "adapter", root / "base"


def test_another_bases_adapter_is_one_line_from_generate_and_serve(model_dir, wide_adapter, capsys):
    adapter, base = wide_adapter
    capsys.readouterr()
    for args in (
        ["generate", str(model_dir), "--lora", str(adapter), "--prompt", "t2 t3"],
        ["serve", str(model_dir), "--lora", str(adapter), "--port", str(_free_port())],
    ):
        assert main(args) == 1, args
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: '{adapter}' does not fit this gpt_neox model: its gpt_neox.layers.0.attention."
        )
        assert "has shape (4, 128), the layer it adapts here takes (4, 64)" in err
        assert err.endswith(
            f": load it onto the model it was trained on, {base} (its base_model_name_or_path)\n"
        )
        assert err.count("\n") == 1


def test_an_adapter_given_as_the_model_says_to_pass_its_base(wide_adapter, capsys):
    adapter, base = wide_adapter
    expected = (
        f"error: '{adapter}' is a PEFT adapter (adapter_config.json), not a model: pass its base model "
        f"({base}) and the adapter with --lora {adapter}\n"
    )
    capsys.readouterr()
    for args in (
        ["generate", str(adapter), "--prompt", "t2"],
        ["generate", str(adapter), "--prompt", "t2", "--tokenizer", str(adapter)],
        ["serve", str(adapter), "--port", str(_free_port())],
    ):
        assert main(args) == 1, args
        assert capsys.readouterr().err == expected, args


def test_serving_an_adapter_on_another_folder_of_its_shapes_warns(model_dir, tmp_path, caplog):
    """The loader serve and generate share (load_served): the folder it read is what the
    adapter's base is compared with."""
    import transformers as tf

    from lmforge.cli.serve import load_served
    from tests.conftest import make_hf_model

    other = tmp_path / "other"
    make_hf_model("gpt_neox", seed=1).save_pretrained(other)
    model = peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(other),
        peft.LoraConfig(r=4, target_modules=["query_key_value"], init_lora_weights=False),
    )
    model.save_pretrained(tmp_path / "adapter")
    with caplog.at_level("WARNING", logger="lmforge.models.peft_read"):
        load_served(model_dir, str(tmp_path / "adapter"), "cpu", None)
        load_served(other, str(tmp_path / "adapter"), "cpu", None)
    said = [r.getMessage() for r in caplog.records if r.name == "lmforge.models.peft_read"]
    assert len(said) == 1 and said[0].startswith(
        f"PEFT adapter {tmp_path / 'adapter'} was trained on {other} (its "
        f"base_model_name_or_path) but is loaded onto {model_dir}: "
    )
