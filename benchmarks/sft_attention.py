"""Packed SFT training step: attention kept inside documents (segment_ids) vs the dense (batch, 1,
seq, seq) mask.

Real documents: the Alpaca subset of ../shared/data (--data), tokenized by the GPT-NeoX tokenizer
and packed first-fit into rows of --seq tokens by lmforge.data.sft, as `lmforge finetune` with
data.packing=true does. One model per preset (random weights, fp32) takes training steps on the same
micro-batch two ways:

* dense: the mask lmforge built for packed SFT before: `document_mask(segment_ids)`, (batch, 1, seq,
  seq), handed to every layer's scaled_dot_product_attention, which computes all seq x seq scores
  and masks them;
* documents: `segment_ids` to the model (lmforge.models.documents), the backend the device picks
  ("split" on the CPU: one SDPA call per document chunk; FlexAttention block masks on CUDA).

A step is what the trainer does for SFT: the fused linear cross-entropy over the answer tokens,
backward, AdamW. Before timing, the two ways' loss and gradients on the same weights must agree
(fp32). The ways take turns, step by step; times are medians, the speedup the median of the per-pair
ratios. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from report import cpu_run_line, publish  # benchmarks/report.py

from lmforge.data.collate import PadCollator
from lmforge.data.sft import SFTDataset
from lmforge.models import build, preset
from lmforge.models.documents import document_backend, document_mask
from lmforge.tokenizers import load_tokenizer
from lmforge.train.loss import IGNORE_INDEX
from lmforge.train.tasks.base import lm_loss

SECTION = "## Packed SFT: attention inside documents vs the dense mask"
ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LMFORGE_SHARED_DATA", ROOT.parent / "shared" / "data"))


def packed_batch(data: Path, tokenizer: Path, seq: int, rows: int) -> dict[str, torch.Tensor]:
    ds = SFTDataset(data, load_tokenizer(tokenizer), seq, packing=True)
    batch = PadCollator(ds.pad_id)([ds[i] for i in range(rows)])
    labels = batch["labels"]
    # as SFT.inputs
    batch["labels"] = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE_INDEX)], 1)
    return batch


def step_fn(model, optimizer, batch: dict, inputs: dict):
    count = int((batch["labels"] != IGNORE_INDEX).sum())

    def step(update: bool = True) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model, {"input_ids": batch["input_ids"], **inputs}, batch["labels"]) / count
        loss.backward()
        if update:
            optimizer.step()
        return loss.item()

    return step


def same_loss_and_gradients(model, steps) -> tuple[float, float, float]:
    """(dense loss, documents loss, largest gradient difference / largest gradient) on the same
    weights."""
    out = []
    for step in steps:
        loss = step(update=False)
        out.append((loss, [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = out
    worst = max(
        (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
        for a, b in zip(g0, g1, strict=True)
    )
    if abs(l0 - l1) > 1e-5 * abs(l0) or worst > 1e-4:
        raise SystemExit(f"the two ways disagree: loss {l0} vs {l1}, gradients {worst:.2e} apart")
    return l0, l1, worst


def run(args, batch: dict) -> list[dict]:
    rows = []
    seg, pos = batch["segment_ids"], batch["position_ids"]
    ways = {
        "dense": {"attention_mask": document_mask(seg), "position_ids": pos},
        "documents": {"segment_ids": seg, "position_ids": pos},
    }
    for name in args.models:
        model = build(preset(name), seed=0).float().train()
        # as the trainer builds it
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        steps = [step_fn(model, optimizer, batch, inputs) for inputs in ways.values()]
        loss_dense, loss_docs, grad_diff = same_loss_and_gradients(model, steps)
        times = [[], []]
        for s in steps:  # warm-up (allocator, one-time work)
            s()
        for _ in range(args.repeats):
            for s, t in zip(steps, times, strict=True):
                start = time.perf_counter()
                s()
                t.append(time.perf_counter() - start)
        tokens = seg.numel()
        rows.append(
            dict(
                model=name,
                loss_dense=loss_dense,
                loss_docs=loss_docs,
                grad_diff=grad_diff,
                dense_s=statistics.median(times[0]),
                docs_s=statistics.median(times[1]),
                speedup=statistics.median(a / b for a, b in zip(*times, strict=True)),
                tokens=tokens,
            )
        )
        print(rows[-1], flush=True)
    return rows


def describe(batch: dict) -> str:
    seg = batch["segment_ids"]
    docs = [int(r.max()) for r in seg]
    real = int((seg > 0).sum())
    return (
        f"{seg.shape[0]} rows x {seg.shape[1]} tokens holding {sum(docs)} documents ({', '.join(map(str, docs))} "
        f"per row, {real / sum(docs):.0f} tokens on average), {real / seg.numel():.1%} of the slots real tokens"
    )


COLUMNS = [  # (header, cell of a row)
    ("model", lambda x: x["model"]),
    ("loss, dense", lambda x: f"{x['loss_dense']:.6f}"),
    ("loss, documents", lambda x: f"{x['loss_docs']:.6f}"),
    ("max grad diff (rel.)", lambda x: f"{x['grad_diff']:.1e}"),
    ("dense s/step", lambda x: f"{x['dense_s']:.2f}"),
    ("documents s/step", lambda x: f"{x['docs_s']:.2f}"),
    ("tokens/s dense", lambda x: f"{x['tokens'] / x['dense_s']:,.0f}"),
    ("tokens/s documents", lambda x: f"{x['tokens'] / x['docs_s']:,.0f}"),
    ("speedup", lambda x: f"**{x['speedup']:.2f}x**"),
]


def table(rows: list[dict]) -> str:
    cells = [[header for header, _ in COLUMNS], ["---"] + ["---:"] * (len(COLUMNS) - 1)]
    cells += [[cell(x) for _, cell in COLUMNS] for x in rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="pythia-14m,pythia-70m",
        type=lambda s: s.split(","),
        help="presets, comma-separated",
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per way and model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--data", type=Path, default=SHARED / "instruct" / "alpaca" / "alpaca_subset_2k.json"
    )
    p.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "gpt-neox-20b")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    for path in (args.data, args.tokenizer):
        if not path.exists():
            raise SystemExit(
                f"{path} not found: give --data/--tokenizer or set LMFORGE_SHARED_DATA"
            )
    torch.set_num_threads(args.threads)
    batch = packed_batch(args.data, args.tokenizer, args.seq, args.rows)
    t0 = time.perf_counter()
    rows = run(args, batch)
    body = (
        f"{cpu_run_line('sft_attention.py')}; backend `{document_backend(torch.device('cpu'))}`."
        f" Micro-batch: {describe(batch)} (Alpaca, GPT-NeoX tokenizer). A step: fused cross-entropy over the "
        f"answer tokens, backward, AdamW; median of {args.repeats} steps per way, taking turns; "
        f"{time.perf_counter() - t0:.0f} s in all, load average {os.getloadavg()[0]:.1f} at the end.\n\n"
        f"{table(rows)}\n\nThe losses are the two ways' first step on the same weights, and so are the gradients "
        "compared (largest difference over the largest entry, per tensor).\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
