"""Lazy, safe reading of the tensors in a Hugging Face folder."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.fsutil import folder_file, open_safetensors, read_weight_map

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class HFWeights:
    """Lazy read access to the tensors of an HF folder: safetensors or weights-only pickles,
    single files or sharded with an index."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for index_name in INDEXES:
            index = folder / index_name
            if index.exists():
                self._where = read_weight_map(index)
                break
        else:
            for name in WEIGHT_FILES:
                if (folder / name).exists():
                    path = folder_file(folder, name)
                    self._where = {k: path for k in self._keys_of(path)}
                    break
        if not self._where:
            raise UserError(
                f"no weights in '{folder}': expected model.safetensors, pytorch_model.bin or a sharded index"
            )

    def _file(self, path: Path):
        if path not in self._open:
            if path.suffix == ".safetensors":
                self._open[path] = open_safetensors(path)
            else:
                self._open[path] = _load_weights_only(path)
        return self._open[path]

    def _keys_of(self, path: Path) -> list[str]:
        return list(self._file(path).keys())

    def keys(self) -> list[str]:
        return list(self._where)

    def nbytes(self) -> int:
        """Bytes of the weight files (headers included)."""
        return sum(p.stat().st_size for p in set(self._where.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        f = self._file(self._where[name])
        return f.get_tensor(name) if hasattr(f, "get_tensor") else f[name]


def _load_weights_only(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"'{path}' is not a weights-only PyTorch file ({first}); lmforge never unpickles arbitrary "
            "objects: convert it to safetensors with a tool you trust"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"'{path}' does not hold a flat name -> tensor state dict")
    return state


class Source:
    """What an adapter reads from: shape-checked tensors by name, and which names it used."""

    def __init__(self, weights: HFWeights, aliases: Callable[[str], list[str]] | None = None):
        self.weights = weights
        self.used: set[str] = set()
        self._aliases = aliases or (lambda name: [])

    def has(self, name: str) -> bool:
        return any(n in self.weights for n in [name, *self._aliases(name)])

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        for candidate in [name, *self._aliases(name)]:
            if candidate in self.weights:
                t = self.weights.get(candidate)
                if tuple(t.shape) != shape:
                    raise UserError(
                        f"tensor '{candidate}' has shape {tuple(t.shape)} in the checkpoint but config.json "
                        f"implies {shape}: the weights do not belong to this config"
                    )
                self.used.add(candidate)
                return t
        stacked = next(
            (
                k
                for k in self.weights.keys()
                if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
            ),
            None,
        )
        # transformers 5's in-memory layout, saved as it is (a state_dict, not
        # save_pretrained)
        if stacked is not None:
            raise UserError(
                f"'{self.weights.folder}' holds its experts stacked ('{stacked}'), as transformers 5 "
                "keeps them in memory; the published layout has one tensor per expert: save the model "
                "with save_pretrained, which writes that, and import the folder it writes"
            )
        raise UserError(
            f"tensor '{name}' is missing from the checkpoint in '{self.weights.folder}'"
        )
