"""Checkpoints a run can trust: checksums verified on resume (a damaged checkpoint gives way to
the one before it), retention that a kill cannot leave half done, and a full disk said in one
line with nothing left behind."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun
from tests.train.conftest import run_config

SAVE_EVERY_4 = ("checkpoint.every_n_steps=4", "checkpoint.save_top_k=-1", "model.dropout=0.1")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in _rows(run_dir)]


def _flip_byte(checkpoint: Path, prefix: str) -> Path:
    """Flip one byte in the middle of the largest tensor whose name starts with `prefix`
    ("model." or "optim.") in the DCP shard that holds it, found through DCP's own index of the
    shards. Returns the shard."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    index, info = max(
        ((i, s) for i, s in storage.items() if i.fqn.startswith(prefix)), key=lambda x: x[1].length
    )
    shard = checkpoint / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.fixture(scope="module")
def eight_steps(tiny_corpus, tmp_path_factory):
    """An 8-step run with checkpoints at steps 4 and 8 (dropout on: a resume must restore the RNG
    too)."""
    run = tmp_path_factory.mktemp("whole") / "run"
    Trainer(run_config(tiny_corpus, run, *SAVE_EVERY_4)).fit()
    return run


@pytest.mark.parametrize("part", ["model.", "optim."], ids=["model-weights", "optimizer-state"])
def test_a_flipped_byte_resumes_from_the_checkpoint_before(
    part, eight_steps, tiny_corpus, tmp_path, caplog
):
    run = tmp_path / "run"
    shutil.copytree(eight_steps, run)
    shard = _flip_byte(run / "checkpoints" / "step-00000008", part)
    with caplog.at_level(logging.WARNING, logger="lmforge.checkpoint.manager"):
        trainer = Trainer(run_config(tiny_corpus, run, *SAVE_EVERY_4))
    assert trainer.state["step"] == 4
    assert f"'{shard}' does not match its SHA-256" in caplog.text
    assert "moved to step-00000008.corrupt, resuming from step-00000004" in caplog.text
    trainer.fit()
    assert _curve(run) == _curve(eight_steps)  # steps 5-8 again, bit for bit
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000008", "step-00000008.corrupt"]


def test_no_intact_checkpoint_is_one_error_naming_the_file(eight_steps, tiny_corpus, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eight_steps, run)
    shard8 = _flip_byte(run / "checkpoints" / "step-00000008", "optim.")
    # another size: no hash needed
    (run / "checkpoints" / "step-00000004" / "rng-rank0.json").write_text("{}")
    with pytest.raises(UserError, match="no intact checkpoint to resume from") as e:
        Trainer(run_config(tiny_corpus, run, *SAVE_EVERY_4))
    assert f"'{shard8}' does not match its SHA-256" in str(e.value)
    assert "1 older checkpoint(s) likewise" in str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000004",
        "step-00000008",
    ]


def test_checkpoints_without_checksums_still_resume(eight_steps, tiny_corpus, tmp_path, caplog):
    """Checkpoints written before checksums were: resumed as they are, with a warning."""
    run = tmp_path / "run"
    shutil.copytree(eight_steps, run)
    (run / "checkpoints" / "step-00000008" / "checksums.json").unlink()
    with caplog.at_level(logging.WARNING, logger="lmforge.checkpoint.manager"):
        trainer = Trainer(run_config(tiny_corpus, run, *SAVE_EVERY_4))
    assert trainer.state["step"] == 8
    assert "has no checksums.json (written by an older lmforge)" in caplog.text


def test_each_checkpoint_records_the_checksum_of_every_file(eight_steps):
    import hashlib

    folder = eight_steps / "checkpoints" / "step-00000004"
    files = json.loads((folder / "checksums.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in folder.iterdir() if p.name != "checksums.json")
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# -- retention
# --------------------------------------------------------------------------------------------


def test_half_deleted_checkpoints_are_ignored_and_removed_at_start(
    eight_steps, tiny_corpus, tmp_path, caplog
):
    """What a kill during deletion leaves: with rename-then-delete a `.step-N.deleting` folder;
    from older lmforge, a `step-N` whose trainer.json is already gone; and a `.step-N.tmp` of a
    save cut short."""
    run = tmp_path / "run"
    shutil.copytree(eight_steps, run)
    ckpts = run / "checkpoints"
    (ckpts / "step-00000004").rename(ckpts / ".step-00000004.deleting")
    (ckpts / ".step-00000004.deleting" / "trainer.json").unlink()
    # deleted in place up to trainer.json
    shutil.copytree(ckpts / "step-00000008", ckpts / "step-00000012")
    (ckpts / "step-00000012" / "trainer.json").unlink()
    (ckpts / "step-00000012" / ".metadata").unlink()
    shutil.copytree(ckpts / "step-00000008", ckpts / ".step-00000016.tmp")
    with caplog.at_level(logging.WARNING, logger="lmforge.checkpoint.manager"):
        trainer = Trainer(
            run_config(
                tiny_corpus, run, *SAVE_EVERY_4, "trainer.max_steps=12", "checkpoint.save_top_k=1"
            )
        )
    assert trainer.state["step"] == 8
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000008"]
    assert caplog.text.count("left by an interrupted checkpoint save or deletion") == 3
    # retention reads every checkpoint's trainer.json: it crashed on the half-deleted one
    trainer.fit()
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".")] == []
    assert [r["step"] for r in _rows(run)] == list(range(1, 13))


# A pretrain whose first retention deletion is killed (SIGKILL, the signal kill -9 sends) after
# removing two files, as a kill arriving mid-deletion would: rmtree is replaced by one that deletes
# trainer.json, then one shard, then kills its own process.
KILLED_IN_RETENTION = """
import os, shutil, signal, sys
from pathlib import Path

real = shutil.rmtree

def rmtree(path, *args, **kwargs):
    path = Path(path)
    if kwargs.get("ignore_errors") or not (path / "trainer.json").exists():
        return real(path, *args, **kwargs)
    (path / "trainer.json").unlink()
    next(path.glob("*.distcp")).unlink()
    os.kill(os.getpid(), signal.SIGKILL)

shutil.rmtree = rmtree
from lmforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _pretrain(corpus, run_dir, *extra) -> list[str]:
    return [
        "pretrain",
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=8",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=4",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "model.dropout=0.1",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *extra,
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_a_kill_during_retention_leaves_a_run_that_resumes(tiny_corpus, tmp_path):
    extra = ("checkpoint.every_n_steps=2", "checkpoint.save_top_k=1")
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_IN_RETENTION, *_pretrain(tiny_corpus, killed, *extra)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr
    ckpts = killed / "checkpoints"
    assert {p.name for p in ckpts.iterdir()} == {".step-00000002.deleting", "step-00000004"}
    rerun = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *_pretrain(tiny_corpus, killed, *extra)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000008"]
    whole = tmp_path / "whole"
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *_pretrain(tiny_corpus, whole, *extra)],
        env=ENV,
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert _curve(killed) == _curve(whole)


# -- a full disk
# ------------------------------------------------------------------------------------------


def _limited(limit: int):
    def set_limit():
        import resource

        # Python ignores SIGXFSZ: writes fail EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def _intact(run_dir: Path, step: int) -> None:
    """Only `step-<step>` under checkpoints/, and its files match their checksums."""
    from lmforge.fsutil import checksum_problems

    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{step:08d}"]
    assert checksum_problems(ckpts / f"step-{step:08d}") == []


@pytest.mark.slow
def test_a_file_size_limit_mid_checkpoint_is_one_line(tiny_corpus, tmp_path):
    """RLIMIT_FSIZE (ulimit -f) below the shard's size: the write fails inside DCP's torch.save
    stream, where the errno is lost ("unexpected pos ..."), after the free space check passed."""
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *_pretrain(tiny_corpus, run, "trainer.max_steps=4")],
        env=ENV,
        check=True,
        capture_output=True,
        timeout=300,
    )
    shard = run / "checkpoints" / "step-00000004" / "__0_0.distcp"
    limit = shard.stat().st_size // 2
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *_pretrain(tiny_corpus, run)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited(limit),
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"error: file size limit reached writing '{run / 'checkpoints' / 'step-00000008'}'"
    )
    assert f"the limit (ulimit -f) is {limit} bytes" in lines[0] and "free on that disk" in lines[0]
    _intact(run, 4)


UNSHARE = shutil.which("unshare")


def _can_mount_tmpfs() -> bool:
    if UNSHARE is None:
        return False
    probe = subprocess.run(
        [UNSHARE, "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(
    not _can_mount_tmpfs(), reason="needs `unshare -rm` to mount a small tmpfs (user namespaces)"
)
@pytest.mark.parametrize(
    "spare", ["none", "tensors", "page"], ids=["before-writing", "mid-write", "run-folder"]
)
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(spare, tiny_corpus, tmp_path):
    """The run folder on a real tmpfs, filled so the step-8 checkpoint does not fit: with no room
    for it, the check before writing says so; with room for its tensors but not the files around
    them, the write itself hits ENOSPC; with a page free, the resume's own files (history.jsonl,
    config.yaml) do not fit. Each way: one line, the temporary folder gone, step-4 intact."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    cli = f"{sys.executable} -m lmforge.cli"
    first = " ".join(_pretrain(tiny_corpus, run, "trainer.max_steps=4"))
    second = " ".join(_pretrain(tiny_corpus, run))
    # Leave free what the check before writing counts (and 64 KB for the metrics written meanwhile):
    # it passes, the records around the tensors and the files beside them do not fit; or 64 KB alone
    # (room for the run folder's config.yaml, history.jsonl and metrics, written anew at the
    # resume): the check fails; or a page: those files do not fit.
    fill = f"""
import math, shutil
RECORD_BYTES = 1024  # as in lmforge.checkpoint.manager
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
meta = FileSystemReader("{run}/checkpoints/step-00000004").read_metadata()
tensors = sum(math.prod(m.size) * m.properties.dtype.itemsize + RECORD_BYTES
              for m in meta.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
keep = {{"tensors": tensors + 65536, "none": 65536, "page": 4096}}["{spare}"]
free = shutil.disk_usage("{mnt}").free
with open("{mnt}/filler", "wb") as f:
    f.write(b"\\0" * max(0, free - keep))
"""
    script = f"""set -e
mount -t tmpfs -o size=16m tmpfs {mnt}
{cli} {first} 2>/dev/null
{sys.executable} -c '{fill}'
set +e
{cli} {second} 2>{tmp_path}/stderr
echo $? > {tmp_path}/rc
mkdir -p {tmp_path}/kept && cp -r {run}/checkpoints {tmp_path}/kept/
"""
    subprocess.run([UNSHARE, "-rm", "sh", "-c", script], env=ENV, check=True, timeout=600)
    stderr = (tmp_path / "stderr").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", stderr
    lines = [line for line in stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1, stderr
    where = run if spare == "page" else run / "checkpoints" / "step-00000008"
    assert lines[0].startswith(f"error: disk full writing '{where}': it needs "), lines[0]
    assert "free on that disk: free space there, keep fewer checkpoints" in lines[0]
    _intact(tmp_path / "kept", 4)


def test_a_damaged_checkpoint_read_as_a_model_is_one_error_naming_the_file(eight_steps, tmp_path):
    """export-hf, serve, eval and model.init_from read a checkpoint's weights: flipped bytes
    there are an error, not a model that quietly differs."""
    from lmforge.models.source import load_pretrained

    ckpt = tmp_path / "step-00000008"
    shutil.copytree(eight_steps / "checkpoints" / "step-00000008", ckpt)
    load_pretrained(ckpt)  # intact: loads
    shard = _flip_byte(ckpt, "model.")
    with pytest.raises(
        UserError, match=f"checkpoint '{ckpt}' is damaged: '{shard}' does not match its SHA-256"
    ):
        load_pretrained(ckpt)


@pytest.mark.parametrize("disk", ["ulimit", "tmpfs"])
def test_export_hf_on_a_full_disk_is_one_line(disk, tmp_path):
    """export-hf writes through the same atomic folder: a full disk (a real 256 KB tmpfs) or a
    file size limit is one line, and no temporary folder is left beside the output."""
    from lmforge.models import build
    from lmforge.models.io import save_model

    if disk == "tmpfs" and not _can_mount_tmpfs():
        pytest.skip("needs `unshare -rm` to mount a small tmpfs (user namespaces)")
    model_dir = save_model(build("tiny-neox", seed=0), tmp_path / "model")  # ~0.9 MB of weights
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    export = f"{sys.executable} -m lmforge.cli export-hf {model_dir} {mnt / 'hf'}"
    if disk == "ulimit":
        proc = subprocess.run(
            export.split(),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_limited(100_000),
        )
        stderr, rc, left = proc.stderr, proc.returncode, sorted(p.name for p in mnt.iterdir())
    else:
        script = (
            f"mount -t tmpfs -o size=256k tmpfs {mnt}; {export} 2>{tmp_path}/stderr; echo $? >{tmp_path}/rc; "
            f"ls -A {mnt} >{tmp_path}/left"
        )
        subprocess.run([UNSHARE, "-rm", "sh", "-c", script], env=ENV, check=True, timeout=300)
        stderr, rc = (tmp_path / "stderr").read_text(), int((tmp_path / "rc").read_text())
        left = (tmp_path / "left").read_text().split()
    assert rc == 1
    lines = [line for line in stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1, stderr
    weights = (model_dir / "model.safetensors").stat().st_size
    kind = "file size limit reached" if disk == "ulimit" else "disk full"
    assert lines[0].startswith(
        f"error: {kind} writing '{mnt / 'hf'}': it needs at least {weights} bytes"
    )
    assert "free on that disk" in lines[0]
    assert left == []


# -- two ranks
# ----------------------------------------------------------------------------------------------


def _torchrun(run_dir: Path, corpus, *extra, preexec_fn=None) -> subprocess.CompletedProcess:
    args = _pretrain(
        corpus,
        run_dir,
        "trainer.data_parallel=fsdp",
        "checkpoint.every_n_steps=4",
        "checkpoint.save_top_k=-1",
        *extra,
    )
    return torchrun(2, ["-m", "lmforge.cli", *args], env=ENV, timeout=420, preexec_fn=preexec_fn)


@pytest.mark.slow
def test_two_ranks_agree_on_a_damaged_checkpoint_and_on_a_full_disk(tiny_corpus, tmp_path):
    """FSDP on two ranks: each rank writes its own shard and hashes a share of the files; on
    resume they verify together and agree to skip the damaged step-8 (flipped in rank 1's shard);
    a file size limit hit while saving is one line from rank 0 and every rank exits, none left
    waiting at a barrier."""
    run = tmp_path / "run"
    first = _torchrun(run, tiny_corpus)
    assert first.returncode == 0, first.stderr[-3000:]
    whole = _curve(run)
    step8 = run / "checkpoints" / "step-00000008"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(
        json.loads((step8 / "checksums.json").read_text())["files"]
    )
    data = bytearray((step8 / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step8 / "__1_0.distcp").write_bytes(bytes(data))
    # As a run killed after its last save: a finished run's rerun says so before reading a
    # checkpoint.
    (run / "finished.json").unlink()
    again = _torchrun(run, tiny_corpus)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "moved to step-00000008.corrupt, resuming from step-00000004" in again.stderr
    assert _curve(run) == whole  # steps 5-8 again, bit for bit
    shutil.rmtree(run / "checkpoints" / "step-00000008.corrupt")
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    limit = (run / "checkpoints" / "step-00000004" / "__0_0.distcp").stat().st_size // 2
    full = _torchrun(run, tiny_corpus, preexec_fn=_limited(limit))
    assert full.returncode != 0
    errors = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: file size limit reached writing"), (
        full.stderr[-3000:]
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
