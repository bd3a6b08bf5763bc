"""One run per run folder: a lock file in RUN_DIR, held from before the resume's clean-up to the end
of the run.

A resume removes what interrupted saves left, assuming nobody else writes the folder; two runs on
one folder (a rerun while orphaned workers still train, the same command started twice) crash or
lose metrics. So the first run holds `RUN_DIR/run.lock` (its PID, host and start time inside); a
second one waits `trainer.lock_wait` seconds, then refuses in one line naming the holder.

The lock is a POSIX record lock (`fcntl.lockf`), not `flock`: the kernel ties it to the process, so
it goes exactly when the holder dies (kill -9 included), forked children (DataLoader workers) do not
inherit it and keep it past their parent, and NFS carries it between hosts. A lock file whose holder
is gone is stale: the next run takes it over with a warning naming the old holder. Under torchrun
rank 0 holds it and tells the other ranks whether it got it, so every rank goes on or stops
together.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from lmforge.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
# Where the file system has no locks (some Lustre or FUSE mounts): the run goes on unprotected, with
# a warning.
NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"PID {info['pid']} on host {info['host']} (since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its PID yet"


class RunLock:
    """`RUN_DIR/run.lock`, held by this process between `acquire` and `release`."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        # the run folder and the parents it took, where acquire made them
        self.made_dirs: list[Path] = []

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (False where the file system has no locks)."""
        return self.fd is not None

    def acquire(self, wait: float = 5.0, poll: float = 0.1) -> RunLock:
        """Take the lock, waiting up to `wait` seconds for a holder to end; a UserError names the
        holder."""
        deadline = time.monotonic() + wait
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(
                f"run_dir '{self.run_dir}' is a file: give a folder for the run (a new one, or a run's "
                "to resume it)"
            )
        while True:
            # (again where a holder that had made it empty removed it)
            if not self.run_dir.exists():
                # deepest first
                made = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
                try:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    # the parents it made before it failed
                    _remove_empty([p for p in made if p.is_dir()])
                    raise UserError(self.unwritable_line("cannot be created", e)) from None
                self.made_dirs = self.made_dirs or made  # the first making names them all
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if isinstance(e, FileNotFoundError) and not self.run_dir.is_dir():
                    continue  # a holder ending removed the folder it had made
                self.release()  # the folders it made, if any
                raise UserError(self.unwritable_line("cannot be written", e)) from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in NO_LOCKS:
                    log.warning(
                        "the file system of %s has no file locks (%s): nothing stops a second run from "
                        "writing this run folder at the same time",
                        self.run_dir,
                        e.strerror,
                    )
                    return self
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                if time.monotonic() >= deadline:
                    raise UserError(self.in_use_line(wait)) from None
                time.sleep(poll)
                continue
            # a holder ending removes the file: the one we locked must still be the
            # one named run.lock
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            break
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        # (a second Trainer in one process: no news)
        if previous.strip() and not self._mine(previous):
            log.warning(
                "taking over %s from %s, which ended without releasing it",
                self.path,
                _holder(previous),
            )
        mine = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (mine + "\n").encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def _mine(text: str) -> bool:
        try:
            info = json.loads(text)
            return info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        except (ValueError, KeyError, TypeError):
            return False

    def unwritable_line(self, what: str, e: OSError) -> str:
        cause = e.strerror or str(e)
        if e.errno == errno.ENOTDIR:  # a file where a folder of the path should be: name it
            blocking = next(
                (p for p in reversed(self.run_dir.parents) if p.exists() and not p.is_dir()), None
            )
            cause = f"'{blocking}' is a file, not a folder" if blocking is not None else cause
        return (
            f"run_dir '{self.run_dir}' {what}: {cause}: set run_dir to a folder this user can write"
        )

    def in_use_line(self, wait: float) -> str:
        try:
            # another process's lock: reading it cannot release ours (we hold none)
            text = self.path.read_text()
        except OSError:
            text = ""
        return (
            f"run folder '{self.run_dir}' is in use by another run, {_holder(text)}, still running after "
            f"{wait:g} s (trainer.lock_wait): wait for it to end or stop it, or set run_dir to another folder"
        )

    def release(self) -> None:
        """Remove the lock file, then let go of it (in that order: a run waiting on the old file
        sees it gone and tries again). A run folder this lock created and nothing else filled is
        removed too, with the parents made for it (runs/ of runs/x), so a run that failed before
        writing leaves nothing."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        made, self.made_dirs = self.made_dirs, []
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders`, deepest first, up to the first that is not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        # the run wrote something there (or another run did): it stays, and so do its
        # parents
        except OSError:
            break


def hold_run_dir(run_dir: str | Path, wait: float) -> RunLock | None:
    """Rank 0 takes the run folder's lock (the other ranks get None); every rank raises the same
    UserError where it could not, so all ranks stop together."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire(wait)
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UserError(error)
    return lock
