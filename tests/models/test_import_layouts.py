"""Checkpoint layouts import-hf does not read, each named with what to do instead."""

from __future__ import annotations

import pytest

from lmforge.cli import main


def test_experts_saved_in_transformers_memory_layout_say_how_to_save_them(tmp_path, capsys):
    """A Mixtral's state_dict saved as it is (transformers 5 stacks the experts in memory;
    save_pretrained writes one tensor per expert) failed as "tensor ...gate.weight is missing
    from the checkpoint"."""
    tf = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    config = tf.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model = tf.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "lm")]) == 1
    err = capsys.readouterr().err
    assert (
        "holds its experts stacked ('model.layers.0.mlp.experts." in err
        and "save_pretrained" in err
    )
    assert not (tmp_path / "lm").exists()
