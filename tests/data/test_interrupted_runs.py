"""A preprocess killed while it writes (the tokenizer's native abort, kill -9) leaves the
prefix's .bin/.idx as they were; the temporaries it left (`.NAME.bin.tmp-PID`) are removed by the
next run of that prefix, but not those of a process still running, nor another prefix's."""

import logging
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter
from lmforge.data.preprocess import merge_shards, preprocess
from lmforge.errors import UserError
from tests.data.test_inputs import jsonl
from tests.data.test_preprocess import gpt2  # noqa: F401  (fixtures)

DOCS = [{"text": f"document {i} of a corpus, with some words."} for i in range(40)]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


@pytest.fixture
def live_pid():
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_dead_runs_temporaries_of_the_prefix_are_removed_a_live_ones_kept(
    tmp_path,
    gpt2,  # noqa: F811
    live_pid,  # noqa: F811
    caplog,
):
    (tmp_path / "in.jsonl").write_bytes(jsonl(DOCS))
    out, dead = tmp_path / "out", dead_pid()
    out.mkdir()
    removed = [f".p_text_document.bin.tmp-{dead}", f".p_text_document.idx.tmp-{dead}"]
    kept = [
        f".p_text_document.bin.tmp-{live_pid}",  # another run of this prefix, still writing
        f".q_text_document.bin.tmp-{dead}",  # another prefix's
        f".p_text_document.shard-0-of-2.bin.tmp-{dead}",
        f".p_text_document.shard-0-of-2.json.tmp-{dead}",
    ]
    for name in removed + kept:
        (out / name).write_bytes(b"half written")
    (out / f".p_text_document.bin.tmp-{os.getpid()}").write_bytes(
        b"a dead run's, under this process's PID"
    )
    with caplog.at_level(logging.INFO, logger="lmforge.data.indexed"):
        stats = preprocess(tmp_path / "in.jsonl", out / "p", gpt2, progress=False)
    assert hidden(out) == sorted(kept)  # the reused PID's file became this run's .bin
    assert IndexedDataset(stats.outputs["text"]).num_documents == len(DOCS)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(
        f"which process {dead} (no longer running) left" in m for m in said
    ), said
    assert sorted(m.split()[1].rsplit("/", 1)[1].rstrip(",") for m in said) == removed

    # a shard run removes its own shard's, and the merge the merged prefix's
    preprocess(tmp_path / "in.jsonl", out / "p", gpt2, progress=False, shard="0/2")
    (out / f".p_text_document.bin.tmp-{dead}").write_bytes(b"a killed merge's")
    preprocess(tmp_path / "in.jsonl", out / "p", gpt2, progress=False, shard="1/2")
    merge_shards(tmp_path / "in.jsonl", out / "p", gpt2)
    assert hidden(out) == [
        f".p_text_document.bin.tmp-{live_pid}",
        f".q_text_document.bin.tmp-{dead}",
    ]


KILLED_RUN = """
import os, signal, sys
import lmforge.data.encoding as enc
import lmforge.data.preprocess as pp
from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.tokenizers import load_tokenizer

tokenizer, inputs, prefix, how = sys.argv[1:]
tok = load_tokenizer(tokenizer)
enc.CHUNK_DOCS = 2
if how == "abort":  # what a tokenizer that cannot allocate does: abort() in native code, SIGABRT (rc 134)
    encode_batch = tok.encode_batch
    def aborting(texts, *a, **kw):
        if any("the last straw" in t for t in texts):
            os.abort()
        return encode_batch(texts, *a, **kw)
    tok.encode_batch = aborting
else:  # kill -9 once some documents are in the temporary .bin
    add_document = IndexedDatasetWriter.add_document
    def killed(self, *a, **kw):
        add_document(self, *a, **kw)
        if self.num_documents == 10:
            self._bin.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    IndexedDatasetWriter.add_document = killed
pp.preprocess(inputs, prefix, tok, progress=False)
"""


@pytest.mark.slow  # a process of its own, which loads the tokenizer: a second or two
@pytest.mark.parametrize("how,signum", [("abort", signal.SIGABRT), ("kill", signal.SIGKILL)])
def test_a_killed_run_leaves_the_pair_whole_and_the_next_run_cleans_up(tmp_path, gpt2, how, signum):  # noqa: F811
    (tmp_path / "old.jsonl").write_bytes(jsonl(DOCS[:5]))
    out = tmp_path / "out"
    preprocess(tmp_path / "old.jsonl", out / "p", gpt2, progress=False)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "new.jsonl").write_bytes(
        jsonl([*DOCS[:30], {"text": "the last straw"}, *DOCS[30:]])
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_RUN,
            str(gpt2),
            str(tmp_path / "new.jsonl"),
            str(out / "p"),
            how,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # no core file
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signum, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")} == files
    assert IndexedDataset(out / "p_text_document").num_documents == 5
    assert hidden(out) == [f".p_text_document.bin.tmp-{proc.pid}"]  # what the kill left
    stats = preprocess(tmp_path / "new.jsonl", out / "p", gpt2, progress=False)
    assert (
        hidden(out) == [] and IndexedDataset(stats.outputs["text"]).num_documents == len(DOCS) + 1
    )


def test_a_temporary_removed_under_a_writer_is_one_line_and_the_old_pair_stays(tmp_path):
    """A run of the same prefix on another host, to which this process's PID looks dead, may
    remove its files."""
    with IndexedDatasetWriter(tmp_path / "p", np.uint16) as w:
        w.add_document([1, 2, 3])
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    w = IndexedDatasetWriter(tmp_path / "p", np.uint16)
    w.add_document([4, 5])
    next(tmp_path.glob(".p.bin.tmp-*")).unlink()
    with pytest.raises(
        UserError,
        match=r"\.p\.bin\.tmp-\d+ was removed while it was written .*: run one "
        "preprocess per output prefix at a time",
    ):
        w.finalize()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
