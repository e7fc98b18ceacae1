"""The native kernels for tests: built, or a failure quoting the compiler; skipped only where no compiler exists.

Why tests do not accept the library's fallback: a user's run falls back to
PyTorch's kernels with one line on stderr, which is right for a user and wrong
for CI, where a `.cpp` that no longer compiles would then skip every kernel
test and leave the suite green.  So where a C++ compiler is present, a failed
build fails every test that needs the kernels, with the compiler's first error
line (`stagedspec.kernels.native.build_failure`).

Instruction-set paths: each test that compares bits runs once per path
(`ISA_PARAMS`: portable C++, AVX2, AVX-512 VNNI in 256-bit tiles and in 512-bit
pairs of them, AMX int8 tiles for every row count), each forced in turn with
`NativeKernels.with_isa`;
a path this CPU does not run is skipped, naming what the CPU lacks.
"""

from __future__ import annotations

import os

import pytest

from stagedspec.kernels import native

ISA_PARAMS = [pytest.param(isa, id=key) for key, isa in native.ISA_KEYS.items()]
ISA_KEY = {isa: key for key, isa in native.ISA_KEYS.items()}  # the STAGEDSPEC_QKERNELS value forcing each path


def native_kernels_unless_no_compiler() -> native.NativeKernels | None:
    """The native kernels; None only where they cannot be built (no C++ compiler) or are switched off
    (`STAGEDSPEC_QKERNELS=torch`); any other failure fails the calling test with the build's first error."""
    kernels = native.native_kernels(quiet=True)
    if kernels is not None or native.switched_off():
        return kernels
    if native.missing_compiler() is not None:  # the build never started (`native._build` checks first)
        return None
    failure = native.build_failure()
    if failure is not None:
        pytest.fail(f"the native kernels failed to build: {failure.error}", pytrace=False)
    pytest.fail(f"the native kernels are unavailable although a C++ compiler exists: {native.unavailable_reason()}",
                pytrace=False)


def native_kernels_or_fail() -> native.NativeKernels:
    """The native kernels, failing as `native_kernels_unless_no_compiler` does, and skipping (saying why) where
    there is no C++ compiler or they are switched off."""
    kernels = native_kernels_unless_no_compiler()
    if kernels is None:
        if native.switched_off():
            pytest.skip(f"native kernels switched off ({native.ENV_SWITCH}={os.environ.get(native.ENV_SWITCH)})")
        pytest.skip(f"no C++ compiler: {native.missing_compiler()}")
    return kernels


def kernels_on(isa: int) -> native.NativeKernels:
    """The native kernels forced onto instruction-set path `isa`; skipped where this CPU does not run it."""
    kernels = native_kernels_or_fail()
    runs = native.cpu_isa()
    assert runs is not None  # loaded, so the library answers
    if isa > runs:
        pytest.skip(f"this CPU does not run the {native.ISA_NAMES[isa]} path (its best: {native.ISA_NAMES[runs]})")
    return kernels.with_isa(isa)
