"""A GGUF file's metadata and tensor table, read in well under a second; tensor data as views of the mapped file.

Why: `gguf.GGUFReader` turns every metadata value into numpy views as it
opens a file, one Python object per string; a 151,936-token vocabulary (the
Qwen2.5 models) makes that take 15-40 s on a 2-core machine, and loading a
model opened the file more than once.  This reader decodes the same format
with `struct` over one memory map: the strings of a vocabulary in a few
tenths of a second, every other value as it is, and each tensor's data as a
numpy view of the map (nothing is read until used).  It offers the parts of
`GGUFReader`'s interface the loaders use (`fields[key].contents()`,
`tensors[i].name / tensor_type / shape / data / n_bytes`).

Layout (GGUF v2/v3, little-endian): magic "GGUF", uint32 version, uint64
tensor count, uint64 key-value count; each key-value is a string key, a
uint32 value type and the value (arrays: uint32 element type, uint64 count,
elements; strings: uint64 length, UTF-8 bytes); then per tensor a string
name, uint32 dimension count, uint64 dimensions (fastest first), uint32 ggml
type, uint64 offset into the data section, which starts at the next multiple
of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stagedspec.errors import StagedSpecError

_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Field:
    """One metadata value, decoded (a number, a string, or a list of either)."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table.  `shape` is in GGUF order (fastest dimension first), as `GGUFReader` gives it."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    file: GGUFFile | None = None

    @property
    def tensor_type(self) -> Any:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.type_name]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def n_bytes(self) -> int:
        """Bytes the tensor's data takes in the file (quantised blocks as stored)."""
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // block * size

    @property
    def data(self) -> np.ndarray:
        """A view of the mapped file: rows in PyTorch order; quantised types as uint8 [..., bytes per row]."""
        if self.file is None:
            raise StagedSpecError(f"tensor {self.name}: read with the table only, no data")
        dims = list(reversed(self.shape)) or [1]
        if self.type_name in _PLAIN_DTYPES:
            dtype = np.dtype(_PLAIN_DTYPES[self.type_name])
        else:
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[self.tensor_type]
            dims[-1] = dims[-1] // block * size
            dtype = np.dtype(np.uint8)
        count = int(np.prod(dims, dtype=np.int64))
        start = self.file.data_start + self.offset
        return np.frombuffer(self.file.buffer, dtype=dtype, count=count, offset=start).reshape(dims)


class GGUFFile:
    """An open GGUF file: `fields` (key -> `Field`) and `tensors` (`TensorEntry` list, data mapped)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.fields, self.tensors, self.data_start = _parse(self.buffer, self)


def open_gguf_file(path: Path) -> GGUFFile:
    """The file at `path`, or a one-line `StagedSpecError` for anything that is not a readable GGUF."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError, struct.error, IndexError, UnicodeDecodeError, KeyError) as exc:
        raise StagedSpecError(f"cannot read {path}: not a valid GGUF file ({exc})") from None


def read_tensor_table(path: Path) -> list[TensorEntry]:
    """The tensors a GGUF file declares (names, shapes, types), for decisions made before loading."""
    return open_gguf_file(path).tensors


def _parse(buf: mmap.mmap, owner: GGUFFile) -> tuple[dict[str, Field], list[TensorEntry], int]:
    from gguf import GGMLQuantizationType

    if buf[:4] != b"GGUF":
        raise ValueError("bad magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    at = 24
    fields: dict[str, Field] = {}
    for _ in range(n_kv):
        key, at = _string(buf, at)
        (kind,) = struct.unpack_from("<I", buf, at)
        value, at = _value(buf, at + 4, kind)
        fields[key] = Field(value)
    tensors = []
    for _ in range(n_tensors):
        name, at = _string(buf, at)
        (dims,) = struct.unpack_from("<I", buf, at)
        shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
        at += 4 + 8 * dims
        ggml_type, offset = struct.unpack_from("<IQ", buf, at)
        at += 12
        type_name = GGMLQuantizationType(ggml_type).name
        tensors.append(TensorEntry(name, tuple(int(d) for d in shape), type_name, int(offset), owner))
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    data_start = -(-at // alignment) * alignment
    for t in tensors:
        if data_start + t.offset + t.n_bytes > len(buf):
            raise ValueError(f"tensor {t.name} runs past the end of the file (truncated?)")
    return fields, tensors, data_start


def _string(buf: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    end = at + 8 + n
    if end > len(buf):
        raise ValueError("truncated string")
    return buf[at + 8:end].decode("utf-8", errors="replace"), end


def _value(buf: mmap.mmap, at: int, kind: int) -> tuple[Any, int]:
    if kind in _FIXED:
        fmt = _FIXED[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buf, at)
    if kind == _ARRAY:
        inner, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if inner in _NUMPY:
            dtype = np.dtype(_NUMPY[inner]).newbyteorder("<")
            end = at + dtype.itemsize * count
            if end > len(buf):
                raise ValueError("truncated array")
            return np.frombuffer(buf, dtype=dtype, count=count, offset=at).tolist(), end
        items = []
        for _ in range(count):
            item, at = _value(buf, at, inner)
            items.append(item)
        return items, at
    raise ValueError(f"unknown metadata value type {kind}")
