"""Turn a user's model spec (`"default"`, a named model, an HF folder, a `.gguf`) into the files it names.

Why its own module, below the loader: resolving a spec converts or joins
the packaged GGUFs into the cache (`default`, `named`), and deciding a
spec's quantisation (`quant.resolve_quant`) looks at those files before any
model is loaded; the loader (`loading`) and `quant` both start from here.
"""

from __future__ import annotations

from pathlib import Path

from stagedspec.errors import StagedSpecError
from stagedspec.models.default import default_model_dir, ensure_hf_folder, gguf_cache_dir
from stagedspec.models.named import NAMED, named_model_dir


def resolve_model_path(spec: str | Path) -> Path:
    """Turn a user's model spec into an existing folder or .gguf file, or say what is wrong."""
    if str(spec) == "default":
        return default_model_dir()
    if str(spec) in NAMED:
        return named_model_dir(str(spec))
    path = Path(spec).expanduser()
    if not path.exists():
        raise StagedSpecError(f"model path does not exist: {path}")
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return path
    raise StagedSpecError(f"not a model folder or .gguf file: {path}")


def hf_folder_for(spec: str | Path) -> Path:
    """An HF-format folder transformers can load for `spec` (a GGUF is converted once into the cache).

    Used by reference tests and benchmarks that compare against transformers.
    """
    path = resolve_model_path(spec)
    if path.is_dir():
        return path
    return ensure_hf_folder(path, gguf_cache_dir(path))
