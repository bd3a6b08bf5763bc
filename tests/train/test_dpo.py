"""DPO: the loss, rewards and accuracy against TRL's formula computed directly from a model's
logits; the three references (a frozen model, the base without adapters, log-probs in the file);
preference data; a short run."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.data.collate import IGNORE_INDEX
from lmforge.errors import UserError
from lmforge.models import build
from lmforge.models.lora import LoRAConfig, apply_lora
from lmforge.train.tasks import get_task
from tests.parallel.launch import torchrun
from tests.train.test_lora import TP_FINETUNE

BETA = 0.3


def _batch():
    """Two pairs (rows: chosen, rejected, chosen, rejected) of different lengths, prompts
    unlabelled."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a shorter rejected answer, right-padded
    labels[1, 9:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _direct_logps(model, batch) -> torch.Tensor:
    """Summed log p(token t+1 | ...t) over the labelled tokens, straight from the logits (TRL's
    get_batch_logps)."""
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).float()
    labels = batch["labels"][:, 1:]
    logp = (
        torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    )
    return (logp * (labels != IGNORE_INDEX)).sum(-1)


def _as_trained(task, batch):
    """The batch as a training step hands it to the loss: each row's scored positions found on
    the host (lmforge.train.step), so the fused per-row loss and the blank-pair check read
    nothing from the device."""
    from lmforge.train.step import scored_positions

    return {**batch, **scored_positions(task.inputs(batch)[1])}


def _task(reference=None, beta=BETA):
    from lmforge.parallel import ParallelConfig, parallelize

    task = get_task("dpo")
    # The reference laid out as one process lays it out (the trainer's ParallelTraining does this
    # for any layout).
    laid = (
        None
        if reference is None
        else parallelize(reference.requires_grad_(False), ParallelConfig(), None)
    )
    task.beta, task.reference, task.precomputed = beta, laid, False
    return task


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma2"])  # Gemma 2: soft-capped logits
def test_loss_rewards_and_accuracy_equal_trls_formula(preset):
    policy, reference = build(preset, seed=1), build(preset, seed=2)
    batch = _batch()
    pc, pr = _direct_logps(policy, batch)[0::2], _direct_logps(policy, batch)[1::2]
    rc, rr = _direct_logps(reference, batch)[0::2], _direct_logps(reference, batch)[1::2]
    logits = (pc - pr) - (rc - rr)  # TRL DPOTrainer, loss_type="sigmoid", label_smoothing=0
    expected_loss = -F.logsigmoid(BETA * logits)
    chosen, rejected = BETA * (pc - rc), BETA * (pr - rr)
    task = _task(reference)
    for fused, given in ((True, batch), (False, batch), (True, _as_trained(task, batch))):
        loss, count, (correct, margin, chosen_sum, rejected_sum) = task.loss(policy, given, fused)
        assert count == 2 and task.count(batch) == 2
        torch.testing.assert_close(loss, expected_loss.sum(), rtol=1e-5, atol=1e-5)
        assert correct == int((chosen > rejected).sum())
        assert margin == pytest.approx(float((chosen - rejected).sum()), rel=1e-4, abs=1e-5)
        assert chosen_sum == pytest.approx(float(chosen.sum()), rel=1e-4, abs=1e-5)
        assert rejected_sum == pytest.approx(float(rejected.sum()), rel=1e-4, abs=1e-5)
    metrics = task.metrics(float(expected_loss.sum()), 2, correct, margin, chosen_sum, rejected_sum)
    assert metrics["val_loss"] == pytest.approx(float(expected_loss.mean()))
    assert metrics["val_reward_accuracy"] == correct / 2
    # Reference log-probs given with the data (TRL's precompute_ref_log_probs) give the same loss.
    given = {**batch, "ref_logps": _direct_logps(reference, batch)}
    torch.testing.assert_close(
        _task(None).loss(policy, given)[0], expected_loss.sum(), rtol=1e-5, atol=1e-5
    )
    # The gradient reaches the policy only.
    loss, _, _ = task.loss(policy, batch)
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    assert all(p.grad is None for p in reference.parameters())


def test_a_blank_pair_filling_up_validation_counts_nowhere():
    """The last validation step is filled up with blank pairs (lmforge.train.tasks.base.Blanks):
    loss, count and reward statistics are those of the real pairs alone."""
    policy, reference = build("tiny-llama", seed=1), build("tiny-llama", seed=2)
    batch, task = _batch(), _task(reference)
    item = {
        "chosen_ids": batch["input_ids"][0],
        "chosen_labels": batch["labels"][0],
        "rejected_ids": batch["input_ids"][1],
        "rejected_labels": batch["labels"][1],
    }
    blank = task.blank(item)
    assert (blank["chosen_labels"] == IGNORE_INDEX).all() and (
        blank["rejected_labels"] == IGNORE_INDEX
    ).all()
    rows = [blank["chosen_ids"], blank["rejected_ids"]]
    padded = {
        "input_ids": torch.cat([batch["input_ids"], torch.stack(rows)]),
        "labels": torch.cat(
            [batch["labels"], torch.stack([blank["chosen_labels"], blank["rejected_labels"]])]
        ),
        "attention_mask": torch.cat([batch["attention_mask"], batch["attention_mask"][:2]]),
    }
    with torch.no_grad():
        loss, count, stats = task.loss(policy, batch)
        for given in (padded, _as_trained(task, padded)):
            loss_b, count_b, stats_b = task.loss(policy, given)
            assert count == count_b == task.count(padded) == 2
            torch.testing.assert_close(loss_b, loss)
            # pytest 9.2's approx takes no tensors
            torch.testing.assert_close(stats_b, stats, rtol=1e-6, atol=1e-12)


def test_under_lora_the_reference_is_the_base_without_adapters():
    base = build("tiny-llama", seed=1)
    policy = copy.deepcopy(base)
    apply_lora(policy, LoRAConfig(rank=2, targets="all-linear", dropout=0.1))
    policy.train()
    task = _task()
    task.lora_reference = True
    batch = _batch()
    loss, count, (correct, margin, _, _) = task.loss(policy, batch)
    # B = 0 at init: the policy is its reference, every pair's loss is log 2 and no reward is ahead.
    assert loss.item() == pytest.approx(2 * math.log(2), abs=1e-6) and correct == 0 and margin == 0
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    ref = task.reference_logps(policy, batch, fused=True)
    torch.testing.assert_close(ref, _direct_logps(base, batch), rtol=1e-5, atol=1e-4)
    assert policy.training  # the reference pass restores train mode


def test_preference_data(shared_data, tmp_path):
    from lmforge.data.dpo import PreferenceDataset
    from lmforge.tokenizers import load_tokenizer

    gpt2 = load_tokenizer(shared_data / "tokenizers" / "gpt2" / "tokenizer.json")
    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {
            "prompt": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name?"},
            ],
            "chosen": [{"role": "assistant", "content": "Ada."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PreferenceDataset(path, gpt2, 64)
    plain = ds[0]
    assert plain["chosen_ids"].tolist() == gpt2.encode("2+2=") + gpt2.encode("4") + [50256]
    assert plain["rejected_labels"].tolist() == [IGNORE_INDEX] * len(
        gpt2.encode("2+2=")
    ) + gpt2.encode("5") + [50256]
    chat = ds[1]  # the earlier answer in the prompt is context: only the last answer is scored
    trained = chat["chosen_ids"][chat["chosen_labels"] != IGNORE_INDEX].tolist()
    assert gpt2.decode(trained) == "Ada.<|endoftext|>"
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].shape[0] == 4
    assert (
        batch["input_ids"][1, : len(plain["rejected_ids"])].tolist()
        == plain["rejected_ids"].tolist()
    )

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(
        UserError, match=r"bad\.jsonl:2: a preference record needs .*'rejected' is missing"
    ):
        PreferenceDataset(bad, gpt2, 64)
    # SFT data given to DPO
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    with pytest.raises(
        UserError,
        match=r"bad\.jsonl:1: .*'prompt', 'chosen', 'rejected' are missing \(its "
        r"'messages' is SFT data: set data.task=sft\)$",
    ):
        PreferenceDataset(bad, gpt2, 64)
    bad.write_text(
        json.dumps({**rows[0], "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0})
        + "\n"
        + json.dumps(rows[0])
        + "\n"
    )
    with pytest.raises(UserError, match="1 of 2 records have ref_chosen_logps"):
        PreferenceDataset(bad, gpt2, 64)
    # Reference log-probs from the file are of whole answers: a pair too long is dropped even with
    # truncate=cut, where cutting it paired a cut answer's policy log-prob with the whole answer's
    # reference one.
    refs = {"ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}
    long = {"prompt": "Say it:", "chosen": " yes" * 40, "rejected": " no" * 40}
    bad.write_text(json.dumps({**rows[0], **refs}) + "\n" + json.dumps({**long, **refs}) + "\n")
    ds = PreferenceDataset(bad, gpt2, 32, truncate="cut")
    assert (len(ds), ds.num_cut, ds.num_dropped) == (1, 0, 1)
    long_only = tmp_path / "long.jsonl"
    long_only.write_text(json.dumps(long) + "\n")
    # without references: cut
    assert PreferenceDataset(long_only, gpt2, 32, truncate="cut").num_cut == 1


WORDS = [
    "apples",
    "rivers",
    "stars",
    "music",
    "trains",
    "clouds",
    "cities",
    "forests",
    "oceans",
    "books",
    "gardens",
    "mountains",
    "bridges",
    "candles",
    "deserts",
    "islands",
    "lanterns",
    "meadows",
    "planets",
    "rockets",
]


@pytest.fixture(scope="module")
def dpo_setup(shared_data, tmp_path_factory):
    """A small GPT-2-shaped model with the real GPT-2 tokenizer, and preference pairs (held-out
    words for validation) whose chosen answers agree and whose rejected ones refuse."""
    from lmforge.models.io import save_model

    root = tmp_path_factory.mktemp("dpo")
    model = build(
        {
            **build("tiny-gpt2", device="meta").config.__dict__,
            "vocab_size": 50257,
            "max_position_embeddings": 64,
        },
        seed=0,
    )
    save_model(
        model, root / "model", tokenizer_from=shared_data / "tokenizers" / "gpt2" / "tokenizer.json"
    )
    for name, words in (("train", WORDS[:14]), ("valid", WORDS[14:])):
        rows = [
            {
                "prompt": f"Tell me about {w}.",
                "chosen": f" Sure, {w} are lovely.",
                "rejected": " No.",
            }
            for w in words
        ]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _dpo_args(root, run, *extra):
    return [
        f"model.init_from={root / 'model'}",
        "data.task=dpo",
        f"data.train_file={root / 'train.jsonl'}",
        f"data.valid_file={root / 'valid.jsonl'}",
        "data.seq_length=32",
        "trainer.max_steps=8",
        "trainer.global_batch_size=6",
        "trainer.micro_batch_size=3",
        "trainer.val_check_interval=8",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "optim.lr=3e-3",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        "dpo.beta=0.5",
        f"run_dir={run}",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        (),
        (
            "lora.rank=8",
            "lora.targets=all-linear",
            "optim.lr=5e-2",
            "trainer.max_steps=12",
            "trainer.val_check_interval=12",
        ),
    ],
    ids=["reference-copy", "lora"],
)
def test_a_short_run_raises_held_out_reward_accuracy(dpo_setup, tmp_path, extra):
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    trainer = Trainer(load_run_config(None, _dpo_args(dpo_setup, tmp_path / "run", *extra)))
    before = trainer.validate()
    # policy = ref
    assert before["val_reward_accuracy"] == 0 and before["val_loss"] == pytest.approx(math.log(2))
    last = trainer.fit()
    assert last["val_reward_accuracy"] >= 0.8 and last["val_reward_margin"] > 0
    assert last["val_loss"] < math.log(2)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected"} <= set(
        rows[-1]
    )


@pytest.mark.slow
def test_a_killed_dpo_run_resumes_bit_exactly(dpo_setup, tmp_path):
    """A LoRA DPO run (the reference: the base without adapters; dropout on the adapters) killed
    with SIGKILL after its step-4 checkpoint continues, rerun with the same command, to the same
    curve as an uninterrupted run."""
    import signal

    from tests.train.runs import ENV, lmforge, metrics_steps, stop, wait_for

    def args(path):
        return [
            "finetune",
            os.devnull,
            *_dpo_args(
                dpo_setup,
                path,
                "trainer.max_steps=12",
                "trainer.val_check_interval=4",
                "checkpoint.every_n_steps=4",
                "checkpoint.save_top_k=-1",
                "lora.rank=4",
                "lora.dropout=0.1",
                "optim.lr=3e-2",
            ),
        ]

    def curve(path):
        keys = (
            "step",
            "loss",
            "grad_norm",
            "reward_accuracy",
            "reward_margin",
            "val_loss",
            "val_reward_margin",
        )
        rows = map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
        return [tuple(r.get(k) for k in keys) for r in rows]

    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args(tmp_path / "whole")],
        check=True,
        env=ENV,
        capture_output=True,
        timeout=600,
    )
    killed = tmp_path / "killed"
    proc = lmforge(args(killed))
    try:
        wait_for(lambda: max(metrics_steps(killed), default=0) >= 6, proc, timeout=600)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        stop(proc)
    assert proc.returncode == -signal.SIGKILL
    assert 6 <= max(metrics_steps(killed)) < 12, "the run finished before it could be killed"
    assert (killed / "checkpoints" / "step-00000004").is_dir()
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args(killed)],
        check=True,
        env=ENV,
        capture_output=True,
        timeout=600,
    )
    whole = curve(tmp_path / "whole")
    assert len(whole) == 12 and curve(killed) == whole  # exact float equality, every step


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


LORA_DPO = ("lora.rank=4", "lora.targets=all-linear", "optim.lr=3e-2")


@pytest.fixture(scope="module")
def one_process_dpo(dpo_setup, tmp_path_factory):
    """DPO runs on one process, against a frozen copy of the initial model or (with LORA_DPO) the
    base without its adapters: what every layout must equal. Each is run on first use."""
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    runs = {}

    def run(*lora: str):
        if lora not in runs:
            runs[lora] = tmp_path_factory.mktemp("dpo-one") / "run"
            Trainer(
                load_run_config(
                    None,
                    _dpo_args(
                        dpo_setup,
                        runs[lora],
                        "trainer.max_steps=4",
                        "trainer.val_check_interval=4",
                        *lora,
                    ),
                )
            ).fit()
        return runs[lora]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("trainer.data_parallel=fsdp",),
        ("parallel.tensor=2", "model.make_vocab_size_divisible_by=256"),
        ("parallel.pipeline=2",),
        ("parallel.pipeline=2", *LORA_DPO),
        pytest.param(
            ("parallel.tensor=2", "model.make_vocab_size_divisible_by=256", *LORA_DPO),
            marks=TP_FINETUNE,
        ),
    ],
    ids=["fsdp2", "tp2", "pp2", "pp2-lora", "tp2-lora"],
)
def test_dpo_on_two_ranks_equals_one_process_with_the_reference_sharded_like_the_policy(
    dpo_setup, one_process_dpo, tmp_path, layout
):
    """DPO against a frozen copy of the initial model on 2 gloo ranks (FSDP2, tensor parallelism
    with sequence parallelism and the vocabulary-parallel loss, or two pipeline stages): every
    step's loss, gradient norm and reward statistics, and the validation's, equal one process's;
    the reference is split exactly like the policy (each rank holds its shards, or its stage,
    only), frozen, gradient-free and outside the optimizer. Under LoRA (the reference: the
    policy's stages with their adapters off) the same curve as one process's LoRA run."""
    run, out = tmp_path / "run", tmp_path / "out.json"
    lora = tuple(a for a in layout if a in LORA_DPO)
    args = _dpo_args(dpo_setup, run, "trainer.max_steps=4", "trainer.val_check_interval=4", *layout)
    r = torchrun(2, [str(Path(__file__).with_name("dpo_worker.py")), str(out), *args])
    assert r.returncode == 0, r.stderr[-3000:]
    ours, theirs = _metrics(run), _metrics(one_process_dpo(*lora))
    assert len(ours) == len(theirs) == 4
    keys = (
        "loss",
        "grad_norm",
        "reward_accuracy",
        "reward_margin",
        "rewards_chosen",
        "rewards_rejected",
        "val_loss",
        "val_reward_accuracy",
        "val_reward_margin",
    )
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() >= set(keys) - {"val_loss", "val_reward_accuracy", "val_reward_margin"}
        for k in keys:
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert theirs[-1]["reward_margin"] != 0  # the policy moved away from its reference
    report = json.loads(out.read_text())
    if lora:
        assert report["reference"] is None
        return
    reference, policy = report["reference"], report["policy"]
    assert reference.keys() == policy.keys()
    assert all(placement == policy[n] for n, (placement, _, _, _) in reference.items())
    from lmforge.models.source import source_config

    whole = dict(build(source_config(dpo_setup / "model"), device="meta").named_parameters())
    # the first stage: the embeddings and the first block, no more
    if "parallel.pipeline=2" in layout:
        assert set(reference) < set(whole) and not any(n.startswith("layers.1.") for n in reference)
    else:  # this rank's shards, not a copy
        assert all(placement != "local" for placement, _, _, _ in reference.values())
        assert sum(numel for _, numel, _, _ in reference.values()) < 0.75 * sum(
            p.numel() for p in whole.values()
        )
    assert (
        not any(trains or grad for _, _, trains, grad in reference.values())
        and report["in_optimizer"] == 0
    )


def test_bad_preference_data_is_one_line_and_writes_nothing(dpo_setup, tmp_path, capsys):
    from lmforge.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
        + "\n"
        + json.dumps({"prompt": "a", "chosen": "b"})
        + "\n"
    )
    args = _dpo_args(dpo_setup, tmp_path / "run", f"data.train_file={bad}")
    assert main(["finetune", "/dev/null", *args]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"error: {bad}:2: a preference record needs 'prompt', 'chosen' and 'rejected'; 'rejected' is "
        "missing\n"
    )
    assert not (tmp_path / "run").exists()
