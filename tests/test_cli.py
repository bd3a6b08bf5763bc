"""The CLI contract: verbs, one-line errors with exit != 0, and nothing half-written on disk."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmforge.cli import VERBS, main
from tests.conftest import edited_copy, needs_torch

tf = pytest.importorskip("transformers")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_contract_verb():
    out = _run("--help").stdout
    for verb in [
        "quickstart",
        "preprocess",
        "tokenizer",
        "pretrain",
        "finetune",
        "compile",
        "import-hf",
        "export-hf",
        "generate",
        "serve",
        "compare",
        "bench",
    ]:
        assert verb in out and verb in VERBS


def test_every_contract_verb_is_built():
    from lmforge.cli import verb_module

    built = {
        verb
        for verb in VERBS
        if callable(getattr(verb_module(verb), "add_arguments", None))
        and callable(getattr(verb_module(verb), "run", None))
    }
    assert built == set(VERBS)


@pytest.mark.slow
def test_import_and_export_through_the_console_script(hf_dirs, tmp_path):
    r = _run("import-hf", str(hf_dirs["gpt_neox"]), str(tmp_path / "lm"))
    assert r.returncode == 0, r.stderr
    assert "imported gpt_neox" in r.stdout
    r = _run("export-hf", str(tmp_path / "lm"), str(tmp_path / "hf"), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    original = load_file(hf_dirs["gpt_neox"] / "model.safetensors")
    assert all(torch.equal(original[k].to(torch.bfloat16), exported[k]) for k in original)


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def _bad_inputs(hf_dirs, tmp):
    neox = hf_dirs["gpt_neox"]
    q = "gpt_neox.layers.0.attention.dense.weight"
    yield (
        "unsupported model_type 't5'",
        edited_copy(neox, tmp / "t5", lambda c: c.update(model_type="t5")),
    )
    yield (
        f"tensor '{q}' is missing",
        edited_copy(neox, tmp / "missing", edit_weights=lambda w: w.pop(q)),
    )
    yield (
        f"tensor '{q}' has shape (64, 32) in the checkpoint but config.json implies (64, 64)",
        edited_copy(neox, tmp / "shape", edit_weights=lambda w: w.update({q: torch.zeros(64, 32)})),
    )
    yield (
        "tensor(s) a gpt_neox model has no place for, first 'extra.weight'",
        edited_copy(
            neox, tmp / "extra", edit_weights=lambda w: w.update({"extra.weight": torch.zeros(2)})
        ),
    )
    yield (
        "lacks the field 'hidden_size'",
        edited_copy(neox, tmp / "field", lambda c: c.pop("hidden_size")),
    )
    pickled = tmp / "pickle"
    pickled.mkdir()
    (pickled / "config.json").write_text((neox / "config.json").read_text())
    torch.save({"w": torch.zeros(1), "x": Evil()}, pickled / "pytorch_model.bin")
    yield "is not a weights-only PyTorch file", pickled
    truncated = edited_copy(neox, tmp / "truncated", lambda c: None)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut short
    yield f"cannot read '{weights}' (", truncated
    empty = tmp / "empty"
    empty.mkdir()
    yield "no config.json", empty
    yield "does not exist", tmp / "nowhere"


def test_bad_inputs_give_one_line_and_leave_nothing(hf_dirs, tmp_path, capsys):
    for expected, src in _bad_inputs(hf_dirs, tmp_path):
        out = tmp_path / "out"
        code = main(["import-hf", str(src), str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1, expected
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert expected in err[0], (expected, err[0])
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], (
            "temporary folder left behind"
        )


def test_existing_output_is_not_overwritten_without_flag(hf_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["import-hf", str(hf_dirs["gpt2"]), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["import-hf", str(hf_dirs["gpt2"]), str(out), "--overwrite"]) == 0
    assert (out / "lmforge.json").exists() and not (out / "keep.txt").exists()


def test_export_of_a_non_lmforge_folder_is_refused(hf_dirs, tmp_path, capsys):
    assert main(["export-hf", str(hf_dirs["gpt2"]), str(tmp_path / "out")]) == 1
    assert (
        f"'{hf_dirs['gpt2']}' is a Hugging Face folder already: export-hf reads an lmforge model folder "
        "(lmforge.json) or a training checkpoint" in capsys.readouterr().err
    )


def test_debug_shows_the_traceback(tmp_path):
    from lmforge.errors import UserError

    with pytest.raises(UserError):
        main(["--debug", "import-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")])


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        (
            "trainer:\n  max_steps: 3\n   bad_indent: 1\n",
            [],
            "is not valid YAML (mapping values are not allowed in this context at line 3, column 14): fix that line",
        ),
        (
            "- model\n- trainer\n",
            [],
            "holds a list, not sections: write it as model:, data:, trainer:",
        ),
        (
            "model:\n  preset: tiny-neox\n",
            ["lora.targets=[q,v"],
            "override 'lora.targets=[q,v' is not valid YAML after the '=' (did not find expected ',' or ']')",
        ),
    ],
)
def test_a_config_that_does_not_parse_is_one_line(config, overrides, expected, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(config)
    assert main(["finetune", str(recipe), f"run_dir={tmp_path / 'run'}", *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not (tmp_path / "run").exists()


def test_overrides_may_follow_a_verbs_options(tmp_path, capsys):
    """`lmforge plan cfg.yaml --world-size 8 parallel.tensor=8` read the override as an unknown
    argument (exit 2)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  preset: tiny-neox\n")
    # read, and checked
    assert main(["plan", str(recipe), "--world-size", "1", "trainer.max_stpes=3"]) == 1
    assert (
        "unknown config key 'trainer.max_stpes' (did you mean 'trainer.max_steps'?)"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as e:
        main(["plan", str(recipe), "--world-size", "1", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_dashed_override_is_answered_with_the_key_value_form(tmp_path, capsys):
    """torchtitan's and NeMo's CLIs take --trainer.max_steps=3; lmforge's overrides are
    key=value."""
    with pytest.raises(SystemExit) as e:
        main(["finetune", str(tmp_path / "c.yaml"), "--trainer.max_steps=3"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2
    assert last.endswith("config overrides are key=value without dashes, e.g. trainer.max_steps=3")


def test_the_keys_pretrain_and_finetune_help_names_exist():
    """`lmforge pretrain --help` / `finetune --help` list keys by name: each one is a field of
    the run config."""
    import dataclasses
    import re

    from lmforge.cli.pretrain import FINETUNE_KEYS, RUN_KEYS
    from lmforge.train.config import ModelSection, RunConfig

    named = set(
        re.findall(
            r"\b(model|data|trainer|optim|checkpoint|eval|cost|parallel|lora|dpo)\.([a-z_0-9]+)",
            RUN_KEYS + FINETUNE_KEYS,
        )
    )
    assert len(named) > 30
    for section, key in named:
        if section == "model":
            assert key in {f.name for f in dataclasses.fields(ModelSection)}, key
            continue
        config = RunConfig()
        held = getattr(config, section) or {"lora": _lora, "dpo": _dpo}[section]()
        assert hasattr(held, key), f"{section}.{key}"


def _lora():
    from lmforge.models.lora import LoRAConfig

    return LoRAConfig()


def _dpo():
    from lmforge.train.config import DPOConfig

    return DPOConfig()


def test_import_of_an_lmforge_folder_and_export_of_a_run_folder_say_what_to_give(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "lmforge.json").write_text("{}")
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    assert main(["import-hf", str(run / "model"), str(tmp_path / "out")]) == 1
    assert (
        f"'{run / 'model'}' is an lmforge model folder already (lmforge.json)"
        in capsys.readouterr().err
    )
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"(RUN_DIR/checkpoints/step-N): give '{run / 'model'}'")
    )
    assert not (tmp_path / "out").exists()


def test_export_into_a_folder_in_use_is_refused_before_reading_weights(tmp_path, capsys):
    """A second export-hf of a checkpoint into the same place loaded the whole model and its
    tokenizer, then said the output was taken: now it says so first (this checkpoint has nothing
    else to read)."""
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert main(["export-hf", str(step), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        f"error: output '{tmp_path / 'out'}' already exists and is not empty: choose "
        "another path or pass --overwrite\n"
    )


@pytest.mark.slow
def test_under_torchrun_only_rank_0_logs_info(tmp_path):
    """Every rank printed the same INFO lines (8 GPUs: each line 8 times); warnings and errors
    still come from all."""
    import itertools
    import os

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a few words to learn merges from, a few words"}\n' * 4)
    outs = (tmp_path / f"tok{i}" for i in itertools.count())

    def info_lines(**env) -> int:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmforge.cli",
                "tokenizer",
                "train",
                "--input",
                str(corpus),
                "--vocab-size",
                "280",
                "--out",
                str(next(outs)),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return sum(line.startswith("INFO ") for line in r.stderr.splitlines())

    assert info_lines(RANK="0") > 0 and info_lines(RANK="1") == 0
    assert info_lines(RANK="1", LMFORGE_LOG_ALL_RANKS="1") > 0


@needs_torch((2, 10), "lmforge plan of a CUDA run on a machine without one")
def test_plan_defaults_to_the_layouts_world_and_prints_no_cpp_warning(tmp_path):
    """`lmforge plan RECIPE` needed --world-size even for one process, and every trace ended in a
    C++ warning from destroying the fake process group ("No backend of type 0 found")."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "model:\n  preset: tiny-llama\n  make_vocab_size_divisible_by: 256\nparallel:\n  tensor: 2\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "plan", str(recipe), "data.seq_length=64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "on 2 processes" in r.stdout and "No backend" not in r.stderr and "Warning" not in r.stderr
    )
    # The layout is the plan's to say, once: the mesh/parallelized lines came once per traced rank.
    assert "device mesh" not in r.stderr and "parallelized:" not in r.stderr


def test_pretrain_without_arguments_names_only_the_config_as_required(capsys):
    """argparse listed the optional overrides as required too ("required: config, overrides")."""
    with pytest.raises(SystemExit) as e:
        main(["pretrain"])
    assert e.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: the following arguments are required: config")
    )


def test_pretrain_help_states_the_learning_rate_schedule_the_trainer_follows():
    """The schedule's formula was documented nowhere; it differs from Megatron's and
    transformers' in the warmup."""
    import math

    from lmforge.cli.pretrain import RUN_KEYS
    from lmforge.train.config import OptimConfig
    from lmforge.train.optim import lr_at

    assert (
        "lr * n / W" in RUN_KEYS
        and "lr_n = min_lr + (lr - min_lr) * f((n - 1 - W) / (D - W))" in RUN_KEYS
    )
    # trainer.log_every_n_steps logs one step's loss
    assert "not the mean over the N steps" in RUN_KEYS
    W, D, lr, min_lr = 3, 10, 1.0, 0.1  # noqa: N806 (the help's names)
    for schedule, f in (
        ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
        ("linear", lambda p: 1 - p),
    ):
        cfg = OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=W, schedule=schedule)
        documented = [
            lr * n / W if n <= W else min_lr + (lr - min_lr) * f(min(1.0, (n - 1 - W) / (D - W)))
            for n in range(1, D + 3)
        ]
        assert [lr_at(n - 1, cfg, D) for n in range(1, D + 3)] == pytest.approx(documented)


def test_a_mistyped_checkpoint_step_is_answered_with_the_runs_checkpoints(tmp_path, capsys):
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        (checkpoints / f"step-{step:08d}").mkdir(parents=True)
        (checkpoints / f"step-{step:08d}" / "trainer.json").write_text("{}")
    (checkpoints / ".step-00000012.tmp").mkdir()  # a save cut short: not one to offer
    missing = checkpoints / "step-00000099"
    for argv in (
        ["export-hf", str(missing), str(tmp_path / "out")],
        ["import-hf", str(missing), str(tmp_path / "o")],
        ["generate", str(missing), "--prompt", "hi"],
        ["serve", str(missing)],
    ):
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            f"error: model folder '{missing}' does not exist: {checkpoints} holds 2 "
            "checkpoints, step-00000004, step-00000008: give one of them\n"
        )
    assert main(["export-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    assert (
        capsys.readouterr().err == f"error: model folder '{tmp_path / 'nowhere'}' does not exist\n"
    )
