"""Documents to token ids for `preprocess`: records parsed (JSON, UTF-8, the --json-keys) and
tokenized in chunks, on the tokenizer's threads or in worker processes, the results given back in
input order.

Parallelism: with one worker, chunks of documents are tokenized in this process by the tokenizer's
batch call, which runs on its own thread pool (Hugging Face `tokenizers` uses every core unless
TOKENIZERS_PARALLELISM=false); with N > 1, N worker processes tokenize one chunk each,
single-threaded. Tokenizing is most of the CPU time (see BENCHMARKS.md); the rest is parsing and
writing, in Python.

With one worker, `THREADS_IN_FLIGHT` batch calls run at once: each releases the GIL, and two keep
the tokenizer's pool fed while Python parses and writes, and while one call waits on its longest
document; one call at a time leaves cores idle then. With N workers, a `ProcessPoolExecutor` fed a
window of futures, not `Pool.imap` as Megatron's preprocess_data.py uses: imap reads the whole input
ahead into its task queue, and a Pool whose worker dies respawns it and waits forever. The window
bounds memory; a dead worker raises.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain

import numpy as np

from lmforge.data.reader import Record, TooLarge
from lmforge.tokenizers import Tokenizer, load_tokenizer

CHUNK_DOCS = 64  # documents per task: enough to amortise IPC and let encode_batch batch
CHUNK_BYTES = 1 << 18  # ... but at most about this much raw text per task, so memory stays bounded
THREADS_IN_FLIGHT = 2  # with --workers 1: batch calls in flight on the tokenizer's thread pool
# Worker processes: fork on Linux, so no importable __main__ is needed (notebooks, `python -`) and
# the children, which only run the tokenizer single-threaded, inherit it loaded. Elsewhere fork is
# unsafe (macOS) or absent (Windows): spawn.
START_METHOD = "fork" if sys.platform == "linux" else "spawn"

# A chunk's result: per key, the ids of its good documents end to end; per record, an error message
# or per key (token count, sequence lengths); and the special-token text found (SpecialText). One
# array per key and chunk rather than one per document: cheaper to build, and to send back from a
# worker process, when documents are short. occurrences of special-token text by token, and
# documents holding any
SpecialText = tuple[dict[str, int], int]
Encoded = tuple[list[np.ndarray], list[str | list[tuple[int, list[int]]]], SpecialText]
Done = tuple[list[Record], Encoded]  # a chunk and its result


def chunked(records: Iterator[Record]) -> Iterator[list[Record]]:
    chunk, size = [], 0
    for rec in records:
        chunk.append(rec)
        size += rec[3]
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class Encoder:
    """Decode, parse and tokenize chunks of records; runs in the main process or in each worker."""

    # the worker process's own encoder, set once by the Pool initializer
    current: Encoder | None = None

    def __init__(
        self,
        tokenizer: Tokenizer,
        json_keys: Sequence[str],
        append_eod: bool,
        prepend_bos: bool = False,
    ):
        self.tokenizer, self.json_keys, self.append_eod = tokenizer, list(json_keys), append_eod
        self.prepend_bos = prepend_bos
        # Special-token text that stays text, to be said at the end: longest first, so
        # "<|im_start|>" is one match.
        names = (
            []
            if tokenizer.parse_special_tokens
            else sorted(filter(None, tokenizer.special_tokens), key=len, reverse=True)
        )
        self.special_text = re.compile("|".join(map(re.escape, names))) if names else None

    def texts(self, kind: str, payload) -> list[list[str]] | str:
        """Per key, the document's sentences; or what is wrong with the record (its place is
        added later)."""
        if isinstance(payload, TooLarge):
            return payload.reason(kind)
        if kind == "row":  # Parquet/Arrow: the --json-keys columns' values, already text (or null)
            return self._sentences(dict(zip(self.json_keys, payload)), check_surrogates=False)
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file as UTF-8"
        if kind == "text":
            return [[text]]
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            return f"malformed JSON ({e.msg} at column {e.colno})"
        if not isinstance(data, dict):
            return f"a line must be a JSON object, got {type(data).__name__}"
        return self._sentences(data, check_surrogates=True)

    def _sentences(self, data: dict, check_surrogates: bool) -> list[list[str]] | str:
        out = []
        for key in self.json_keys:
            if key not in data:
                return f"no key {key!r} (keys: {', '.join(map(repr, data)) or 'none'}): check --json-keys"
            value = data[key]
            sentences = value if isinstance(value, list) else [value]
            if not all(isinstance(s, str) for s in sentences):
                return f"key {key!r} must hold a string or a list of strings, got {type(value).__name__}"
            if check_surrogates:
                # a JSON escape like "\ud800" gives a lone surrogate, which no
                # tokenizer can take
                try:
                    for s in sentences:
                        s.encode("utf-8")
                except UnicodeEncodeError:
                    return f"key {key!r} holds a lone UTF-16 surrogate escape, which is not text"
            out.append(sentences)
        return out

    def encode_chunk(self, chunk: list[Record]) -> Encoded:
        parsed = [self.texts(kind, payload) for _, kind, payload, _ in chunk]
        # One encode_batch over every text of the chunk: the tokenizer's batch path is its fast
        # path.
        flat = [s for p in parsed if not isinstance(p, str) for sentences in p for s in sentences]
        ids = iter(self.tokenizer.encode_batch(flat) if flat else [])
        eod, bos = [self.tokenizer.eod_id], [self.tokenizer.bos_id] if self.prepend_bos else []
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
                    sentence_ids = bos + next(ids)
                    if sentence_ids:  # Megatron drops empty sentences from the sequence lengths
                        key_parts.append(sentence_ids)
                        lengths.append(len(sentence_ids))
                if lengths and self.append_eod:
                    key_parts.append(eod)
                    lengths[-1] += 1
                doc.append((sum(lengths), lengths))
            records.append(doc)
        arrays = [
            np.fromiter(chain.from_iterable(p), np.int64, count=sum(map(len, p))) for p in parts
        ]
        return arrays, records, self._special_text(parsed)

    def _special_text(self, parsed: list[list[list[str]] | str]) -> SpecialText:
        """The special-token text in the chunk's good records (none looked for where it is
        parsed)."""
        found: dict[str, int] = {}
        documents = 0
        if self.special_text is None:
            return found, documents
        search, findall = self.special_text.search, self.special_text.findall
        for p in parsed:
            hit = False
            for text in () if isinstance(p, str) else chain.from_iterable(p):
                if search(text):  # the common case, no match, costs one scan in C
                    hit = True
                    for name in findall(text):
                        found[name] = found.get(name, 0) + 1
            documents += hit
        return found, documents


def _init_worker(
    encoder: Encoder | None,
    tokenizer_file: str,
    json_keys: list[str],
    append_eod: bool,
    parse_special_tokens: bool,
    prepend_bos: bool,
) -> None:
    # encode_batch would otherwise start a thread per core in every worker; the workers are the
    # parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if encoder is None:  # spawned: load our own copy (forked workers get the parent's, loaded once)
        logging.getLogger("lmforge.tokenizers").setLevel(logging.WARNING)
        tok = load_tokenizer(tokenizer_file)
        tok.parse_special_tokens = parse_special_tokens
        encoder = Encoder(tok, json_keys, append_eod, prepend_bos)
    Encoder.current = encoder


def _encode_in_worker(chunk: list[Record]) -> Encoded:
    return Encoder.current.encode_chunk(chunk)


def _in_order(pool: Executor, fn, chunks: Iterator[list[Record]], window: int) -> Iterator[Done]:
    """(chunk, fn(chunk)) for each chunk on `pool`, in input order, at most `window` chunks in
    flight."""
    pending: deque[tuple[list[Record], Future]] = deque()
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(fn, chunk)))
            if len(pending) >= window:
                chunk, future = pending.popleft()
                yield chunk, future.result()
        while pending:
            chunk, future = pending.popleft()
            yield chunk, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def encoded_chunks(
    chunks: Iterator[list[Record]], encoder: Encoder, workers: int
) -> Iterator[Done]:
    """Encoded chunks in input order; memory stays bounded by the window of chunks in flight."""
    if workers == 1:
        # Two batch calls in flight (each releases the GIL) keep the tokenizer's thread pool fed
        # while Python parses and writes, and while one waits on its longest document.
        pool = ThreadPoolExecutor(THREADS_IN_FLIGHT, thread_name_prefix="preprocess")
        yield from _in_order(pool, encoder.encode_chunk, chunks, window=THREADS_IN_FLIGHT + 1)
        return
    ctx = multiprocessing.get_context(START_METHOD)
    # A forked worker inherits the loaded tokenizer as it is (initargs are not pickled under fork):
    # loading it again costs each worker ~0.3 s of CPU before its first chunk.
    inherited = encoder if ctx.get_start_method() == "fork" else None
    init_args = (
        inherited,
        str(encoder.tokenizer.files[0]),
        encoder.json_keys,
        encoder.append_eod,
        encoder.tokenizer.parse_special_tokens,
        encoder.prepend_bos,
    )
    # Not Megatron's Pool.imap, which reads the whole input ahead and waits forever on a dead worker
    # (module docstring): a window of futures bounds memory, and a dead worker raises.
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=init_args
    )
    try:
        yield from _in_order(pool, _encode_in_worker, chunks, window=4 * workers)
    except BrokenProcessPool as e:
        raise RuntimeError(
            f"a preprocess worker process died ({e}): out of memory? try fewer --workers"
        ) from e
