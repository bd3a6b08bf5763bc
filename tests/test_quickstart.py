"""The README's first command, end to end: offline corpus -> tokenizer -> data -> training ->
export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_trains_and_exports_a_model_transformers_loads(tmp_path):
    tf = pytest.importorskip("transformers")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "quickstart",
            "--out",
            str(tmp_path),
            "--minutes",
            "30",
            "--max-steps",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for step in range(1, 7):
        assert f"[{step}/6]" in r.stdout
    vals = [float(v) for v in re.findall(r"step \d+: (\d+\.\d+)", r.stdout)]
    assert len(vals) >= 2 and vals[-1] < vals[0]  # validation loss falls
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["val_loss"] == pytest.approx(vals[-1], abs=0.01)
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("Return a new list", return_tensors="pt").input_ids
    # generation stops at the quickstart tokenizer's <|endoftext|> (0), which config.json names (it
    # had null)
    assert model.config.eos_token_id == tok.eos_token_id == 0
    out = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(out) == 5 or out[-1] == 0


def test_a_rerun_starts_afresh_unless_resume(tmp_path):
    """Issue 18 item 21: rerunning quickstart silently continued the last run (at step 302)."""
    from lmforge.quickstart import clear_run

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000302").mkdir(parents=True)
    assert not clear_run(run, resume=True) and (run / "checkpoints" / "step-00000302").is_dir()
    (tmp_path / ".run.old-999").mkdir()  # what a kill during an earlier removal left
    assert clear_run(run, resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not clear_run(run, resume=False)  # nothing to remove the first time


# -- what quickstart writes into, and what it is asked: refused before any work
# ------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """A quickstart that gets past its checks fails at once, not minutes later, where it would
    write."""
    from lmforge import quickstart

    def gather_corpus(*args, **kwargs):
        raise AssertionError("quickstart started work")

    monkeypatch.setattr(quickstart, "gather_corpus", gather_corpus)


def cli(args: list[str], capsys) -> tuple[int, str]:
    from lmforge.cli import main

    rc = main(["quickstart", *args])
    return rc, capsys.readouterr().err


def test_a_folder_quickstart_did_not_make_is_refused_and_left_as_it_was(tmp_path, capsys, no_work):
    """Audit: quickstart --out mydir deleted mydir/run/notes.txt and mydir/model/weights.bin and
    overwrote mydir/hf/config.json, saying it 'removed the previous run'."""
    mine = {"run/notes.txt": "my notes", "model/weights.bin": "my weights", "hf/config.json": "{}"}
    for name, text in mine.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    rc, err = cli(["--out", str(tmp_path)], capsys)
    assert rc == 1
    assert err == (
        f"error: --out '{tmp_path}' holds model/weights.bin, run/notes.txt, which lmforge quickstart did "
        "not make: choose another --out (a new or empty folder)\n"
    )
    assert {
        str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()
    } == mine


def test_a_quickstart_folder_is_recognised_by_its_marker_or_its_files(tmp_path):
    from lmforge.errors import UserError
    from lmforge.quickstart import MARKER, claim_folder

    claim_folder(tmp_path / "new" / "qs")  # a new folder, its parents too
    assert [p.name for p in (tmp_path / "new" / "qs").iterdir()] == [MARKER]
    claim_folder(tmp_path / "new" / "qs")  # rerun
    (tmp_path / "empty").mkdir()
    claim_folder(tmp_path / "empty")
    assert (tmp_path / "empty" / MARKER).is_file()

    # What a quickstart made before it wrote its marker, with what killed writes leave
    old = tmp_path / "old"
    files = [
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "data/stdlib_text_document.bin",
        "data/stdlib_text_document.idx",
        "data/cache/stdlib_text_document-ab12-sample_index.npy",
        "model/lmforge.json",
        "model/model.safetensors",
        "hf/config.json",
        "hf/tokenizer.json",
        "run/config.yaml",
        "run/metrics.jsonl",
        "run/finished.json",
        "run/tensorboard/events.out.tfevents.1.vm",
        "run/checkpoints/step-00000600/.metadata",
        "run/checkpoints/step-00000600/__0_0.distcp",
        "run/checkpoints/.step-00000650.tmp/__0_0.distcp",
        ".run.old-123/metrics.jsonl",
        ".hf.tmp-9/x.bin",
    ]
    for name in files:
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        (old / name).write_text("")
    (old / "corpus.jsonl").write_text(
        json.dumps({"title": "abc", "text": "Abstract Base Classes."}) + "\n"
    )
    claim_folder(old)
    assert (old / MARKER).is_file()
    # in a folder with the marker: left alone, the folder is quickstart's
    (old / "notes.txt").write_text("mine")
    claim_folder(old)

    (old / MARKER).unlink()
    with pytest.raises(
        UserError, match=r"holds notes\.txt, which lmforge quickstart did not make: choose another"
    ):
        claim_folder(old)
    (old / "notes.txt").unlink()
    # quickstart's names, not its
    (old / "corpus.jsonl").write_text(json.dumps({"text": "my own corpus"}) + "\n")
    with pytest.raises(
        UserError,
        match=r"holds corpus\.jsonl, data/\S+, data/\S+, \.\.\. but neither "
        r"\.lmforge-quickstart nor the corpus\.jsonl a quickstart writes first",
    ):
        claim_folder(old)
    assert not (old / MARKER).exists()


def test_out_naming_a_file_is_one_error_line(tmp_path, capsys, no_work):
    """Audit: --out naming a file printed a FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert cli(["--out", str(afile)], capsys) == (
        1,
        f"error: --out '{afile}' is a file, not a folder: choose another --out\n",
    )
    rc, err = cli(["--out", str(afile / "sub")], capsys)
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith(f"error: cannot make the folder --out '{afile / 'sub'}': ")
    assert afile.read_text() == "mine"


@pytest.mark.parametrize(
    "args, error",
    [
        (["--minutes", "-1"], "--minutes must be > 0 (the training time budget), got -1"),
        (["--minutes", "nan"], "--minutes must be > 0 (the training time budget), got nan"),
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    ],
)
def test_arguments_are_checked_before_any_work(tmp_path, capsys, no_work, args, error):
    """Audit: --minutes -1 trained a step and exited 0; --max-steps 0 was refused after three
    stages had run."""
    assert cli(["--out", str(tmp_path / "qs"), *args], capsys) == (1, f"error: {error}\n")
    assert not (tmp_path / "qs").exists()


def test_the_next_steps_sample_as_quickstart_did_and_say_what_transformers_needs(tmp_path):
    """Audit: the printed `lmforge generate` was greedy (the sample sampled) and the transformers
    line printed nothing and did not say it needs transformers, which lmforge's install does not
    bring."""
    from lmforge.quickstart import SAMPLING, next_steps

    lines = next_steps(tmp_path / "run", tmp_path / "my hf").splitlines()
    generate = next(line for line in lines if "lmforge generate" in line)
    assert generate.split("  #")[0].split()[-8:] == [
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--seed",
        "0",
    ]
    assert SAMPLING == {"max_new_tokens": 40, "temperature": 0.8, "top_k": 40, "seed": 0}
    assert f"'{tmp_path / 'my hf'}'" in generate  # a path with a space stays one argument
    i = next(i for i, line in enumerate(lines) if "python -c" in line)
    assert "pip install transformers" in lines[i - 1]
    assert "print(" in lines[i]


@pytest.mark.slow
def test_a_rerun_resume_and_the_printed_generate_command(tmp_path, monkeypatch, capsys):
    """Two steps on a smaller corpus: `lmforge generate` as printed prints the sample again;
    --resume of the finished run says so in quickstart's words (audit: it named trainer.max_steps
    and said 'nothing written', then exported); a rerun of the folder starts afresh, as before it
    had a marker."""
    import functools
    import shlex

    from lmforge import quickstart
    from lmforge.cli import main

    monkeypatch.setattr(
        quickstart, "gather_corpus", functools.partial(quickstart.gather_corpus, max_chars=300_000)
    )
    lines: list[str] = []
    quickstart.run(tmp_path, minutes=5, say=lines.append, max_steps=2)
    sample = next(line for line in lines if line.startswith("[5/6] sample: ")).removeprefix(
        "[5/6] sample: "
    )
    generate = next(line for line in "\n".join(lines).splitlines() if "lmforge generate" in line)
    capsys.readouterr()
    assert main(shlex.split(generate.split("  #")[0])[1:]) == 0
    assert "Return a new list" + capsys.readouterr().out == sample + "\n"

    lines.clear()
    quickstart.run(tmp_path, minutes=5, say=lines.append, max_steps=2, resume=True)
    said = "\n".join(lines)
    assert (
        "      the run is at step 2 already (--max-steps 2): nothing to train; raise --max-steps to train it "
        "further" in lines
    )
    assert "trainer.max_steps" not in said and "nothing written" not in said
    assert f"[5/6] sample: {sample}" in lines  # the same model, from its checkpoint

    lines.clear()
    quickstart.run(tmp_path, minutes=5, say=lines.append, max_steps=1)
    assert (
        f"      removed the previous run in {tmp_path / 'run'} (--resume continues it instead)"
        in lines
    )
    assert any(line.startswith("      finished at step 1: 1 step,") for line in lines)
