"""Writes that never leave a half-written result under the final name; checksums of what was
written; one line for a full disk, or for a weights file that cannot be read."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import resource
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmforge.errors import UserError

# What atomic_write and atomic_dir leave when killed: `.NAME.tmp-PID` (the new NAME being written)
# and `.NAME.old-PID` (the previous NAME, between the two renames that replace it).
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(
    folder: str | Path, name: str | None = None, only_dead: bool = True
) -> list[Path]:
    """Remove what a killed atomic_write or atomic_dir left in `folder` (only those for `name`,
    where given): `.NAME.tmp-PID`, and `.NAME.old-PID`, which is renamed back to NAME where NAME
    is gone (the kill came between moving the old NAME aside and putting the new one in its
    place). `only_dead`: only those of processes no longer running here; False where nothing else
    can be writing the folder (a held run folder). Returns what was removed or restored."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for path in sorted(folder.iterdir()):
        m = LEFTOVER.match(path.name)
        if (
            not m
            or (name is not None and m["name"] != name)
            or (only_dead and _running(int(m["pid"])))
        ):
            continue
        final = folder / m["name"]
        if m["kind"] == "old" and not final.exists():
            path.rename(final)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        done.append(path)
    return done


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary sibling renamed over it: a reader (or a crash)
    sees the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(
    final: str | Path, overwrite: bool = False, needed: int | None = None
) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it is renamed to `final`.

    On any exception the temporary directory is removed and `final` is untouched; a full disk is one
    UserError naming `final`, the bytes needed (`needed`, where the caller knows them, else those
    written before it failed) and the bytes free. Where fewer than `needed` bytes are free, that
    error comes before any write.
    """
    final = Path(final)
    remove_leftovers(final.parent, final.name)  # of an earlier write of `final` that was killed
    if final.exists() and not overwrite and (final.is_file() or any(final.iterdir())):
        raise UserError(
            f"output '{final}' already exists and is not empty: choose another path or pass --overwrite"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if needed is not None and shutil.disk_usage(tmp).free < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        yield tmp
    except BaseException as e:
        written = folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        full = out_of_space(e, final, needed, written) if isinstance(e, Exception) else None
        if full is not None:
            raise full from None
        raise
    _umask_modes(tmp)
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _umask_modes(folder: Path) -> None:
    """Give the files in `folder` the modes the user's umask gives a new file: safetensors writes
    its files owner-only (0600), so an export colleagues on a shared cluster should read was
    readable by no one else."""
    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    for f in folder.rglob("*"):
        if f.is_file() and not f.is_symlink() and f.stat().st_mode & 0o777 != mode:
            f.chmod(mode)


# -- files a model folder names ------------------------------------------------------------------


def folder_file(folder: str | Path, name: str | Path) -> Path:
    """`folder/name`: a file read by name from a model folder (a shard an index names, a
    tokenizer, chat template, generation or license file), where it resolves inside `folder`; a
    UserError naming it and where it points where it leads outside (`../`, an absolute name, a
    symlink), so that a folder from someone else cannot have lmforge read a file of this machine,
    or copy one into an export. A link that stays inside the folder reads nothing the folder does
    not hold: it is followed. A Hugging Face cache snapshot (models--ORG--NAME/snapshots/REV)
    holds links into its entry's blobs/ (`config.json -> ../../blobs/SHA`), which is what that
    layout is: those are followed too."""
    folder = Path(folder)
    path = folder / name
    try:
        root, target = folder.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        raise UserError(
            f"'{path}' cannot be followed ({e}): replace the link by the file"
        ) from None
    if target.is_relative_to(root) or (
        _cache_snapshot(root)
        and target.parent == root.parent.parent / "blobs"
        and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    ):
        return path
    raise UserError(
        f"'{path}' points outside its folder, to '{target}': lmforge reads no file a model folder names "
        "outside it; copy that file into the folder if it belongs to the model"
    )


def _cache_snapshot(folder: Path) -> bool:
    """Whether `folder` (resolved) is a revision of a Hugging Face hub cache entry:
    models--ORG--NAME/snapshots/REV."""
    return folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")


def read_weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> the shard that holds it, from a sharded checkpoint's index
    (model.safetensors.index.json, pytorch_model.bin.index.json): each shard checked to be in the
    index's folder (folder_file) and there. A damaged index is one UserError naming it."""
    folder = index.parent
    folder_file(folder, index.name)
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(
            f"cannot read '{index}' as JSON ({e}): the index is damaged: copy it again"
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(
            f"'{index}' has no weight_map (tensor name -> shard file): it is not a checkpoint index: "
            "copy it again"
        )
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise UserError(
            f"'{index}' maps tensor '{bad[0]}' to {bad[1]!r}, not a shard file name: the index is damaged: "
            "copy it again"
        )
    shards = {name: folder_file(folder, name) for name in sorted(set(weight_map.values()))}
    missing = [name for name, path in shards.items() if not path.is_file()]
    if missing:
        raise UserError(
            f"'{index}' names {len(missing)} shard(s) missing in '{folder}', first '{missing[0]}': copy "
            "the folder again"
        )
    return {k: shards[v] for k, v in weight_map.items()}


# -- checksums -------------------------------------------------------------------------------------

CHECKSUMS = "checksums.json"


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks into one buffer (hashlib releases the GIL on
    them)."""
    digest, block = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def file_checksums(folder: Path, names: Iterable[str]) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of the named files of `folder`, what `CHECKSUMS` records."""
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
        for name in names
    }


def read_checksums(folder: Path) -> dict[str, dict] | None:
    """The files `folder/CHECKSUMS` records, or None where the folder has none (written before
    checksums were). A manifest that cannot be read is a UserError naming it."""
    path = Path(folder) / CHECKSUMS
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise ValueError("files is not a table")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"'{path}' is unreadable ({e})") from None
    return files


def checksum_problems(folder: Path, rank: int = 0, world: int = 1) -> list[str] | None:
    """What is wrong with the files `folder/CHECKSUMS` records (this rank's share: every
    `world`-th file from `rank`, so ranks read a large folder together), or None where the folder
    has no manifest."""
    files = read_checksums(folder)
    if files is None:
        return None
    names = sorted(files)[rank::world]
    return [p for name in names if (p := checksum_problem(folder, name, files[name])) is not None]


def checksum_problem(folder: Path, name: str, expected: dict) -> str | None:
    """What is wrong with `folder/name` against its manifest entry (missing, another size,
    another SHA-256), or None where it is intact. The size is compared first: a truncated file
    costs no read."""
    path = Path(folder) / name
    try:
        size = path.stat().st_size
        if size != expected["size"]:
            return f"'{path}' has {size} bytes, {expected['size']} were written"
        if file_sha256(path) != expected["sha256"]:
            return f"'{path}' does not match its SHA-256 in {CHECKSUMS} (the bytes changed after it was written)"
    except FileNotFoundError:
        return f"'{path}' is missing"
    except OSError as e:
        return f"'{path}' cannot be read ({e.strerror})"
    return None


# -- disk full
# ----------------------------------------------------------------------------------------

_FULL = {errno.ENOSPC, errno.EDQUOT}
# What a full disk looks like where the errno is lost on the way up: safetensors' Rust error, and
# torch's zip writer, which checks its position after a short write ("unexpected pos 704 vs 598").
_FULL_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded")
_LIMIT_TEXT = ("File too large", "FileTooLarge")
_SHORT_WRITE = "unexpected pos"


def open_safetensors(path: str | Path):
    """safetensors' safe_open of `path` (a context manager too); a damaged or truncated file is
    one UserError naming it, not safetensors' own exception."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"cannot read '{path}' ({e}): the file is damaged or incomplete: copy it again"
        ) from None


def _causes(e: BaseException) -> Iterator[BaseException]:
    """`e`, its causes and contexts, and the per-rank failures a DCP CheckpointException gathers."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [
                f[0] if isinstance(f, tuple) else f
                for f in failures.values()
                if isinstance(f, BaseException)
                or (isinstance(f, tuple) and f and isinstance(f[0], BaseException))
            ]


def _mb(n: int) -> str:
    return f"{n} bytes ({n / 1e6:.1f} MB)"


def out_of_space(
    e: BaseException,
    path: Path,
    needed: int | None = None,
    written: int | None = None,
    fix: str = "free some space or write elsewhere",
) -> UserError | None:
    """One line for a write that failed because the disk (or the file size limit, `ulimit -f`) is
    full: the path, the bytes needed and free; None for any other failure. Call it after removing
    what was written, so the free bytes are what the user can count on."""
    errnos = {c.errno for c in _causes(e) if isinstance(c, OSError)}
    text = " ".join(str(c) for c in _causes(e))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = (
        f"needs at least {_mb(needed)}"
        if needed is not None
        else f"needs more than the {_mb(written)} written"
        if written
        else "needs more space"
    )
    full = errnos & _FULL or any(s in text for s in _FULL_TEXT)
    size_limit = errno.EFBIG in errnos or any(s in text for s in _LIMIT_TEXT)
    # a short write, its errno lost: which limit?
    if _SHORT_WRITE in text and not (full or size_limit):
        full = limit == resource.RLIM_INFINITY or (needed is not None and free < needed)
        size_limit = not full
    if size_limit:
        return UserError(
            f"file size limit reached writing '{path}': it {need}, the limit (ulimit -f) is "
            f"{_mb(limit)} per file, {_mb(free)} free on that disk: raise the limit"
        )
    if full:
        return UserError(
            f"disk full writing '{path}': it {need}, {_mb(free)} free on that disk: {fix}"
        )
    return None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 where it is gone)."""
    return (
        sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        if Path(folder).exists()
        else 0
    )
