"""Hostile training checkpoints: a `.metadata` or an optimizer item that runs code when plain
pickle reads it is refused by every verb that reads checkpoints, with nothing executed and
nothing written; damaged metadata and storage entries naming files outside the folder are one
line.

Each fixture is built here from a real checkpoint, and its checksum manifest rewritten as an
attacker would. The fixtures are first shown to run their code under torch's own reader (so a
refusal is not an accident of a broken fixture)."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.dcp_read import METADATA, load_state, read_metadata
from lmforge.errors import UserError
from lmforge.fsutil import CHECKSUMS, file_checksums

STEP = "step-00000004"


class Payload:
    """Pickles as a call of builtins.eval that writes `marker`, then evaluates to `value` (an
    expression): the file then loads as it would have, and only the marker says code ran."""

    def __init__(self, marker: Path, value: str):
        self.marker, self.value = marker, value

    def __reduce__(self):
        return eval, (
            f"(__import__('pathlib').Path({str(self.marker)!r}).write_text('ran'), {self.value})[1]",
        )


def reseal(folder: Path) -> None:
    """Rewrite the checksum manifest over the folder's files, as whoever altered them would."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text(
        json.dumps({"format": 1, "files": file_checksums(folder, names)})
    )


def hostile_metadata(good: Path, out: Path, marker: Path) -> Path:
    """A copy of checkpoint `good` whose .metadata runs code, then returns the real metadata."""
    shutil.copytree(good, out)
    real = (good / METADATA).read_bytes()
    (out / METADATA).write_bytes(
        pickle.dumps(Payload(marker, f"__import__('pickle').loads({real!r})"))
    )
    reseal(out)
    return out


def hostile_item(good: Path, out: Path, marker: Path) -> Path:
    """A copy of checkpoint `good` resaved with one optimizer hyperparameter (a non-tensor item,
    which DCP reads with torch.load(weights_only=False)) a pickle that runs code, then gives the
    real value."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:  # torch's own reading of the good checkpoint, whole
        dcp_to_torch_save(good, Path(tmp) / "whole.pt")
        state = torch.load(Path(tmp) / "whole.pt", weights_only=False)
    optim = state["optim"]  # lmforge's flat form: "param_groups.<parameter>.lr" ...
    key = next(k for k in optim if k.startswith("param_groups.") and k.endswith(".lr"))
    optim[key] = Payload(marker, repr(optim[key]))
    out.mkdir()
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    for f in good.iterdir():
        if not f.name.endswith(".distcp") and f.name not in (METADATA, CHECKSUMS):
            shutil.copy(f, out / f.name)
    reseal(out)
    return out


def hostile_tensor(good: Path, out: Path, marker: Path) -> Path:
    """A copy of checkpoint `good` whose first model tensor's bytes are a torch.save'd pickle
    that runs code, then gives the real tensor: appended to its .distcp file, the (torch-made)
    metadata pointed at it."""
    import io

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(good, out)
    meta = FileSystemReader(str(good)).read_metadata()
    index = next(i for i in meta.storage_data if i.fqn.startswith("model."))
    info = meta.storage_data[index]
    real = (good / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    payload = io.BytesIO()
    torch.save(
        Payload(marker, f"__import__('torch').load(__import__('io').BytesIO({real!r}))"), payload
    )
    with open(out / info.relative_path, "ab") as f:
        info.offset, info.length = f.tell(), len(payload.getvalue())
        f.write(payload.getvalue())
    meta.storage_meta.load_id = None
    (out / METADATA).write_bytes(pickle.dumps(meta))
    reseal(out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 4-step tiny-neox run with a 300-id tokenizer (copied into its checkpoint)."""
    from tests.eval.conftest import train_tokenizer

    root = tmp_path_factory.mktemp("hostile")
    text = " ".join(f"{a} plus {b} is {a + b}." for a in range(40) for b in range(40))
    tokenizer = train_tokenizer(
        text, ["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", False, root / "tok"
    )
    from lmforge.data.indexed import IndexedDatasetWriter

    corpus = root / "corpus" / "text_document"
    corpus.parent.mkdir()
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(corpus, np.uint16) as writer:
        for _ in range(64):
            writer.add_document(rng.integers(1, 300, int(rng.integers(20, 80))))
    assert main(["pretrain", "/dev/null", *train_args(corpus, tokenizer, root / "run")]) == 0
    return root / "run"


def train_args(
    corpus: Path, tokenizer: Path, run_dir: Path, steps: int = 4, *extra: str
) -> list[str]:
    return [
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_length=32",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "trainer.precision=fp32",
        "trainer.device=cpu",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        f"run_dir={run_dir}",
        "cost.peak_flops=1e11",
        *extra,
    ]


def test_the_fixtures_run_their_code_under_torchs_own_reader(run, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "ran"
    bad = hostile_metadata(run / "checkpoints" / STEP, tmp_path / "meta", marker)
    assert FileSystemReader(str(bad)).read_metadata().state_dict_metadata
    assert marker.read_text() == "ran"
    marker.unlink()
    bad = hostile_item(run / "checkpoints" / STEP, tmp_path / "item", marker)
    state: dict = {}
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    dcp.load(state, checkpoint_id=str(bad), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert marker.read_text() == "ran"


def test_hostile_metadata_is_refused_by_name_before_anything_runs(run, tmp_path):
    marker = tmp_path / "ran"
    bad = hostile_metadata(run / "checkpoints" / STEP, tmp_path / "bad", marker)
    with pytest.raises(
        UserError, match=r"^checkpoint metadata '.*/bad/\.metadata' names builtins\.eval, which DCP"
    ):
        read_metadata(bad)
    assert not marker.exists()


@pytest.mark.parametrize(
    "module,name",
    [
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("torch", "Size.__reduce_ex__"),
        ("pathlib", "Path.write_text"),
        ("torch.distributed.checkpoint.metadata", "pickle"),
        ("torch", "_C"),
    ],
)
def test_each_callable_outside_the_metadata_classes_is_refused(module, name, tmp_path):
    (tmp_path / METADATA).write_bytes(b"\x80\x04" + pickle_global(module, name))
    with pytest.raises(UserError, match=re.escape(f"names {module}.{name}, which")):
        read_metadata(tmp_path)


def pickle_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle body that looks up module.name and calls it with ('x',)."""
    return (
        b"\x8c"
        + bytes([len(module)])
        + module.encode()
        + b"\x8c"
        + bytes([len(name)])
        + name.encode()
        + b"\x93\x8c\x01x\x85R."
    )


def test_hostile_optimizer_item_is_refused_on_load(run, tmp_path):
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    from lmforge.dcp_read import CheckedBytes

    # reads every item, the optimizer's too
    class EveryItem(CheckedBytes, _EmptyStateDictLoadPlanner):
        folder = tmp_path / "bad"

    marker = tmp_path / "ran"
    bad = hostile_item(run / "checkpoints" / STEP, tmp_path / "bad", marker)
    read_metadata(bad)  # the metadata itself is torch's own
    with pytest.raises(
        UserError, match=r"item 'optim\.param_groups\..*\.lr' names builtins\.eval, which lmforge"
    ):
        load_state({}, bad, EveryItem())
    assert not marker.exists()


def test_hostile_tensor_item_is_refused_in_one_line(run, tmp_path):
    marker = tmp_path / "ran"
    bad = hostile_tensor(run / "checkpoints" / STEP, tmp_path / "bad", marker)
    meta = read_metadata(bad)
    state = {
        k: torch.zeros(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(m, "size")
    }
    with pytest.raises(
        UserError,
        match=r"^checkpoint '.*/bad' holds a tensor item that names builtins\.eval, which",
    ):
        load_state(state, bad)
    assert not marker.exists()
    from lmforge.models.source import load_pretrained

    with pytest.raises(UserError, match="holds a tensor item that names builtins.eval"):
        load_pretrained(bad)


def test_a_good_checkpoint_loads_through_the_checked_reader_as_through_torchs(run):
    import torch.distributed.checkpoint as dcp

    folder = run / "checkpoints" / STEP
    meta = read_metadata(folder)
    ours = {
        k: torch.zeros(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(m, "size")
    }
    theirs = {k: torch.zeros_like(t) for k, t in ours.items()}
    load_state(ours, folder)
    dcp.load(theirs, checkpoint_id=str(folder), no_dist=True)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(t.abs().sum() > 0 for t in ours.values())


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "empty", "not metadata"])
def test_damaged_metadata_is_one_line_naming_the_file(run, tmp_path, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / STEP, folder)
    data = (folder / METADATA).read_bytes()
    if damage == "missing":
        (folder / METADATA).unlink()
    elif damage == "truncated":
        (folder / METADATA).write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        (folder / METADATA).write_bytes(data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    elif damage == "empty":
        (folder / METADATA).write_bytes(b"")
    else:
        (folder / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UserError) as e:
        read_metadata(folder)
    line = str(e.value)
    assert "\n" not in line and str(folder) in line, line


@pytest.mark.parametrize(
    "name", ["../outside.distcp", "/etc/passwd", "sub/dir.distcp", "..", "link.distcp"]
)
def test_a_storage_entry_outside_the_folder_is_refused(run, tmp_path, name):
    folder = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / STEP, folder)
    (tmp_path / "secret").write_text("secret")
    if name == "link.distcp":
        (folder / name).symlink_to(tmp_path / "secret")
    meta = read_metadata(folder)
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = name
    meta.storage_meta.load_id = None
    (folder / METADATA).write_bytes(pickle.dumps(meta))
    with pytest.raises(UserError, match=r"names the file .* outside the checkpoint folder"):
        read_metadata(folder)


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("vocab_size", 10**12, "declares a model of"),
        ("num_layers", 10**6, "declares a model of"),
        ("hidden_size", "64", "expected an integer"),
        ("num_layers", 2.5, "expected an integer"),
    ],
)
def test_a_checkpoints_absurd_config_is_one_line_before_anything_is_built(
    run, tmp_path, key, value, said
):
    from lmforge.models.source import load_pretrained

    folder = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / STEP, folder)
    config = json.loads((folder / "lmforge.json").read_text())
    config["model"][key] = value
    (folder / "lmforge.json").write_text(json.dumps(config))
    reseal(folder)
    with pytest.raises(UserError, match=said) as e:
        load_pretrained(folder)
    assert "\n" not in str(e.value)


# --- every verb that reads a checkpoint (through the CLI, as a user runs it)
# ----------------------------------


def _cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )


def _refused(r: subprocess.CompletedProcess, marker: Path, what: str) -> None:
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint") and what in last, r.stderr[-3000:]
    assert not marker.exists(), "the checkpoint's code ran"


VERBS = ["generate", "serve", "export-hf", "eval", "init_from", "resume"]


@pytest.mark.slow
@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_refuses_hostile_metadata_and_runs_nothing(run, tmp_path, verb, shared_data):
    marker = tmp_path / "ran"
    good = run / "checkpoints" / STEP
    if verb == "resume":
        run_dir = tmp_path / "run"
        shutil.copytree(run, run_dir)
        bad = run_dir / "checkpoints" / STEP
        shutil.rmtree(bad)
        hostile_metadata(good, bad, marker)
    else:
        bad = hostile_metadata(good, tmp_path / STEP, marker)
    r = _verb(verb, bad, tmp_path, run, shared_data)
    _refused(r, marker, "names builtins.eval")
    _nothing_written(verb, tmp_path)


@pytest.mark.slow
def test_resume_refuses_a_hostile_optimizer_item_and_runs_nothing(run, tmp_path, shared_data):
    marker = tmp_path / "ran"
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    bad = run_dir / "checkpoints" / STEP
    shutil.rmtree(bad)
    hostile_item(run / "checkpoints" / STEP, bad, marker)
    r = _verb("resume", bad, tmp_path, run, shared_data)
    _refused(r, marker, "eval, which lmforge does not unpickle")
    _nothing_written("resume", tmp_path)


def _verb(
    verb: str, checkpoint: Path, tmp_path: Path, run: Path, shared_data: Path
) -> subprocess.CompletedProcess:
    config = json.loads((run / "checkpoints" / STEP / "trainer.json").read_text())["run_config"]
    corpus, tokenizer = config["data"]["paths"][0], config["data"]["tokenizer"]
    if verb == "generate":
        return _cli(
            ["generate", str(checkpoint), "--prompt", "1 plus 2 is", "--max-new-tokens", "4"]
        )
    if verb == "serve":
        return _cli(["serve", str(checkpoint), "--port", "0"], timeout=120)
    if verb == "export-hf":
        return _cli(["export-hf", str(checkpoint), str(tmp_path / "out")])
    if verb == "eval":
        return _cli(
            [
                "eval",
                str(checkpoint),
                "--tasks",
                "sst2_local",
                "--data-dir",
                str(shared_data),
                "--limit",
                "2",
                "--output-path",
                str(tmp_path / "out" / "results.json"),
            ]
        )
    if verb == "init_from":
        return _cli(
            [
                "pretrain",
                "/dev/null",
                *train_args(corpus, tokenizer, tmp_path / "out", 2),
                f"model.init_from={checkpoint}",
                "model.preset=null",
            ]
        )
    return _cli(
        ["pretrain", "/dev/null", *train_args(corpus, tokenizer, checkpoint.parent.parent, 6)]
    )


def _nothing_written(verb: str, tmp_path: Path) -> None:
    if verb == "resume":
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [STEP]
    else:
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))
