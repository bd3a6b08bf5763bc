"""The tokenizer a `.bin/.idx` pair was made with, written beside it as `PREFIX.tokenizer.json`.

Megatron's files hold ids and nothing about what made them: data tokenized with Llama 2's tokenizer
(32,000 ids) trains without a word under GPT-2's (50,257), every id in range, each one meaning
another piece of text. So `lmforge preprocess` (and the merge of its shards) writes, once the pair
is in place:

    {"format": "lmforge-tokenizer/1", "tokenizer": "<its first file>", "files": [...],
     "sha256": "<its files' bytes>", "vocab_sha256": "<id -> token, for every id>",
     "vocab_size": N, "eod_id": E, "bin_bytes": ..., "idx_bytes": ...}

The .bin/.idx stay byte for byte Megatron's; the record is a file of its own, written atomically
after them. Its sizes tie it to the pair it describes: a record beside other files (the prefix made
again, by a tool that writes none) is stale and read as absent. A run's tokenizer matches a record
when its files are those bytes, or when it maps every id to the same token with the same end of
document (the same tokenizer saved in another file).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from lmforge.data.indexed import bin_path, idx_path
from lmforge.fsutil import atomic_write
from lmforge.tokenizers import CONFIG_FILES, Tokenizer

logger = logging.getLogger(__name__)

FORMAT = "lmforge-tokenizer/1"
MAX_BYTES = 1 << 20  # a record is well under a kilobyte and a list of file names


def fingerprint_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.tokenizer.json")


def tokenizer_identity(tok: Tokenizer) -> dict:
    """What makes a tokenizer's ids: its files' bytes (Hugging Face config files beside them too,
    which can change eod), and the vocabulary size and eod id that follow from them."""
    h = hashlib.sha256()
    files = [*tok.files, *(f.parent / n for f in tok.files for n in CONFIG_FILES)]
    for path in dict.fromkeys(files):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return {
        "files": [str(f) for f in tok.files],
        "sha256": h.hexdigest(),
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
    }


def vocab_digest(tok) -> str:
    """sha256 of the token of every id in order: what the ids mean, whatever file the tokenizer
    was read from."""
    h = hashlib.sha256()
    for i in range(tok.vocab_size):
        h.update((tok.id_to_token(i) or "").encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def tokenizer_fingerprint(tok) -> dict:
    """What identifies `tok`'s ids (the record's tokenizer fields)."""
    identity = tokenizer_identity(tok)
    return {
        "tokenizer": identity["files"][0],
        "files": identity["files"],
        "sha256": identity["sha256"],
        "vocab_sha256": vocab_digest(tok),
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
    }


def write_fingerprint(prefix: str | Path, fingerprint: dict) -> None:
    """PREFIX.tokenizer.json for the pair now at `prefix`, written through a temporary file
    renamed over it."""
    sizes = {
        "bin_bytes": bin_path(prefix).stat().st_size,
        "idx_bytes": idx_path(prefix).stat().st_size,
    }
    atomic_write(
        fingerprint_path(prefix),
        json.dumps({"format": FORMAT, **fingerprint, **sizes}, indent=1) + "\n",
    )


def read_fingerprint(prefix: str | Path) -> dict | None:
    """The record beside `prefix`, or None where there is none, it cannot be read, or it
    describes other files."""
    path = fingerprint_path(prefix)
    try:
        # a data folder is not trusted: no file read whole for a few fields
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"{path.stat().st_size:,} bytes, over {MAX_BYTES:,}")
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s (%s): the data's tokenizer is not checked", path, e)
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    try:
        sizes = (bin_path(prefix).stat().st_size, idx_path(prefix).stat().st_size)
    except OSError:
        return None
    if (record.get("bin_bytes"), record.get("idx_bytes")) != sizes:
        logger.info(
            "%s describes other files than %s.bin/.idx (written again since): not used",
            path,
            prefix,
        )
        return None
    return record


def verdict(record: dict, run: dict) -> str:
    """Whether the run's tokenizer (its tokenizer_fingerprint) makes the ids the record's made
    (see the module docstring): "same", "other", or "unknown" where the record cannot tell (a
    merge of shards made before records held the vocabulary's digest, of another file with the
    same size and end of document)."""
    if record.get("sha256") == run["sha256"]:
        return "same"
    if (record.get("vocab_size"), record.get("eod_id")) != (run["vocab_size"], run["eod_id"]):
        return "other"
    if record.get("vocab_sha256") is None:
        return "unknown"
    return "same" if record["vocab_sha256"] == run["vocab_sha256"] else "other"


def describe(record: dict) -> str:
    return f"{record.get('tokenizer')} ({record.get('vocab_size')} ids, end of document {record.get('eod_id')})"
