"""Fine-tuning through the same loop: SFT on Alpaca, SST-2 classification, BERT MLM."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from lmforge.cli import main
from lmforge.data.preprocess import preprocess
from lmforge.data.tokenizer_train import train_tokenizer
from lmforge.models import build
from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _base(run_dir, *extra):
    return [
        f"run_dir={run_dir}",
        "trainer.progress_bar=false",
        "trainer.precision=fp32",
        "cost.peak_flops=1e11",
        "optim.lr=2e-3",
        "optim.warmup_steps=2",
        *extra,
    ]


@pytest.mark.slow
def test_sft_on_alpaca_with_packing(tiny_gpt2, shared_data, tmp_path):
    alpaca = shared_data / "instruct" / "alpaca" / "alpaca_subset_2k.json"
    cfg = load_run_config(
        None,
        _base(
            tmp_path / "sft",
            f"model.init_from={tiny_gpt2}",
            "data.task=sft",
            f"data.train_file={alpaca}",
            f"data.valid_file={alpaca}",
            "data.packing=true",
            "data.seq_length=128",
            "trainer.max_steps=12",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=12",
            "trainer.val_batches=1",
        ),
    )
    trainer = Trainer(cfg)
    # keep validation quick
    trainer.data.valid = torch.utils.data.Subset(trainer.data.valid, range(16))
    trainer.fit()
    rows = _rows(tmp_path / "sft")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5 and "val_loss" in rows[-1]
    assert rows[-1]["tokens_per_second"] > 0


@pytest.mark.slow
def test_sft_of_a_tiny_mixtral_on_padded_batches_logs_its_aux_loss(shared_data, tmp_path):
    """Padded (unpacked) SFT batches: the load-balancing loss counts the real tokens only (the
    attention mask), as transformers' does; the loss falls with it added."""
    from lmforge.models.io import save_model

    model_dir = tmp_path / "mixtral"
    model = build(
        {
            **build("tiny-mixtral", device="meta").config.__dict__,
            "vocab_size": 50257,
            "max_position_embeddings": 128,
        },
        seed=0,
    )
    save_model(
        model, model_dir, tokenizer_from=shared_data / "tokenizers" / "gpt2" / "tokenizer.json"
    )
    alpaca = shared_data / "instruct" / "alpaca" / "alpaca_subset_2k.json"
    cfg = load_run_config(
        None,
        _base(
            tmp_path / "sft",
            f"model.init_from={model_dir}",
            "data.task=sft",
            f"data.train_file={alpaca}",
            "data.packing=false",
            "data.seq_length=128",
            "trainer.max_steps=12",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=0",
            "model.router_aux_loss_coef=0.05",
        ),
    )
    Trainer(cfg).fit()
    rows = _rows(tmp_path / "sft")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert all(1.9 <= r["aux_loss"] <= 8.0 for r in rows)  # k = 2 balanced, at most k x 4 experts


@pytest.mark.slow
def test_classification_on_sst2_exports_a_sequence_classifier(tiny_gpt2, shared_data, tmp_path):
    tf = pytest.importorskip("transformers")
    sst = shared_data / "classification" / "sst-2"
    run = tmp_path / "cls"
    code = main(
        [
            "finetune",
            "/dev/null",
            *_base(
                run,
                f"model.init_from={tiny_gpt2}",
                "data.task=classification",
                f"data.train_file={sst}/train.tsv",
                f"data.valid_file={sst}/dev.tsv",
                "data.seq_length=64",
                "trainer.max_steps=6",
                "trainer.global_batch_size=16",
                "trainer.micro_batch_size=16",
                "trainer.val_check_interval=6",
                "checkpoint.convert_to_hf=true",
            ),
        ]
    )
    assert code == 0
    last = _rows(run)[-1]
    assert 0.0 <= last["val_accuracy"] <= 1.0 and last["val_loss"] > 0
    hf, info = tf.AutoModelForSequenceClassification.from_pretrained(
        run / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.num_labels == 2


@pytest.mark.slow
def test_mlm_pretraining_of_a_tiny_bert(shared_data, tmp_path):
    text = shared_data / "corpora" / "tinyshakespeare" / "input.txt"
    tok_dir = tmp_path / "tok"
    train_tokenizer(
        [text], 1000, tok_dir, special_tokens=("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")
    )
    prefix = tmp_path / "shakespeare"
    preprocess([text], prefix, tok_dir, progress=False)
    run = tmp_path / "mlm"
    cfg = load_run_config(
        None,
        _base(
            run,
            "model.preset=tiny-bert",
            "data.task=mlm",
            f"data.tokenizer={tok_dir}",
            f"data.paths=[{prefix}_text_document]",
            f"data.valid_file={prefix}_text_document",
            "data.seq_length=64",
            "trainer.max_steps=10",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=8",
            "trainer.val_check_interval=10",
        ),
    )
    trainer = Trainer(cfg)
    # trainer.val_batches global batches per validation, as pretraining (the whole held-out corpus
    # was scored)
    assert (
        len(trainer.data.valid) > 32
        and trainer.task.validation_samples(cfg, trainer.data.valid, 8) == 4 * 8
    )
    trainer.data.valid = torch.utils.data.Subset(trainer.data.valid, range(16))
    trainer.fit()
    rows = _rows(run)
    assert rows[-1]["loss"] < rows[0]["loss"] and "val_loss" in rows[-1]
    two = load_run_config(
        None,
        _base(
            tmp_path / "two",
            "model.preset=tiny-bert",
            "data.task=mlm",
            f"data.tokenizer={tok_dir}",
            f"data.paths=[0.5,{prefix}_text_document,0.5,{prefix}_text_document]",
            "data.seq_length=64",
        ),
    )
    from lmforge.errors import UserError

    with pytest.raises(UserError, match="data.task=mlm trains on one data prefix, got 2"):
        Trainer(two)  # it trained on the first and dropped the other without a word


def test_finetune_refuses_a_pretraining_config(tiny_corpus, tmp_path, capsys):
    assert (
        main(["finetune", "/dev/null", "model.preset=tiny-neox", f"data.paths=[{tiny_corpus}]"])
        == 1
    )
    assert (
        "got data.task=pretrain: set data.task=sft|classification|mlm|dpo|grpo"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    shown = capsys.readouterr().out
    assert all(
        key in shown
        for key in (
            "data.task",
            "data.chat_template",
            "data.assistant_only_loss",
            "lora.rank",
            "lora.targets",
            "dpo.beta",
            "data.truncate",
            "hf-adapter",
        )
    )


@pytest.mark.parametrize("task", ["sft", "dpo", "classification"])
def test_a_missing_validation_file_stops_the_run_before_the_training_file_is_read(
    task, tiny_gpt2, tmp_path, capsys
):
    train = tmp_path / "train.jsonl"
    train.write_text("{not json\n")  # read first, this would be the error
    run = tmp_path / "run"
    args = [
        "finetune",
        "/dev/null",
        *_base(
            run,
            f"model.init_from={tiny_gpt2}",
            f"data.task={task}",
            "data.packing=false",
            "data.seq_length=64",
            f"data.train_file={train}",
            f"data.valid_file={tmp_path / 'nope.jsonl'}",
        ),
    ]
    assert main(args) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: data.valid_file: data file {tmp_path / 'nope.jsonl'} not found: check the path"
    )
    assert main(args[:-2] + ["data.train_file=null"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("data.train_file is not set: give the file to fine-tune on")
    )
    assert not run.exists()


def test_a_validation_file_of_another_record_kind_is_named(tiny_gpt2, tmp_path, caplog):
    from lmforge.tokenizers import load_tokenizer
    from lmforge.train.tasks.sft import SFT

    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text(json.dumps({"instruction": "Add 2 and 3.", "output": "5"}) + "\n")
    valid.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Add 1 and 1."},
                    {"role": "assistant", "content": "2"},
                ]
            }
        )
        + "\n"
    )
    overrides = _base(
        tmp_path / "run",
        f"model.init_from={tiny_gpt2}",
        "data.task=sft",
        "data.seq_length=64",
        f"data.train_file={train}",
    )
    for valid_file, warned in ((valid, True), (train, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="lmforge.train.tasks.sft"):
            SFT().build_data(
                load_run_config(None, [*overrides, f"data.valid_file={valid_file}"]),
                load_tokenizer(tiny_gpt2),
            )
        assert (
            "data.valid_file holds chat records, data.train_file alpaca ones" in caplog.text
        ) is warned


@pytest.mark.slow
def test_fine_tuning_batches_are_padded_to_a_few_shapes(tiny_gpt2, shared_data, tmp_path):
    """Classification batches: the longest example rounded up to data.pad_to_multiple_of (64
    under trainer.compile, so a compiled block sees two shapes here instead of one per length),
    never past seq_length; the padding is masked out, so the loss of a batch does not depend on
    it."""
    from lmforge.tokenizers import load_tokenizer
    from lmforge.train.tasks import get_task

    task = get_task("classification")

    sst = shared_data / "classification" / "sst-2"
    tok = load_tokenizer(tiny_gpt2)

    def cfg(*extra):
        return load_run_config(
            None,
            _base(
                tmp_path,
                f"model.init_from={tiny_gpt2}",
                "data.task=classification",
                f"data.train_file={sst / 'train.tsv'}",
                "data.seq_length=100",
                *extra,
            ),
        )

    compiled = task.build_data(cfg("trainer.compile=true"), tok)
    items = [compiled.train[i] for i in range(64)]
    lengths = {compiled.collate(items[i : i + 4])["input_ids"].shape[1] for i in range(0, 64, 4)}
    longest = {max(len(x["input_ids"]) for x in items[i : i + 4]) for i in range(0, 64, 4)}
    # 100 = seq_length: the cap, not 128
    assert lengths <= {64, 100} and len(longest) > len(lengths)
    assert task.build_data(cfg("data.pad_to_multiple_of=1"), tok).collate(items[:4])[
        "input_ids"
    ].shape[1] == max(len(x["input_ids"]) for x in items[:4])
    model = build(
        {
            **build("tiny-gpt2", device="meta").config.__dict__,
            "vocab_size": 50257,
            "max_position_embeddings": 128,
            "num_labels": 2,
        },
        seed=0,
    ).eval()
    exact = task.build_data(cfg("data.pad_to_multiple_of=1"), tok).collate(items[:4])
    with torch.no_grad():
        a, _, _ = task.loss(model, exact)
        b, _, _ = task.loss(model, compiled.collate(items[:4]))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chat_sft_export_serves_prompts_as_trained(tiny_gpt2, tmp_path):
    """A chat SFT run's export carries the template it trained with: the served prompt for a chat
    is, token for token, the training example up to the answer; transformers reads the same
    template from hf/."""
    from lmforge.data.sft import SFTDataset
    from lmforge.serve.chat import ChatFormat
    from lmforge.tokenizers import load_tokenizer

    chats = [
        [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": "Double it."},
            {"role": "assistant", "content": str(2 * (a + b))},
        ]
        for a in range(6)
        for b in range(6)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    run = tmp_path / "run"
    code = main(
        [
            "finetune",
            "/dev/null",
            *_base(
                run,
                f"model.init_from={tiny_gpt2}",
                "data.task=sft",
                f"data.train_file={data}",
                "data.seq_length=64",
                "trainer.max_steps=2",
                "trainer.global_batch_size=4",
                "trainer.micro_batch_size=4",
                "trainer.val_check_interval=0",
                "checkpoint.convert_to_hf=true",
            ),
        ]
    )
    assert code == 0
    hf = run / "hf"
    assert (hf / "chat_template.jinja").is_file() and (
        run / "model" / "chat_template.jinja"
    ).is_file()
    trained = SFTDataset(data, load_tokenizer(tiny_gpt2), 64)[0]
    labels = trained["labels"].tolist()
    second_answer = (
        len(labels) - next(i for i, x in enumerate(reversed(labels[:-1])) if x == -100) - 1
    )
    served = ChatFormat(load_tokenizer(hf), hf).encode(
        [(m["role"], m["content"]) for m in chats[0][:3]]
    )
    assert served == trained["input_ids"][:second_answer].tolist()
    tf = pytest.importorskip("transformers")
    assert (
        tf.AutoTokenizer.from_pretrained(hf).chat_template
        == (hf / "chat_template.jinja").read_text()
    )


@pytest.mark.slow
def test_a_checkpoint_export_carries_a_builtin_chat_template(tiny_gpt2, tmp_path):
    """Issue 16: `export-hf RUN/checkpoints/step-N` of an SFT run with data.chat_template=chatml
    had no template (only the run's own hf/ had it), so serving the export prompted in a format
    the model never saw. The checkpoint keeps the template; its export, `serve` of the export or
    of the checkpoint itself, and transformers' apply_chat_template on the export all give the
    training example's ids up to the answer."""
    from lmforge.chat_template import builtin_template
    from lmforge.data.sft import SFTDataset
    from lmforge.models.source import tokenizer_source
    from lmforge.serve.chat import ChatFormat
    from lmforge.tokenizers import load_tokenizer

    chat = [
        {"role": "system", "content": "Answer in digits."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Double it."},
        {"role": "assistant", "content": "10"},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    run = tmp_path / "run"
    assert (
        main(
            [
                "finetune",
                "/dev/null",
                *_base(
                    run,
                    f"model.init_from={tiny_gpt2}",
                    "data.task=sft",
                    f"data.train_file={data}",
                    "data.seq_length=128",
                    "data.chat_template=chatml",
                    "trainer.max_steps=1",
                    "trainer.global_batch_size=1",
                    "trainer.micro_batch_size=1",
                    "trainer.val_check_interval=0",
                ),
            ]
        )
        == 0
    )
    step, hf = run / "checkpoints" / "step-00000001", tmp_path / "hf"
    assert main(["export-hf", str(step), str(hf)]) == 0
    tokenizer = load_tokenizer(tiny_gpt2)
    template = builtin_template("chatml", tokenizer.add_bos_token)
    assert (hf / "chat_template.jinja").read_text() == template
    trained = SFTDataset(data, tokenizer, 128, chat_template="chatml")[0]
    labels = trained["labels"].tolist()
    second_answer = (
        len(labels) - next(i for i, x in enumerate(reversed(labels[:-1])) if x == -100) - 1
    )
    expected = trained["input_ids"][:second_answer].tolist()
    prompt = [(m["role"], m["content"]) for m in chat[:4]]
    assert ChatFormat(load_tokenizer(hf), hf).encode(prompt) == expected
    # `lmforge serve CHECKPOINT` and `lmforge generate CHECKPOINT` read the run's tokenizer and the
    # kept template.
    assert ChatFormat(load_tokenizer(tokenizer_source(step)), step).encode(prompt) == expected
    assert (
        main(
            [
                "generate",
                str(step),
                "--prompt",
                "2 plus 3 is",
                "--max-new-tokens",
                "2",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    tf = pytest.importorskip("transformers")
    theirs = tf.AutoTokenizer.from_pretrained(hf).apply_chat_template(
        chat[:4], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert theirs["input_ids"] == expected


@pytest.fixture(scope="module")
def tiny_pythia(shared_data, tmp_path_factory):
    """A random Pythia-shaped Hugging Face folder with the real GPT-NeoX-20B tokenizer: what the
    recipes take."""
    import shutil

    tf = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("pythia") / "hf"
    torch.manual_seed(0)
    tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(
            vocab_size=50304,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            rotary_pct=0.25,
            max_position_embeddings=256,
        )
    ).save_pretrained(out)
    shutil.copyfile(
        shared_data / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json", out / "tokenizer.json"
    )
    return out


@pytest.fixture(scope="module")
def tiny_qwen3_moe(shared_data, tmp_path_factory):
    """A random Qwen3-MoE Hugging Face folder (4 experts, 2 per token) with the GPT-NeoX-20B
    tokenizer: what the MoE recipe takes."""
    import shutil

    tf = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(
            vocab_size=50304,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
        )
    ).save_pretrained(out)
    shutil.copyfile(
        shared_data / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json", out / "tokenizer.json"
    )
    return out


NO_TORCHAO = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        "sft-pythia-160m",
        "lora-pythia-410m",
        "dpo-pythia-160m",
        pytest.param("qlora-llama-3.1-8b", marks=NO_TORCHAO),
        pytest.param("qlora-qwen3-30b-a3b", marks=NO_TORCHAO),
    ],
)
def test_fine_tuning_recipes_run_as_the_readme_says(recipe, request, tmp_path):
    """Each recipe, with the README's command and a tiny model (a mixture of experts for the MoE
    one), trains and writes what the README says."""
    from pathlib import Path

    base = request.getfixturevalue("tiny_qwen3_moe" if "qwen3" in recipe else "tiny_pythia")

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Spell {w}."},
                {"role": "assistant", "content": " ".join(w)},
            ]
        }
        for w in ("cat", "dog", "owl", "bee", "elk", "ant")
    ]
    pairs = [
        {"prompt": f"Spell {w}.", "chosen": " ".join(w), "rejected": w}
        for w in ("cat", "dog", "owl", "bee")
    ]
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps(r) + "\n" for r in (pairs if recipe.startswith("dpo") else chats))
    )
    run = tmp_path / "run"
    path = Path(__file__).resolve().parents[2] / "configs" / f"{recipe}.yaml"
    code = main(
        [
            "finetune",
            str(path),
            f"model.init_from={base}",
            f"data.train_file={data}",
            f"data.valid_file={data}",
            "data.seq_length=64",
            "trainer.max_steps=2",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
            "trainer.val_check_interval=2",
            "trainer.precision=fp32",
            "checkpoint.every_n_steps=0",
            "trainer.progress_bar=false",
            "cost.peak_flops=1e11",
            f"run_dir={run}",
        ]
    )
    assert code == 0
    assert (run / "hf" / "config.json").is_file() and (run / "hf" / "chat_template.jinja").is_file()
    assert (run / "hf-adapter" / "adapter_config.json").is_file() == recipe.startswith(
        ("lora", "qlora")
    )
    last = _rows(run)[-1]
    assert ("val_reward_accuracy" in last) == recipe.startswith("dpo") and "val_loss" in last


@pytest.mark.parametrize(
    "preset", ["tiny-llama", "tiny-neox", "tiny-gpt2", "tiny-mistral", "tiny-gemma2"]
)
def test_a_decoder_classifier_runs_causal_attention_without_a_padding_mask(preset, monkeypatch):
    """The classification task pads on the right, where causal attention is exact for every real
    token: the decoder runs SDPA's is_causal (or the capped path's own causal mask) instead of
    building a (batch, 1, seq, seq) padding mask, and gives the class logits the masked model
    gives (sliding windows and Gemma 2's soft-capping included)."""
    import torch.nn.functional as F

    from lmforge.train.tasks import get_task

    meta = build(preset, device="meta").config
    model = build(
        {
            **meta.__dict__,
            "num_labels": 3,
            "pad_token_id": 0,
            "sliding_window": 5 if meta.sliding_window else None,
        },
        seed=0,
    ).eval()
    ids = torch.randint(1, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 7:], mask[2, 4:] = 0, 0  # right padding: rows of 7, 12 and 4 tokens
    ids = ids.masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask, "label": torch.tensor([0, 2, 1])}
    with torch.no_grad():
        expected = model(ids, attention_mask=mask)
        masks = []
        sdpa = F.scaled_dot_product_attention
        monkeypatch.setattr(
            F,
            "scaled_dot_product_attention",
            lambda *a, **k: masks.append(k.get("attn_mask")) or sdpa(*a, **k),
        )
        loss, count, correct = get_task("classification").loss(model, batch)
    # at most a sliding window's band, never one per row
    assert all(m is None or m.dim() == 2 for m in masks)
    assert masks or meta.attn_logit_softcapping  # Gemma 2's capped scores go their own way
    torch.testing.assert_close(
        loss, F.cross_entropy(expected, batch["label"], reduction="sum"), rtol=1e-6, atol=1e-6
    )
    assert int(count) == 3 and int(correct) == int((expected.argmax(-1) == batch["label"]).sum())
    for row, n in enumerate((7, 12, 4)):  # each row's logits equal those of the row alone, unpadded
        with torch.no_grad():
            alone = model(ids[row : row + 1, :n])
        torch.testing.assert_close(expected[row : row + 1], alone, rtol=1e-5, atol=1e-5)


def test_starts_seldom_meant_are_warned_of(tmp_path, caplog):
    """Fine-tuning random weights (a preset, no model.init_from) and stretching a trained model's
    context past what it saw both run without a word; each now says so, once, with the fix."""
    from lmforge.models.io import save_model
    from lmforge.train.setup import warn_about_the_start

    source = tmp_path / "source"
    save_model(
        build(
            {**build("tiny-neox", device="meta").config.__dict__, "max_position_embeddings": 128},
            seed=0,
        ),
        source,
    )
    cases = [  # (overrides, the warning's words or None)
        (
            ["model.preset=tiny-neox", "data.task=sft"],
            "data.task=sft on randomly initialised weights",
        ),
        (
            ["model.preset=tiny-neox", "data.task=dpo"],
            "data.task=dpo on randomly initialised weights",
        ),
        (["model.preset=tiny-neox"], None),  # pretraining starts from random weights
        # said nothing
        (["model.preset=tiny-neox", "lora.rank=4"], "lora.rank=4 on randomly initialised weights"),
        (
            [
                f"model.init_from={source}",
                "model.max_position_embeddings=1024",
                "data.seq_length=1024",
            ],
            "model.max_position_embeddings 1024 is over the 128 positions",
        ),
        ([f"model.init_from={source}", "data.seq_length=128"], None),
    ]
    for overrides, words in cases:
        cfg = load_run_config(None, [*_base(tmp_path / "run"), *overrides])
        caplog.clear()
        with caplog.at_level("WARNING", logger="lmforge.train.setup"):
            warn_about_the_start(cfg, cfg.model.resolve())
        assert (words in caplog.text) if words else not caplog.text, (overrides, caplog.text)
