"""Raw text -> Megatron `PREFIX_<key>_document.bin/.idx`, as Megatron-LM's
`tools/preprocess_data.py` writes them.

Inputs (JSON lines, plain or .gz/.zst; plain text; Parquet; Hugging Face `datasets` folders; folders
and glob patterns of them) are found and cut into slices by `lmforge.data.inputs`, and read by
`lmforge.data.reader`, streamed: only a bounded window of chunks is in memory at once. In JSON lines
each line is one document per `--json-keys` key, in Parquet and Arrow each row, its columns named by
`--json-keys`. A value is a string, or a list of strings (sentences, as Megatron's
`--split-sentences` pass writes them; each non-empty one becomes a sequence). Blank lines are
skipped. Plain text fills the one output key, so it needs exactly one `--json-keys` key.

Per document and key, as Megatron does: ids = tokenize(text), and with `append_eod` the tokenizer's
eod id is appended to a non-empty document; `add_document(ids, [len(ids)])`. With `prepend_bos` each
text (each sentence) starts with the tokenizer's bos id, as Megatron's Llama-2/3 tokenizers add it
(`tokenize(text, bos=True)`; Llama's pretraining starts every document so), an empty text too (it
holds the bos alone there as well). An empty document (empty text) is still a document, with no
sequence: `document_indices` repeats a value, and every key's file keeps one document per input
line, so documents line up across keys. An input file without any text at all (every document empty,
or none) is an error naming it: it is a wrong path or a wrong `--json-keys`, not data. The dtype
follows Megatron's rule (uint16 below 65,500 ids, else int32). Documents are written in input order
whatever the number of workers. Megatron's tool finalizes only the last `--json-keys` key's index;
we finalize every key's.

Special tokens: by default text is text, so a literal "<|endoftext|>" in a document is tokenized as
the characters it is made of (lmforge.tokenizers' rule: scraped text cannot forge a document
boundary). `parse_special_tokens=True` turns such text into the control id, as Hugging Face's
tokenizers do by default and therefore Megatron's tool does: the same bytes as Megatron's output for
corpora that contain such strings. Left as text, such strings are counted (one regex search per
text, a count only where it finds one) and said in one warning at the end: lmforge eval and
transformers read them as the special ids (WikiText's 11,718 "<unk>").

Document size: a document over `max_document_bytes` (a JSON line's bytes, a plain-text file's, a
row's text's UTF-8 bytes) is refused before it is parsed or tokenized, naming its file and line (or
row) and its size; with `on_error="skip"` it is skipped and counted instead. The reader never holds
more of it than the limit (lmforge.data.reader). Tokenizing takes memory in proportion to a
document's tokens, and a tokenizer that cannot allocate it aborts the whole process (Rust's
allocation failure: rc 134), which nothing can catch; the limit is what prevents it. Measured peak
memory of one tokenizer call per MB of text (8 MiB documents): Hugging Face tokenizers (GPT-2,
GPT-NeoX) 120 MB on prose, 140-170 MB on text without spaces; SentencePiece (Llama 2) 45 MB. The
default of 8 MiB keeps one document's tokenization under about 1.5 GB whatever the text (twice that
with one worker, which keeps two calls in flight), and passes any real document (a long book is a
few MB). A run killed anyway (that abort, kill -9) leaves the prefix's existing .bin/.idx as they
were: the new files are written under temporary names (`.NAME.bin.tmp-PID`), renamed only when
whole, and the next run of the prefix removes those a dead process left.

Beside each whole pair, `PREFIX.tokenizer.json` records the tokenizer that made its ids (its files'
sha256, its vocabulary's, its size and end-of-document id; lmforge.data.fingerprint), written after
the pair the same way: a run refuses data made by another tokenizer than its own. The .bin/.idx
bytes are Megatron's whatever it holds.

Sharding (`shard=(I, N)`): only slice I of N of the input is tokenized, into
`...document.shard-I-of-N` files plus a record of how they were made; `lmforge.data.shards.merge`
joins the N shards into the files one run over the whole input writes, byte for byte.

Tokenizing, in chunks on threads or worker processes: lmforge.data.encoding.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge.data import shards as sharding
from lmforge.data.encoding import Encoder, chunked, encoded_chunks
from lmforge.data.fingerprint import (
    fingerprint_path,
    tokenizer_fingerprint,
    tokenizer_identity,
    write_fingerprint,
)
from lmforge.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    bin_path,
    idx_path,
    optimal_dtype,
    remove_stale_temporaries,
)
from lmforge.data.inputs import Piece, Source, describe, find_inputs, inputs_digest, plan
from lmforge.data.reader import TooLarge, records
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

MAX_LOGGED_SKIPS = 10
# The default document size limit, in bytes: see the module docstring for the measurement behind it.
MAX_DOCUMENT_BYTES = 8 << 20


@dataclass
class PreprocessStats:
    documents: int = 0  # input documents written (each to every key's file)
    tokens: int = 0  # tokens written, eod included, summed over keys
    skipped: int = 0  # bad lines skipped with on_error="skip"
    too_large: int = 0  # ... of which documents over max_document_bytes
    seconds: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)  # key -> prefix of its .bin/.idx
    shard: tuple[int, int] | None = None  # (I, N) when one slice of N was tokenized
    # Special-token text tokenized as plain text (parse_special_tokens off): occurrences by token,
    # and documents
    special_text: dict[str, int] = field(default_factory=dict)
    special_text_documents: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def documents_per_second(self) -> float:
        return self.documents / self.seconds if self.seconds else 0.0


def _check_arguments(json_keys: Sequence[str] | str, sources: Sequence[Source]) -> list[str]:
    json_keys = [json_keys] if isinstance(json_keys, str) else list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise UserError(f"json keys {json_keys} must be one or more distinct names")
    if len(json_keys) > 1 and any(s.kind == "text" for s in sources):
        raise UserError(
            f"plain-text inputs fill one output, but {len(json_keys)} json keys were given: give one"
        )
    return json_keys


def _identity(
    key: str,
    tok: Tokenizer,
    append_eod: bool,
    parse_special_tokens: bool,
    sources: Sequence[Source],
    prepend_bos: bool = False,
) -> dict:
    """What a shard of this run records, and what every shard of one dataset must share
    (shards.SAME)."""
    return {
        "key": key,
        "dtype": optimal_dtype(tok.vocab_size).name,
        "tokenizer": tokenizer_identity(tok),
        "append_eod": append_eod,
        "parse_special_tokens": parse_special_tokens,
        # absent when off: shards made before it still merge
        **({"prepend_bos": True} if prepend_bos else {}),
        "inputs": {"sha256": inputs_digest(sources), "files": len(sources)},
    }


def preprocess(
    inputs: str | Path | Iterable[str | Path],
    output_prefix: str | Path,
    tokenizer: str | Path | Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    on_error: str = "fail",
    progress: bool = True,
    shard: str | tuple[int, int] | None = None,
    parse_special_tokens: bool = False,
    prepend_bos: bool = False,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
) -> PreprocessStats:
    """Tokenize `inputs` into `{output_prefix}_{key}_document.bin/.idx` for each key; see the module
    docstring.

    `on_error="fail"` stops at the first bad line (malformed JSON, missing key, not UTF-8, a
    document over `max_document_bytes`) with a UserError naming file:line; `"skip"` skips such lines
    and counts them. On any error no output file is left under its final name. `shard` ("I/N" or (I,
    N)) tokenizes slice I of N only, into `{output_prefix}_{key}_document.shard-I-of-N.bin/.idx` and
    its `.json` record (lmforge.data.shards).
    """
    if on_error not in ("fail", "skip"):
        raise UserError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    if workers < 1:
        raise UserError(f"workers must be at least 1, not {workers}")
    if max_document_bytes < 1:
        raise UserError(f"--max-document-bytes must be at least 1, not {max_document_bytes}")
    i, n = sharding.parse_shard(shard) if shard is not None else (0, 1)
    sources = find_inputs(inputs)
    json_keys = _check_arguments(json_keys, sources)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if append_eod and tok.eod_id is None:
        raise UserError(f"tokenizer {tok.files[0]} has no end-of-document token: drop --append-eod")
    if prepend_bos and tok.bos_id is None:
        raise UserError(
            f"tokenizer {tok.files[0]} has no beginning-of-sequence token: drop --prepend-bos"
        )
    pieces = plan(sources, json_keys, i, n)
    dtype = optimal_dtype(tok.vocab_size)
    outputs = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    if shard is not None:
        outputs = {k: sharding.shard_prefix(p, i, n) for k, p in outputs.items()}
        if not pieces:
            logger.info(
                "shard %d/%d has no input (fewer units of input than shards): writing it empty",
                i,
                n,
            )
    # what killed runs of these prefixes left (a live process's stay)
    for prefix in outputs.values():
        record = sharding.record_path(prefix) if shard is not None else fingerprint_path(prefix)
        remove_stale_temporaries(prefix, also=[record])
    stats = PreprocessStats(outputs=outputs, shard=(i, n) if shard is not None else None)
    logger.info(
        "tokenizing %d file(s)%s into %s (%s, %d workers)",
        len(pieces),
        f" (shard {i}/{n} of {len(sources)})" if shard is not None else "",
        list(outputs.values()),
        dtype.name,
        workers,
    )
    parsed_before = tok.parse_special_tokens  # a caller's tokenizer object is given back as it came
    tok.parse_special_tokens = parse_special_tokens
    try:
        file_tokens = _write(
            pieces,
            Encoder(tok, json_keys, append_eod, prepend_bos),
            workers,
            on_error,
            progress,
            dtype,
            stats,
            max_document_bytes,
        )
    finally:
        tok.parse_special_tokens = parsed_before
    fingerprint = tokenizer_fingerprint(tok)
    if shard is None:  # beside the whole pairs: what made their ids (lmforge.data.fingerprint)
        for prefix in outputs.values():
            write_fingerprint(prefix, fingerprint)
    else:
        partial = {
            str(p.source.path): file_tokens[str(p.source.path)] for p in pieces if not p.whole
        }
        try:
            for key, prefix in outputs.items():
                ds = IndexedDataset(prefix)
                sharding.write_record(
                    prefix,
                    {
                        **_identity(
                            key, tok, append_eod, parse_special_tokens, sources, prepend_bos
                        ),
                        "shard": i,
                        "num_shards": n,
                        "tokenizer_vocab_sha256": fingerprint["vocab_sha256"],
                        "documents": ds.num_documents,
                        "tokens": int(ds.sequence_lengths.sum(dtype=np.int64)),
                        "partial_files": partial,
                    },
                )
        except BaseException:
            for prefix in outputs.values():
                for path in (bin_path(prefix), idx_path(prefix), sharding.record_path(prefix)):
                    path.unlink(missing_ok=True)
            raise
    if stats.skipped:
        logger.warning("skipped %d bad line(s) in all%s", stats.skipped, _too_large(stats))
    if stats.special_text:
        _warn_special_text(stats)
    logger.debug(
        "wrote %d documents, %d tokens in %.1f s (%.0f tokens/s)",
        stats.documents,
        stats.tokens,
        stats.seconds,
        stats.tokens_per_second,
    )
    return stats


def _too_large(stats: PreprocessStats) -> str:
    """How many of the skipped documents were over the size limit, for the summary lines."""
    return f", {stats.too_large} of them over --max-document-bytes" if stats.too_large else ""


def _warn_special_text(stats: PreprocessStats) -> None:
    """One warning for the special-token text left as text (a shard's: its own counts)."""
    found = sorted(stats.special_text.items(), key=lambda kv: (-kv[1], kv[0]))
    listed = ", ".join(f"{name} x{count:,}" for name, count in found[:5]) + (
        ", ..." if len(found) > 5 else ""
    )
    shard = f"shard {stats.shard[0]}/{stats.shard[1]}: " if stats.shard else ""
    logger.warning(
        "%s%s occurrences of special-token text (%s) in %s documents were tokenized as plain text "
        "(lmforge's default, as Megatron's preprocess_data.py does with its own GPT-2 BPE and SentencePiece "
        "tokenizers); lmforge eval and transformers read such text as the special ids: "
        "--parse-special-tokens tokenizes them so",
        shard,
        f"{sum(stats.special_text.values()):,}",
        listed,
        f"{stats.special_text_documents:,}",
    )


def _write(
    pieces: Sequence[Piece],
    encoder: Encoder,
    workers: int,
    on_error: str,
    progress: bool,
    dtype: np.dtype,
    stats: PreprocessStats,
    max_document_bytes: int,
) -> dict[str, int]:
    """Tokenize the pieces into stats.outputs' files; returns the tokens written per input file."""
    start = time.perf_counter()
    writers: dict[str, IndexedDatasetWriter] = {}
    finalized: list[str] = []
    file_tokens = {str(p.source.path): 0 for p in pieces}
    lines: dict = {}  # describe()'s cache of line counts
    bar = tqdm(
        unit="doc",
        desc="preprocess",
        file=sys.stderr,
        disable=not (progress and sys.stderr.isatty()),
    )
    encoded = encoded_chunks(
        chunked(records(pieces, encoder.json_keys, max_document_bytes)), encoder, workers
    )
    try:
        for key, prefix in stats.outputs.items():
            writers[key] = IndexedDatasetWriter(prefix, dtype)
        for chunk, (arrays, results, (special_text, special_documents)) in encoded:
            for name, count in special_text.items():
                stats.special_text[name] = stats.special_text.get(name, 0) + count
            stats.special_text_documents += special_documents
            offsets = [0] * len(encoder.json_keys)
            for (where, kind, payload, _), res in zip(chunk, results):
                if isinstance(res, str):
                    message = f"{describe(where, kind, lines)}: {res}"
                    if on_error == "fail":
                        raise UserError(f"{message} (or pass --on-error skip)")
                    stats.skipped += 1
                    stats.too_large += isinstance(payload, TooLarge)
                    if stats.skipped <= MAX_LOGGED_SKIPS:
                        logger.warning("skipped %s", message)
                    continue
                tokens = 0
                for k, (n, lengths) in enumerate(res):
                    writers[encoder.json_keys[k]].add_document(
                        arrays[k][offsets[k] : offsets[k] + n], lengths
                    )
                    offsets[k] += n
                    tokens += n
                stats.tokens += tokens
                file_tokens[where[0]] += tokens
                stats.documents += 1
            bar.update(len(results))
            bar.set_postfix_str(
                f"{stats.tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False
            )
        # A file read whole that gave no token is a wrong path or a wrong --json-keys, not data: say
        # which. (A file cut between shards is checked by the merge, which sees every part.)
        if empty := next(
            (p.source.path for p in pieces if p.whole and not file_tokens[str(p.source.path)]), None
        ):
            raise UserError(
                f"input {empty} has no text (every document in it is empty): remove it from the input, "
                "or check --json-keys"
            )
        for key, writer in writers.items():
            writer.finalize()
            finalized.append(key)
    except BaseException:
        for key, writer in writers.items():
            writer.abort()
            if key in finalized:  # a later key failed: take back the complete pairs too
                bin_path(stats.outputs[key]).unlink(missing_ok=True)
                idx_path(stats.outputs[key]).unlink(missing_ok=True)
        raise
    finally:
        encoded.close()  # stops the worker pool now, not when the traceback is collected
        bar.close()
    stats.seconds = time.perf_counter() - start
    return file_tokens


def merge_shards(
    inputs: str | Path | Iterable[str | Path],
    output_prefix: str | Path,
    tokenizer: str | Path | Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    parse_special_tokens: bool = False,
    prepend_bos: bool = False,
) -> list[sharding.MergeStats]:
    """Merge the shards that `preprocess(..., shard=...)` with these arguments wrote, one dataset
    per key, checking that they were made with these arguments (tokenizer, options, inputs)."""
    sources = find_inputs(inputs)
    json_keys = _check_arguments(json_keys, sources)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    return [
        sharding.merge(
            f"{output_prefix}_{key}_document",
            expect=_identity(key, tok, append_eod, parse_special_tokens, sources, prepend_bos),
        )
        for key in json_keys
    ]
