"""Build, load and self-check the native quantised-linear kernels (`qlinear.cpp`).

Why at first use and not at install: `pip install -e .` stays a pure-Python
install (the README's first command), and the kernels are compiled for the
machine that runs them with the compiler it has.  The build takes about half a
minute once (one line on stderr) and is cached under
`<cache>/kernels/<torch version>-<source hash>/`; later loads take
milliseconds.  Where it cannot build (no compiler, no ninja, a non-x86 CPU
without the portable path working), the engine keeps PyTorch's own int4/int8
kernels and says so in one line.

`norm.cpp` and `attention.cpp` are the RMSNorm and attention of quantised
models: one call each, and each row computed alone, so a whole pass is
bit-identical per row (activations quantised to int8 would turn the last-bit
differences of PyTorch's attention into visible ones).  `layer.cpp` runs a
whole Llama-family decoder layer in one call (the same operations, without
Python's cost per operation).  `grid.cpp` (in the
same library) finds the 4-bit grid a dequantised GGUF group sits on, so
loading recovers its codes.  `peak.cpp` runs nothing but int8 dot products, to
measure the rate the tiles are a fraction of (`scripts/kernels/floor.py`).

Before the kernels are used, the fastest instruction set the CPU has is
checked against the portable C++ path on random data, bit for bit (the kernels
promise the same bits on every instruction set); one that disagrees is not
used.  `STAGEDSPEC_QKERNELS=torch` skips the native kernels altogether;
`STAGEDSPEC_QKERNELS=portable|avx2|avx512-vnni` forces one path (read at each
`native_kernels()` call, so at each model load), which is how a wrong result is
pinned to one instruction set.

A failed build keeps its record (`build_failure()`: the compiler's first error
line and the whole log) so that the test suite can fail with the compiler's own
words instead of quietly running on the fallback, as a user's run does.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stagedspec import hardware
from stagedspec.errors import first_line
from stagedspec.kernels import pair_rows, prefetch, tile_rows
from stagedspec.kernels.packing import FORMATS, random_segments
from stagedspec.paths import cache_root

SOURCES = tuple(Path(__file__).with_name(f) for f in ("qlinear.cpp", "grid.cpp", "norm.cpp", "attention.cpp",
                                                      "layer.cpp", "peak.cpp"))
INCLUDED = (Path(__file__).with_name("qlinear_amx.inc"),)  # compiled as part of qlinear.cpp; hashed with the sources
ISA_NAMES = {0: "portable C++", 1: "AVX2", 2: "AVX-512 VNNI", 3: "AVX-512 VNNI, 512-bit", 4: "AMX int8"}
AMX_ISA = tile_rows.AMX_ISA  # AMX int8 tiles (`qlinear_amx.inc`), with a VNNI path below `NativeKernels.tile_rows`
# The values of STAGEDSPEC_QKERNELS that force one instruction set; each CPU runs the paths up to its best.
ISA_KEYS = {"portable": 0, "avx2": 1, "avx512-vnni": 2, "avx512-vnni-512": 3, "amx": 4}
# A CPU with AVX-512 VNNI runs the tiles in 256-bit registers (2) or two at a time in 512-bit ones (3, the same
# bits).  The 512-bit form is chosen where its tiles run faster, timed at load (`wide_vnni_pays`): on Zen 5, whose
# 512-bit `vpdpbusd` retires twice the multiply-adds of a 256-bit one, about 1.9x at 16 rows (docs/kernels.md,
# "512-bit pairs of tiles on Zen 5"); on Zen 4, which splits 512-bit operations in two halves and retires the same
# multiply-adds either way, still 1.15-1.20x from 4 rows, since a pair issues half the float steps and loads of
# two tiles (docs/kernels.md, "The 512-bit pairs on Zen 4").  An earlier rule compared the instructions' peak
# rates alone and kept Zen 4 on the 256-bit form.
WIDE_VNNI_GAIN = 1.05  # the least speedup of the pairs' tiles (16 rows, int4 and Q4_K) that selects them
WIDE_VNNI_ROWS, WIDE_VNNI_CALLS = 16, 8
WIDE_VNNI_OUTPUTS = 512  # outputs of the 512 x 1536 layer timed: held in cache, packed in a few ms
# `amx_state()` of qlinear.cpp: 0 the tiles are usable; else why not
AMX_STATES = {1: "the CPU does not report them", 2: "the operating system does not enable their state",
              3: "the kernel refused this process their state (arch_prctl ARCH_REQ_XCOMP_PERM)",
              4: "the kernels were built without them"}
ENV_SWITCH = "STAGEDSPEC_QKERNELS"
OFF_VALUES = ("torch", "0", "off", "none")
AUTO_VALUES = ("", "auto", "native")
# -ffp-contract=off: the portable path's float operations stay the ones written (no fused multiply-adds the
# vector paths do not make).  -fopenmp: at::parallel_for is inline and splits work only where OpenMP is on;
# the runtime it links is libgomp.so.1, the soname of the copy PyTorch has loaded, so one thread pool serves both.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")


@dataclass(frozen=True)
class NativeKernels:
    """The loaded kernels and the instruction set they run with on this CPU.

    `isa` runs every pass, except that on a CPU with usable AMX tiles a pass of `tile_rows` rows or more runs
    on them (`tile_rows.measured_tile_rows`: where they are faster here; 0: never).  Every path gives the same
    bits, so which one runs a pass changes its speed only."""

    isa: int
    tile_rows: int = 0

    @property
    def name(self) -> str:
        tiles = f"; AMX int8 tiles from {self.tile_rows} rows" if self.tile_rows else ""
        return f"stagedspec-native ({ISA_NAMES.get(self.isa, self.isa)}{tiles})"

    def isa_for(self, rows: int) -> int:
        """The path that runs a pass of `rows` rows."""
        return AMX_ISA if self.tile_rows and rows >= self.tile_rows else self.isa

    def q4_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, K] (bf16 or fp32) times int4 weights packed by `packing.pack_int4` -> [rows, out_features]."""
        return torch.ops.stagedspec_qlinear.q4_linear(x, packed, out_features, self.isa_for(x.shape[0]))

    def q8_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, K] (bf16 or fp32) times int8 weights packed by `packing.pack_int8` -> [rows, out_features]."""
        return torch.ops.stagedspec_qlinear.q8_linear(x, packed, out_features, self.isa_for(x.shape[0]))

    def qlinear(self, x: torch.Tensor, packed: torch.Tensor, formats: list[int], outs: list[int]) -> torch.Tensor:
        """x [rows, K] times a weight stored as segments along its outputs: segment i holds `outs[i]` outputs in
        format `formats[i]` (`packing.FORMATS`), packed one after another -> [rows, sum(outs)]."""
        return torch.ops.stagedspec_qlinear.qlinear(x, packed, formats, outs, self.isa_for(x.shape[0]))

    def grid_groups(self, w: torch.Tensor, max_levels: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per group of 32 of w [N, K]: (low, step, levels) as `grid.grid_steps_reference` defines them."""
        return torch.ops.stagedspec_qlinear.grid_groups(w, max_levels)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last axis, each row alone (`norm.cpp`)."""
        return torch.ops.stagedspec_qlinear.rms_norm(x, weight, eps)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        """q [B, H, T, D] over keys/values [B, Hkv, S, D] (GQA when H > Hkv) with an additive bias [T', S] or
        [B, 1, T', S] (0 / -inf; its first T rows are used) -> [B, H, T, D], each row alone (`attention.cpp`)."""
        return torch.ops.stagedspec_qlinear.attention(q, keys, values, bias, scale, self.isa)

    def decoder_layer(self, x: torch.Tensor, packed: list[torch.Tensor], formats: list[int], outs: list[int],
                      splits: list[int], biases: list[torch.Tensor | None], attn_norm: torch.Tensor,
                      mlp_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, start: int, mask: torch.Tensor | None, scale: float, n_heads: int,
                      n_kv_heads: int) -> torch.Tensor:
        """One Llama-family decoder layer (`layer.cpp`): the Python path's operations from C++, the same bits."""
        return torch.ops.stagedspec_qlinear.decoder_layer(x, packed, formats, outs, splits, biases, attn_norm, mlp_norm,
                                                          eps, cos, sin, k_cache, v_cache, start, mask, scale, n_heads,
                                                          n_kv_heads, self.isa_for(_rows(x)))

    def decoder_layers(self, x: torch.Tensor, packed: list[torch.Tensor], formats: list[int], outs: list[int],
                       splits: list[int], biases: list[torch.Tensor | None], attn_norms: list[torch.Tensor],
                       mlp_norms: list[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_caches: torch.Tensor, v_caches: torch.Tensor, start: int, mask: torch.Tensor | None,
                       scale: float, n_heads: int, n_kv_heads: int) -> torch.Tensor:
        """Every decoder layer of a pass in one call (`layer.cpp`): `decoder_layer` for each, the same bits.
        Layer l owns packed[4l:4l+4], splits[4l:4l+4], biases[4l:4l+4] and caches [l] ([layers, B, Hkv, S, D])."""
        return torch.ops.stagedspec_qlinear.decoder_layers(x, packed, formats, outs, splits, biases, attn_norms,
                                                           mlp_norms, eps, cos, sin, k_caches, v_caches, start, mask,
                                                           scale, n_heads, n_kv_heads, self.isa_for(_rows(x)))

    def ragged_layers(self, x: torch.Tensor, packed: list[torch.Tensor], formats: list[int], outs: list[int],
                      splits: list[int], biases: list[torch.Tensor | None], attn_norms: list[torch.Tensor],
                      mlp_norms: list[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], starts: list[int], rows: list[int],
                      masks: list[torch.Tensor | None], scale: float, n_heads: int, n_kv_heads: int) -> torch.Tensor:
        """`decoder_layers` over several requests' passes at once (`layer.cpp`, `stagedspec.models.ragged`):
        x [1, R, hidden] holds rows[i] rows of request i after those of the requests before it (then padding);
        request i's caches are k_caches[i] / v_caches[i] [layers, 1, Hkv, S, D], its slots start at starts[i]."""
        return torch.ops.stagedspec_qlinear.ragged_layers(x, packed, formats, outs, splits, biases, attn_norms,
                                                          mlp_norms, eps, cos, sin, k_caches, v_caches, starts, rows,
                                                          masks, scale, n_heads, n_kv_heads, self.isa_for(_rows(x)))

    def int8_peak(self, width: int, rounds: int, threads: int) -> int | None:
        """Run `rounds` x `int8_peak_chains()` of this instruction set's int8 dot products (`width`-bit
        `vpdpbusd` on AVX-512 VNNI; `vpmaddubsw` + `vpaddw` on AVX2) on each of `threads` threads, for the caller
        to time (`peak.cpp`).  None where this CPU has no such instruction."""
        out = torch.ops.stagedspec_qlinear.int8_peak(self.isa, width, rounds, threads)
        return None if out < 0 else out

    def int8_peak_chains(self) -> int:
        return torch.ops.stagedspec_qlinear.int8_peak_chains()

    def with_isa(self, isa: int) -> NativeKernels:
        """The same kernels on another instruction set for every pass (tests compare them bit for bit)."""
        return NativeKernels(isa)


def _rows(x: torch.Tensor) -> int:
    """Rows of a pass whose last axis is the hidden size."""
    return x.numel() // max(1, x.shape[-1])


@dataclass(frozen=True)
class BuildFailure:
    """Why the kernels did not build, kept for whoever must not fall back quietly (the test suite)."""

    error: str  # the compiler's first error line ("qlinear.cpp:12:5: error: ..."), else the failure's first line
    output: str  # everything the failed build said

    @classmethod
    def of(cls, exc: BaseException) -> BuildFailure:
        output = str(exc)
        return cls(first_compiler_error(output) or first_line(exc), output)


def first_compiler_error(output: str) -> str | None:
    """The first line of a build log in which the compiler (or linker) reports an error, else None.

    Why not the exception's first line: `torch.utils.cpp_extension` starts its message with ninja's command
    lines ("Error building extension ...: [1/6] c++ -MMD ..."), which say nothing about what is wrong."""
    for line in output.splitlines():
        if re.search(r"\berror:", line) or "undefined reference" in line:
            return line.strip()
    return None


_lock = threading.Lock()
_state: dict[str, object] = {}


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """The kernels' sources and flags, hashed once a process (cost profiles are keyed by it, `profiling`)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *INCLUDED)) + " ".join(CFLAGS).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return cache_root() / "kernels" / f"torch{torch.__version__.replace('+', '-')}-{_source_digest()}"


def native_kernels(quiet: bool = False) -> NativeKernels | None:
    """The native kernels, built and checked once per process; None (with one warning line) where they cannot run.

    `STAGEDSPEC_QKERNELS` is read at every call: `torch` (or off) gives None, a path's name (`ISA_KEYS`) those
    kernels on that path where the CPU runs it, anything else the checked best path."""
    choice = _switch()
    if choice in OFF_VALUES:
        return None
    with _lock:
        if "result" not in _state:
            _state["result"], _state["why"] = _load(quiet)
            if _state["result"] is None and not quiet and _state["why"]:
                print(f"stagedspec: native int4/int8 kernels unavailable ({_state['why']}); "
                      "using PyTorch's kernels", file=sys.stderr)
        best: NativeKernels | None = _state["result"]  # type: ignore[assignment]
        if best is None or choice in AUTO_VALUES:
            return best
        return _forced(best, choice, quiet)


def switched_off() -> bool:
    """Whether `STAGEDSPEC_QKERNELS` asks for PyTorch's kernels (then `native_kernels()` is None by request)."""
    return _switch() in OFF_VALUES


def unavailable_reason() -> str | None:
    """Why `native_kernels()` returned None (after it was called), else None."""
    return _state.get("why")  # type: ignore[return-value]


def build_failure() -> BuildFailure | None:
    """The failed build of this process (after `native_kernels()` was called), else None."""
    return _state.get("failure")  # type: ignore[return-value]


def missing_compiler() -> str | None:
    """Why there is no C++ compiler to build the kernels with, or None where there is one.

    The compiler is the one `torch.utils.cpp_extension` runs: `$CXX`, else `c++`."""
    given = os.environ.get("CXX", "").strip()
    words = given.split() or ["c++"]
    if shutil.which(words[0]) is not None:
        return None
    if given:
        return f"$CXX is {given!r}, which is not an executable on PATH"
    return "`c++` is not on PATH (install g++ or clang++, or set CXX)"


def cpu_isa() -> int | None:
    """The best instruction set this CPU runs (a key of `ISA_NAMES`), once the kernels are loaded, else None."""
    return int(torch.ops.stagedspec_qlinear.best_isa()) if _registered() else None


def _switch() -> str:
    return os.environ.get(ENV_SWITCH, "").strip().lower()


def _forced(best: NativeKernels, choice: str, quiet: bool) -> NativeKernels:
    """The kernels on the path `choice` names, or `best` (said once) where the name is unknown or the CPU lacks
    the path.  A forced path skips the load-time check against the portable one: it is what is being checked."""
    isa = ISA_KEYS.get(choice)
    runs = cpu_isa()
    if isa is not None and runs is not None and isa <= runs:
        return NativeKernels(isa)
    warned: set[str] = _state.setdefault("warned", set())  # type: ignore[assignment]
    if not quiet and choice not in warned:
        warned.add(choice)
        why = (f"this CPU does not run {ISA_NAMES[isa]}" if isa is not None
               else f"not one of {', '.join((*ISA_KEYS, 'auto', 'torch'))}")
        print(f"stagedspec: {ENV_SWITCH}={choice} ignored ({why}); using {best.name}", file=sys.stderr)
    return best


def _load(quiet: bool) -> tuple[NativeKernels | None, str | None]:
    if not hasattr(torch.ops, "stagedspec_qlinear") or not _registered():
        try:
            _build(quiet)
        except Exception as exc:  # noqa: BLE001 - any build failure means the fallback, said in one line
            failure = BuildFailure.of(exc)
            _state["failure"] = failure
            return None, f"build failed: {failure.error}"
    _register_fakes()
    best = _best_isa()
    tiles = best == AMX_ISA
    if tiles:
        best = 3
    elif not quiet and "amx_int8" in hardware.cpu_flags():
        print(f"stagedspec: this CPU has AMX int8 tiles, but {amx_unusable_reason()}; "
              "using AVX-512 VNNI", file=sys.stderr)
    if best == 3 and not wide_vnni_pays():
        best = 2
    for isa in range(best, -1, -1):
        if isa == 0 or _agrees_with_portable(isa):
            kernels = NativeKernels(isa, _tile_rows(isa, quiet) if tiles else 0)
            if isa > 0:  # the portable path does not prefetch
                sweep = prefetch.stream_sweep(kernels)  # 145 MB of copies, made only where something is timed
                torch.ops.stagedspec_qlinear.prefetch_ahead(
                    prefetch.measured_distance(sweep, _source_digest(), quiet=quiet))
                if isa == 3:  # only the 512-bit path pairs tiles
                    torch.ops.stagedspec_qlinear.pair_min_rows(
                        pair_rows.measured_pair_rows(pair_rows.stream_timer(sweep), _source_digest(), quiet=quiet))
            return kernels, None
        print(f"stagedspec: the {ISA_NAMES[isa]} kernels disagree with the portable ones on this CPU; not used",
              file=sys.stderr)
    return None, "no instruction set passed the self-check"


def _best_isa() -> int:
    return int(torch.ops.stagedspec_qlinear.best_isa())


def amx_unusable_reason() -> str:
    """Why `qlinear.cpp` does not use the AMX tiles this CPU lists (`amx_state`), in a few words."""
    state = int(torch.ops.stagedspec_qlinear.amx_state())
    return AMX_STATES.get(state, f"AMX state {state}")


def _tile_rows(isa: int, quiet: bool) -> int:
    """The rows from which passes run on the tiles, where the tiles agree with the portable path (else 0)."""
    if not _agrees_with_portable(AMX_ISA):
        print("stagedspec: the AMX int8 kernels disagree with the portable ones on this CPU; not used", file=sys.stderr)
        return 0

    def run(path: int, x: torch.Tensor, packed: torch.Tensor, fmt: int) -> torch.Tensor:
        return NativeKernels(path).qlinear(x, packed, [fmt], [tile_rows.SIZE])

    return tile_rows.measured_tile_rows(isa, tile_rows.time_paths(run, isa), _source_digest(), quiet=quiet)


def wide_vnni_pays() -> bool:
    """Whether the 512-bit pairs of tiles run at least `WIDE_VNNI_GAIN` times as fast as the 256-bit tiles on this
    core: an int4 and a Q4_K layer of `WIDE_VNNI_OUTPUTS` outputs and `WIDE_VNNI_ROWS` rows, held in cache, timed
    as the AMX threshold is (`tile_rows.time_paths`: both paths interleaved, best of a few sweeps, about 25 ms in
    all), so that a busy machine slows both alike.  The rows a verification pass runs are what the choice serves;
    passes of fewer rows than `kernels.pair_rows` measured (`g_pair_min_rows` in `qlinear.cpp`) stay on the 256-bit
    tiles."""
    if NativeKernels(3).int8_peak(512, 10, 1) is None:  # built without the 512-bit form
        return False

    def run(path: int, x: torch.Tensor, packed: torch.Tensor, fmt: int) -> torch.Tensor:
        return NativeKernels(path).qlinear(x, packed, [fmt], [WIDE_VNNI_OUTPUTS])

    timer = tile_rows.time_paths(run, 2, 3, outputs=WIDE_VNNI_OUTPUTS, calls=WIDE_VNNI_CALLS)
    tiles = pairs = 0.0
    for name in ("int4", "q4_k"):
        a, b = timer(FORMATS[name], WIDE_VNNI_ROWS)
        tiles, pairs = tiles + a, pairs + b
    return tiles >= WIDE_VNNI_GAIN * pairs


def _register_fakes() -> None:
    """Shapes of the ops' results for `torch.compile`'s tracing (`--compile` on the CPU's static passes)."""
    lib = "stagedspec_qlinear"
    if "fakes" in _state:
        return
    _state["fakes"] = True

    def linear(x: torch.Tensor, packed: torch.Tensor, n: int, isa: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    torch.library.register_fake(f"{lib}::q4_linear", linear)
    torch.library.register_fake(f"{lib}::q8_linear", linear)
    torch.library.register_fake(f"{lib}::qlinear", lambda x, packed, formats, outs, isa: x.new_empty(x.shape[0], sum(outs)))
    torch.library.register_fake(f"{lib}::rms_norm", lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake(f"{lib}::attention", lambda q, k, v, bias, scale, isa=-1: torch.empty_like(q))
    torch.library.register_fake(f"{lib}::decoder_layer", lambda x, *args: torch.empty_like(x))
    torch.library.register_fake(f"{lib}::decoder_layers", lambda x, *args: torch.empty_like(x))
    torch.library.register_fake(f"{lib}::ragged_layers", lambda x, *args: torch.empty_like(x))


def _registered() -> bool:
    try:
        torch.ops.stagedspec_qlinear.best_isa
        return True
    except (AttributeError, RuntimeError):
        return False


def _build(quiet: bool) -> None:
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / "stagedspec_qlinear.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    missing = missing_compiler()
    if missing is not None:
        raise RuntimeError(f"no C++ compiler: {missing}")
    if not quiet:
        print("stagedspec: building the native int4/int8 kernels for this CPU (once, about 30 s)...",
              file=sys.stderr, flush=True)
    cpp_extension.load(
        name="stagedspec_qlinear", sources=[str(p) for p in SOURCES], build_directory=str(directory),
        extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
    )


def _agrees_with_portable(isa: int) -> bool:
    """The instruction set's results (linear layers and attention) equal the portable path's, bit for bit, on random data."""
    g = torch.Generator().manual_seed(0)
    k = 256
    x = torch.randn(19, k, generator=g) * torch.rand(19, 1, generator=g) * 4  # more rows than one AMX block
    packed, formats, outs = random_segments(("int4", "int8", "q4_k", "q6_k", "q5_0"), k, g)
    fast, ref = NativeKernels(isa), NativeKernels(0)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        if not torch.equal(fast.qlinear(xd, packed, formats, outs), ref.qlinear(xd, packed, formats, outs)):
            return False
    q, keys, values = (torch.randn(1, 4, 3, 64, generator=g), torch.randn(1, 2, 21, 64, generator=g),
                       torch.randn(1, 2, 21, 64, generator=g))
    bias = torch.zeros(3, 21).masked_fill_(torch.rand(3, 21, generator=g) < 0.3, float("-inf"))
    for dtype in (torch.float32, torch.bfloat16):
        args = (q.to(dtype), keys.to(dtype), values.to(dtype), bias.to(dtype).repeat(2, 1), 0.125)
        if not torch.equal(fast.attention(*args), ref.attention(*args)):
            return False
    return True
