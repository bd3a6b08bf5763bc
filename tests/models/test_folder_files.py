"""A model folder from someone else names files (an index's shards, tokenizer, chat template,
generation and license files): none it names outside itself is read, or copied into an import or
export, whether by `../`, an absolute name or a symlink; links that stay inside it, and a Hugging
Face cache snapshot's links into its blobs/, are followed (lmforge.fsutil.folder_file)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.fsutil import folder_file

SECRET = "the secret of another project\n"


@pytest.fixture
def hf_folder(tiny_hf):
    return tiny_hf


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def copy_of(folder, dst):
    shutil.copytree(folder, dst)
    return dst


def copies_of(secret, root) -> list:
    """The files under `root` (links aside) holding the secret's text, the secret itself aside."""
    return [
        p
        for p in root.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and p != secret
        and SECRET in p.read_text(errors="replace")
    ]


def test_a_name_or_link_leading_out_of_the_folder_is_refused(tmp_path, secret):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.json").write_text("{}")
    (folder / "inner.json").symlink_to("sub/a.json")
    (folder / "LICENSE").symlink_to(secret)
    (folder / "outer").symlink_to(secret.parent, target_is_directory=True)
    (folder / "loop").symlink_to("loop")
    assert folder_file(folder, "sub/a.json") == folder / "sub" / "a.json"
    # a link inside the folder is followed
    assert folder_file(folder, "inner.json") == folder / "inner.json"
    assert folder_file(folder, "sub/../inner.json") == folder / "sub/../inner.json"
    for name in ("LICENSE", "../elsewhere/secret.txt", str(secret), "outer/secret.txt"):
        with pytest.raises(UserError) as e:
            folder_file(folder, name)
        assert str(e.value) == (
            f"'{folder / name}' points outside its folder, to '{secret}': lmforge reads no file a "
            "model folder names outside it; copy that file into the folder if it belongs to the "
            "model"
        )
    with pytest.raises(UserError, match=r"'.*loop' cannot be followed"):
        folder_file(folder, "loop")


def test_a_folder_reached_through_a_link_is_the_folder(hf_folder, tmp_path):
    (tmp_path / "link").symlink_to(hf_folder, target_is_directory=True)
    assert folder_file(tmp_path / "link", "config.json") == tmp_path / "link" / "config.json"


def test_import_and_export_do_not_copy_a_linked_license(hf_folder, tmp_path, secret, capsys):
    """import-hf and export-hf copied what a symlinked LICENSE or NOTICE pointed to into their
    output."""
    src = copy_of(hf_folder, tmp_path / "src")
    (src / "NOTICE").symlink_to(secret)
    assert main(["import-hf", str(src), str(tmp_path / "lm")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: '{src / 'NOTICE'}' points outside its folder, to '{secret}': lmforge reads no file a model folder "
        "names outside it; copy that file into the folder if it belongs to the model"
    ]
    assert not (tmp_path / "lm").exists() and not copies_of(secret, tmp_path)

    (src / "NOTICE").unlink()
    assert main(["import-hf", str(src), str(tmp_path / "lm")]) == 0
    (tmp_path / "lm" / "LICENSE").unlink()
    (tmp_path / "lm" / "LICENSE").symlink_to(secret)
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "lm"), str(tmp_path / "hf")]) == 1
    assert (
        f"'{tmp_path / 'lm' / 'LICENSE'}' points outside its folder, to '{secret}'"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "hf").exists() and not copies_of(secret, tmp_path)


def test_an_index_naming_a_shard_outside_the_folder_is_refused(hf_folder, tmp_path):
    """A weight_map entry `../other/model.safetensors` loaded the other folder's weights without
    a word."""
    from lmforge.models.source import load_pretrained

    other = copy_of(hf_folder, tmp_path / "other")
    src = copy_of(hf_folder, tmp_path / "src")
    (src / "model.safetensors").unlink()
    keys = (
        list(json.loads((other / "model.safetensors.index.json").read_text())["weight_map"])
        if (other / "model.safetensors.index.json").exists()
        else _keys(other / "model.safetensors")
    )
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "../other/model.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        UserError,
        match=r"^'.*src/\.\./other/model\.safetensors' points outside its folder, to "
        rf"'{other / 'model.safetensors'}'",
    ):
        load_pretrained(src)
    index["weight_map"] = dict.fromkeys(keys, str(other / "model.safetensors"))  # an absolute name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"points outside its folder"):
        load_pretrained(src)


def _keys(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    "name",
    ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"],
)
def test_generate_reads_no_linked_side_file(hf_folder, tmp_path, secret, name, capsys):
    src = copy_of(hf_folder, tmp_path / "src")
    if (src / name).exists():
        (src / name).unlink()
    secret.write_text("{}" if name.endswith(".json") and name != "tokenizer.json" else SECRET)
    (src / name).symlink_to(secret)
    args = ["generate", str(src), "--prompt", "w1 w2", "--max-new-tokens", "2"]
    assert main([*args, "--chat"] if name == "chat_template.jinja" else args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: '{src / name}' points outside its folder, to '{secret}': lmforge reads no file a model "
        "folder names outside it; copy that file into the folder if it belongs to the model"
    ]


def hf_cache_entry(src, cache):
    """`src` laid out as the Hugging Face hub cache keeps a download: models--ORG--NAME/blobs/SHA
    and snapshots/REV/NAME -> ../../blobs/SHA."""
    entry = cache / "models--someone--tiny"
    snapshot = entry / "snapshots" / "0123abcd"
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, entry / "blobs" / sha)
        (snapshot / f.name).symlink_to(os.path.join("..", "..", "blobs", sha))
    return snapshot


def test_a_hugging_face_cache_snapshot_is_read_through_its_links(hf_folder, tmp_path, capsys):
    from lmforge.models.source import load_pretrained

    snapshot = hf_cache_entry(hf_folder, tmp_path / "hub")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert load_pretrained(snapshot).config.vocab_size == 64
    assert main(["import-hf", str(snapshot), str(tmp_path / "lm")]) == 0
    assert (tmp_path / "lm" / "LICENSE").read_text() == "the model's license\n"
    assert main(["generate", str(snapshot), "--prompt", "w1 w2", "--max-new-tokens", "2"]) == 0


def test_a_cache_snapshot_link_elsewhere_is_refused(hf_folder, tmp_path, secret):
    """Only the snapshot's own entry's blobs/: not another entry's, nor a file beside the cache."""
    from lmforge.models.hf import import_hf
    from lmforge.models.source import load_pretrained

    snapshot = hf_cache_entry(hf_folder, tmp_path / "hub")
    (snapshot / "LICENSE").unlink()
    (snapshot / "LICENSE").symlink_to(secret)
    with pytest.raises(UserError, match="LICENSE' points outside its folder"):
        import_hf(snapshot, tmp_path / "lm")
    assert not copies_of(secret, tmp_path)
    other = hf_cache_entry(hf_folder, tmp_path / "hub2")
    target = os.readlink(other / "config.json")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(other / target)
    with pytest.raises(UserError, match="config.json' points outside its folder"):
        load_pretrained(snapshot)


def test_a_tokenizer_copy_takes_no_linked_file(hf_folder, tmp_path, secret):
    """A run's checkpoints, its export and export-hf copy the tokenizer's folder's config files
    and chat template (Tokenizer.save): a link out of that folder is not copied."""
    from lmforge.tokenizers import load_tokenizer

    src = copy_of(hf_folder, tmp_path / "src")
    tok = load_tokenizer(src)
    (src / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(UserError, match="chat_template.jinja' points outside its folder"):
        tok.save(tmp_path / "copy")
    assert not copies_of(secret, tmp_path)


def test_an_lmforge_folder_names_no_file_outside_it(hf_folder, tmp_path, secret):
    """The same reader for lmforge's own folders: lmforge.json, its weights and its index."""
    from lmforge.models.hf import import_hf
    from lmforge.models.source import load_pretrained

    import_hf(hf_folder, tmp_path / "lm")
    other = copy_of(tmp_path / "lm", tmp_path / "other")
    (tmp_path / "lm" / "model.safetensors").unlink()
    (tmp_path / "lm" / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.safetensors' points outside its folder"):
        load_pretrained(tmp_path / "lm")
    (tmp_path / "lm" / "model.safetensors").unlink()
    index = {"weight_map": {"embed.weight": "../other/model.safetensors"}}
    (tmp_path / "lm" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"other/model\.safetensors' points outside its folder"):
        load_pretrained(tmp_path / "lm")


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_lora_adapter_folder_names_no_file_outside_it(tmp_path, secret, name):
    """`--lora DIR` / `load_peft_adapter`: an adapter folder's files are read from inside it too."""
    pytest.importorskip("peft")
    from lmforge.models.peft_read import load_peft_adapter
    from lmforge.models.source import load_pretrained
    from tests.conftest import make_hf_model
    from tests.models.test_peft_fit import peft_adapter

    make_hf_model("llama").save_pretrained(tmp_path / "base")
    adapter = peft_adapter(tmp_path / "base", tmp_path / "adapter", ["q_proj", "v_proj"])
    (tmp_path / "elsewhere" / name).write_bytes((adapter / name).read_bytes())
    (adapter / name).unlink()
    (adapter / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(UserError, match=f"'{adapter / name}' points outside its folder"):
        load_peft_adapter(load_pretrained(tmp_path / "base"), adapter)
