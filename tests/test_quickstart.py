"""The README's first command, end to end: offline corpus -> tokenizer -> data -> training -> export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_trains_and_exports_a_model_transformers_loads(tmp_path):
    tf = pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "quickstart", "--out", str(tmp_path), "--minutes",
                        "30", "--max-steps", "40"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for step in range(1, 7):
        assert f"[{step}/6]" in r.stdout
    vals = [float(v) for v in re.findall(r"step \d+: (\d+\.\d+)", r.stdout)]
    assert len(vals) >= 2 and vals[-1] < vals[0]  # validation loss falls
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_loss"] == pytest.approx(vals[-1], abs=0.01)
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("Return a new list", return_tensors="pt").input_ids
    # generation stops at the quickstart tokenizer's <|endoftext|> (0), which config.json names (it had null)
    assert model.config.eos_token_id == tok.eos_token_id == 0
    out = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:].tolist()
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
