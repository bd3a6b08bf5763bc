"""Every shipped recipe parses, validates and describes a model that builds, and splits as its
`parallel` says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.models import build, num_parameters, preset
from lmforge.parallel import check_model
from lmforge.train.config import load_run_config, to_yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
# Recipes whose model comes from model.init_from, and the published model each is written for.
INIT_FROM_MODELS = {
    "llama2-7b-continued": "llama-2-7b",
    "gpt-j-6b": "gpt-j-6b",
    "sft-pythia-160m": "pythia-160m",
    "lora-pythia-410m": "pythia-410m",
    "dpo-pythia-160m": "pythia-160m",
    "llama-3.2-1b-continued": "llama-3.2-1b",
    "sft-qwen2.5-0.5b": "qwen2.5-0.5b",
    "qlora-llama-3.1-8b": "llama-3.1-8b",
    "qlora-qwen3-30b-a3b": "qwen3-30b-a3b",
    "grpo-qwen2.5-0.5b-gsm8k": "qwen2.5-0.5b",
}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_is_valid(path, tmp_path):
    cfg = load_run_config(
        path, [f"model.init_from={tmp_path}"] if "init_from" in path.read_text() else []
    )
    t = cfg.trainer
    assert t.global_batch_size % t.micro_batch_size == 0
    mcfg, init_from = cfg.model.config, cfg.model.init_from
    if mcfg is not None:
        assert cfg.data.seq_length <= mcfg.max_position_embeddings
        assert num_parameters(build(mcfg, device="meta")) > 0
    else:
        assert init_from == str(tmp_path)
        overrides = {
            k: v
            for k, v in cfg.model.overrides.items()
            if k not in ("dropout", "attention_dropout")
        }
        mcfg = dataclasses.replace(preset(INIT_FROM_MODELS[path.stem]), **overrides)
    p = cfg.parallel
    # Heads, layers and the padded vocabulary split as the layout asks (one model replica's
    # processes).
    check_model(p.resolved(p.tensor * p.pipeline), mcfg)
    if p.tensor > 1:
        assert mcfg.padded_vocab_size % (128 * p.tensor) == 0
        assert p.sequence_parallel is False or cfg.data.seq_length % p.tensor == 0


def test_there_are_recipes_for_every_reference_model():
    names = {p.stem for p in CONFIGS}
    assert {
        "pythia-160m",
        "pythia-6.9b",
        "neox-20b",
        "llama2-7b-continued",
        "gpt2",
        "gpt-j-6b",
    } <= names


@pytest.mark.parametrize(
    ("name", "tensor", "pipeline"),
    [("pythia-6.9b", 8, 1), ("neox-20b", 8, 4), ("llama2-7b-continued", 8, 1)],
)
def test_reference_layouts(name, tensor, pipeline, tmp_path):
    """The layouts of the reference write-ups: Pythia 6.9B TP 8; GPT-NeoX-20B TP 8 x PP 4; Llama
    2 7B TP 8."""
    path = next(p for p in CONFIGS if p.stem == name)
    cfg = load_run_config(path, [f"model.init_from={tmp_path}"] if name in INIT_FROM_MODELS else [])
    assert (cfg.parallel.tensor, cfg.parallel.pipeline) == (tensor, pipeline)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=abc", "trainer.max_steps: expected an integer, got 'abc'"),
        ("trainer.max_steps=1.5", "trainer.max_steps: expected an integer, got 1.5"),
        ("trainer.compile=3", "trainer.compile: expected true or false, got 3"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
        ("optim.betas=[0.9,x]", "optim.betas[1]: expected a number, got 'x'"),
        ("model.hidden_size=wide", "model.hidden_size: expected an integer, got 'wide'"),
        (
            "data.tokenizer=[a]",
            "data.tokenizer: expected a string, got ['a']: quote the text for YAML inside the "
            "shell's quotes, 'data.tokenizer=\"...\"'",
        ),
        (
            "data.prompt_template={instruction}",
            "data.prompt_template: expected a string, got {'instruction': None}: "
            "quote the text for YAML inside the shell's "
            "quotes, 'data.prompt_template=\"...\"'",
        ),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(override, message):
    """Every value is checked against its field's type when the config is read, before it can
    fail later as a comparison between a str and an int."""
    from lmforge.errors import UserError

    with pytest.raises(UserError) as e:
        load_run_config(None, ["model.preset=tiny-neox", override])
    assert str(e.value) == message


def test_typed_values_keep_their_meaning():
    cfg = load_run_config(
        None, ["model.preset=tiny-neox", "optim.lr=3", "model.rotary_pct=1", "data.tokenizer=null"]
    )
    assert (
        cfg.optim.lr == 3.0
        and isinstance(cfg.optim.lr, float)
        and cfg.model.config.rotary_pct == 1.0
    )
    assert cfg.data.tokenizer is None and cfg.trainer.precision == "auto"


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, "bf16-mixed"), (False, "fp32")])
def test_precision_auto_is_bf16_mixed_only_where_the_device_has_bf16_matrix_units(
    has_bf16, expected, monkeypatch
):
    """Issue 18 item 13: bf16-mixed by default took 428 s a step on a CPU without bf16 matrix
    instructions."""
    import torch

    from lmforge import devices

    monkeypatch.setattr(devices, "bf16_matmul", lambda device: (has_bf16, "stated by the test"))
    cfg = load_run_config(None, ["model.preset=tiny-neox"])
    assert cfg.precision_for(torch.device("cpu")).name == expected
    assert cfg.precision.name == expected
    # A precision the recipe states is kept whatever the device.
    stated = load_run_config(None, ["model.preset=tiny-neox", "trainer.precision=bf16-mixed"])
    assert stated.precision_for(torch.device("cpu")).name == "bf16-mixed"


def test_one_data_prefix_needs_no_brackets():
    """Issue 18 item 19: data.paths=PREFIX was read character by character as a blend."""
    cfg = load_run_config(None, ["model.preset=tiny-neox", "data.paths=/data/wiki_text_document"])
    assert cfg.data.paths == ["/data/wiki_text_document"]
    assert "- /data/wiki_text_document" in to_yaml(cfg)  # recorded as the list it means


def test_an_unknown_task_is_one_line_with_the_closest_name():
    from lmforge.errors import UserError
    from lmforge.train.tasks import get_task

    with pytest.raises(UserError, match=r"data.task='sfft' is not valid \(did you mean 'sft'\?\)"):
        get_task("sfft")


def test_a_preset_with_init_from_takes_the_sources_architecture(tmp_path, caplog):
    """A from-scratch recipe (preset and fields) pointed at a model folder: the folder's
    architecture wins, dropout and vocabulary padding stay the run's, and one log line says what
    was not used."""
    import logging

    from lmforge.models.io import save_model

    source = dataclasses.replace(preset("tiny-llama"), max_position_embeddings=64)
    save_model(build(source, device="cpu"), tmp_path / "src")
    # max_position_embeddings: 256
    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny-neox.yaml"
    cfg = load_run_config(
        recipe, [f"model.init_from={tmp_path / 'src'}", "model.dropout=0.1", "model.num_layers=7"]
    )
    with caplog.at_level(logging.INFO, logger="lmforge.train.config"):
        resolved = cfg.model.resolve()
        # said once, however often resolved (it was three times a run)
        assert cfg.model.resolve() == resolved
    assert resolved == dataclasses.replace(source, dropout=0.1)
    lines = [r.getMessage() for r in caplog.records]
    # The fields written out (the recipe's, one typed on the command line) are named, with the
    # source's values that win, in one line.
    assert len(lines) == 1 and caplog.records[0].levelname == "WARNING"
    assert lines[0].startswith(
        "model.vocab_size=50304, model.max_position_embeddings=256, model.num_layers=7 not "
        "used, nor model.preset tiny-neox: model.init_from"
    )
    assert lines[0].endswith("(its vocab_size=1000, max_position_embeddings=64, num_layers=2)")
    caplog.clear()
    # a preset alone: one line says so
    with caplog.at_level(logging.INFO, logger="lmforge.train.config"):
        load_run_config(
            None, ["model.preset=tiny-neox", f"model.init_from={tmp_path / 'src'}"]
        ).model.resolve()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "model.preset tiny-neox and its fields are not used" in lines[0]
    assert caplog.records[0].levelname == "INFO" and "max_position_embeddings" in lines[0]


# Shapes no export can hold, reached through a preset's overrides: each fails when the recipe is
# read, in one line naming the overrides and a shape that fits (which itself reads). Zero or
# negative sizes used to train (or fail with a ZeroDivisionError); grouped key/value heads on
# GPT-NeoX/GPT-2 exported a folder neither transformers nor lmforge could load.
IMPOSSIBLE = [
    (
        "tiny-neox",
        {"hidden_size": 128, "head_dim": 16},
        r"head_dim 16 does not fit a gpt_neox model.*use head_dim=32",
    ),
    (
        "tiny-gpt2",
        {"num_heads": 3},
        r"hidden_size 64 is not divisible by num_heads 3.*use num_heads=4",
    ),
    # Both shapes suggested keep the rotary quarter even (were num_heads=16 and hidden_size=72: 1
    # rotary dim each).
    (
        "pythia-160m",
        {"hidden_size": 64},
        r"not divisible by num_heads 12 .*use num_heads=8 or hidden_size=96 ",
    ),
    ("tiny-llama", {"num_heads": 3}, r"transformers rejects such a llama config.*use num_heads=4"),
    ("tiny-llama", {"num_kv_heads": 3}, r"not a multiple of num_kv_heads 3.*use num_kv_heads=4"),
    (
        "tiny-llama",
        {"num_kv_heads": 8},
        r"num_kv_heads 8 is more than num_heads 4: use num_kv_heads=4",
    ),
    ("tiny-neox", {"rotary_pct": 0.3125}, r"gives 5 rotary dims.*use rotary_pct=0.25"),
    ("tiny-gptj", {"rotary_pct": 0.1}, r"gives 1 rotary dims.*use rotary_pct=0.125"),
    ("tiny-neox", {"num_heads": 0}, r"num_heads must be a positive integer, got 0"),
    ("tiny-neox", {"intermediate_size": 0}, r"intermediate_size must be a positive integer, got 0"),
    ("tiny-llama", {"num_layers": -1}, r"num_layers must be a positive integer, got -1"),
    (
        "tiny-neox",
        {"num_kv_heads": 2},
        r"a gpt_neox checkpoint has num_kv_heads=4, this model has 2.*num_kv_heads=4",
    ),
    (
        "tiny-gpt2",
        {"gated_mlp": True},
        r"a gpt2 checkpoint has gated_mlp=False.*set gated_mlp=False",
    ),
    ("tiny-bert", {"causal": True}, r"a bert checkpoint has causal=False"),
    ("tiny-neox", {"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
]


@pytest.mark.parametrize(
    "name, overrides, message", IMPOSSIBLE, ids=[f"{n}-{'-'.join(o)}" for n, o, _ in IMPOSSIBLE]
)
def test_an_impossible_shape_from_a_presets_overrides_fails_when_read(name, overrides, message):
    import re

    from lmforge.errors import UserError

    given = [f"model.{k}={v}" for k, v in overrides.items()]
    with pytest.raises(UserError) as e:
        load_run_config(None, [f"model.preset={name}", *given])
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"model.preset {name} with {', '.join(given)}: ")
    assert re.search(message, line), line
    fix = re.search(r"(?:use|set) (\w+)=([\w.']+)", line)
    if fix:  # the shape it suggests reads, and builds
        key, value = fix.group(1), fix.group(2).strip("'")
        cfg = load_run_config(None, [f"model.preset={name}", *given, f"model.{key}={value}"])
        assert num_parameters(build(cfg.model.config, device="meta")) > 0


def test_init_from_overrides_are_checked_as_a_presets_are(tmp_path):
    from lmforge.errors import UserError
    from lmforge.models.io import save_model

    save_model(build(preset("tiny-llama"), device="cpu"), tmp_path / "src")
    for override, message in (
        ("model.dropout=1.5", r"^dropout must be in \[0, 1\), got 1.5$"),
        (
            "model.make_vocab_size_divisible_by=0",
            r"^make_vocab_size_divisible_by must be a positive integer, got 0$",
        ),
    ):
        cfg = load_run_config(None, [f"model.init_from={tmp_path / 'src'}", override])
        with pytest.raises(UserError, match=message):
            cfg.model.resolve()


@pytest.mark.parametrize(
    "name, overrides, fields",
    [
        ("tiny-neox", {"hidden_size": 128}, {"head_dim": 32, "intermediate_size": 512}),
        ("tiny-gpt2", {"num_heads": 8}, {"head_dim": 8, "num_kv_heads": 8}),
        (
            "tiny-llama",
            {"hidden_size": 128},
            {"head_dim": 32, "intermediate_size": 160, "num_kv_heads": 2},
        ),
        # set apart from hidden_size / num_heads: kept
        ("tiny-qwen3", {"hidden_size": 128}, {"head_dim": 32}),
        ("tiny-neox", {"attention_bias": False}, {"qkv_bias": False}),
    ],
)
def test_what_a_preset_derives_follows_the_overrides(name, overrides, fields):
    """model.hidden_size=128 on a preset of 4 heads of 16 kept head_dim 16: a gpt_neox model that
    trained and exported a folder nothing could load. What the preset derived is derived again,
    as writing its fields out would."""
    cfg = load_run_config(
        None, [f"model.preset={name}", *(f"model.{k}={v}" for k, v in overrides.items())]
    )
    got = cfg.model.config
    assert {k: getattr(got, k) for k in fields} == fields
    written = {k: v for k, v in dataclasses.asdict(preset(name)).items() if k not in fields}
    assert got == dataclasses.replace(preset(name), **{**written, **overrides, **fields})


def test_a_neox_preset_widened_by_an_override_exports_what_transformers_loads(tmp_path):
    import torch
    import transformers

    from lmforge.models import init_weights
    from lmforge.models.hf import export_hf
    from lmforge.models.io import save_model

    mcfg = load_run_config(None, ["model.preset=tiny-neox", "model.hidden_size=128"]).model.config
    model = build(mcfg, device="cpu")
    init_weights(model, mcfg, 0)
    save_model(model, tmp_path / "model")
    export_hf(tmp_path / "model", tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, mcfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model.eval()(ids)[..., : mcfg.vocab_size])


def test_a_rotary_source_may_be_given_a_longer_context_and_a_learned_one_may_not(tmp_path):
    """Continued pretraining at a longer context (Code Llama's larger rotary base, Llama 3.1's
    rope_scaling): model.max_position_embeddings, model.rotary_base and model.rope_scaling may be
    set over a rotary model.init_from, whose weights are unchanged by them; a model with learned
    positions refuses in one line."""
    import torch

    from lmforge.errors import UserError
    from lmforge.models import load_pretrained
    from lmforge.models.io import save_model
    from lmforge.train.setup import check_fit, with_config

    source = dataclasses.replace(preset("tiny-llama"), max_position_embeddings=64)
    save_model(build(source, device="cpu"), tmp_path / "llama")
    cfg = load_run_config(None, [f"model.init_from={tmp_path / 'llama'}", "data.seq_length=128"])
    with pytest.raises(
        UserError,
        match=r"exceeds the model's max_position_embeddings 64: shorten the sequences "
        r"\(data.seq_length=64\) or raise model.max_position_embeddings \(rotary",
    ):
        check_fit(cfg, cfg.model.resolve(), 1)
    longer = load_run_config(
        None,
        [
            f"model.init_from={tmp_path / 'llama'}",
            "data.seq_length=128",
            "model.max_position_embeddings=128",
        ],
    )
    mcfg = longer.model.resolve()
    assert mcfg == dataclasses.replace(source, max_position_embeddings=128) and check_fit(
        longer, mcfg, 1
    )
    model = load_pretrained(tmp_path / "llama").eval()
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    # the same weights and frequencies: the same logits over the source's own context
    with torch.no_grad():
        assert torch.equal(with_config(model, mcfg).eval()(ids), model(ids))
    scaled = load_run_config(
        None,
        [
            f"model.init_from={tmp_path / 'llama'}",
            "model.max_position_embeddings=128",
            "model.rotary_base=40000",
            "model.rope_scaling={type: linear, factor: 2.0}",
        ],
    )
    got = scaled.model.resolve()
    assert (got.rotary_base, got.rope_scaling.type, got.rope_scaling.factor) == (
        40000,
        "linear",
        2.0,
    )

    save_model(
        build(dataclasses.replace(preset("tiny-gpt2"), max_position_embeddings=64), device="cpu"),
        tmp_path / "gpt2",
    )
    cfg = load_run_config(None, [f"model.init_from={tmp_path / 'gpt2'}", "data.seq_length=128"])
    with pytest.raises(
        UserError,
        match=r"max_position_embeddings 64: shorten the sequences \(data.seq_length=64; its "
        r"positions are learned weights\)$",
    ):
        check_fit(cfg, cfg.model.resolve(), 1)
    cfg = load_run_config(
        None, [f"model.init_from={tmp_path / 'gpt2'}", "model.max_position_embeddings=128"]
    )
    with pytest.raises(
        UserError,
        match=r"^model.max_position_embeddings: '.*gpt2' has learned position embeddings, "
        r"weights for its 64 positions: keep data.seq_length within them$",
    ):
        cfg.model.resolve()


def test_a_field_init_from_defines_is_named_alone(tmp_path):
    """The refusal listed every override, the allowed ones (a recipe's
    make_vocab_size_divisible_by) among them."""
    from lmforge.errors import UserError

    with pytest.raises(
        UserError,
        match=r"^model.vocab_size cannot be set with model.init_from, whose folder defines "
        r"the model \(it may take only dropout, .*max_position_embeddings",
    ):
        load_run_config(
            None,
            [
                f"model.init_from={tmp_path}",
                "model.vocab_size=50304",
                "model.make_vocab_size_divisible_by=128",
            ],
        )


def test_a_shipped_recipe_named_from_another_folder_is_found_for_the_user(tmp_path, monkeypatch):
    """`lmforge pretrain configs/llama2-7b-continued.yaml` (as the recipes' comments write it)
    from another folder."""
    from lmforge.errors import UserError
    from lmforge.train.config import SHIPPED_RECIPES

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError,
        match=f"the recipe that ships with lmforge is "
        f"'{SHIPPED_RECIPES / 'llama2-7b-continued.yaml'}'$",
    ):
        load_run_config("configs/llama2-7b-continued.yaml", [])
    with pytest.raises(UserError, match=r"config file 'configs/mine.yaml' does not exist$"):
        load_run_config("configs/mine.yaml", [])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.precision=fp16",
            r"^trainer.precision='fp16': fp16 is not supported \(it needs loss scaling\): use "
            # "did you mean 'bf16'?" sent a
            # Megatron user to round-to-nearest
            r"bf16-mixed",
        ),
        (
            "cost.usd_per_hour=-3",
            r"^cost.usd_per_hour must be >= 0, got -3",
        ),  # was read as "no price"
    ],
)
def test_settings_a_megatron_user_types_get_the_right_fix(override, message):
    from lmforge.errors import UserError

    with pytest.raises(UserError, match=message):
        load_run_config(None, ["model.preset=tiny-neox", override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1)"),
        ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1)"),
        ("optim.lr=-1", "optim.lr must be > 0, got -1"),
        # trained a step and exited 0
        ("trainer.max_minutes=-1", "trainer.max_minutes must be > 0, got -1.0"),
        ("optim.lr=0", "optim.lr must be > 0"),
        ("optim.eps=0", "optim.eps must be > 0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
        ("optim.min_lr=-1e-5", "optim.min_lr must be >= 0"),
        ("optim.min_lr=0.01", "optim.min_lr=0.01 is above optim.lr=0.0003"),
        ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
        (
            "trainer.val_check_interval=-1",
            "trainer.val_check_interval must be >= 0 (0: no validation)",
        ),
        (
            "checkpoint.every_n_steps=-5",
            "checkpoint.every_n_steps must be >= 0 (0: a checkpoint at the end only)",
        ),
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps must be >= 1"),
    ],
)
def test_a_value_no_run_can_use_is_one_line_when_the_config_is_read(override, message):
    """torch.optim took these as far as the optimizer's first step (an IndexError or ValueError
    traceback), or the run took them silently (a negative interval validated and saved never)."""
    with pytest.raises(UserError) as e:
        load_run_config(None, ["model.preset=tiny-neox", "optim.lr=3e-4", override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "warmup, expected",
    [(50, "ends at 4% of optim.lr=0.001"), (2, "only at its last step"), (1, None), (0, None)],
)
def test_a_warmup_the_run_never_finishes_is_said(warmup, expected):
    from lmforge.train.config_checks import schedule_warning

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny-neox",
            "trainer.max_steps=2",
            "optim.lr=1e-3",
            f"optim.warmup_steps={warmup}",
        ],
    )
    warning = schedule_warning(cfg)
    assert (
        warning is None if expected is None else expected in warning and "never decays" in warning
    )


def test_a_run_from_init_from_says_where_its_weights_come_from(tmp_path, caplog):
    """A continued-pretraining log said nothing of its start: one line names the source, its size
    and the vocabulary rows the run re-pads (Megatron's padding for the tensor-parallel degree)."""
    import logging

    from lmforge.models.io import save_model
    from lmforge.train.setup import init_model

    source = dataclasses.replace(preset("tiny-llama"), make_vocab_size_divisible_by=8)
    save_model(build(source, device="cpu"), tmp_path / "src")
    cfg = load_run_config(
        None, [f"model.init_from={tmp_path / 'src'}", "model.make_vocab_size_divisible_by=256"]
    )
    with caplog.at_level(logging.INFO, logger="lmforge.train.setup"):
        model, _ = init_model(cfg)
    line = next(r.getMessage() for r in caplog.records if "model.init_from" in r.getMessage())
    assert line.startswith(
        f"weights from model.init_from '{tmp_path / 'src'}' (an lmforge folder): llama, "
    )
    assert (
        f"vocabulary rows re-padded {source.padded_vocab_size} -> {model.config.padded_vocab_size} (a multiple "
        f"of 256; the Hugging Face export cuts them back to {source.vocab_size})"
    ) in line
    assert source.padded_vocab_size != model.config.padded_vocab_size


def test_both_shapes_a_head_count_error_suggests_read():
    """pythia-160m shrunk to hidden_size=64: the error suggested num_heads=16 and hidden_size=72,
    and each failed next ("rotary_pct 0.25 of head_dim 4 gives 1 rotary dims")."""
    from lmforge.errors import UserError

    with pytest.raises(UserError, match="use num_heads=8 or hidden_size=96 "):
        load_run_config(None, ["model.preset=pythia-160m", "model.hidden_size=64"])
    for fix in ("model.num_heads=8", "model.hidden_size=96"):
        load_run_config(None, ["model.preset=pythia-160m", "model.hidden_size=64", fix])
