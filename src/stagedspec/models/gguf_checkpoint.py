"""A GGUF file as an HF checkpoint (`GGUFCheckpoint`), and the metadata and tensor helpers every GGUF reader uses.

Why apart from the readers themselves (`gguf_read` for Llama, Qwen2 and
GPT-2, `gemma3` for Gemma-3): `gguf_read.read_gguf` dispatches to Gemma-3's
reader, and that reader needs these same helpers, so they sit below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.models.gguf_codes import RawTensor
from stagedspec.models.gguf_file import open_gguf_file
from stagedspec.models.sources import TensorSource


@dataclass
class GGUFCheckpoint:
    """A GGUF file seen as an HF checkpoint: config dict + lazy HF-layout tensors."""

    reader: Any
    hf_config: dict[str, Any]
    source: TensorSource
    tensor_names: list[str] = field(default_factory=list)
    raw: dict[str, RawTensor] = field(default_factory=dict)  # HF name -> stored blocks, for 2-D weights


def open_gguf(path: Path) -> Any:
    """The GGUF file at `path` (`gguf_file.GGUFFile`: metadata decoded, tensors mapped), or a one-line error."""
    return open_gguf_file(path)


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as exc:
        raise StagedSpecError(f"corrupt GGUF metadata {key!r}: {first_line(exc)}") from None


def gguf_required(reader: Any, key: str) -> Any:
    value = gguf_value(reader, key)
    if value is None:
        raise StagedSpecError(f"GGUF file has no {key!r} metadata")
    return value


def tidy_float(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.9999997e-06); restore the intended decimal."""
    return float(f"{float(x):.7g}")


def gguf_tensor_loader(t: Any) -> Callable[[], Tensor]:
    """Dequantise one GGUF tensor to fp32, shaped [rows, cols] in PyTorch order."""
    from gguf.quants import dequantize

    def load() -> Tensor:
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise StagedSpecError(f"cannot dequantise GGUF tensor {t.name} ({t.tensor_type.name}): {first_line(exc)}") from None
        # GGUF lists dimensions fastest-first (ne order); PyTorch wants them reversed.
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        if not arr.flags.writeable or np.may_share_memory(arr, t.data):
            arr = arr.copy()  # still a view of the mapped file (an F32 tensor): own it
        return torch.from_numpy(arr)

    return load


def gguf_layer_name(name: str, per_layer: Mapping[str, str], layer_prefix: str = "model.layers.") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None for unknown tensors)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in per_layer:
        return None
    return f"{layer_prefix}{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"


def raw_tensor(t: Any) -> RawTensor | None:
    """A 2-D GGUF tensor's stored blocks (a view of the mapped file, nothing read), else None."""
    if len(t.shape) != 2:
        return None
    return RawTensor(t.tensor_type.name, t.data, int(t.shape[0]))
