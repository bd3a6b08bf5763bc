"""The serving engine's decode with response_format on vs off: what the per-row token mask costs.

A random Pythia-14m-shaped model (GPT-NeoX config built in transformers, loaded by lmforge) and the
real GPT-2 tokenizer (../shared/data/tokenizers/gpt2, 50,257 tokens) in the engine that `lmforge
serve` runs, in this process, without HTTP. --batch requests of a 16-token prompt, --new-tokens
each, sampled (temperature 1, a seed per request). Sides, taking turns: *off* (no format), *on*
(every row with a json_schema: an array of at least 64 short enum strings, so no row can finish
early), *half on* (every other row, batch > 1): tokens/s = completion tokens / wall time of the
engine's steps (prefill included), median of --repeats; mask share = time in the engine's mask step
over that wall time. A warm-up run first checks that the on side's text is the start of such an
array.

    python benchmarks/structured_decode.py --tokenizer ../shared/data/tokenizers/gpt2 [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import cpu_run_line, publish  # benchmarks/report.py

import lmforge.inference.engine as engine_module
from lmforge.inference.engine import Engine, EngineConfig
from lmforge.inference.requests import RequestParams
from lmforge.inference.sampling import SamplingParams
from lmforge.models import load_pretrained
from lmforge.tokenizers import load_tokenizer

SECTION = "## Constrained decoding: response_format on vs off in the serving engine"
SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    intermediate_size=512,
    vocab_size=50304,
    max_position_embeddings=2048,
    rotary_pct=0.25,
)
SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 64}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "colors", "schema": SCHEMA, "strict": True},
}


def make_engine(folder: Path, tokenizer_dir: Path, batch: int) -> Engine:
    import transformers as tf

    tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**SHAPE, bos_token_id=50256, eos_token_id=50256)
    ).save_pretrained(folder)
    for name in ("tokenizer.json",):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return Engine(
        load_pretrained(folder).eval(), load_tokenizer(folder), EngineConfig(max_batch=batch)
    )


MASK_SECONDS = [0.0]  # time inside the engine's constrain() (masks filled, expanded, applied)
_constrain = engine_module.constrain


def timed_constrain(logits, reqs):
    start = time.perf_counter()
    out = _constrain(logits, reqs)
    MASK_SECONDS[0] += time.perf_counter() - start
    return out


engine_module.constrain = timed_constrain


def run(
    engine: Engine, batch: int, new_tokens: int, grammar, which: str
) -> tuple[float, float, list]:
    """(tokens/s, share of the time spent masking, the requests)."""
    MASK_SECONDS[0] = 0.0
    reqs = []
    for i in range(batch):
        on = which == "on" or (which == "half on" and i % 2 == 1)
        params = RequestParams(
            new_tokens, SamplingParams(temperature=1.0), seed=i, grammar=grammar if on else None
        )
        reqs.append(engine.submit([464, 2068, 7586, 21831] * 4, params, lambda ev: None))
    start = time.perf_counter()
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    seconds = time.perf_counter() - start
    assert all(r.finish_reason == "length" for r in reqs), [r.finish_reason for r in reqs]
    return sum(len(r.output_ids) for r in reqs) / seconds, MASK_SECONDS[0] / seconds, reqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default="../shared/data/tokenizers/gpt2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for batch in args.batches:
            engine = make_engine(Path(tmp) / f"b{batch}", Path(args.tokenizer), batch)
            # the vocabulary's trie too: once per server, not timed
            grammar = engine.grammars.compile(FORMAT)
            # warm-up, and the output checked
            _, _, reqs = run(engine, batch, args.new_tokens, grammar, "on")
            text = engine.tokenizer.decode(reqs[0].output_ids)
            assert text.startswith('["') and set(text[1:]) <= set('"redgnblu,'), text
            sides = ["off", "on"] if batch == 1 else ["off", "on", "half on"]
            times: dict[str, list[float]] = {side: [] for side in sides}
            shares: dict[str, list[float]] = {side: [] for side in sides}
            for k in range(args.repeats):
                for which in sides[k % len(sides) :] + sides[: k % len(sides)]:
                    tps, share, _ = run(engine, batch, args.new_tokens, grammar, which)
                    times[which].append(tps)
                    shares[which].append(share)
            off = statistics.median(times["off"])
            for which in sides:
                tps = statistics.median(times[which])
                share = statistics.median(shares[which])
                rows.append(
                    f"| {batch} | {which} | {tps:.1f} | **{tps / off:.2f}x** | {100 * share:.1f}% |"
                )
    head = (
        f"{cpu_run_line('structured_decode.py')}; {time.perf_counter() - started:.0f} s in all. Pythia-14m "
        f"shape (d 128, 6 layers, vocab 50304), random, GPT-2 tokenizer; {args.new_tokens} new tokens a request, "
        f"sampled; *on*: every row masked by a json_schema ({SCHEMA}); *half on*: every other row. Median of "
        f"{args.repeats} runs per side, taking turns; ratio: side / off tokens/s (1.00x = free); mask share: "
        "the time inside the engine's mask step (bitmasks filled for the constrained rows, expanded, applied) over "
        "the run's wall time, the cost measured directly, which the load of a shared machine moves less than "
        "tokens/s."
    )
    body = "\n".join(
        [
            head,
            "",
            "| batch | response_format | tokens/s | vs off | mask share |",
            "| ---: | --- | ---: | ---: | ---: |",
            *rows,
        ]
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    sys.exit(main())
