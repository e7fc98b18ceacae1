"""What the machine in front of us is: its CPU's features, a fingerprint, and the dtype it runs best.

Speculation pays or loses by the hardware's cost of a multi-row pass, so the
choices that depend on it (`--dtype auto`, the cost curves behind `--method
auto`) are keyed by what this module reads, never by a hard-coded machine.
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache

import torch

# CPU flags (as /proc/cpuinfo spells them) that change which kernels PyTorch runs.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """PyTorch's own reading of the CPU's vector ISA (e.g. AVX2, AVX512, AVX512_BF16 on newer builds)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch builds have no such function
        return "unknown"


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run natively, so bf16 passes beat fp32 ones at any row count.

    Without them oneDNN emulates bf16 through fp32 conversions, and a pass over
    several rows costs far more than a one-row pass (the AVX2 figures in docs/benchmarks-history.md).
    """
    flags = cpu_flags()
    if any(f in flags for f in NATIVE_BF16_FLAGS):
        return True
    cap = cpu_capability().upper()
    return "AMX" in cap or "BF16" in cap


AMX_ISA_CAP = "AVX512_CORE_BF16"  # oneDNN's ISA cap below AMX (ONEDNN_MAX_CPU_ISA)


def amx_rounds_by_rows(isa: str | None = None) -> bool:
    """Whether oneDNN may run bf16 matmuls on AMX here, i.e. without the ISA capped below it.

    On an AMX CPU a multi-row bf16 pass differs from one-row passes of the
    same rows, because AMX kernels are chosen by the row count; capped at
    AVX-512 BF16 the rows are bit-identical.  AMX also makes multi-row passes
    nearly free, so it stays on unless `--bit-exact` asks for bit-identity
    (docs/measurements.md, "AMX and the row count of bf16 passes on an AMX Xeon").

    `isa`: the ONEDNN_MAX_CPU_ISA value oneDNN started with (default: the
    current environment's; a process that already ran bf16 passes keeps the
    value it started with).
    """
    if "amx_bf16" not in cpu_flags():
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa is None else isa
    return isa.upper() in ("", "ALL", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")


def cap_isa_for_bit_exact() -> bool:
    """`--bit-exact` on an AMX CPU: cap oneDNN below AMX for this process (before its first bf16 pass).

    Returns whether the cap was set.  oneDNN reads the variable once, at its
    first primitive, so this only works at start-up (the CLI calls it before
    loading anything); library users set ONEDNN_MAX_CPU_ISA themselves.
    """
    if not amx_rounds_by_rows():
        return False
    # An environment variable, not an argument: oneDNN (inside PyTorch) takes its ISA cap from nowhere else.
    os.environ["ONEDNN_MAX_CPU_ISA"] = AMX_ISA_CAP
    return True


def describe(device: str = "cpu") -> str:
    """One line naming the device: the CPU model and its bf16 support, or the GPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA)"
    flags = cpu_flags()
    features = [f for f in KERNEL_FLAGS if f in flags] or [cpu_capability()]
    return f"{cpu_name()} ({', '.join(features)}; {torch.get_num_threads()} threads)"


@lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """A short key for 'the same engine code': every Python and C++ source of the installed package.

    Timed choices (cost profiles, draft weight formats, matmul plans) price the
    code that ran when they were measured.  Keyed by the machine alone, a profile
    measured before a kernel got faster kept pricing passes at their old cost,
    and a seeded `auto` run, which prices by the profile alone, chose trees that
    ran slower than `ar` (docs/measurements.md, "A cost profile kept across a kernel change on an AVX2 EPYC")."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".cpp", ".h")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def fingerprint(device: str = "cpu") -> str:
    """A short key for 'the same machine' as far as pass costs go: device model, kernel flags, torch, threads,
    and the engine's own code (`engine_fingerprint`)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        parts = [torch.cuda.get_device_name(dev), str(torch.cuda.get_device_capability(dev)),
                 str(torch.version.cuda)]
    else:
        parts = [cpu_name(), ",".join(sorted(f for f in KERNEL_FLAGS if f in cpu_flags())), cpu_capability(),
                 str(os.cpu_count())]
    parts += [torch.__version__, f"threads={torch.get_num_threads()}", engine_fingerprint()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def auto_dtype(device: str = "cpu") -> tuple[str, str]:
    """(`bf16` or `fp32`, why) for `--dtype auto`.

    bf16 where the hardware computes it natively (a CUDA GPU that supports
    it; a CPU with AVX-512 BF16 or AMX), fp32 elsewhere: on an AVX2-only CPU
    a bf16 pass is no faster than fp32 for one row and much slower for the
    several rows speculation verifies.
    """
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16", "this GPU supports bf16"
        return "fp32", "this GPU has no bf16 support"
    if cpu_has_native_bf16():
        native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags()] or [cpu_capability()]
        return "bf16", f"this CPU has native bf16 ({', '.join(native)})"
    return "fp32", f"this CPU has no native bf16 (PyTorch capability {cpu_capability()})"
