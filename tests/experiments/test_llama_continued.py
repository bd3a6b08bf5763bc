"""Experiment 4 end to end, small: scripts/experiments/llama_continued.sh from a random transformers
Llama to transformers generating with the continued-pretrained export."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_continued_pretraining_exports_a_llama_that_transformers_runs_identically(
    shared_data, tmp_path
):
    tf = pytest.importorskip("transformers")
    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    out = tmp_path / "exp"
    text = (shared_data / "corpora" / "tinyshakespeare" / "input.txt").read_text()
    corpus = tmp_path / "shakespeare-part.txt"
    corpus.write_text(text[: text.index("\n\n", 150_000)])  # the first ~1,000 speeches
    env = {
        **os.environ,
        "OUT": str(out),
        "CORPUS": str(corpus),
        "LMFORGE_SHARED_DATA": str(shared_data),
        "OMP_NUM_THREADS": "1",
    }
    small = [
        "trainer.max_steps=6",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4",
        "data.seq_length=64",
        "trainer.val_check_interval=3",
        "trainer.val_batches=1",
        "optim.warmup_steps=2",
        "cost.peak_flops=1e11",
    ]
    proc = subprocess.run(
        ["bash", "scripts/experiments/llama_continued.sh", *small],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["val_loss"] < rows[2]["val_loss"]
    report = json.loads((out / "check.json").read_text())
    assert report["tensors_changed"] == report["tensors"] == 21 and report["generated"]

    # Independently of the script: the exported folder in transformers vs lmforge's own model folder
    # of the same run, on real text of the new corpus (with right padding in the batch).
    hf, info = tf.LlamaForCausalLM.from_pretrained(
        out / "run" / "hf", output_loading_info=True, dtype=torch.float32
    )
    assert not any(info.values())  # no missing/unexpected/mismatched keys
    ours = load_pretrained(out / "run" / "model").eval()
    tok = load_tokenizer(out / "run" / "hf")
    texts = [
        "ROMEO:\nBut soft, what light through yonder window breaks?",
        "First Citizen:\nSpeak, speak.",
    ]
    ids = [tok.encode(t, add_bos=True) for t in texts]
    length = max(map(len, ids))
    batch = torch.tensor([x + [tok.eos_id] * (length - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in ids])
    with torch.no_grad():
        theirs = hf(batch, attention_mask=mask).logits
        mine = ours(batch, attention_mask=mask)[..., : hf.config.vocab_size]
    keep = mask.bool()
    torch.testing.assert_close(mine[keep], theirs[keep], rtol=0, atol=1e-5)
    source = tf.LlamaForCausalLM.from_pretrained(
        out / "hf-source", dtype=torch.float32
    ).state_dict()
    assert all(not torch.equal(source[k], v) for k, v in hf.state_dict().items())
    greedy = hf.generate(
        batch[:1, : len(ids[0])], max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_id
    )
    assert greedy.shape[1] == len(ids[0]) + 8
