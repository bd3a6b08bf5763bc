"""Save and resume training with torch.distributed.checkpoint (DCP).

    RUN_DIR/checkpoints/step-00000100/   DCP shards of model + optimizer (any data/FSDP layout)
                        .../trainer.json step, consumed samples, monitored metric, skip counters
                        .../rng-rank0.json python/numpy/torch RNG states of each rank
                        .../lmforge.json the model config (so the folder says what it holds)
                        .../chat_template.jinja the template a fine-tuning run rendered its examples with
                        .../tokenizer.json ... a copy of the run's tokenizer files (lmforge.train.checkpointing)

                        .../checksums.json size and SHA-256 of every other file

Each checkpoint is written under `.step-N.tmp` and renamed when complete: a crash at any moment
leaves either the previous set of checkpoints or the new one, never a torn folder. Retention keeps
the `save_top_k` best by the monitored metric plus the newest (`save_last`; a run stopped before its
end keeps its stop's checkpoint until a newer one is written, whatever save_last says):
lmforge.checkpoint.retention, which deletes by renaming to `.step-N.deleting` first. A resume first
removes such leftovers and `.step-N.tmp`, then takes the newest checkpoint whose files match their
checksums: one that does not is renamed `step-N.corrupt` with a warning. A full disk is found before
writing where it can be (the state's bytes against the free bytes) and is one UserError either way,
with the temporary folder removed.

With `async_save`, save() returns once DCP has copied the state aside
(torch.distributed.checkpoint.async_save), and the write goes on in a thread while training
continues. The same guarantees hold: the folder is renamed into place, its checksums written and
retention run only after every rank's write has finished; a kill meanwhile leaves `.step-N.tmp`
beside the previous checkpoints; one save at a time (the next waits for the one in flight); wait()
finishes it and raises its failure, the same on every rank.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lmforge.checkpoint.hold import hold_for_test
from lmforge.checkpoint.retention import LEFTOVER, NAME, Retention
from lmforge.checkpoint.rng import rng_state, set_rng_state
from lmforge.dcp_read import load_state
from lmforge.errors import UserError
from lmforge.fsutil import CHECKSUMS, atomic_write, checksum_problems, file_checksums, out_of_space
from lmforge.models.config import ModelConfig
from lmforge.models.io import write_config
from lmforge.models.source import dcp_error_line, load_checkpoint_model, one_process_quietly

log = logging.getLogger(__name__)

DISK_FIX = "free space there, keep fewer checkpoints (checkpoint.save_top_k) or set run_dir on a larger disk"
# One process without a process group is a normal way to run: DCP need not warn about it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """`obj` of every rank, in rank order (small Python values: errors, checksums, byte counts)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _tensors(obj: Any, key: str = "") -> Any:
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{key}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{key}.{i}")


# DCP writes each tensor as its own torch.save record: ~1.3 KB of zip and pickle around the data
# (measured).
RECORD_BYTES = 1024


def checkpoint_bytes(state: dict) -> int:
    """At least the bytes a DCP save of `state` writes, over all ranks: each name once at its
    global size (DTensors report it; replicas of a plain tensor are written once), plus its
    record's frame."""
    sizes: dict[str, int] = {}
    for rank_sizes in _gather(
        {k: t.numel() * t.element_size() + RECORD_BYTES for k, t in _tensors(state)}
    ):
        sizes.update(rank_sizes)
    return sum(sizes.values())


class CheckpointManager(Retention):
    def __init__(
        self,
        root: Path,
        save_top_k: int = 1,
        monitor: str = "val_loss",
        mode: str = "min",
        save_last: bool = True,
        async_save: bool = False,
    ):
        """Every rank builds it, at the same point (with `async_save` it creates a process
        group)."""
        self.root = Path(root)
        self.save_top_k, self.monitor, self.mode, self.save_last = (
            save_top_k,
            monitor,
            mode,
            save_last,
        )
        self._said_unmonitored = False
        self.async_save = async_save
        self._in_flight: Future | None = None
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="lmforge-checkpoint") if async_save else None
        )
        # The write's thread talks to the ranks while training uses the default group: one group
        # would interleave them (gloo aborts). Gloo is also async_save's CPU backend beside NCCL.
        self._group = (
            dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        )

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first (a `step-N` without trainer.json is what an older
        lmforge's interrupted deletion left: not a checkpoint)."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := NAME.match(p.name)) and (p / "trainer.json").is_file()
        ]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    # -- writing ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict,
        model_config: ModelConfig,
        side_files: dict[str, str | bytes] | None = None,
        resume_point: bool = False,
    ) -> Path | None:
        """Write checkpoint `step` (every rank calls this), with rank 0's `side_files` (name ->
        text or bytes) beside it. With `async_save` it returns once the state is copied aside:
        the folder appears under the returned name when the write in the background is done
        (wait()). A `resume_point` (written because the run stops before its end) outlives
        retention until a newer checkpoint is written, whatever save_last says: it is where the
        rerun goes on. None, and nothing written, where retention would delete it at once
        (dropped_at_once)."""
        self.wait()  # at most one save in flight
        if self.dropped_at_once(step, trainer_state.get("metrics") or {}, resume_point):
            return None
        hold_for_test("save", step, _rank())
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".step-{step:08d}.tmp"
        model_sd, optim_sd = self.state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        needed = checkpoint_bytes(state)
        error: BaseException | None = None
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                free = shutil.disk_usage(tmp).free
                # known before a byte is written: say so rather than fill the disk
                if free < needed:
                    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                error = e
        self._agree(error, final, tmp, needed)
        # The files beside the tensors, as of now: training goes on while an async write does.
        files = {f"rng-rank{_rank()}.json": json.dumps(rng_state())}
        if _rank() == 0:
            files["trainer.json"] = json.dumps(trainer_state, indent=2) + "\n"
            files.update(side_files or {})
        if self._writer is None:
            try:
                with one_process_quietly():
                    dcp.save(state, checkpoint_id=str(tmp))
                error = None
            # DCP gathers every rank's failure into a CheckpointException, a BaseException (not an
            # Exception).
            except (Exception, CheckpointException) as e:
                error = e
            self._seal(error, final, tmp, needed, files, model_config, resume_point=resume_point)
            return final
        # only the arguments every torch since 2.6 takes; it copies the state (staging)
        # before returning
        try:
            written, error = (
                dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group),
                None,
            )
        except (Exception, CheckpointException) as e:
            written, error = None, e
        self._agree(error, final, tmp, needed)
        self._in_flight = self._writer.submit(
            self._seal_written, written, final, tmp, needed, files, model_config, resume_point
        )
        return final

    def dropped_at_once(self, step: int, metrics: dict, resume_point: bool) -> bool:
        """Whether retention would delete checkpoint `step`, with these metrics, as soon as it
        were written (Retention.would_drop): then it is not written (as Lightning's
        ModelCheckpoint skips it), rank 0 deciding for all ranks, and retention runs as it would
        have."""
        if resume_point or self.save_last or self.save_top_k < 0:
            return False
        drop = _rank() == 0 and self.would_drop(step, metrics)
        if drop:
            # as after a save: a stop's checkpoint was kept until a newer one came
            self._apply_retention()
        return bool(_gather(drop)[0])

    def kept(self, path: Path | None) -> bool:
        """Whether checkpoint `path` is in place (written, and not since dropped by retention),
        as rank 0 sees it: every rank the same answer (a save is collective)."""
        return bool(_gather(path is not None and _rank() == 0 and path.is_dir())[0])

    def wait(self) -> None:
        """Return once the save in flight (if any) is in place under its name; its failure is
        raised here, on every rank alike (a UserError where the user can fix it, such as a full
        disk)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """wait(), for a run already ending on an error: a failure of the save is logged, not
        raised over it."""
        try:
            self.wait()
        except (Exception, CheckpointException) as e:
            log.error("the checkpoint being written when the run stopped failed too: %s", e)

    def _seal_written(
        self,
        written: Future,
        final: Path,
        tmp: Path,
        needed: int,
        files: dict[str, str | bytes],
        model_config: ModelConfig,
        resume_point: bool,
    ) -> None:
        """The writer thread: once DCP's write has finished on every rank (its future), seal the
        folder."""
        try:
            written.result()
            error = None
        except (Exception, CheckpointException) as e:
            error = e
        self._seal(error, final, tmp, needed, files, model_config, self._group, resume_point)

    def _seal(
        self,
        error: BaseException | None,
        final: Path,
        tmp: Path,
        needed: int,
        files: dict[str, str | bytes],
        model_config: ModelConfig,
        group: dist.ProcessGroup | None = None,
        resume_point: bool = False,
    ) -> None:
        """After DCP's write (failed with `error`, or not): the files beside the tensors, the
        checksums of all (each rank hashes a share, read back while still in the page cache), the
        rename into place and retention."""
        if error is None:
            try:
                for name, content in files.items():
                    (tmp / name).write_bytes(
                        content if isinstance(content, bytes) else content.encode()
                    )
                if _rank() == 0:
                    write_config(tmp, model_config)
            except Exception as e:
                error = e
        self._agree(error, final, tmp, needed, group=group)
        hold_for_test("written", int(NAME.match(final.name).group(1)), _rank())
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        try:
            checksums, error = file_checksums(tmp, names[_rank() :: _world()]), None
        except OSError as e:
            checksums, error = {}, e
        shares = self._agree(error, final, tmp, needed, checksums, group)
        if _rank() == 0:
            try:
                found = {k: v for share in shares for k, v in share.items()}
                atomic_write(
                    tmp / CHECKSUMS,
                    json.dumps({"format": 1, "files": dict(sorted(found.items()))}, indent=1)
                    + "\n",
                )
                if final.exists():  # a rerun reached the same step again
                    self._delete(final)
                os.replace(tmp, final)
                log.info("saved checkpoint %s", final)
                hold_for_test("renamed", int(NAME.match(final.name).group(1)), _rank())
                self._apply_retention(final if resume_point else None)
                error = None
            except OSError as e:
                error = e
        self._agree(error, final, tmp, needed, group=group)

    def _agree(
        self,
        error: BaseException | None,
        final: Path,
        tmp: Path,
        needed: int,
        payload: Any = None,
        group: dist.ProcessGroup | None = None,
    ) -> list[Any]:
        """Every rank's `payload`, once no rank failed; where one did, every rank raises (a rank
        going on alone would wait at the next collective forever) after rank 0 removed the
        temporary folder: a full disk is one line with the bytes needed and free (counted once
        the folder is gone). `group`: the writer thread's."""
        got = _gather(
            (None if error is None else f"{type(error).__name__}: {error}", payload), group
        )
        if all(e is None for e, _ in got):
            return [p for _, p in got]
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(group)
        mine = (
            None
            if error is None
            else (
                error
                if isinstance(error, UserError)
                else out_of_space(error, final, needed, fix=DISK_FIX)
            )
        )
        lines = _gather(None if mine is None else str(mine), group)
        if mine is not None:
            raise mine from None
        if error is not None:
            raise error
        for line in lines:  # another rank's full disk: the same line on this rank
            if line is not None:
                raise UserError(line)
        rank, text = next((r, e) for r, (e, _) in enumerate(got) if e is not None)
        raise UserError(f"writing checkpoint '{final}' failed on rank {rank}: {text}")

    # -- reading ------------------------------------------------------------------------------

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        check: Callable[[Path], None] | None = None,
    ) -> tuple[Path, dict] | None:
        """Restore the newest intact checkpoint (model, optimizer, RNG) in place: (its path, the
        trainer state), or None where there is none yet. Leftovers of interrupted saves and
        deletions are removed first; a checkpoint whose files do not match its checksums is
        renamed `step-N.corrupt` with a warning and the one before it is taken; where no
        checkpoint is intact, a UserError names the damaged file. `check(path)` runs on every
        rank before the chosen checkpoint is loaded (the trainer compares configs there)."""
        if _rank() == 0:
            self.clean()
        _barrier()
        bad, good = [], None
        for _, path in reversed(self.checkpoints()):
            problem = self.verify(path)
            if problem is None:
                good = path
                break
            bad.append((path, problem))
        if bad and good is None:
            others = f" (and {len(bad) - 1} older checkpoint(s) likewise)" if len(bad) > 1 else ""
            raise UserError(
                f"no intact checkpoint to resume from: {bad[0][1]}{others}: move the damaged checkpoint "
                f"away to start the run from scratch"
            )
        if _rank() == 0:
            for path, problem in bad:
                aside = _free_name(path.with_name(path.name + ".corrupt"))
                os.replace(path, aside)
                log.warning(
                    "checkpoint %s is damaged: %s; moved to %s, resuming from %s",
                    path.name,
                    problem,
                    aside.name,
                    good.name,
                )
        _barrier()
        if good is not None and check is not None:
            check(good)
        return None if good is None else (good, self.load(good, model, optimizer))

    def verify(self, path: Path) -> str | None:
        """What is wrong with checkpoint `path` (the first damaged file), or None where its files
        match the checksums written with it. The ranks read the files together. A checkpoint
        written before checksums were passes, with a warning."""
        try:
            mine = checksum_problems(path, _rank(), _world())
        except UserError as e:  # the manifest itself is damaged
            return str(e)
        if mine is None:
            if _rank() == 0:
                log.warning(
                    "checkpoint %s has no %s (written by an older lmforge): its files are not verified",
                    path,
                    CHECKSUMS,
                )
            return None
        problems = [p for share in _gather(mine) for p in share]
        return problems[0] if problems else None

    def clean(self) -> None:
        """Remove what interrupted saves and deletions left: `.step-N.tmp`, `.step-N.deleting`,
        and `step-N` folders without trainer.json (an older lmforge deleted checkpoints in
        place). Call it where no other run writes this folder."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            if LEFTOVER.match(path.name) or (
                NAME.match(path.name) and not (path / "trainer.json").is_file()
            ):
                log.warning("removing %s, left by an interrupted checkpoint save or deletion", path)
                self._delete(path)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Restore model (+ optimizer, RNG) in place; return the trainer state."""
        model_sd, optim_sd = self.state_dicts(model, optimizer, path)
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        try:
            with one_process_quietly():
                load_state(state, path)
        except UserError:  # the checkpoint's contents refused (lmforge.dcp_read)
            raise
        # Across processes DCP gathers the ranks' failures into a CheckpointException (a
        # BaseException); in one process the planner's own ValueError/RuntimeError comes through.
        except (Exception, CheckpointException) as e:
            raise UserError(
                f"checkpoint '{path}' does not fit this model/optimizer ({dcp_error_line(e)}): resume "
                "with the config it was written with"
            ) from None
        self.load_state_dicts(model, optimizer, state["model"], state.get("optim"), path)
        rng = path / f"rng-rank{_rank()}.json"
        if rng.exists():
            set_rng_state(json.loads(rng.read_text()))
        return json.loads((path / "trainer.json").read_text())

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: Path | None = None
    ) -> tuple[dict, dict | None]:
        """(model, optimizer) state dicts to save, or to load a checkpoint (`path`) into in
        place. A subclass changes how they are laid out (the trainer's, for tensor- and
        pipeline-parallel models)."""
        if optimizer is None:
            return get_state_dict(model, [])[0], None
        return get_state_dict(model, optimizer)

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict,
        optim_sd: dict | None,
        path: Path | None = None,
    ) -> None:
        """Copy state dicts filled by dcp.load into the model and optimizer."""
        if optim_sd is None:
            set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        else:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3` ... whichever does not exist yet."""
    k, out = 2, path
    while out.exists():
        out, k = path.with_name(f"{path.name}-{k}"), k + 1
    return out


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model part of a training checkpoint (fine-tuning / continued pretraining)."""
    sd = get_state_dict(model, [], options=StateDictOptions())[0]
    load_checkpoint_model(sd, path)
    set_state_dict(model, [], model_state_dict=sd, optim_state_dict={})
