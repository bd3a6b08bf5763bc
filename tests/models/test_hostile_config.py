"""A model folder's config declares sizes lmforge would allocate (lmforge.models.sizes): each is
checked, and a wrong type, a size past the device's memory, a config bigger than the weights
beside it, or a damaged index is one line on stderr and a non-zero exit, within seconds: not a
traceback, an allocation of terabytes or a build of a million layers that runs for minutes."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from lmforge.cli import main
from lmforge.errors import UserError

# Far more than these tiny models take anywhere, far less than a build of a million layers (minutes)
# or an attempt at allocating terabytes: the refusal comes before either.
QUICK = 60


def edited(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def refused(capsys, *args) -> str:
    """The one line `lmforge ARGS` ends with, asserting it fails within QUICK seconds."""
    capsys.readouterr()
    start = time.perf_counter()
    assert main(list(args)) == 1
    assert time.perf_counter() - start < QUICK
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def generate(folder) -> list[str]:
    return [
        "generate",
        str(folder),
        "--prompt",
        "w1 w2",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
    ]


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("vocab_size", "32", "'32'"),
        ("num_hidden_layers", 2.5, "2.5"),
        ("hidden_size", True, "True"),
        ("max_position_embeddings", 1e12, "1000000000000.0"),
    ],
)
def test_a_size_of_another_type_is_named(tiny_hf, tmp_path, capsys, key, value, shown):
    """ "32" or 2.5 gave a TypeError from deep inside the build."""
    folder = edited(tiny_hf, tmp_path / "m", **{key: value})
    assert (
        refused(capsys, *generate(folder))
        == f"{folder / 'config.json'}: {key}: expected an integer, got {shown}"
    )


def test_a_vocabulary_past_the_memory_is_refused_before_allocating(tiny_hf, tmp_path, capsys):
    """vocab_size 10**12 tried to allocate the embedding (a traceback from the allocator)."""
    folder = edited(tiny_hf, tmp_path / "m", vocab_size=10**12)
    line = refused(capsys, *generate(folder))
    assert line.startswith(f"'{folder}' declares a model of 32,")
    assert "(vocab_size 1000000000000 x hidden_size 16: 100% of them)" in line
    assert (
        "TiB in float32: more than the " in line and " free on the host: check its config" in line
    )


def test_a_million_layers_are_refused_before_the_build(tiny_hf, tmp_path, capsys):
    """num_hidden_layers 10**6 built a model (on the meta device) for minutes before a tensor was
    found missing."""
    folder = edited(tiny_hf, tmp_path / "m", num_hidden_layers=10**6)
    assert refused(capsys, *generate(folder)) == (
        f"'{folder / 'config.json'}' declares num_hidden_layers 1000000 but its weights hold 12 tensors in all, and "
        "every layer has its own: the config does not belong to these weights: use the config written with them"
    )


def test_an_lmforge_folder_declaring_more_than_its_weights_is_refused(
    tiny_hf, tmp_path, capsys, monkeypatch
):
    """2.6e9 parameters in 10**6 layers: 10 GiB in float32, which a host may have; the weight
    file has 100 KiB."""
    import lmforge.models.sizes as sizes

    monkeypatch.setattr(sizes, "host_available", lambda: 1 << 40)
    assert main(["import-hf", str(tiny_hf), str(tmp_path / "lm")]) == 0
    meta = json.loads((tmp_path / "lm" / "lmforge.json").read_text())
    meta["model"]["num_layers"] = 10**6
    (tmp_path / "lm" / "lmforge.json").write_text(json.dumps(meta))
    line = refused(capsys, *generate(tmp_path / "lm"))
    assert line == (
        f"'{tmp_path / 'lm'}' declares a model of 2,592,002,064 parameters (num_layers 1000000 x "
        "(hidden_size 16, intermediate_size 32): 100% of them) but its weight files hold "
        f"{sizes.human_bytes((tmp_path / 'lm' / 'model.safetensors').stat().st_size)}, too few for them "
        "even at 4 bits each: the config does not belong to these weights: use the config written with "
        "them"
    )
    # export-hf reads the folder the same way, without loading it whole
    assert "the config does not belong to these weights" in refused(
        capsys, "export-hf", str(tmp_path / "lm"), str(tmp_path / "hf")
    )


def test_a_wide_model_is_counted_without_overflow(tiny_hf, tmp_path, capsys):
    """hidden_size 2**30 overflowed torch's size computation of a weight (a RuntimeError)."""
    folder = edited(tiny_hf, tmp_path / "m", hidden_size=2**30)
    line = refused(capsys, *generate(folder))
    assert "hidden_size 1073741824" in line and "declares a model of" in line


def test_an_indivisible_huge_width_is_one_line_at_once(tiny_hf, tmp_path, capsys):
    """The advice for a hidden_size num_heads does not divide looked at every number up to it."""
    folder = edited(tiny_hf, tmp_path / "m", hidden_size=2**30 + 2, num_attention_heads=4)
    line = refused(capsys, *generate(folder))
    assert line.startswith("hidden_size 1073741826 is not divisible by num_heads 4")


def test_learned_positions_past_the_memory_are_refused(tiny_gpt2, tmp_path, capsys):
    folder = edited(tiny_gpt2, tmp_path / "m", n_positions=10**12)
    line = refused(capsys, *generate(folder))
    assert "(max_position_embeddings 1000000000000 x hidden_size 16: 100% of them)" in line


def test_a_context_past_the_memory_gives_serve_one_line(tiny_hf, tmp_path, capsys):
    """max_position_embeddings 10**12 made serve size a KV cache of 8 rows of 10**12 tokens."""
    folder = edited(tiny_hf, tmp_path / "m", max_position_embeddings=10**12)
    line = refused(capsys, "serve", str(folder), "--port", "0", "--device", "cpu")
    assert line.startswith(
        "the KV cache of 8 row(s) x 1000000000000 tokens (the model's max_position_embeddings) "
        "takes 931.3 TiB in float32: more than the "
    )
    assert line.endswith(
        " free on the host: lower max_context or max_batch (serve: --max-context, --max-batch)"
    )
    line = refused(
        capsys, "serve", str(folder), "--port", "0", "--device", "cpu", "--max-context", str(10**11)
    )
    assert line.startswith("the KV cache of 8 row(s) x 100000000000 tokens (max_context) takes ")
    # generate sizes its cache by the prompt and --max-new-tokens: those fit
    assert main(generate(folder)) == 0


def test_the_memory_of_a_gpu_is_its_free_memory_and_the_allocators_unused_cache(monkeypatch):
    import torch

    import lmforge.models.sizes as sizes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 << 30)
    assert sizes.free_memory("cuda:1") == (6 << 30, "cuda:1")


def test_generate_sizes_its_cache_before_allocating(tiny_hf, tmp_path):
    from lmforge.inference import generate as generate_ids
    from lmforge.models.source import load_pretrained

    model = load_pretrained(edited(tiny_hf, tmp_path / "m", max_position_embeddings=10**12))
    with pytest.raises(
        UserError,
        match=r"^the KV cache of 1 row\(s\) x 100000000001 tokens \(the prompt and "
        r"max_new_tokens\) takes .*: lower max_new_tokens$",
    ):
        generate_ids(model, [[1, 2]], max_new_tokens=10**11)


# --- a sharded checkpoint's index
# ------------------------------------------------------------------------------


def sharded(src, dst, index):
    """`src` with its weights named by `index` (written as given: a dict as JSON, text as it is)."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").rename(dst / "model-00001-of-00001.safetensors")
    (dst / "model.safetensors.index.json").write_text(
        index if isinstance(index, str) else json.dumps(index)
    )
    return dst


@pytest.mark.parametrize(
    ("index", "says"),
    [
        (
            {"metadata": {}},
            "has no weight_map (tensor name -> shard file): it is not a checkpoint index: copy it again",
        ),
        ("{not json", "cannot read '{index}' as JSON"),
        (
            {"weight_map": {"model.norm.weight": 3}},
            "maps tensor 'model.norm.weight' to 3, not a shard file name",
        ),
        (
            {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
            "names 1 shard(s) missing in '{folder}', first 'model-00002-of-00002.safetensors': copy the folder again",
        ),
    ],
)
def test_a_damaged_index_is_one_line_naming_it(tiny_hf, tmp_path, capsys, index, says):
    """An index without weight_map, malformed JSON, a weight_map value that is not a name:
    tracebacks."""
    folder = sharded(tiny_hf, tmp_path / "m", index)
    line = refused(capsys, *generate(folder))
    assert f"'{folder / 'model.safetensors.index.json'}'" in line
    assert says.format(index=folder / "model.safetensors.index.json", folder=folder) in line


@pytest.mark.parametrize(
    ("family", "fields", "says"),
    [
        (
            "llama",
            {"hidden_act": ["silu"]},
            "activation '['silu']' in config.json is not supported",
        ),
        (
            "llama",
            {"rope_scaling": "linear"},
            "config.json: rope_scaling: expected a mapping, got 'linear'",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
            "rope_scaling.factor: expected a number, got '2'",
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": [],
                    "original_max_position_embeddings": 16,
                }
            },
            "rope_scaling.factor: expected a number, got []",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": "16"}},
            "rope_scaling.original_max_position_embeddings: expected a positive integer, got '16'",
        ),
        (
            "llama",
            {"num_attention_heads": 0},
            "config.json: num_attention_heads: expected a positive integer, got 0",
        ),
        ("llama", {"rms_norm_eps": "1e-6"}, "norm_eps: expected a number, got '1e-6'"),
        ("gpt2", {"n_embd": None}, "config.json: n_embd: expected an integer, got None"),
    ],
)
def test_a_value_of_another_kind_anywhere_is_one_line(
    tiny_hf, tiny_gpt2, tmp_path, family, fields, says
):
    """Found by setting each config.json key to 0, -1, "x", 2.5, null, [], {}, true, 10**30 and
    2**63 (and the rope sections' keys alike): these gave a TypeError (a factor "2" was read as
    2.0; 0 heads was named by lmforge's name for them); every other value was one line already."""
    from lmforge.models.source import load_pretrained

    folder = edited(tiny_hf if family == "llama" else tiny_gpt2, tmp_path / "m", **fields)
    with pytest.raises(UserError) as e:
        load_pretrained(folder)
    assert says in str(e.value)
