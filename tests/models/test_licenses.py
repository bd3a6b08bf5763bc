"""A model's license and notice files travel with it: import-hf, export-hf (of a model folder and
of a training checkpoint) keep Llama's LICENSE and USE_POLICY.md, an Apache NOTICE, and nothing
else that is not a model file; and the files written are as readable as the user's umask says."""

from __future__ import annotations

import pytest

from lmforge.cli import main

LICENSES = {
    "LICENSE": "the community license\n",
    "USE_POLICY.md": "# acceptable use\n",
    "NOTICE.txt": "notice\n",
}


@pytest.fixture(scope="module")
def licensed_llama(tmp_path_factory):
    tf = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("licensed") / "hf"
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    tf.LlamaForCausalLM(config).save_pretrained(out)
    for name, text in LICENSES.items():
        (out / name).write_text(text)
    (out / "README.md").write_text("---\nlicense: other\n---\nthe source's model card\n")
    return out


def test_import_and_export_keep_the_license_files(licensed_llama, tmp_path):
    assert main(["import-hf", str(licensed_llama), str(tmp_path / "lm")]) == 0
    assert main(["export-hf", str(tmp_path / "lm"), str(tmp_path / "hf")]) == 0
    for folder in (tmp_path / "lm", tmp_path / "hf"):
        assert {name: (folder / name).read_text() for name in LICENSES} == LICENSES
        # The model card describes the source model, not what was made from it: it stays behind.
        assert not (folder / "README.md").exists()


def test_written_folders_take_the_users_umask(licensed_llama, tmp_path):
    """safetensors writes its files owner-only (0600): an export on a shared cluster was
    unreadable to colleagues while every other file in it was 0644."""
    import os

    old = os.umask(0o022)
    try:
        assert main(["import-hf", str(licensed_llama), str(tmp_path / "lm")]) == 0
        assert main(["export-hf", str(tmp_path / "lm"), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {
        p.name: p.stat().st_mode & 0o777
        for folder in ("lm", "hf")
        for p in (tmp_path / folder).iterdir()
    }
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
