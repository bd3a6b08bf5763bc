"""`lmforge pretrain`/`finetune` under torchrun with tensor, sequence and pipeline parallelism
(gloo, CPU).

Every layout trains like one process on the same global batch (loss, gradient norm and validation
loss, to the tolerances of test_distributed.py); a checkpoint written at (tp=2, pp=2) resumes at
(dp=2) and on one process with the curve going on as if never interrupted; BERT MLM with two
interleaved pipeline stages, 12 microbatches and data parallelism on top equals one process.
Launches are few (each torchrun costs seconds of start-up); references run in this process.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from lmforge.checkpoint import load_model_weights
from lmforge.models import build
from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun

# 4 layers: two pipeline ranks x two virtual stages. decay_steps fixes the schedule, so a 4-step run
# and the first 4 steps of a 6-step run train alike (and resume to 6 like the 6-step run).
NEOX = [
    "model.preset=tiny-neox",
    "model.num_layers=4",
    "data.seq_length=32",
    "trainer.max_steps=4",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "trainer.val_check_interval=2",
    "trainer.val_batches=1",
    "trainer.precision=fp32",
    "optim.lr=3e-3",
    "optim.decay_steps=6",
    "trainer.progress_bar=false",
    "cost.peak_flops=1e11",
]
INTERLEAVED = [
    "parallel.pipeline=2",
    "parallel.pipeline_schedule=interleaved_1f1b",
    "parallel.virtual_stages=2",
]


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in rows]


def _close(a, b, loss=2e-5, grad=2e-4):
    assert len(a) == len(b), (a, b)
    for (la, ga, va), (lb, gb, vb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, rel=loss) and ga == pytest.approx(gb, rel=grad), (a, b)
        assert (va is None) == (vb is None) and (va is None or va == pytest.approx(vb, rel=loss)), (
            a,
            b,
        )


def _torchrun(processes: int, verb: str, *overrides: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun(
        processes, ["-m", "lmforge.cli", verb, os.devnull, *overrides], env=env, timeout=420
    )
    assert r.returncode == 0, r.stderr[-4000:]


def _one(*overrides: str) -> Trainer:
    """The single-process reference, in this process, on one thread (as each torchrun rank has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(load_run_config(None, list(overrides)))
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    return trainer


@pytest.fixture(scope="module")
def neox(tiny_corpus, tmp_path_factory):
    """(arguments, the single-process reference run of 6 steps)."""
    args = [*NEOX, f"data.paths=[{tiny_corpus}]"]
    ref = tmp_path_factory.mktemp("one") / "run"
    _one(*args, "trainer.max_steps=6", f"run_dir={ref}")
    return args, ref


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["parallel.tensor=2"], ["parallel.pipeline=2"], INTERLEAVED],
    ids=["tensor2", "pipeline2_1f1b", "pipeline2_interleaved"],
)
def test_two_processes_train_like_one(layout, neox, tmp_path):
    args, ref = neox
    _torchrun(2, "pretrain", *args, *layout, f"run_dir={tmp_path}")
    _close(_curve(tmp_path), _curve(ref)[:4])


@pytest.mark.slow
def test_tensor_x_pipeline_then_resume_on_other_layouts(neox, tmp_path):
    """tp=2 x pp=2 on 4 processes equals one process; its checkpoint (DCP: model and the Adam
    moments) resumes on 2 data-parallel processes and on one process, the curve going on like the
    uninterrupted run's; its Hugging Face export (gathered from the 4 ranks) holds the
    checkpoint's weights."""
    tf = pytest.importorskip("transformers")
    args, ref = neox
    run = tmp_path / "tp2pp2"
    _torchrun(
        4,
        "pretrain",
        *args,
        "parallel.tensor=2",
        "parallel.pipeline=2",
        "checkpoint.convert_to_hf=true",
        f"run_dir={run}",
    )
    _close(_curve(run), _curve(ref)[:4])
    model = build(load_run_config(None, args).model.config, seed=1)
    load_model_weights(run / "checkpoints" / "step-00000004", model)
    hf = tf.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), rtol=1e-5, atol=1e-5)

    shutil.copytree(run, tmp_path / "one")
    _torchrun(2, "pretrain", *args, "trainer.max_steps=6", f"run_dir={run}")  # dp=2 (DDP)
    _close(_curve(run), _curve(ref))
    _one(*args, "trainer.max_steps=6", f"run_dir={tmp_path / 'one'}")
    _close(_curve(tmp_path / "one"), _curve(ref))


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_tensor_x_pipeline(neox, tmp_path):
    """The reverse direction: 4 steps on one process, then the same run resumed at tp=2 x pp=2
    (interleaved, 4 processes) goes on to step 6 like the uninterrupted one-process run (DCP
    reshards model and Adam moments)."""
    args, ref = neox
    run = tmp_path / "run"
    _one(*args, f"run_dir={run}")
    _torchrun(
        4,
        "pretrain",
        *args,
        "trainer.max_steps=6",
        "parallel.tensor=2",
        *INTERLEAVED,
        f"run_dir={run}",
    )
    _close(_curve(run), _curve(ref))


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_is_one_clear_error_on_every_rank(neox, tmp_path):
    """Resuming under tp=2 from a checkpoint of another model (another MLP width): every rank
    exits non-zero, rank 0 says what differs in one line, nobody hangs."""
    args, _ = neox
    run = tmp_path / "run"
    _one(*args, "trainer.max_steps=2", f"run_dir={run}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            "pretrain",
            os.devnull,
            *args,
            "model.intermediate_size=96",
            "parallel.tensor=2",
            f"run_dir={run}",
        ],
        env=env,
        timeout=300,
    )
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert (
        len(errors) == 1 and "with another model: model.intermediate_size 256 -> 96" in errors[0]
    ), r.stderr[-3000:]
    assert "Set it back to resume this run, or give a new run_dir" in errors[0]
    # nothing half-written
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]


@pytest.mark.slow
def test_bf16_stochastic_rounding_under_tensor_parallelism(tiny_corpus, tmp_path):
    """AdamWSR updates each rank's shard of the DTensor parameters: the bf16-sr curve follows one
    process's (to bf16 noise only: the rounding noise is drawn per shard). Eight steps that
    learn, so that a wrong update shows (one laid out unlike its gradient drifted by 0.036 nats
    at step 6)."""
    args = [
        *NEOX,
        f"data.paths=[{tiny_corpus}]",
        "trainer.precision=bf16-sr",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        "optim.decay_steps=8",
    ]
    _torchrun(2, "pretrain", *args, "parallel.tensor=2", f"run_dir={tmp_path / 'tp'}")
    _one(*args, f"run_dir={tmp_path / 'one'}")
    # bf16 weights: single-process bf16-sr and bf16 runs differ by up to 1e-3 in loss, 5% in
    # gradient norm.
    _close(_curve(tmp_path / "tp"), _curve(tmp_path / "one"), loss=1e-3, grad=0.1)


@pytest.mark.slow
def test_fsdp_bf16_mixed_gathers_bf16_and_follows_one_process(tiny_corpus, tmp_path):
    """bf16-mixed under FSDP2 on 2 ranks (bf16 all-gathers, fp32 reduce-scatters, fp32 shards)
    follows one process's bf16-mixed curve to bf16 rounding: the gathered weights are the fp32
    ones rounded to bf16, as autocast rounds them for the matmuls (norms and the residual stream
    now also run in bf16). Losses within 3e-4: 1.07e-4 apart at step 4 on an Intel Xeon with AMX
    (bf16 matmuls through oneDNN), under 1e-4 on an AMD EPYC."""
    args = [*NEOX, f"data.paths=[{tiny_corpus}]", "trainer.precision=bf16-mixed"]
    _torchrun(2, "pretrain", *args, "trainer.data_parallel=fsdp", f"run_dir={tmp_path / 'fsdp'}")
    _one(*args, f"run_dir={tmp_path / 'one'}")
    _close(_curve(tmp_path / "fsdp"), _curve(tmp_path / "one"), loss=3e-4, grad=5e-3)


@pytest.fixture(scope="module")
def bert_data(shared_data, tmp_path_factory):
    """A BERT tokenizer and MLM samples from a slice of Tiny Shakespeare (train, and a small
    valid part)."""
    from lmforge.data.preprocess import preprocess
    from lmforge.data.tokenizer_train import train_tokenizer

    root = tmp_path_factory.mktemp("bert")
    text = (shared_data / "corpora" / "tinyshakespeare" / "input.txt").read_text()
    (root / "train.txt").write_text(text[:120_000])
    (root / "valid.txt").write_text(text[-6_000:])
    train_tokenizer(
        [root / "train.txt"],
        1000,
        root / "tok",
        special_tokens=("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"),
    )
    for name in ("train", "valid"):
        preprocess([root / f"{name}.txt"], root / name, root / "tok", progress=False)
    return root


@pytest.mark.slow
def test_bert_mlm_pipeline_interleaved_with_data_parallel_equals_one_process(bert_data, tmp_path):
    """Issue 7's experiment 3, small: 2 pipeline stages x 2 virtual stages, 12 microbatches, 2
    data-parallel replicas (4 processes) against one process with the same global batch of 24."""
    args = [
        "model.preset=tiny-bert",
        "model.num_layers=4",
        "data.task=mlm",
        f"data.tokenizer={bert_data / 'tok'}",
        f"data.paths=[{bert_data / 'train_text_document'}]",
        f"data.valid_file={bert_data / 'valid_text_document'}",
        "data.seq_length=32",
        "trainer.max_steps=3",
        "trainer.global_batch_size=24",
        "trainer.val_check_interval=3",
        "trainer.precision=fp32",
        "optim.lr=2e-3",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
    ]
    _torchrun(
        4,
        "finetune",
        *args,
        "trainer.micro_batch_size=1",
        *INTERLEAVED,
        "parallel.microbatches=12",
        f"run_dir={tmp_path / 'pp'}",
    )
    _one(*args, "trainer.micro_batch_size=24", f"run_dir={tmp_path / 'one'}")
    _close(_curve(tmp_path / "pp"), _curve(tmp_path / "one"))


@pytest.mark.parametrize("micro", [1, 2])
def test_a_moe_step_trains_on_the_loss_plus_coef_times_the_router_losses(micro):
    """One process, one step: the gradient is that of the summed token loss over the step's label
    count plus, for each micro-batch, (aux_coef x aux loss + z_coef x z-loss) / micro-batches,
    computed by hand."""
    import dataclasses

    from lmforge.models import build, preset
    from lmforge.models.router_losses import router_losses
    from lmforge.parallel import ParallelConfig
    from lmforge.train.config import OptimConfig, Precision
    from lmforge.train.step import ParallelTraining
    from lmforge.train.tasks import get_task, logits_loss

    cfg = dataclasses.replace(
        preset("tiny-qwen3-moe"), router_aux_loss_coef=0.3, router_z_loss_coef=0.05
    )
    model = build(cfg, seed=0).train()
    reference = build(cfg, seed=0).train()
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"tokens": t, "labels": t.roll(-1, 1)} for t in tokens.chunk(micro)]
    training = ParallelTraining(
        model,
        ParallelConfig(),
        None,
        get_task("pretrain"),
        OptimConfig(),
        Precision("fp32", torch.float32),
        0,
        16,
        torch.device("cpu"),
    )
    training.step(batches, training.global_counts(batches), max_norm=0.0)
    aux = []
    for b in batches:
        loss = logits_loss(reference(b["tokens"]), b["labels"]) / tokens.numel()
        losses = router_losses(reference, cfg)
        aux.append(losses.aux_loss.item())
        (loss + (0.3 * losses.aux_loss + 0.05 * losses.z_loss) / micro).backward()
    assert training.router_metrics["aux_loss"] == pytest.approx(sum(aux) / micro, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name
