"""GSM8K's records ({"question", "answer": "... #### 72"}) as GRPO prompts: the question as a chat
turn after a system prompt asking for DeepSeek-R1's format, the answer kept for the `accuracy`
reward (the text after `####`).

    lmforge data gsm8k-prompts IN.jsonl OUT.jsonl [--limit N]
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.errors import UserError
from lmforge.fsutil import atomic_write

SYSTEM = "Think about the problem inside <think> </think>, then give the final number alone inside <answer> </answer>."


def convert(source: str | Path, out: str | Path, limit: int | None = None) -> int:
    """Write OUT's prompt records from SOURCE's GSM8K records; the number written."""
    written, lines = 0, []
    with Path(source).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or "question" not in record or "answer" not in record:
                raise UserError(f"{source}:{n}: a GSM8K record has a question and an answer")
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": record["question"]},
            ]
            lines.append(json.dumps({"prompt": messages, "answer": record["answer"]}) + "\n")
            written += 1
            if limit is not None and written >= limit:
                break
    atomic_write(out, "".join(lines))  # a bad record leaves no half-written file
    return written
