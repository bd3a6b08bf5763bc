"""Raw text -> Megatron `PREFIX_<key>_document.bin/.idx`, as Megatron-LM's `tools/preprocess_data.py` writes them.

Inputs, streamed (only a bounded window of chunks is in memory at once):

* JSON lines: `.jsonl`, `.json`, `.ndjson`, each optionally `.gz`. Each line is one document per
  `--json-keys` key. A value is a string, or a list of strings (sentences, as Megatron's
  `--split-sentences` pass writes them; each non-empty one becomes a sequence). Blank lines are skipped.
* plain text: `.txt` / `.txt.gz`. A whole file is one document, read at once; large corpora belong in
  JSONL. Plain text fills the one output key, so it needs exactly one `--json-keys` key.
* folders: every file of those kinds below it, recursively, in sorted path order (hidden ones skipped).

Per document and key, as Megatron does: ids = tokenize(text), and with `append_eod` the tokenizer's eod id
is appended to a non-empty document; `add_document(ids, [len(ids)])`. An empty document (empty text) is
still a document, with no sequence: `document_indices` repeats a value, and every key's file keeps one
document per input line, so documents line up across keys. The dtype follows Megatron's rule (uint16 below
65,500 ids, else int32). Documents are written in input order whatever the number of workers.
Megatron's tool finalizes only the last `--json-keys` key's index; we finalize every key's.

Parallelism: with one worker, chunks of documents are tokenized in this process by the tokenizer's batch
call, which runs on its own thread pool (Hugging Face `tokenizers` uses every core unless
TOKENIZERS_PARALLELISM=false); with N > 1, N worker processes tokenize one chunk each, single-threaded.
Tokenizing is most of the CPU time (see BENCHMARKS.md); the rest is JSON parsing and writing, in Python.
"""

from __future__ import annotations

import gzip
import json
import logging
import multiprocessing
import os
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge.data.indexed import IndexedDatasetWriter, bin_path, idx_path, optimal_dtype
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
KINDS_HINT = "give .jsonl/.json/.ndjson or .txt files (optionally .gz), or folders holding them"
CHUNK_DOCS = 64  # documents per task: enough to amortise IPC and let encode_batch batch
CHUNK_BYTES = 1 << 18  # ... but at most about this much raw text per task, so memory stays bounded
THREADS_IN_FLIGHT = 2  # with --workers 1: batch calls in flight on the tokenizer's thread pool
# Worker processes: fork on Linux, so no importable __main__ is needed (notebooks, `python -`) and the children,
# which only run the tokenizer single-threaded, inherit it loaded. Elsewhere fork is unsafe (macOS) or absent
# (Windows): spawn.
START_METHOD = "fork" if sys.platform == "linux" else "spawn"
MAX_LOGGED_SKIPS = 10

# A task: (where, kind, raw bytes); where is "file:line" for JSON lines, the file for plain text.
Record = tuple[str, str, bytes]
# A chunk's result: per key, the ids of its good documents end to end; and per record, an error message or per
# key (token count, sequence lengths). One array per key and chunk rather than one per document: cheaper to
# build, and to send back from a worker process, when documents are short.
Encoded = tuple[list[np.ndarray], list[str | list[tuple[int, list[int]]]]]


@dataclass
class PreprocessStats:
    documents: int = 0  # input documents written (each to every key's file)
    tokens: int = 0  # tokens written, eod included, summed over keys
    skipped: int = 0  # bad lines skipped with on_error="skip"
    seconds: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)  # key -> prefix of its .bin/.idx

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def documents_per_second(self) -> float:
        return self.documents / self.seconds if self.seconds else 0.0


def _suffix_kind(path: Path) -> str | None:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "json"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def find_inputs(inputs: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Expand files and folders into (file, kind) pairs, in the order documents are written."""
    inputs = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    if not inputs:
        raise UserError(f"no input given: {KINDS_HINT}")
    found = []
    for path in inputs:
        if not path.exists():
            raise UserError(f"input {path} does not exist: check the path")
        if path.is_dir():
            files = [
                p for p in sorted(path.rglob("*"))
                if p.is_file() and _suffix_kind(p) and not any(s.startswith(".") for s in p.relative_to(path).parts)
            ]
            if not files:
                raise UserError(f"input folder {path} holds no data files: {KINDS_HINT}")
            found += [(p, _suffix_kind(p)) for p in files]
        elif kind := _suffix_kind(path):
            found.append((path, kind))
        else:
            raise UserError(f"input {path} is of an unknown kind: {KINDS_HINT}")
    return found


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _records(files: list[tuple[Path, str]]) -> Iterator[Record]:
    for path, kind in files:
        try:
            with _open(path) as f:
                if kind == "text":
                    yield str(path), kind, f.read()
                    continue
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield f"{path}:{lineno}", kind, line
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise UserError(f"cannot read {path} ({e}): check the file is intact") from e


def _chunks(records: Iterator[Record]) -> Iterator[list[Record]]:
    chunk, size = [], 0
    for rec in records:
        chunk.append(rec)
        size += len(rec[2])
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _Encoder:
    """Decode, parse and tokenize chunks of records; runs in the main process or in each worker."""

    current: _Encoder | None = None  # the worker process's own encoder, set once by the Pool initializer

    def __init__(self, tokenizer: Tokenizer, json_keys: Sequence[str], append_eod: bool):
        self.tokenizer, self.json_keys, self.append_eod = tokenizer, list(json_keys), append_eod

    def texts(self, where: str, kind: str, raw: bytes) -> list[list[str]] | str:
        """Per key, the document's sentences; or an error message naming `where`."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file as UTF-8"
        if kind == "text":
            return [[text]]
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{where}: malformed JSON ({e.msg} at column {e.colno})"
        if not isinstance(data, dict):
            return f"{where}: a line must be a JSON object, got {type(data).__name__}"
        out = []
        for key in self.json_keys:
            if key not in data:
                return f"{where}: no key {key!r} (keys: {', '.join(map(repr, data)) or 'none'}): check --json-keys"
            value = data[key]
            sentences = value if isinstance(value, list) else [value]
            if not all(isinstance(s, str) for s in sentences):
                return f"{where}: key {key!r} must hold a string or a list of strings, got {type(value).__name__}"
            try:  # a JSON escape like "\ud800" gives a lone surrogate, which no tokenizer can take
                for s in sentences:
                    s.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where}: key {key!r} holds a lone UTF-16 surrogate escape, which is not text"
            out.append(sentences)
        return out

    def encode_chunk(self, chunk: list[Record]) -> Encoded:
        parsed = [self.texts(*rec) for rec in chunk]
        # One encode_batch over every text of the chunk: the tokenizer's batch path is its fast path.
        flat = [s for p in parsed if not isinstance(p, str) for sentences in p for s in sentences]
        ids = iter(self.tokenizer.encode_batch(flat) if flat else [])
        eod = [self.tokenizer.eod_id]
        parts: list[list[list[int]]] = [[] for _ in self.json_keys]
        records: list[str | list[tuple[int, list[int]]]] = []
        for p in parsed:
            if isinstance(p, str):
                records.append(p)
                continue
            doc = []
            for key_parts, sentences in zip(parts, p):
                lengths = []
                for _ in sentences:
                    sentence_ids = next(ids)
                    if sentence_ids:  # Megatron drops empty sentences from the sequence lengths
                        key_parts.append(sentence_ids)
                        lengths.append(len(sentence_ids))
                if lengths and self.append_eod:
                    key_parts.append(eod)
                    lengths[-1] += 1
                doc.append((sum(lengths), lengths))
            records.append(doc)
        arrays = [np.fromiter(chain.from_iterable(p), np.int64, count=sum(map(len, p))) for p in parts]
        return arrays, records


def _init_worker(encoder: _Encoder | None, tokenizer_file: str, json_keys: list[str], append_eod: bool) -> None:
    # encode_batch would otherwise start a thread per core in every worker; the workers are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if encoder is None:  # spawned: load our own copy (forked workers get the parent's, loaded once)
        logging.getLogger("lmforge.tokenizers").setLevel(logging.WARNING)
        encoder = _Encoder(load_tokenizer(tokenizer_file), json_keys, append_eod)
    _Encoder.current = encoder


def _encode_in_worker(chunk: list[Record]) -> Encoded:
    return _Encoder.current.encode_chunk(chunk)


def _in_order(pool: Executor, fn, chunks: Iterator[list[Record]], window: int) -> Iterator[Encoded]:
    """fn(chunk) for each chunk on `pool`, yielded in input order, at most `window` chunks in flight."""
    pending: deque[Future] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(fn, chunk))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encoded_chunks(chunks: Iterator[list[Record]], encoder: _Encoder, workers: int) -> Iterator[Encoded]:
    """Encoded chunks in input order; memory stays bounded by the window of chunks in flight."""
    if workers == 1:
        # The batch call releases the GIL and tokenizes on the tokenizer's own thread pool (every core, unless
        # TOKENIZERS_PARALLELISM=false). Two calls in flight keep that pool fed while Python parses and writes,
        # and while one call waits on its longest document; one call at a time leaves cores idle then.
        pool = ThreadPoolExecutor(THREADS_IN_FLIGHT, thread_name_prefix="preprocess")
        yield from _in_order(pool, encoder.encode_chunk, chunks, window=THREADS_IN_FLIGHT + 1)
        return
    ctx = multiprocessing.get_context(START_METHOD)
    # A forked worker inherits the loaded tokenizer as it is (initargs are not pickled under fork): loading
    # it again costs each worker ~0.3 s of CPU before its first chunk.
    inherited = encoder if ctx.get_start_method() == "fork" else None
    init_args = (inherited, str(encoder.tokenizer.files[0]), encoder.json_keys, encoder.append_eod)
    # Not Pool.imap, as Megatron does: it reads the whole input ahead into its task queue, and a Pool whose
    # worker dies respawns it and waits forever. A window of futures bounds memory; a dead worker raises.
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init_args)
    try:
        yield from _in_order(pool, _encode_in_worker, chunks, window=4 * workers)
    except BrokenProcessPool as e:
        raise RuntimeError(f"a preprocess worker process died ({e}): out of memory? try fewer --workers") from e


def preprocess(
    inputs: str | Path | Iterable[str | Path],
    output_prefix: str | Path,
    tokenizer: str | Path | Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    on_error: str = "fail",
    progress: bool = True,
) -> PreprocessStats:
    """Tokenize `inputs` into `{output_prefix}_{key}_document.bin/.idx` for each key; see the module docstring.

    `on_error="fail"` stops at the first bad line (malformed JSON, missing key, not UTF-8) with a
    UserError naming file:line; `"skip"` skips such lines and counts them. On any error no output
    file is left under its final name.
    """
    if on_error not in ("fail", "skip"):
        raise UserError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    if workers < 1:
        raise UserError(f"workers must be at least 1, not {workers}")
    json_keys = [json_keys] if isinstance(json_keys, str) else list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise UserError(f"json keys {json_keys} must be one or more distinct names")
    files = find_inputs(inputs)
    if len(json_keys) > 1 and any(kind == "text" for _, kind in files):
        raise UserError(f"plain-text inputs fill one output, but {len(json_keys)} json keys were given: give one")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if append_eod and tok.eod_id is None:
        raise UserError(f"tokenizer {tok.files[0]} has no end-of-document token: drop --append-eod")
    dtype = optimal_dtype(tok.vocab_size)
    stats = PreprocessStats(outputs={k: f"{output_prefix}_{k}_document" for k in json_keys})
    logger.info("tokenizing %d file(s) into %s (%s, %d workers)", len(files), list(stats.outputs.values()),
                dtype.name, workers)

    start = time.perf_counter()
    writers: dict[str, IndexedDatasetWriter] = {}
    finalized: list[str] = []
    bar = tqdm(unit="doc", desc="preprocess", file=sys.stderr, disable=not (progress and sys.stderr.isatty()))
    encoded = _encoded_chunks(_chunks(_records(files)), _Encoder(tok, json_keys, append_eod), workers)
    try:
        for key, prefix in stats.outputs.items():
            writers[key] = IndexedDatasetWriter(prefix, dtype)
        for arrays, records in encoded:
            offsets = [0] * len(json_keys)
            for res in records:
                if isinstance(res, str):
                    if on_error == "fail":
                        raise UserError(f"{res} (or pass --on-error skip)")
                    stats.skipped += 1
                    if stats.skipped <= MAX_LOGGED_SKIPS:
                        logger.warning("skipped %s", res)
                    continue
                for k, (n, lengths) in enumerate(res):
                    writers[json_keys[k]].add_document(arrays[k][offsets[k] : offsets[k] + n], lengths)
                    offsets[k] += n
                    stats.tokens += n
                stats.documents += 1
            bar.update(len(records))
            bar.set_postfix_str(f"{stats.tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
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
    if stats.skipped:
        logger.warning("skipped %d bad line(s) in all", stats.skipped)
    logger.info("wrote %d documents, %d tokens in %.1f s (%.0f tokens/s)", stats.documents, stats.tokens,
                stats.seconds, stats.tokens_per_second)
    return stats
