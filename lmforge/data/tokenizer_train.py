"""`lmforge tokenizer train`: a byte-level BPE tokenizer (GPT-2's kind) trained with Hugging Face
`tokenizers`.

Byte-level: text is split by GPT-2's pre-tokenizer regex, each piece's UTF-8 bytes are mapped to 256
printable characters, and merges are learned on those. Every string is encodable (no unknown token)
and `decode(encode(text)) == text`. No prefix space is added, as in GPT-2. The 256 byte symbols and
the special tokens count towards `vocab_size`; the special tokens take the first ids
(`<|endoftext|>` is 0).

Inputs are found and opened as `preprocess` finds them (lmforge.data.inputs and reader: JSON lines
with a text key and `.txt`, plain, `.gz` or `.zst`; Parquet; `datasets` folders; folders and globs
of them) and streamed: a bounded batch of text is in memory at a time.

Output, written to a temporary folder renamed into place: `tokenizer.json`, and
`tokenizer_config.json` naming the special tokens' roles where their names say them (BERT's [CLS],
[SEP], [MASK], [PAD], [UNK], whose texts transformers then frames as "[CLS] text [SEP]"; <s>, </s>,
<pad>, <unk>, <mask>), else the first special token as bos, eos and unk (GPT-2's convention), so
`lmforge.tokenizers` and transformers' `AutoTokenizer` both load the folder.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lmforge.data.inputs import describe, find_inputs, plan
from lmforge.data.reader import open_binary, records
from lmforge.errors import UserError
from lmforge.fsutil import atomic_dir

# Special tokens whose name says their role (tokenizer_config.json's key for it).
ROLES = {
    "[PAD]": "pad_token",
    "[CLS]": "cls_token",
    "[SEP]": "sep_token",
    "[MASK]": "mask_token",
    "[UNK]": "unk_token",
    "<s>": "bos_token",
    "</s>": "eos_token",
    "<pad>": "pad_token",
    "<unk>": "unk_token",
    "<mask>": "mask_token",
}

logger = logging.getLogger(__name__)

# text handed to the trainer per batch; memory stays bounded whatever the corpus size
BATCH_CHARS = 1 << 20
ENDOFTEXT = "<|endoftext|>"


def iter_texts(inputs: Sequence[str | Path], json_key: str = "text") -> Iterator[str]:
    """Texts from the inputs: each JSON line's text, and plain-text files in pieces of about
    BATCH_CHARS.

    A plain-text piece is whole lines joined, so pre-tokenization sees the file as it is except at
    the few piece boundaries.
    """
    for source in find_inputs(inputs):
        path, kind = source.path, source.kind
        if kind in ("parquet", "arrow"):  # a column of rows
            for where, _, (value,), _ in records(plan([source], [json_key]), [json_key]):
                if not isinstance(value, str):
                    raise UserError(
                        f"{describe(where, 'row')}: {json_key!r} must be a string, got "
                        f"{type(value).__name__}"
                    )
                if value:
                    yield value
            continue
        lines, size = [], 0
        try:
            with io.TextIOWrapper(open_binary(source), encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if kind == "json":
                        if text := _json_text(line, f"{path}:{lineno}", json_key):
                            yield text
                        continue
                    lines.append(line)
                    size += len(line)
                    if size >= BATCH_CHARS:
                        yield "".join(lines)
                        lines, size = [], 0
        except UnicodeDecodeError as e:
            raise UserError(
                f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file"
            ) from None
        except (OSError, EOFError) as e:
            raise UserError(f"cannot read {path} ({e}): check the file is intact") from None
        except Exception as e:  # zstandard.ZstdError, which is no OSError
            if type(e).__name__ != "ZstdError":
                raise
            raise UserError(f"cannot read {path} ({e}): check the file is intact") from None
        if lines:
            yield "".join(lines)


def _json_text(line: str, where: str, key: str) -> str:
    if not line.strip():
        return ""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict) or key not in rec:
        keys = ", ".join(map(repr, rec)) if isinstance(rec, dict) else type(rec).__name__
        raise UserError(f"{where}: no key {key!r} (got {keys}): pass --json-key")
    if not isinstance(rec[key], str):
        raise UserError(f"{where}: {key!r} must be a string, got {type(rec[key]).__name__}")
    return rec[key]


def train_tokenizer(
    inputs: Sequence[str | Path],
    vocab_size: int,
    out_dir: str | Path,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
    min_frequency: int = 2,
    json_key: str = "text",
    overwrite: bool = False,
    progress: bool = False,
) -> Tokenizer:
    """Train byte-level BPE on `inputs` and save it to `out_dir`; returns the trained
    `tokenizers.Tokenizer`."""
    special_tokens = list(special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise UserError(
            f"vocab_size {vocab_size} is below the {len(alphabet)} byte symbols plus "
            f"{len(special_tokens)} special token(s): raise it"
        )
    if min_frequency < 1:
        raise UserError(f"min_frequency must be at least 1, not {min_frequency}")
    find_inputs(inputs)  # fail on a bad path now, not after a long read
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite and (out_dir.is_file() or any(out_dir.iterdir())):
        raise UserError(
            f"output '{out_dir}' already exists and is not empty: choose another path or pass --overwrite"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # GPT-2's tokenizer.json has the same
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        show_progress=progress,
    )
    start = time.perf_counter()
    tok.train_from_iterator(iter_texts(inputs, json_key), trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        logger.warning(
            "the corpus yields only %d tokens (min_frequency %d), fewer than vocab_size %d",
            tok.get_vocab_size(),
            min_frequency,
            vocab_size,
        )

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False}
    roles = {ROLES[s]: s for s in special_tokens if s in ROLES}
    # BERT's [CLS] [SEP] [MASK] [PAD] [UNK], or <s> </s> <pad> <unk> <mask>: each in its role
    if roles:
        config |= roles
        # transformers' tokenizer then frames a text as BERT's
        if "cls_token" in roles and "sep_token" in roles:
            cls, sep = roles["cls_token"], roles["sep_token"]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{cls} $A {sep}",
                pair=f"{cls} $A {sep} $B:1 {sep}:1",
                special_tokens=[(cls, special_tokens.index(cls)), (sep, special_tokens.index(sep))],
            )
    elif special_tokens:  # GPT-2's convention: one <|endoftext|> for all three
        config |= {
            "bos_token": special_tokens[0],
            "eos_token": special_tokens[0],
            "unk_token": special_tokens[0],
        }
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2) + "\n", encoding="utf-8"
        )
    logger.info(
        "trained a %d-token byte-level BPE in %.1f s, saved to %s",
        tok.get_vocab_size(),
        time.perf_counter() - start,
        out_dir,
    )
    return tok
