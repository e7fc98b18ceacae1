"""Checkpoints seen as lazy name -> tensor lookups (HF-layout names), so no checkpoint is held twice in memory.

Every reader (safetensors folders, GGUF files, an in-memory state dict)
hands the loader one of these; `loading.convert_hf_state` then maps it into
our parameters whatever the file was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import Tensor

from stagedspec.errors import StagedSpecError, first_line


class TensorSource:
    """Lazy name -> tensor lookup, so a checkpoint is never held twice in memory."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str) -> Tensor:
        raise NotImplementedError


@dataclass
class DictSource(TensorSource):
    tensors: dict[str, Tensor]

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> Tensor:
        return self.tensors[name]


class SafetensorsSource(TensorSource):
    """One or more .safetensors files, opened lazily (memory-mapped by safetensors)."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        self._handles = []
        for f in files:
            if not f.is_file():
                raise StagedSpecError(f"missing weights file {f}")
            try:
                handle = safe_open(str(f), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:
                raise StagedSpecError(
                    f"cannot read {f}: not a valid safetensors file, corrupt or truncated ({first_line(exc)})"
                ) from None
            self._handles.append(handle)
            self._where.update({k: (handle, f) for k in keys})

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsSource":
        single = folder / "model.safetensors"
        index = folder / "model.safetensors.index.json"
        if single.is_file():
            return cls([single])
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise StagedSpecError(f"cannot read {index}: {first_line(exc)}") from None
            return cls([folder / name for name in sorted(set(weight_map.values()))])
        raise StagedSpecError(f"no model.safetensors or model.safetensors.index.json in {folder}")

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> Tensor:
        handle, f = self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise StagedSpecError(f"cannot read tensor {name!r} from {f}: {first_line(exc)}") from None


class FunctionSource(TensorSource):
    """Tensors produced on demand by callables (used for GGUF dequantisation)."""

    def __init__(self, makers: dict[str, Callable[[], Tensor]]) -> None:
        self._makers = makers

    def names(self) -> set[str]:
        return set(self._makers)

    def get(self, name: str) -> Tensor:
        return self._makers[name]()


def compose(load: Callable[[], Tensor], fn: Callable[[Tensor], Tensor]) -> Callable[[], Tensor]:
    """`load` followed by `fn`, still lazy: a reader's layout fix (a transpose, a row order) runs only when read."""
    return lambda: fn(load())
