"""`lmforge quickstart`: raw text to a trained, exported model in a few minutes, offline.

The corpus is English prose already on every machine that runs lmforge: the docstrings of the
installed Python standard library. The steps are the ones a real run takes, each with its verb:

    gather text -> tokenizer train -> preprocess (.bin/.idx) -> pretrain (Pythia-shaped) ->
    generate -> export-hf
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from lmforge.fsutil import atomic_write

log = logging.getLogger(__name__)

# A Pythia-shaped model (parallel residual, rotary on 25% of each head) that learns visibly in
# a couple of minutes on two CPU cores.
MODEL = {"family": "gpt_neox", "vocab_size": 4096, "hidden_size": 128, "num_layers": 4, "num_heads": 4,
         "max_position_embeddings": 128, "parallel_residual": True, "rotary_pct": 0.25}


def gather_corpus(out: Path, max_chars: int = 3_000_000) -> tuple[int, int]:
    """One JSONL document per standard-library module: its module, class and function docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines, chars = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "idle_test"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        texts = [d for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and (d := ast.get_docstring(node)) and len(d) > 40]
        if texts:
            text = "\n\n".join(texts)
            lines.append(json.dumps({"title": path.stem, "text": text}) + "\n")
            chars += len(text)
        if chars >= max_chars:
            break
    atomic_write(out, "".join(lines))  # a few MB
    return len(lines), chars


def clear_run(run_dir: Path, resume: bool) -> bool:
    """Remove the run an earlier quickstart left (unless `resume`); True if there was one. It is renamed
    first, so a kill during the deletion leaves no half-deleted run where the next one starts; what such
    a kill left is removed here too."""
    for stale in run_dir.parent.glob(f".{run_dir.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if resume or not run_dir.exists():
        return False
    old = run_dir.with_name(f".{run_dir.name}.old-{os.getpid()}")
    run_dir.rename(old)
    shutil.rmtree(old)
    return True


def run(out_dir: str | Path = "quickstart", minutes: float = 3.0, say: Callable[[str], None] = log.info,
        max_steps: int = 600, resume: bool = False) -> dict:
    """The whole walk-through; `say` reports each step (the CLI passes print). Training stops at
    `max_steps` or after `minutes`, whichever comes first. A run left in `out_dir` by an earlier
    quickstart is removed first (the corpus, tokenizer and data are rebuilt anyway), or continued with
    `resume`."""
    from lmforge.data.preprocess import preprocess
    from lmforge.data.tokenizer_train import train_tokenizer
    from lmforge.inference import generate_text
    from lmforge.models.hf import export_hf
    from lmforge.models.io import save_model
    from lmforge.tokenizers import load_tokenizer
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    corpus = out / "corpus.jsonl"
    docs, chars = gather_corpus(corpus)
    say(f"[1/6] corpus: {docs} documents, {chars / 1e6:.1f} M characters of Python standard-library docstrings "
        f"-> {corpus}")

    tok_dir = out / "tokenizer"
    train_tokenizer([corpus], MODEL["vocab_size"], tok_dir, overwrite=True)
    tokenizer = load_tokenizer(tok_dir)
    say(f"[2/6] tokenizer: byte-level BPE, {tokenizer.vocab_size} tokens -> {tok_dir}/tokenizer.json")

    prefix = out / "data" / "stdlib"
    prefix.parent.mkdir(exist_ok=True)
    stats = preprocess([corpus], prefix, tok_dir, append_eod=True, progress=False)
    say(f"[3/6] preprocess: {stats.tokens:,} tokens in {stats.documents} documents -> {prefix}_text_document.bin/.idx")

    run_dir = out / "run"
    if clear_run(run_dir, resume):
        say(f"      removed the previous run in {run_dir} (--resume continues it instead)")
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"data.paths=[{prefix}_text_document]", f"data.tokenizer={tok_dir}", "data.split=95,5,0",
        "data.seq_length=128", f"trainer.max_steps={max_steps}", f"trainer.max_minutes={minutes}",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "trainer.precision=fp32",
        f"trainer.val_check_interval={min(50, max(1, max_steps // 2))}", "trainer.val_batches=4",
        "optim.lr=3e-3", "optim.min_lr=3e-4",
        "optim.warmup_steps=30", "optim.weight_decay=0.01", "checkpoint.save_top_k=1", f"run_dir={run_dir}",
    ]
    cfg = load_run_config(None, overrides)
    say(f"[4/6] pretrain: Pythia-shaped model ({MODEL['num_layers']} layers, d={MODEL['hidden_size']}), "
        f"up to {minutes:g} minutes")
    trainer = Trainer(cfg)
    last = trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    say("      validation loss: " + "  ".join(f"step {s}: {v:.2f}" for s, v in val))
    say(f"      {trainer.summary(last)}")

    model = trainer.model.eval()
    prompt = "Return a new list"
    sample = generate_text(model, tokenizer, [prompt], max_new_tokens=40, temperature=0.8, top_k=40, seed=0)[0]
    say(f"[5/6] sample: {prompt}{sample}")

    model_dir, hf_dir = out / "model", out / "hf"
    save_model(model, model_dir, tokenizer_from=tok_dir / "tokenizer.json", overwrite=True)
    export_hf(model_dir, hf_dir, overwrite=True)
    say(f"[6/6] exported: lmforge model {model_dir}, Hugging Face folder {hf_dir}")
    say(f"done in {time.perf_counter() - t0:.0f} s. Next:\n"
        f"  tensorboard --logdir {run_dir}/tensorboard\n"
        f"  lmforge generate {hf_dir} --prompt \"{prompt}\"\n"
        f"  lmforge serve {hf_dir}\n"
        f"  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('{hf_dir}')\"")
    return {"val": val, "sample": sample, "hf_dir": str(hf_dir)}
