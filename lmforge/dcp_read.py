"""Reading a torch.distributed.checkpoint (DCP) folder from anyone without running code hidden in
it.

torch's own reader unpickles a checkpoint's `.metadata` with plain `pickle` and its non-tensor items
with `torch.load(weights_only=False)`: a `.metadata` crafted to call `os.system` runs it before a
single tensor is read, whatever checksums sit beside it (whoever rewrites the metadata rewrites the
manifest too). Every lmforge read of a checkpoint goes through here instead:

- `.metadata` through an unpickler that admits only the classes DCP's metadata is made of (its
  dataclasses, `torch.Size`, dtypes, layouts, memory formats, paths); anything else is refused by
  name before it is built;
- the metadata's shape checked: its storage entries name plain files inside the folder (no `../`, no
  symlink out), with non-negative offsets and lengths;
- non-tensor items (the optimizer's hyperparameters) through `torch.load(weights_only=True)`,
  torch's own restricted unpickler, as the tensors already are.

Each refusal is one UserError naming the file and what it held.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from lmforge.errors import UserError

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a lookup by name
    ("collections", "OrderedDict"),
}
# StorageMeta.checkpoint_id is the path the writer saved to; it is rebuilt as a pure path (nothing
# touches the file system, and a Windows writer's path loads on Linux).
_PATHS = {
    "PosixPath": PurePosixPath,
    "PurePosixPath": PurePosixPath,
    "WindowsPath": PureWindowsPath,
    "PureWindowsPath": PureWindowsPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _PATHS[name]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format)
        ):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UserError(
            f"checkpoint metadata '{self.source}' names {module}.{name}, which DCP's metadata never "
            "holds: lmforge does not unpickle it and loaded nothing (the file was not written by "
            "torch.distributed.checkpoint, or was altered: use a checkpoint from a source you trust)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UserError(
            f"checkpoint metadata '{self.source}' holds a persistent reference, which DCP's metadata "
            "never does: lmforge loaded nothing from it"
        )


def read_metadata(folder: str | Path) -> Metadata:
    """The checked metadata of the DCP checkpoint in `folder` (a UserError naming the file when
    it is missing, damaged, names a class DCP's metadata does not use, or points outside the
    folder)."""
    folder = Path(folder)
    path = folder / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise UserError(
            f"checkpoint '{folder}' has no {METADATA} file: it is not a whole DCP checkpoint (a save "
            "that did not finish, or files copied in part): use another checkpoint of the run"
        ) from None
    except UserError:
        raise
    except (
        OSError,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        ImportError,
        MemoryError,
        RecursionError,
        OverflowError,
    ) as e:
        raise UserError(
            f"checkpoint metadata '{path}' is damaged ({type(e).__name__}: {_first_line(e)}): use "
            "another checkpoint of the run"
        ) from None
    _check_shape(metadata, folder, path)
    return metadata


def load_state(state: dict, folder: str | Path, planner: CheckedBytes | None = None) -> None:
    """dcp.load of `state` (filled in place) from `folder` through the checked reader and planner
    (another planner given has CheckedBytes mixed in). DCP's own failures come through as DCP
    raises them (the callers say which config to use); a refusal of the checkpoint's contents is
    its UserError, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = CheckpointReader(folder)
    # refused here, outside DCP's collectives, where it is hostile or damaged
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=planner or CheckpointLoadPlanner(folder))
    except (pickle.UnpicklingError, CheckpointException) as e:  # DCP gathers each rank's failure
        refusal = _refusal(e, Path(folder))
        if refusal is None:
            raise
        raise refusal from None


class CheckpointReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by `read_metadata` above (once; DCP asks
    again)."""

    def __init__(self, folder: str | Path):
        super().__init__(str(folder))
        self.folder = Path(folder)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not a layout lmforge writes
            raise UserError(
                f"checkpoint '{self.folder}' asks for per-rank metadata, which lmforge does not read"
            )
        if self._metadata is None:
            self._metadata = read_metadata(self.folder)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class CheckedBytes:
    """A DCP load planner's `load_bytes` with non-tensor items read by torch's weights-only
    unpickler (mixed in before the planner class; `folder` names the checkpoint in its refusals)."""

    folder: Path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(
                f"checkpoint '{self.folder}' item {fqn!r} {_unpickled_name(e)} lmforge does not "
                "unpickle: nothing was loaded (use a checkpoint from a source you trust)"
            ) from None
        except (RuntimeError, EOFError, ValueError) as e:
            raise UserError(
                f"checkpoint '{self.folder}' item {fqn!r} is damaged ({_first_line(e)}): use another "
                "checkpoint of the run"
            ) from None
        if self.flatten_state_dict:  # placed as DefaultLoadPlanner.load_bytes places it
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class CheckpointLoadPlanner(CheckedBytes, DefaultLoadPlanner):
    """DCP's default load planner with checked non-tensor items."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = Path(folder)


def _check_shape(metadata: Any, folder: Path, path: Path) -> None:
    """The metadata is DCP's Metadata, and every storage entry a plain file in `folder` at a sane
    place."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def bad(what: str) -> UserError:
        return UserError(
            f"checkpoint metadata '{path}' {what}: lmforge loaded nothing from it (use a checkpoint "
            "from a source you trust)"
        )

    if not isinstance(metadata, Metadata):
        raise bad(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
        metadata.storage_data, dict
    ):
        raise bad("is not laid out as DCP writes it")
    root = folder.resolve()
    seen: set[str] = set()
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad("has a storage entry that is not DCP's")
        name = info.relative_path
        if name not in seen:
            if (
                not isinstance(name, str)
                or not _plain_name(name)
                or not (folder / name).resolve().is_relative_to(root)
            ):
                raise bad(f"names the file {name!r}, outside the checkpoint folder")
            seen.add(name)
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise bad(f"gives {name!r} an offset or length that is not a non-negative integer")
    if metadata.storage_meta is None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()


def _plain_name(name: str) -> bool:
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..")
        and "\0" not in name
    )


def _refusal(e: BaseException, folder: Path) -> UserError | None:
    """Our UserError inside a CheckpointException (DCP wraps each rank's failure), or the one
    line for a tensor item that torch's weights-only unpickler refused."""
    failures = getattr(e, "failures", {0: e})
    for failure in failures.values():
        # (exception, its traceback summary)
        original = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(original, UserError):
            return original
        if isinstance(original, pickle.UnpicklingError):
            return UserError(
                f"checkpoint '{folder}' holds a tensor item that {_unpickled_name(original)} lmforge "
                "does not unpickle: nothing was loaded (use a checkpoint from a source you trust)"
            )
    return None


def _unpickled_name(e: pickle.UnpicklingError) -> str:
    """'names builtins.eval, which' from torch's weights-only refusal (which leaves builtins'
    module out)."""
    named = re.search(r"GLOBAL ([\w.]+)", str(e))
    if named is None:
        return "is not plain data, which"
    name = named.group(1)
    return f"names {name if '.' in name else 'builtins.' + name}, which"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
