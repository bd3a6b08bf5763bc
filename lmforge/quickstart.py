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
import shlex
import shutil
import sysconfig
import time
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path

from lmforge.errors import UserError
from lmforge.fsutil import LEFTOVER, atomic_write

log = logging.getLogger(__name__)

# A Pythia-shaped model (parallel residual, rotary on 25% of each head) that learns visibly in
# a couple of minutes on two CPU cores.
MODEL = {
    "family": "gpt_neox",
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "max_position_embeddings": 128,
    "parallel_residual": True,
    "rotary_pct": 0.25,
}
# The [5/6] sample; the printed `lmforge generate` command passes the same, so it prints the same
# text.
PROMPT = "Return a new list"
SAMPLING = {"max_new_tokens": 40, "temperature": 0.8, "top_k": 40, "seed": 0}

# Written into --out before anything else: a rerun replaces what quickstart made only in a folder
# holding it.
MARKER = ".lmforge-quickstart"
# What quickstart (and the trainer it runs) writes under --out, to recognise a folder an earlier
# quickstart made before it wrote MARKER. A last `**` matches any path below; leftovers of killed
# writes (fsutil.LEFTOVER) too.
OWN = (
    "corpus.jsonl",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "data/stdlib_text_document.bin",
    "data/stdlib_text_document.idx",
    "data/cache/stdlib_text_document-*",
    "model/*.json",
    "model/*.safetensors",
    "hf/*.json",
    "hf/*.safetensors",
    "run/config.yaml",
    "run/metrics.jsonl",
    "run/finished.json",
    "run/history.jsonl",
    "run/run.lock",
    "run/tensorboard/**",
    "run/checkpoints/**",
)


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
        texts = [
            d
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (d := ast.get_docstring(node))
            and len(d) > 40
        ]
        if texts:
            text = "\n\n".join(texts)
            lines.append(json.dumps({"title": path.stem, "text": text}) + "\n")
            chars += len(text)
        if chars >= max_chars:
            break
    atomic_write(out, "".join(lines))  # a few MB
    return len(lines), chars


def check_arguments(minutes: float, max_steps: int) -> None:
    if not minutes > 0:  # nan too
        raise UserError(f"--minutes must be > 0 (the training time budget), got {minutes:g}")
    if max_steps < 1:
        raise UserError(f"--max-steps must be >= 1, got {max_steps}")


def _files(folder: Path, parts: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], bool]]:
    """(path parts below `folder`, whether a plain file) of everything not a folder, in order; a
    link is no file."""
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not path.is_symlink():
            yield from _files(path, (*parts, path.name))
        else:
            yield (*parts, path.name), path.is_file() and not path.is_symlink()


def _own(parts: tuple[str, ...]) -> bool:
    if any(LEFTOVER.match(part) for part in parts):
        return True
    for pattern in OWN:
        pat = pattern.split("/")
        if pat[-1] == "**":
            if len(parts) >= len(pat) and all(map(fnmatchcase, parts, pat[:-1])):
                return True
        elif len(parts) == len(pat) and all(map(fnmatchcase, parts, pat)):
            return True
    return False


def _quickstart_corpus(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and set(first) == {"title", "text"}


def not_quickstarts(out: Path) -> str | None:
    """Why the existing folder `out`, without MARKER, is no quickstart's; None where it is empty
    or an earlier quickstart's: nothing but what quickstart writes (OWN), starting with the
    corpus it writes first."""
    foreign, own = [], []
    for parts, plain in _files(out):
        (own if plain and _own(parts) else foreign).append("/".join(parts))
        if len(foreign) > 3:  # enough to say; a large folder is not walked to its end
            break

    def some(paths: list[str]) -> str:
        return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")

    if foreign:
        return f"holds {some(foreign)}, which lmforge quickstart did not make"
    real = [p for p in own if not any(LEFTOVER.match(part) for part in p.split("/"))]
    if real and not _quickstart_corpus(out / "corpus.jsonl"):
        return f"holds {some(real)} but neither {MARKER} nor the corpus.jsonl a quickstart writes first"
    return None


def claim_folder(out: Path) -> None:
    """Make `out` quickstart's: create it, or check an existing one is empty or quickstart's (its
    MARKER, or recognised), then write MARKER. Everything quickstart replaces lies in a folder it
    claimed."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file, not a folder: choose another --out")
    marker = out / MARKER
    if out.is_dir() and not marker.is_file() and (why := not_quickstarts(out)) is not None:
        raise UserError(f"--out '{out}' {why}: choose another --out (a new or empty folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not marker.is_file():
            atomic_write(
                marker, "made by `lmforge quickstart`: a rerun replaces what it made here\n"
            )
    except OSError as e:
        raise UserError(
            f"cannot make the folder --out '{out}': {e.strerror or e}: choose another --out"
        ) from None


def next_steps(run_dir: Path, hf_dir: Path) -> str:
    """The commands to try next; `lmforge generate` prints the [5/6] sample again."""
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SAMPLING.items())
    hf = shlex.quote(str(hf_dir))
    # transformers' generate has no seed
    kwargs = ", ".join(f"{k}={v}" for k, v in SAMPLING.items() if k != "seed")
    # JSON strings are Python strings in double quotes, which the shell's single quotes leave alone.
    code = (
        f'import transformers as t; print(t.pipeline("text-generation", {json.dumps(str(hf_dir))})'
        f'({json.dumps(PROMPT)}, {kwargs}, do_sample=True)[0]["generated_text"])'
    )
    return (
        f"  tensorboard --logdir {shlex.quote(str(run_dir / 'tensorboard'))}\n"
        f"  lmforge generate {hf} --prompt {shlex.quote(PROMPT)} {flags}  # the sample above again\n"
        f"  lmforge serve {hf}\n"
        "  # with Hugging Face transformers, which lmforge does not install (pip install transformers):\n"
        f"  python -c {shlex.quote(code)}"
    )


def clear_run(run_dir: Path, resume: bool) -> bool:
    """Remove the run an earlier quickstart left (unless `resume`); True if there was one. It is
    renamed first, so a kill during the deletion leaves no half-deleted run where the next one
    starts; what such a kill left is removed here too."""
    for stale in run_dir.parent.glob(f".{run_dir.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if resume or not run_dir.exists():
        return False
    old = run_dir.with_name(f".{run_dir.name}.old-{os.getpid()}")
    run_dir.rename(old)
    shutil.rmtree(old)
    return True


def run(
    out_dir: str | Path = "quickstart",
    minutes: float = 3.0,
    say: Callable[[str], None] = log.info,
    max_steps: int = 600,
    resume: bool = False,
) -> dict:
    """The whole walk-through; `say` reports each step (the CLI passes print). Training stops at
    `max_steps` or after `minutes`, whichever comes first. A run left in `out_dir` by an earlier
    quickstart is removed first (the corpus, tokenizer and data are rebuilt anyway), or continued
    with `resume`. Only a new or empty `out_dir`, or one a quickstart made, is written to
    (claim_folder)."""
    from lmforge.data.preprocess import preprocess
    from lmforge.data.tokenizer_train import train_tokenizer
    from lmforge.inference import generate_text
    from lmforge.models.hf import export_hf
    from lmforge.models.io import save_model
    from lmforge.tokenizers import load_tokenizer
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    check_arguments(minutes, max_steps)
    out = Path(out_dir).resolve()
    claim_folder(out)
    t0 = time.perf_counter()

    corpus = out / "corpus.jsonl"
    docs, chars = gather_corpus(corpus)
    say(
        f"[1/6] corpus: {docs} documents, {chars / 1e6:.1f} M characters of Python standard-library docstrings "
        f"-> {corpus}"
    )

    tok_dir = out / "tokenizer"
    train_tokenizer([corpus], MODEL["vocab_size"], tok_dir, overwrite=True)
    tokenizer = load_tokenizer(tok_dir)
    say(
        f"[2/6] tokenizer: byte-level BPE, {tokenizer.vocab_size} tokens -> {tok_dir}/tokenizer.json"
    )

    prefix = out / "data" / "stdlib"
    prefix.parent.mkdir(exist_ok=True)
    stats = preprocess([corpus], prefix, tok_dir, append_eod=True, progress=False)
    say(
        f"[3/6] preprocess: {stats.tokens:,} tokens in {stats.documents} documents -> {prefix}_text_document.bin/.idx"
    )

    run_dir = out / "run"
    if clear_run(run_dir, resume):
        say(f"      removed the previous run in {run_dir} (--resume continues it instead)")
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"data.paths=[{prefix}_text_document]",
        f"data.tokenizer={tok_dir}",
        "data.split=95,5,0",
        "data.seq_length=128",
        f"trainer.max_steps={max_steps}",
        f"trainer.max_minutes={minutes}",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        "trainer.precision=fp32",
        f"trainer.val_check_interval={min(50, max(1, max_steps // 2))}",
        "trainer.val_batches=4",
        "optim.lr=3e-3",
        "optim.min_lr=3e-4",
        "optim.warmup_steps=30",
        "optim.weight_decay=0.01",
        "checkpoint.save_top_k=1",
        f"run_dir={run_dir}",
    ]
    cfg = load_run_config(None, overrides)
    say(
        f"[4/6] pretrain: Pythia-shaped model ({MODEL['num_layers']} layers, d={MODEL['hidden_size']}), "
        f"up to {minutes:g} minutes"
    )
    trainer = Trainer(cfg)
    last = trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    say("      validation loss: " + "  ".join(f"step {s}: {v:.2f}" for s, v in val))
    # the trainer's own line names trainer.max_steps and says nothing is written
    if trainer.finished:
        say(
            f"      the run is at step {trainer.end_step} already (--max-steps {max_steps}): nothing to train; "
            "raise --max-steps to train it further"
        )
    else:
        say(f"      {trainer.summary(last)}")

    model = trainer.model.eval()
    sample = generate_text(model, tokenizer, [PROMPT], **SAMPLING)[0]
    say(f"[5/6] sample: {PROMPT}{sample}")

    model_dir, hf_dir = out / "model", out / "hf"
    save_model(model, model_dir, tokenizer_from=tok_dir / "tokenizer.json", overwrite=True)
    export_hf(model_dir, hf_dir, overwrite=True)
    say(f"[6/6] exported: lmforge model {model_dir}, Hugging Face folder {hf_dir}")
    say(f"done in {time.perf_counter() - t0:.0f} s. Next:\n{next_steps(run_dir, hf_dir)}")
    return {"val": val, "sample": sample, "hf_dir": str(hf_dir)}
