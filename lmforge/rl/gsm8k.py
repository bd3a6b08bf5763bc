"""GSM8K's records ({"question", "answer": "... #### 72"}) as GRPO prompts: the question as a chat turn after a
system prompt asking for DeepSeek-R1's format, the answer kept for the `accuracy` reward (the text after `####`).

    python -m lmforge.rl.gsm8k IN.jsonl OUT.jsonl [--limit N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmforge.errors import UserError

SYSTEM = "Think about the problem inside <think> </think>, then give the final number alone inside <answer> </answer>."


def convert(source: str | Path, out: str | Path, limit: int | None = None) -> int:
    """Write OUT's prompt records from SOURCE's GSM8K records; the number written."""
    written = 0
    with Path(source).open(encoding="utf-8") as f, Path(out).open("w", encoding="utf-8") as w:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or "question" not in record or "answer" not in record:
                raise UserError(f"{source}:{n}: a GSM8K record has a question and an answer")
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": record["question"]}]
            w.write(json.dumps({"prompt": messages, "answer": record["answer"]}) + "\n")
            written += 1
            if limit is not None and written >= limit:
                break
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="GSM8K JSON lines (question, answer)")
    parser.add_argument("out", help="the prompts file to write")
    parser.add_argument("--limit", type=int, default=None, help="the first N records only")
    args = parser.parse_args(argv)
    print(f"wrote {convert(args.source, args.out, args.limit)} prompts to {args.out}")


if __name__ == "__main__":
    main()
