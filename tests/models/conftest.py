"""Model folders the tests of this package edit: a tiny Hugging Face folder with a tokenizer and
a license."""

from __future__ import annotations

import pytest


def save_tiny(tf, cls, config, out):
    """`config`'s model saved as transformers saves it, with a word-level tokenizer of its
    vocabulary and a LICENSE."""
    from tokenizers import Tokenizer, models

    cls(config).save_pretrained(out)
    words = {f"w{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(out / "tokenizer.json"))
    (out / "LICENSE").write_text("the model's license\n")
    return out


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """A tiny Llama folder (one safetensors file)."""
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    return save_tiny(tf, tf.LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """A tiny GPT-2 folder: learned positions, sized by n_positions."""
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    return save_tiny(tf, tf.GPT2LMHeadModel, config, tmp_path_factory.mktemp("tiny") / "gpt2")
