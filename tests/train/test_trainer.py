"""The training loop on one process: learning, batch equivalence, precision, NaN handling,
checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmforge.errors import UserError
from lmforge.train.run_files import truncate_metrics
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loss_falls_and_every_metric_is_logged(tiny_corpus, tmp_path, monkeypatch):
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=24",
        "trainer.val_check_interval=8",
        "cost.usd_per_hour=2.0",
        "optim.lr=1e-2",
    )
    # as under a 3-node torchrun
    monkeypatch.setattr("lmforge.train.trainer.nodes_from_env", lambda: 3)
    last = Trainer(cfg).fit()
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
    for key in (
        "grad_norm",
        "lr",
        "tokens_per_second",
        "sequences_per_second",
        "step_time",
        "mfu",
        "memory_gb",
        "tokens_per_dollar",
        "usd_per_million_tokens",
    ):
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    r = rows[-1]
    assert r["tokens_per_second"] == pytest.approx(8 * 32 / r["step_time"])
    # every node paid
    assert r["tokens_per_dollar"] == pytest.approx(r["tokens_per_second"] * 3600 / (3 * 2.0))
    assert all(set(row) <= set(rows[-1]) | {"time_to_first_step"} for row in rows)
    # no internal counts leak into the metrics
    assert not any(key.startswith("_") for row in rows for key in row)
    # Wall clock since the start, validation included: more than start-up plus the timed steps.
    elapsed = [row["elapsed"] for row in rows]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:]))
    assert elapsed[-1] > rows[0]["time_to_first_step"] + sum(row["step_time"] for row in rows[1:])
    assert last["val_ppl"] == pytest.approx(math.exp(last["val_loss"]))
    assert list((tmp_path / "run" / "tensorboard").iterdir())


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tiny_corpus, tmp_path):
    """global 8 as 2 micro-batches of 4 (accumulated) or 1 micro-batch of 8: the same training."""
    losses = []
    for micro in (4, 8):
        cfg = run_config(
            tiny_corpus,
            tmp_path / f"m{micro}",
            f"trainer.micro_batch_size={micro}",
            "trainer.max_steps=4",
            "trainer.val_check_interval=0",
        )
        Trainer(cfg).fit()
        losses.append([(r["loss"], r["grad_norm"]) for r in _rows(tmp_path / f"m{micro}")])
    for (la, ga), (lb, gb) in zip(*losses):
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-sr", "bf16"])
def test_bf16_precisions_train(precision, tiny_corpus, tmp_path):
    trainer = Trainer(
        run_config(
            tiny_corpus,
            tmp_path / precision,
            f"trainer.precision={precision}",
            "trainer.max_steps=12",
            "trainer.val_check_interval=0",
        )
    )
    trainer.fit()
    rows = _rows(tmp_path / precision)
    assert rows[-1]["loss"] < rows[0]["loss"]
    expected = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert all(p.dtype == expected for p in trainer.model.parameters())


def test_non_finite_steps_are_skipped_then_stop_the_run(tiny_corpus, tmp_path, monkeypatch):
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=20",
        "trainer.max_consecutive_skips=3",
        "checkpoint.every_n_steps=2",
        "trainer.val_check_interval=0",
    )
    trainer = Trainer(cfg)
    real = trainer.training.micro_loss

    def poisoned(batch):
        loss, n, correct = real(batch)
        step = trainer.state["step"]
        return (loss * float("nan") if step == 3 or step >= 5 else loss), n, correct

    monkeypatch.setattr(trainer.training, "micro_loss", poisoned)
    with pytest.raises(UserError, match="3 steps in a row had a non-finite loss"):
        trainer.fit()
    rows = _rows(tmp_path / "run")
    assert [r["skipped"] for r in rows] == [0, 0, 0, 1, 0, 1, 1]
    latest = trainer.checkpoints.latest()
    assert latest.name == "step-00000006"  # written before the run stopped, and whole
    state = json.loads((latest / "trainer.json").read_text())
    assert state["skipped_steps"] == 2
    assert all(torch.isfinite(p.detach()).all() for p in trainer.model.parameters())


@pytest.mark.slow
def test_the_python_and_numpy_generators_start_from_the_run_seed(tiny_corpus, tmp_path):
    """Only torch's generator was seeded: Python's and NumPy's global ones (which a library or a
    user's dataset may draw from) kept whatever the process had, so two runs with the same seed
    saved different RNG states in their checkpoints. Now every generator a checkpoint keeps
    starts from trainer.seed."""
    import random

    import numpy as np

    states = {}
    for name, seed, before in [("a", 3, 1), ("b", 3, 2), ("c", 4, 1)]:
        random.seed(before)  # whatever ran earlier in the process
        np.random.seed(before)
        Trainer(
            run_config(
                tiny_corpus,
                tmp_path / name,
                f"trainer.seed={seed}",
                "trainer.max_steps=1",
                "trainer.val_check_interval=0",
            )
        ).fit()
        states[name] = json.loads(
            (tmp_path / name / "checkpoints" / "step-00000001" / "rng-rank0.json").read_text()
        )
    assert states["a"] == states["b"]
    assert all(states["a"][k] != states["c"][k] for k in ("python", "numpy", "torch"))


def test_top_k_and_last_checkpoints_are_kept(tiny_corpus, tmp_path):
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=10",
        "trainer.val_check_interval=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=2",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    kept = trainer.checkpoints.checkpoints()
    val = {r["step"]: r["val_loss"] for r in _rows(tmp_path / "run") if "val_loss" in r}
    best_two = sorted(val, key=val.get)[:2]
    assert {s for s, _ in kept} == set(best_two) | {10}
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))  # no temporary folders left


def test_a_checkpoint_between_validations_is_not_ranked_by_an_earlier_one(tiny_corpus, tmp_path):
    """Checkpoints every 2 steps, validation every 4: step 6's carried step 4's val_loss, and
    with save_top_k=1 a tie or a stale better value deleted checkpoints the ranking should have
    kept. Only checkpoints at a validation step are ranked; the newest stays (a resume starts
    there) until a newer one is written."""
    import json

    run = tmp_path / "run"
    cfg = run_config(
        tiny_corpus,
        run,
        "trainer.max_steps=10",
        "trainer.val_check_interval=4",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
    )
    Trainer(cfg).fit()
    val = {r["step"]: r["val_loss"] for r in _rows(run) if "val_loss" in r}
    assert sorted(val) == [4, 8, 10]
    for step in (2, 4, 6, 8, 10):
        metrics = json.loads(
            (run / "checkpoints" / f"step-{step:08d}" / "trainer.json").read_text()
        )["metrics"]
        assert metrics == (
            {"val_loss": val[step], "val_ppl": metrics.get("val_ppl")} if step in val else {}
        ), step
    ranked = run_config(
        tiny_corpus,
        tmp_path / "ranked",
        "trainer.max_steps=10",
        "trainer.val_check_interval=4",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=1",
        "checkpoint.save_last=false",
    )
    trainer = Trainer(ranked)
    trainer.fit()
    assert {s for s, _ in trainer.checkpoints.checkpoints()} == {min(val, key=val.get)}


def test_convert_to_hf_writes_a_folder_transformers_loads(tiny_corpus, tmp_path):
    tf = pytest.importorskip("transformers")
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=3",
        "checkpoint.convert_to_hf=true",
        "trainer.val_check_interval=0",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    hf, info = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf.eval()(ids).logits, trainer.model.eval()(ids), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_export_hf_of_a_checkpoint_equals_the_runs_own_export(
    precision, tiny_corpus, shared_data, tmp_path
):
    """Issue 18 item 12: `lmforge export-hf RUN/checkpoints/step-N` said `no model.safetensors in
    ...`. It reads the checkpoint directly, and its export of the last checkpoint is the folder
    the run wrote at the end: the same tensors bit for bit (in the dtype the run kept: bf16 under
    bf16-sr), config.json and tokenizer files."""
    from safetensors.torch import load_file

    from lmforge.cli import main

    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b"
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=3",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
        "checkpoint.convert_to_hf=true",
        "trainer.val_check_interval=0",
        f"trainer.precision={precision}",
        f"data.tokenizer={tokenizer}",
        "model.vocab_size=50277",
    )
    Trainer(cfg).fit()
    run = tmp_path / "run"
    assert (
        main(["export-hf", str(run / "checkpoints" / "step-00000003"), str(tmp_path / "hf")]) == 0
    )
    ours, theirs = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(run / "hf" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    assert {t.dtype for t in ours.values()} == {
        torch.bfloat16 if precision == "bf16-sr" else torch.float32
    }
    written = sorted(p.name for p in (run / "hf").iterdir())
    assert (
        sorted(p.name for p in (tmp_path / "hf").iterdir()) == written
        and "tokenizer.json" in written
    )
    for name in written:
        assert (tmp_path / "hf" / name).read_bytes() == (run / "hf" / name).read_bytes(), name
    # An earlier checkpoint exports its own weights, not the final ones.
    assert (
        main(["export-hf", str(run / "checkpoints" / "step-00000002"), str(tmp_path / "hf2")]) == 0
    )
    earlier = load_file(tmp_path / "hf2" / "model.safetensors")
    assert not all(torch.equal(earlier[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_export_hf_refuses_a_damaged_checkpoint_and_writes_nothing(tiny_corpus, tmp_path, capsys):
    from lmforge.cli import main

    cfg = run_config(
        tiny_corpus, tmp_path / "run", "trainer.max_steps=1", "trainer.val_check_interval=0"
    )
    Trainer(cfg).fit()
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export-hf", str(step), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"checkpoint '{step}' is damaged" in err and shard.name in err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.global_batch_size=6"],
            "global_batch_size 6 is not divisible by micro_batch_size 4",
        ),
        (["data.seq_length=512"], "seq_length 512 exceeds the model's max_position_embeddings 256"),
        (["data.paths=[/nonexistent/prefix]"], "data prefix '/nonexistent/prefix' has no"),
        (
            ["trainer.precision=bf17"],
            "trainer.precision='bf17' is not valid (did you mean 'bf16'?)",
        ),
        (["optim.lrr=1"], "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["model.init_from=/nonexistent"], "does not exist"),
        # was an AttributeError traceback
        (["trainer=null"], "config section 'trainer' must be a mapping, got None"),
        (["optim=5"], "config section 'optim' must be a mapping, got 5"),
    ],
)
def test_bad_configs_fail_before_compute(overrides, message, tiny_corpus, tmp_path):
    with pytest.raises(UserError) as e:
        Trainer(run_config(tiny_corpus, tmp_path / "run", *overrides))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_before_writing_leaves_no_folders(tiny_corpus, tmp_path):
    """A walkthrough's first failed run (a missing data file) left an empty runs/ behind
    run_dir=runs/x."""
    with pytest.raises(UserError):
        Trainer(
            run_config(
                tiny_corpus, tmp_path / "runs" / "deep" / "x", "data.paths=[/nonexistent/prefix]"
            )
        )
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()  # a folder that was there stays, with what it holds
    with pytest.raises(UserError):
        Trainer(
            run_config(
                tiny_corpus, tmp_path / "runs" / "deep" / "x", "data.paths=[/nonexistent/prefix]"
            )
        )
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other"]


def test_a_token_id_past_the_model_vocabulary_fails_before_training(tiny_corpus, tmp_path):
    """Issue 18 item 6: ids up to 999 on a 500-id model crashed with an IndexError at the first
    step and left a run folder behind."""
    with pytest.raises(UserError) as e:
        Trainer(run_config(tiny_corpus, tmp_path / "run", "model.vocab_size=500"))
    assert str(e.value).startswith(
        f"data prefix '{tiny_corpus}' has token id 999 but the model's vocab_size is 500"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["trainer.global_batch_size=6", "data.seq_length=512"])
def test_batch_and_sequence_checks_come_before_the_sample_index_cache(
    override, tiny_corpus, tmp_path
):
    """Issue 18 item 20: a bad batch size failed only after the sample indices were written
    beside the data."""
    with pytest.raises(UserError):
        Trainer(
            run_config(
                tiny_corpus, tmp_path / "run", override, f"data.cache_dir={tmp_path / 'cache'}"
            )
        )
    assert not (tmp_path / "cache").exists()


def test_the_last_line_and_the_log_say_what_the_run_did(tiny_corpus, tmp_path, caplog):
    """Issue 18 items 15 and 21: run totals and averages, not the last step's dict; off a
    terminal the progress is plain log lines (no tqdm carriage returns)."""
    import logging

    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "trainer.max_steps=4",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=true",
    )
    trainer = Trainer(cfg)
    with caplog.at_level(logging.INFO):
        last = trainer.fit()
    # What the run computes on, said once (a cluster job that asked for no GPU trained on the CPU
    # without a word).
    assert [
        r.getMessage()
        for r in caplog.records
        if r.name == "lmforge.train.trainer" and "1 process on cpu (" in r.getMessage()
    ]
    lines = [r.getMessage() for r in caplog.records if r.name == "lmforge.train.progress"]
    assert lines[0].startswith("step 1/4 (25%), loss ") and lines[-1].startswith(
        "step 4/4 (100%), loss "
    )
    assert all("\r" not in line for line in lines)
    summary = trainer.summary(last)
    rows = _rows(tmp_path / "run")
    tokens = 4 * 8 * 32
    average = tokens / sum(r["step_time"] for r in rows)
    assert summary.startswith(f"finished at step 4: 4 steps, {tokens:,} tokens in ")
    assert f"{average:,.0f} tokens/s, MFU " in summary and f"loss {rows[-1]['loss']:.4f}" in summary
    events = b"".join(p.read_bytes() for p in (tmp_path / "run" / "tensorboard").glob("events.*"))
    # grouped there, plain here
    assert b"train/loss" in events and b"perf/mfu" in events and "loss" in rows[-1]


def test_tokenizer_larger_than_model_vocab_is_refused(tiny_corpus, tmp_path, shared_data):
    with pytest.raises(UserError, match="has 50257 ids but the model only 1000"):
        Trainer(
            run_config(
                tiny_corpus, tmp_path / "run", f"data.tokenizer={shared_data}/tokenizers/gpt2"
            )
        )


def test_a_torn_last_metrics_line_does_not_stop_a_resume(tmp_path):
    """A run killed while writing metrics.jsonl leaves half a row; resuming drops it with the
    rows past the checkpoint."""
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "lo')
    truncate_metrics(path, 2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"


def test_continued_pretraining_can_repad_the_vocabulary(tmp_path):
    """model.make_vocab_size_divisible_by on top of model.init_from (128 x TP for tensor
    parallelism): the embedding and head gain zero rows past the vocabulary and the model
    computes the same logits."""
    from lmforge.models import build
    from lmforge.models.io import save_model
    from lmforge.train.config import load_run_config
    from lmforge.train.setup import init_model

    source = build("tiny-llama", seed=0)
    save_model(source, tmp_path / "src")
    cfg = load_run_config(
        None, [f"model.init_from={tmp_path / 'src'}", "model.make_vocab_size_divisible_by=2048"]
    )
    model, _ = init_model(cfg)
    assert model.config.padded_vocab_size == 2048 and source.config.padded_vocab_size == 1024
    assert model.embed.weight.shape[0] == 2048 and not model.embed.weight[1000:].any()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), source.eval()(ids))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_a_mixture_of_experts_trains_with_its_router_losses_logged(preset, tiny_corpus, tmp_path):
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        f"model.preset={preset}",
        "trainer.max_steps=16",
        "trainer.val_check_interval=8",
        "optim.lr=1e-2",
        "model.router_z_loss_coef=0.001",
    )
    Trainer(cfg).fit()
    rows = _rows(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert vals[-1] < vals[0]
    # The load-balancing loss is num_experts * sum_e f_e P_e, f_e the share of the k choices per
    # token: k when perfectly balanced, at most k * num_experts.
    k, experts = cfg.model.resolve().experts_per_token, cfg.model.resolve().num_experts
    assert all(0.95 * k <= r["aux_loss"] <= k * experts and r["z_loss"] > 0 for r in rows)


@pytest.mark.parametrize("key", ["true", "false"])
def test_a_run_sets_tf32_for_its_device_from_trainer_tf32(key, tiny_corpus, tmp_path, monkeypatch):
    """The Trainer hands its device and trainer.tf32 to set_tf32 (which acts on CUDA only:
    tests/test_devices.py): a CPU run leaves the flags as they were."""
    from lmforge import devices

    calls = []
    monkeypatch.setattr(
        "lmforge.train.trainer.set_tf32",
        lambda d, on: calls.append((d.type, on)) or devices.set_tf32(d, on),
    )
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    Trainer(run_config(tiny_corpus, tmp_path / "run", f"trainer.tf32={key}", "trainer.max_steps=1"))
    assert calls == [("cpu", key == "true")]
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_a_checkpoint_finds_its_runs_relative_paths_from_any_folder(
    tiny_corpus, shared_data, tmp_path, monkeypatch
):
    """A run started with relative paths (data.tokenizer=tok, run_dir=runs/x: the README's
    spelling) wrote them as given, and its checkpoint's tokenizer (and a QLoRA run's
    model.init_from) was found only from the folder the run was started in: `lmforge
    generate/serve/export-hf RUN/checkpoints/step-N` failed from anywhere else."""
    from pathlib import Path

    from lmforge.models.source import run_path, tokenizer_source

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    (work / "tok").symlink_to(shared_data / "tokenizers" / "gpt-neox-20b")
    monkeypatch.chdir(work)
    Trainer(
        run_config(
            tiny_corpus,
            "runs/x",
            "trainer.max_steps=1",
            "trainer.val_check_interval=0",
            "data.tokenizer=tok",
            "model.vocab_size=50277",
        )
    ).fit()
    step = work / "runs" / "x" / "checkpoints" / "step-00000001"
    monkeypatch.chdir(elsewhere)
    assert tokenizer_source(step) == step  # the copy every checkpoint holds
    (step / "20B_tokenizer.json").unlink()  # as an older one was
    assert tokenizer_source(step) == work / "tok" and run_path(step, "tok") == work / "tok"
    # A checkpoint from before trainer.json recorded the working folder: the one its relative
    # run_dir leads back to.
    state = json.loads((step / "trainer.json").read_text())
    assert state.pop("working_dir") == str(work)
    (step / "trainer.json").write_text(json.dumps(state))
    assert tokenizer_source(step) == work / "tok"
    # not there either way: as recorded, for the error to name
    assert run_path(step, "nowhere") == Path("nowhere")


def test_run_dir_that_is_a_file_is_one_line(tiny_corpus, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        UserError, match=r"run_dir '.*notes\.txt' is a file: give a folder for the run"
    ):
        Trainer(run_config(tiny_corpus, tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_monitored_metric_the_run_never_records_is_said_once(tiny_corpus, tmp_path, caplog):
    """checkpoint.monitor=val_los (a typo) kept the newest checkpoints without a word: Lightning
    and NeMo say so."""
    import logging

    cfg = run_config(
        tiny_corpus, tmp_path / "run", "checkpoint.every_n_steps=4", "checkpoint.monitor=val_los"
    )
    with caplog.at_level(logging.WARNING, logger="lmforge.checkpoint.manager"):
        Trainer(cfg).fit()
    said = [r.getMessage() for r in caplog.records if "checkpoint.monitor" in r.getMessage()]
    assert said == [
        "checkpoint.monitor=val_los is not among the metrics the checkpoints record (val_loss, val_ppl): "
        "retention keeps the newest"
    ]


def test_a_warmup_longer_than_the_run_is_one_warning(tiny_corpus, tmp_path, caplog):
    """The peak learning rate is never reached: the run said nothing. A rerun of the finished run
    trains nothing, so it says only that (it warned of the schedule too)."""
    cfg = run_config(tiny_corpus, tmp_path / "run", "trainer.max_steps=2", "optim.warmup_steps=50")
    Trainer(cfg).fit()
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "warmup_steps" in r.getMessage()
    ]
    assert warned == [
        "optim.warmup_steps=50 >= trainer.max_steps=2: the learning rate ends at 4% of optim.lr=0.003 "
        "and never decays; shorten the warmup or train longer"
    ]
    caplog.clear()
    rerun = Trainer(cfg)
    assert rerun.fit() == {} and rerun.summary({}).startswith(
        "the run is at step 2 already (trainer.max_steps=2)"
    )
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
