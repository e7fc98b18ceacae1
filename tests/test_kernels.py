"""The native int4/int8 kernels (`stagedspec.kernels`): layout, accuracy, and exactness per row.

Speculation verifies a tree of R rows in one pass and keeps the accepted
rows' results as if each had been decoded alone; that is only exact if a
row's output never depends on the other rows.  These tests check it bit for
bit for every row count 1..64 and every position, across thread counts and
on every instruction-set path this CPU runs, each forced in turn
(`isa_kernels`: portable, AVX2, AVX-512 VNNI), against the portable path and
against each other.

A kernel build that fails where a C++ compiler exists fails these tests with
the compiler's first error (the `kernels` fixture, `tests/_native.py`); they
skip only where there is no compiler.  The library itself falls back with one
line, tested here too.
"""

from __future__ import annotations

import pytest
import torch

from _exactness import assert_bit_identical
from _native import kernels_on, native_kernels_or_fail
from stagedspec.kernels import grid, native, packing, pair_rows, prefetch, tile_rows
from stagedspec.models.pass_spec import PassSpec


def _layers(n: int = 40, k: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight packed both ways: (packed int4, its fp32 weight, packed int8, its fp32 weight)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    codes, scale, low = grid.int4_groups_from_float(w)
    c8, s8 = grid.int8_groups_from_float(w)
    return (packing.pack_int4(codes, scale, low), packing.dequantize_int4(codes, scale, low),
            packing.pack_int8(c8, s8), packing.dequantize_int8(c8, s8))


def test_packing_round_trips() -> None:
    p4, w4, p8, w8 = _layers(n=21, k=64)  # 21 outputs: a padded last tile
    assert torch.equal(packing.unpack_int4(p4, 21, 64), w4)
    assert torch.equal(packing.unpack_int8(p8, 21, 64), w8)


def test_q4_1_groups_come_back_exactly() -> None:
    """A weight made the Q4_1 way (fp16 scale and min, codes 0 and 15 in each group) is recovered exactly."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (16, 4, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(16, 4, 1, generator=g) * 0.02 + 0.001).half().float()
    low = ((-7.5 + torch.randn(16, 4, 1, generator=g)) * scale).half().float()
    w = (codes * scale + low).reshape(16, 128)
    c, s, lo = grid.int4_groups_from_float(w)
    assert torch.equal(packing.dequantize_int4(c, s, lo), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_matches_its_dequantised_weights(dtype: torch.dtype, kernels: native.NativeKernels) -> None:
    """Only the activations' int8 rounding separates the kernel from x @ W^T (about 0.5% here)."""
    p4, w4, p8, w8 = _layers(n=64, k=256)
    x = torch.randn(9, 256).to(dtype)
    for y, w in ((kernels.q4_linear(x, p4, 64), w4), (kernels.q8_linear(x, p8, 64), w8)):
        assert y.dtype == dtype and y.shape == (9, 64)
        ref = x.float() @ w.t()
        assert ((y.float() - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_every_row_count_and_position_is_bit_identical_to_the_row_alone(kind: str, dtype: torch.dtype,
                                                                        isa_kernels: native.NativeKernels) -> None:
    kernels = isa_kernels
    p4, _, p8, _ = _layers(n=24, k=64)
    run = (lambda x: kernels.q4_linear(x, p4, 24)) if kind == "q4" else (lambda x: kernels.q8_linear(x, p8, 24))
    # past one chunk of 64 rows, into a part-filled block of 8 (the activations' blocks, `quantize_rows`)
    x = (torch.randn(77, 64) * torch.rand(77, 1) * 3).to(dtype)
    alone = torch.cat([run(x[i:i + 1]) for i in range(77)])
    where = f"{isa_kernels.name} {kind} {dtype}"
    for rows in range(1, 78):
        assert_bit_identical(run(x[:rows]), alone[:rows], f"{where}: {rows} rows in one pass against each alone")
    perm = torch.randperm(77)
    assert_bit_identical(run(x[perm]), alone[perm], f"{where}: 77 rows shuffled")
    assert_bit_identical(run(x[17:50]), alone[17:50], f"{where}: rows 17-49")


def test_results_do_not_depend_on_the_thread_count(isa_kernels: native.NativeKernels) -> None:
    kernels = isa_kernels
    p4, _, p8, _ = _layers(n=200, k=128)
    x = torch.randn(11, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (kernels.q4_linear(x, p4, 200), kernels.q8_linear(x, p8, 200))
        torch.set_num_threads(max(2, before))
        many = (kernels.q4_linear(x, p4, 200), kernels.q8_linear(x, p8, 200))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def _every_kernel_result(kernels: native.NativeKernels) -> dict[str, torch.Tensor]:
    """Each kernel's result on fixed random inputs: int4 and int8 layers, a weight of every format as segments,
    and attention, with fp32 and bf16 activations."""
    g = torch.Generator().manual_seed(4)
    p4, _, p8, _ = _layers(n=48, k=160, seed=4)
    segments = packing.random_segments(("q4_k", "q6_k", "int8", "q5_0", "int4"), 256, g)
    q, keys, values = (torch.randn(1, 4, 5, 64, generator=g), torch.randn(1, 2, 23, 64, generator=g) * 3,
                       torch.randn(1, 2, 23, 64, generator=g))
    visible = torch.rand(5, 23, generator=g) < 0.6
    visible[:, 0] = True
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(13, 160, generator=g) * 2).to(dtype)
        xs = (torch.randn(9, 256, generator=g) * torch.rand(9, 1, generator=g) * 4).to(dtype)
        bias = torch.zeros(5, 23, dtype=dtype).masked_fill_(~visible, float("-inf")).repeat(2, 1)
        name = str(dtype).removeprefix("torch.")
        out[f"q4_linear {name}"] = kernels.q4_linear(x, p4, 48)
        out[f"q8_linear {name}"] = kernels.q8_linear(x, p8, 48)
        out[f"qlinear segments {name}"] = kernels.qlinear(xs, *segments)
        out[f"attention {name}"] = kernels.attention(q.to(dtype), keys.to(dtype), values.to(dtype), bias, 0.125)
    return out


def test_each_instruction_set_path_gives_the_portable_paths_bits(isa_kernels: native.NativeKernels) -> None:
    """The path forced here computes every kernel's result to the portable C++ path's bit."""
    portable = _every_kernel_result(isa_kernels.with_isa(0))
    for what, got in _every_kernel_result(isa_kernels).items():
        assert torch.equal(got, portable[what]), f"{isa_kernels.name} differs from the portable path: {what}"


def test_every_pair_of_paths_this_cpu_runs_gives_the_same_bits(kernels: native.NativeKernels) -> None:
    """All paths this CPU runs, against each other (a difference names both paths and the kernel)."""
    runs = native.cpu_isa()
    assert runs is not None
    results = {isa: _every_kernel_result(kernels.with_isa(isa)) for isa in range(runs + 1)}
    differ = [f"{native.ISA_NAMES[a]} vs {native.ISA_NAMES[b]}: {what}"
              for a in results for b in results if a < b
              for what in results[a] if not torch.equal(results[a][what], results[b][what])]
    assert not differ, differ


@pytest.mark.parametrize("fmt", sorted(packing.FORMATS))
def test_512_bit_pairs_of_tiles_give_the_256_bit_tiles_bits(fmt: str, kernels: native.NativeKernels) -> None:
    """The 512-bit path runs two tiles at a time where both are one thread's and one segment's, and single tiles
    elsewhere: every row block (1-8 rows and the rest), an odd tile count with a partial last tile, and thread
    counts that split the tiles at odd places give the 256-bit path's bits."""
    runs = native.cpu_isa()
    assert runs is not None
    if runs < 3:
        pytest.skip(f"this CPU does not run the {native.ISA_NAMES[3]} path (its best: {native.ISA_NAMES[runs]})")
    g = torch.Generator().manual_seed(7)
    n, k = 8 * 7 + 3, 512  # seven full tiles and a partial eighth
    weight, _ = packing.random_format(fmt, n, k, g)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (1, 2, 5, 8, 9, 17):
                x = torch.randn(rows, k, generator=g) * 2
                wide = kernels.with_isa(3).qlinear(x, weight, [packing.FORMATS[fmt]], [n])
                narrow = kernels.with_isa(2).qlinear(x, weight, [packing.FORMATS[fmt]], [n])
                assert_bit_identical(wide, narrow, f"{fmt}, {rows} rows, {threads} threads: 512-bit pairs against "
                                                   "256-bit tiles")
    finally:
        torch.set_num_threads(before)


def test_the_512_bit_pairs_are_chosen_where_their_tiles_run_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wide_vnni_pays` times the 256-bit tiles and their 512-bit pairs on the same layer: the pairs are chosen
    where they take at most 1 / `WIDE_VNNI_GAIN` of the time (Zen 5's wider instruction, Zen 4's fewer float
    steps a pair), not where they are about as fast or slower; a build without the 512-bit form never."""
    clock = {"t": 0.0}
    monkeypatch.setattr(native.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(native.NativeKernels, "int8_peak", lambda self, width, rounds, threads: 1)
    for pairs_over_tiles, pays in ((0.5, True), (0.85, True), (0.97, False), (1.2, False)):
        def fake_qlinear(self, x, packed, formats, outs, ratio: float = pairs_over_tiles):  # noqa: ANN001, ANN202
            clock["t"] += (ratio if self.isa == 3 else 1.0) * 1e-4
            return x

        monkeypatch.setattr(native.NativeKernels, "qlinear", fake_qlinear)
        assert native.wide_vnni_pays() is pays, pairs_over_tiles
    monkeypatch.setattr(native.NativeKernels, "int8_peak", lambda self, width, rounds, threads: None)
    assert native.wide_vnni_pays() is False


def test_zero_rows_and_extreme_activations(isa_kernels: native.NativeKernels) -> None:
    kernels = isa_kernels
    p4, _, _, _ = _layers(n=8, k=32)
    assert kernels.q4_linear(torch.zeros(0, 32), p4, 8).shape == (0, 8)
    assert torch.equal(kernels.q4_linear(torch.zeros(2, 32), p4, 8), torch.zeros(2, 8))
    big = torch.full((1, 32), 3e4)
    assert torch.isfinite(kernels.q4_linear(big, p4, 8)).all()


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """`native_kernels()` as in a new process: nothing loaded or built yet (the loaded library stays loaded)."""
    monkeypatch.setattr(native, "_state", {})


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "torch")
    assert native.native_kernels() is None and native.switched_off()
    assert native.unavailable_reason() is None  # nothing was tried


# What `torch.utils.cpp_extension.load` raises when a source does not compile: its prefix, ninja's output.
NINJA_LOG = """Error building extension 'stagedspec_qlinear': [1/6] c++ -MMD -MF qlinear.o.d -DTORCH_EXTENSION_NAME=x \
-O3 -ffp-contract=off -c /src/stagedspec/kernels/qlinear.cpp -o qlinear.o
FAILED: qlinear.o
c++ -MMD -MF qlinear.o.d -O3 -c /src/stagedspec/kernels/qlinear.cpp -o qlinear.o
/src/stagedspec/kernels/qlinear.cpp: In function 'int64_t best_isa()':
/src/stagedspec/kernels/qlinear.cpp:1012:3: error: expected ';' before '}' token
/src/stagedspec/kernels/qlinear.cpp:1020:1: error: expected declaration before '}' token
ninja: build stopped: subcommand failed.
"""


def _broken_source(quiet: bool) -> None:
    raise RuntimeError(NINJA_LOG)


def test_a_failed_build_falls_back_with_one_line_quoting_the_compiler(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fresh_state: None) -> None:
    """A user's run keeps going on PyTorch's kernels, saying so in one line that names the compiler's first error;
    the whole failure stays on record for the test suite (`build_failure`)."""
    monkeypatch.setattr(native, "_registered", lambda: False)
    monkeypatch.setattr(native, "_build", _broken_source)
    assert native.native_kernels() is None
    err = capsys.readouterr().err.strip().splitlines()
    first = "/src/stagedspec/kernels/qlinear.cpp:1012:3: error: expected ';' before '}' token"
    assert len(err) == 1 and first in err[0] and "PyTorch's kernels" in err[0], err
    failure = native.build_failure()
    assert failure is not None and failure.error == first and failure.output == NINJA_LOG


def test_without_a_compiler_the_notice_is_one_line_saying_so(monkeypatch: pytest.MonkeyPatch, tmp_path,  # noqa: ANN001
                                                             capsys: pytest.CaptureFixture, fresh_state: None) -> None:
    """No library built yet and `$CXX` not there: the one-line notice says there is no compiler, and the test
    helper would skip (not fail) for that reason alone."""
    from _native import native_kernels_unless_no_compiler

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(native, "_registered", lambda: False)
    assert native.missing_compiler() is not None and "no-such-c++" in native.missing_compiler()
    assert native.native_kernels() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C++ compiler" in err[0] and "PyTorch's kernels" in err[0], err
    assert native_kernels_unless_no_compiler() is None


def test_a_failed_build_with_a_compiler_present_fails_the_test_helper(
        monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    from _native import native_kernels_or_fail

    monkeypatch.setattr(native, "_registered", lambda: False)
    monkeypatch.setattr(native, "_build", _broken_source)
    monkeypatch.setattr(native, "missing_compiler", lambda: None)
    with pytest.raises(pytest.fail.Exception, match=r"failed to build: .*qlinear.cpp:1012:3: error: expected ';'"):
        native_kernels_or_fail()


def test_a_path_forced_by_name_is_used_where_the_cpu_runs_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture,
                                                             kernels: native.NativeKernels) -> None:
    """`STAGEDSPEC_QKERNELS=<path>` is read at each call; a path the CPU lacks, or an unknown name, keeps the
    checked best path and says so once."""
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    best, runs = native.native_kernels(), native.cpu_isa()
    assert best is not None and runs is not None
    for key, isa in native.ISA_KEYS.items():
        monkeypatch.setenv(native.ENV_SWITCH, key)
        got = native.native_kernels()
        assert got is not None and got.isa == (isa if isa <= runs else best.isa), key
    monkeypatch.setenv(native.ENV_SWITCH, "avx9000")
    assert native.native_kernels() == best and native.native_kernels() == best
    assert capsys.readouterr().err.count("STAGEDSPEC_QKERNELS=avx9000 ignored") == 1


def _q4_k_like(n: int = 64, k: int = 256, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups made as Q4_K makes them: codes over part of 0..15, scale = fp16 x 6-bit (not fp16), offset."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(2, 14, (n, k // 32, 32), generator=g)
    scale = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half().float() * torch.randint(1, 63, (n, k // 32, 1), generator=g)
    offset = -(torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float() * 7
    return (codes * scale + offset).reshape(n, k), codes.reshape(n, k), scale.reshape(n, k // 32)


def test_grid_detection_keeps_4_bit_codes_and_finds_other_groups_off_grid() -> None:
    w, codes, scale = _q4_k_like()
    c, s, low = grid.int4_groups_from_float(w)
    shift = codes.reshape(64, -1, 32).amin(-1, keepdim=True)
    assert torch.equal(c.reshape(64, -1, 32).long(), codes.reshape(64, -1, 32) - shift)  # the same codes, from 0
    rel = (s.float() - scale).abs() / scale
    assert rel.max() <= 2 ** -11  # the scale only rounded to fp16
    assert grid.four_bit_share(w) == 1.0
    assert grid.four_bit_share(torch.randn(16, 64)) == 0.0
    lo, step, levels = grid.grid_steps_reference(w)
    assert ((levels >= 2) & (levels <= 16)).all()


def test_native_grid_scan_agrees_with_the_reference(kernels: native.NativeKernels) -> None:
    w, _, _ = _q4_k_like(seed=5)
    w = torch.cat([w, torch.randn(8, 256), torch.zeros(2, 256)])
    ref = grid.grid_steps_reference(w)
    got = kernels.grid_groups(w)
    assert torch.equal(got[2], ref[2]) and torch.equal(got[0], ref[0])
    assert torch.allclose(got[1], ref[1], rtol=1e-6)


def test_q5_0_and_q8_0_groups_keep_their_codes_in_int8() -> None:
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(32, 4, 1, generator=g) * 0.01 + 0.001).half().float()
    for lo, hi in ((-16, 16), (-127, 128)):  # Q5_0: d * (q - 16); Q8_0: d * q
        codes = torch.randint(lo, hi, (32, 4, 32), generator=g)
        codes[..., 0], codes[..., 1] = lo, hi - 1
        w = (codes * d).reshape(32, 128)
        c, s = grid.int8_groups_from_float(w)
        assert torch.equal(packing.dequantize_int8(c, s), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_attention_matches_sdpa_with_gqa_and_a_tree_mask(dtype: torch.dtype,
                                                                 kernels: native.NativeKernels) -> None:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(6)
    B, H, Hkv, T, S, D = 1, 6, 2, 5, 19, 32
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    cache_k = torch.randn(B, Hkv, 40, D, generator=g).to(dtype)  # the cache holds more slots than are keys
    cache_v = torch.randn(B, Hkv, 40, D, generator=g).to(dtype)
    keys, values = cache_k.narrow(2, 0, S), cache_v.narrow(2, 0, S)
    visible = torch.ones(T, S, dtype=torch.bool)
    visible[:, S - T:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                       [1, 0, 1, 0, 1]], dtype=torch.bool)  # a tree over the last 5 slots
    bias = torch.zeros(T, S, dtype=dtype).masked_fill_(~visible, float("-inf"))
    got = kernels.attention(q, keys, values, bias.repeat(H // Hkv, 1), D ** -0.5)
    ref = F.scaled_dot_product_attention(q.float(), keys.float().repeat_interleave(H // Hkv, 1),
                                         values.float().repeat_interleave(H // Hkv, 1), attn_mask=bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 24])
def test_native_attention_is_the_same_bits_on_every_instruction_set_and_ignores_masked_slots(
        dtype: torch.dtype, D: int, isa_kernels: native.NativeKernels) -> None:
    """The path forced here (AVX2's 8 keys at a time) gives the portable path's bits, and a row's result depends
    only on its visible keys in order: moving them to other slots (as a tree pass does) changes nothing."""
    kernels = isa_kernels
    g = torch.Generator().manual_seed(11)
    H, Hkv, T, S = 4, 2, 3, 37
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    keys = (torch.randn(1, Hkv, S, D, generator=g) * 3).to(dtype)
    values = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    visible = torch.rand(T, S, generator=g) < 0.6
    visible[:, 0] = True
    bias = torch.zeros(T, S, dtype=dtype).masked_fill_(~visible, float("-inf")).repeat(H // Hkv, 1)
    got = kernels.attention(q, keys, values, bias, D ** -0.5)
    assert torch.equal(got, kernels.with_isa(0).attention(q, keys, values, bias, D ** -0.5))
    for t in range(T):  # the row alone, its visible keys packed into the first slots
        idx = visible[t].nonzero().flatten()
        alone = kernels.attention(q[:, :, t:t + 1], keys[:, :, idx], values[:, :, idx], None, D ** -0.5)
        assert torch.equal(alone, got[:, :, t:t + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (12, 2, 128), (4, 4, 64), (2, 1, 256)],
                         ids=["smollm2-shape", "qwen-shape", "no-gqa", "d256"])
@pytest.mark.parametrize("T", [1, 7])
def test_native_attention_gives_the_portable_bits_for_shared_key_heads_and_causal_spans(
        dtype: torch.dtype, H: int, Hkv: int, D: int, T: int, isa_kernels: native.NativeKernels) -> None:
    """Where the query heads of one key head run together (the AVX-512 path) and keys outside a row's visible span
    are skipped: every row is still the portable path's, bit for bit, with 1 and 2 threads, for a causal prompt
    pass over a cache (keys after the row never read), a tree whose first slots are masked, and a row with no
    visible key."""
    g = torch.Generator().manual_seed(21)
    S = 45
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    keys = (torch.randn(1, Hkv, 64, D, generator=g) * 3).to(dtype).narrow(2, 0, S)
    values = torch.randn(1, Hkv, 64, D, generator=g).to(dtype).narrow(2, 0, S)
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    late = causal.clone()
    late[:, :5] = False  # nothing visible before slot 5
    late[-1] = False  # a padding row
    for visible in (causal, late):
        bias = torch.zeros(T, S, dtype=dtype).masked_fill_(~visible, float("-inf"))
        ref = isa_kernels.with_isa(0).attention(q, keys, values, bias, D ** -0.5)
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(isa_kernels.attention(q, keys, values, bias, D ** -0.5), ref)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(ref[:, :, -1], torch.zeros_like(ref[:, :, -1]))


def _tiny_quantised_llama(dtype: torch.dtype, kernels: native.NativeKernels):  # noqa: ANN202
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.quant import quantize_model
    from stagedspec.models.transformer import Transformer, init_random

    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=128, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True)
    model = init_random(Transformer(cfg), seed=3).eval().requires_grad_(False)
    return quantize_model(model, "int4", dtype, kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_quantised_model_on_native_kernels_is_bit_identical_per_row(dtype: torch.dtype,
                                                                      isa_kernels: native.NativeKernels) -> None:
    """A tree row's logits equal one-token decoding of its path; a prompt split in two passes equals one pass;
    a one-row pass equals a row of a longer one, over the filled keys or the whole cache.  So the oracle runs a
    native model's bf16 passes without the dense bf16 path's fixed width and second row (`wants_fixed_width`)."""
    from stagedspec.runner import wants_fixed_width

    model = _tiny_quantised_llama(dtype, isa_kernels)
    assert not wants_fixed_width(model)
    ids = [5, 9, 33, 2, 200, 17, 41]
    P = len(ids)
    with torch.inference_mode():
        whole = model(torch.tensor([ids]), torch.arange(P), model.new_cache(64))[0]
        cache = model.new_cache(64)
        model(torch.tensor([ids[:4]]), torch.arange(4), cache)
        cache.commit()
        split = model(torch.tensor([ids[4:]]), torch.arange(4, P), cache)[0]
        cache.commit([])
        # a tree over the last three tokens: root ids[4], children ids[5] and 99, grandchild ids[6] under ids[5]
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        tree_logits = model(torch.tensor([[ids[4], ids[5], 99, ids[6]]]), torch.tensor([4, 5, 5, 6]), cache,
                            PassSpec(tree_mask=tree))[0]
        one_row = {}
        for width in (None, 64):
            model(torch.tensor([ids[4:6]]), torch.arange(4, 6), cache)
            cache.commit()
            one_row[width] = model(torch.tensor([ids[6:]]), torch.tensor([6]), cache, PassSpec(key_width=width))[0]
            cache.truncate(4)
    where = f"{isa_kernels.name} {dtype}"
    assert_bit_identical(split, whole[4:], f"{where}: a prompt in two passes against one pass")
    assert_bit_identical(tree_logits[[0, 1, 3]], whole[4:], f"{where}: a tree path's rows against the prompt pass")
    for width, got in one_row.items():
        assert_bit_identical(got, whole[6:], f"{where}: a one-row pass (key width {width}) against a row of seven")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_quantised_model_gives_the_portable_paths_logits_on_every_path(dtype: torch.dtype,
                                                                          isa_kernels: native.NativeKernels) -> None:
    """A whole model (every decoder layer in one native call) on the path forced here: the portable path's logits
    for a prompt pass and a tree pass, bit for bit."""
    def passes(kernels: native.NativeKernels) -> list[torch.Tensor]:
        model = _tiny_quantised_llama(dtype, kernels)
        with torch.inference_mode():
            cache = model.new_cache(64)
            prompt = model(torch.tensor([[5, 9, 33, 2, 200, 17]]), torch.arange(6), cache)
            cache.commit()
            tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            nodes = model(torch.tensor([[7, 8, 9]]), torch.tensor([6, 7, 7]), cache, PassSpec(tree_mask=tree))
        return [prompt, nodes]

    for what, got, want in zip(("prompt", "tree"), passes(isa_kernels), passes(isa_kernels.with_isa(0))):
        assert torch.equal(got, want), f"{isa_kernels.name}: the {what} pass differs from the portable path's"


def test_a_dense_bf16_model_keeps_the_fixed_width() -> None:
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random
    from stagedspec.runner import wants_fixed_width

    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=128, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True)
    model = init_random(Transformer(cfg), seed=3).eval().requires_grad_(False)
    assert not wants_fixed_width(model)  # fp32
    assert wants_fixed_width(model.to(torch.bfloat16))


@pytest.mark.parametrize("mode, dtype, qkv_bias", [("int4", torch.float32, False), ("mixed", torch.float32, True),
                                                    ("int8", torch.bfloat16, True)])
def test_the_native_decoder_layer_gives_the_python_path_bits(mode: str, dtype: torch.dtype, qkv_bias: bool,
                                                             isa_kernels: native.NativeKernels) -> None:
    """`layer.cpp` runs a block's operations in the Python path's order: prompt, tree and batched passes agree
    bit for bit with the layers run op by op (Qwen2's q|k|v bias included), one call per block or one call for
    all of them."""
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.quant import NativeDecoderLayer, NativeLayerStack, quantize_model
    from stagedspec.models.transformer import Transformer, init_random

    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=128, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True,
                      qkv_bias=qkv_bias)
    model = quantize_model(init_random(Transformer(cfg), seed=5).eval().requires_grad_(False), mode, dtype,
                           isa_kernels)
    assert all(isinstance(b.native_layer, NativeDecoderLayer) for b in model.layers)

    def passes() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(64)
            prompt = model(torch.tensor([[5, 9, 33, 2, 200]]), torch.arange(5), cache)
            cache.commit()
            tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            nodes = model(torch.tensor([[7, 8, 9]]), torch.tensor([5, 6, 6]), cache, PassSpec(tree_mask=tree))
            batch_cache = model.new_cache(16, batch=2)
            batch = model(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(3), batch_cache)
        return [prompt, nodes, batch]

    assert isinstance(model.runtime.native_stack, NativeLayerStack)
    stacked = passes()
    stack, model.runtime.native_stack = model.runtime.native_stack, None
    fused = passes()
    saved = [b.native_layer for b in model.layers]
    for b in model.layers:
        b.native_layer = None
    op_by_op = passes()
    for b, layer in zip(model.layers, saved):
        b.native_layer = layer
    model.runtime.native_stack = stack
    for s, a, b in zip(stacked, fused, op_by_op):
        assert torch.equal(s, b) and torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", sorted(packing.FORMATS))
def test_amx_tiles_give_every_row_count_and_position_the_portable_bits(fmt: str, dtype: torch.dtype,
                                                                       threads: int) -> None:
    """AMX tiles (`qlinear_amx.inc`) on each format: 1-70 rows (blocks of 16, part-filled ones, past a chunk of
    64), rows shuffled and a slice, against the portable path bit for bit.  K spans a part-filled chunk of groups;
    the outputs a pair of tiles and a single one."""
    amx = kernels_on(native.AMX_ISA)
    portable = amx.with_isa(0)
    k = 512 if fmt in ("q4_k", "q6_k") else 160
    packed, formats, outs = packing.random_segments((fmt,), k, torch.Generator().manual_seed(7))
    x = (torch.randn(70, k, generator=torch.Generator().manual_seed(8)) * torch.rand(70, 1) * 4).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        expected = portable.qlinear(x, packed, formats, outs)
        for rows in range(1, 71):
            assert_bit_identical(amx.qlinear(x[:rows], packed, formats, outs), expected[:rows],
                                 f"{fmt} {dtype}: {rows} rows on AMX tiles against the portable path")
        perm = torch.randperm(70)
        assert_bit_identical(amx.qlinear(x[perm], packed, formats, outs), expected[perm], f"{fmt}: shuffled")
        assert_bit_identical(amx.qlinear(x[17:50], packed, formats, outs), expected[17:50], f"{fmt}: rows 17-49")
    finally:
        torch.set_num_threads(before)


def test_passes_run_on_tiles_from_the_measured_row_count() -> None:
    split = native.NativeKernels(3, tile_rows=16)
    assert [split.isa_for(n) for n in (1, 15, 16, 64)] == [3, 3, native.AMX_ISA, native.AMX_ISA]
    assert native.NativeKernels(3).isa_for(1000) == 3  # no tiles
    assert native.NativeKernels(native.AMX_ISA).isa_for(1) == native.AMX_ISA  # forced onto tiles
    assert "AMX int8 tiles from 16 rows" in split.name


def test_the_tile_threshold_is_where_tiles_win_from_there_on(tmp_path) -> None:  # noqa: ANN001
    """Per format, the least row count from which tiles are faster at every larger count; a pass takes the
    largest, and never where one format never gains.  Timed once: the second call reads the cache file."""
    assert tile_rows.threshold({4: (1, 2), 8: (1, 0.5), 12: (1, 1.5), 16: (2, 1), 32: (4, 2)}) == 16
    assert tile_rows.threshold({4: (1, 2), 8: (1, 2)}) == tile_rows.NEVER
    assert tile_rows.pass_threshold({"int4": 8, "q6_k": 16}) == 16
    assert tile_rows.pass_threshold({"int4": 8, "q6_k": tile_rows.NEVER}) == tile_rows.NEVER
    calls = []

    def timer(fmt: int, rows: int) -> tuple[float, float]:
        calls.append((fmt, rows))
        return 1.0, (2.0 if rows < 12 else 0.5)  # tiles win from 12 rows on every format

    path = tmp_path / "amx-rows.json"
    assert tile_rows.measured_tile_rows(3, timer, "digest", cache_file=path, quiet=True) == 12
    timed = len(calls)
    assert timed == len(packing.FORMATS) * len(tile_rows.CANDIDATE_ROWS)
    assert tile_rows.measured_tile_rows(3, timer, "digest", cache_file=path, quiet=True) == 12 and len(calls) == timed
    tile_rows.forget_measured_tile_rows(path)
    assert not path.exists()


def test_an_amx_cpu_whose_tiles_are_unusable_runs_vnni_and_says_why_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fresh_state: None) -> None:
    native_kernels_or_fail()  # the library is loaded; the state below is a new process's
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_best_isa", lambda: 3)
    monkeypatch.setattr(native.hardware, "cpu_flags", lambda: frozenset({"avx512_vnni", "amx_tile", "amx_int8"}))
    monkeypatch.setattr(native, "amx_unusable_reason", lambda: native.AMX_STATES[3])
    monkeypatch.setattr(native, "wide_vnni_pays", lambda: True)
    monkeypatch.setattr(native, "_agrees_with_portable", lambda isa: True)
    # the faked flags make another machine's key: its prefetch and pairing timings are not what this test is about
    monkeypatch.setattr(native.prefetch, "measured_distance", lambda *args, **kwargs: prefetch.DEFAULT)
    monkeypatch.setattr(native.pair_rows, "measured_pair_rows", lambda *args, **kwargs: pair_rows.DEFAULT)
    kernels = native.native_kernels()
    assert kernels is not None and kernels.isa == 3 and kernels.tile_rows == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AMX" in err[0] and "ARCH_REQ_XCOMP_PERM" in err[0] and "VNNI" in err[0], err


def test_the_prefetch_distance_changes_no_bits() -> None:
    """How far ahead the tiles prefetch (`prefetch_ahead`) is a matter of speed alone: every format and path gives
    the same bits at any distance; a distance that is not whole cache lines up to 1 MiB is refused."""
    kernels = native_kernels_or_fail()
    g = torch.Generator().manual_seed(0)
    k = 512
    packed, formats, outs = packing.random_segments(("int4", "int8", "q4_k", "q6_k", "q5_0"), k, g)
    x = torch.randn(9, k, generator=g)
    ahead = torch.ops.stagedspec_qlinear.prefetch_ahead
    kept = ahead(0)  # 0 reads the setting
    try:
        results = []
        for distance in (64, 4096, 65536):
            assert ahead(distance) == distance
            results.append([kernels.with_isa(isa).qlinear(x[:rows], packed, formats, outs)
                            for isa in range(1, kernels.isa + 1) for rows in (1, 4, 9)])
        for distance, other in zip((4096, 65536), results[1:]):
            for i, (a, b) in enumerate(zip(results[0], other)):
                assert_bit_identical(b, a, f"call {i} at {distance} bytes ahead against 64")
        for bad in (100, 2 << 20):
            with pytest.raises(RuntimeError, match="prefetch_ahead"):
                ahead(bad)
    finally:
        ahead(kept)


def test_the_row_count_that_pairs_tiles_changes_no_bits() -> None:
    """From how many rows the 512-bit path pairs its tiles (`pair_min_rows`) is a matter of speed alone: every
    format gives the same bits for 1-9 rows whether pairs start at 1 row or never."""
    kernels = native_kernels_or_fail()
    if kernels.isa < 3:
        pytest.skip("this CPU has no 512-bit VNNI path")
    g = torch.Generator().manual_seed(0)
    k = 512
    packed, formats, outs = packing.random_segments(("int4", "int8", "q4_k", "q6_k", "q5_0"), k, g)
    x = torch.randn(9, k, generator=g)
    pair_from = torch.ops.stagedspec_qlinear.pair_min_rows
    kept = pair_from(0)  # 0 reads the setting
    wide = kernels.with_isa(3)
    try:
        results = []
        for rows_from in (1, 64):
            assert pair_from(rows_from) == rows_from
            results.append([wide.qlinear(x[:rows], packed, formats, outs) for rows in range(1, 10)])
        for rows, (a, b) in enumerate(zip(*results), start=1):
            assert_bit_identical(b, a, f"{rows} rows, never paired against paired")
    finally:
        pair_from(kept)


def test_tiles_pair_from_the_least_row_count_that_pays_and_are_timed_once(tmp_path) -> None:  # noqa: ANN001
    """Pairs start at the least row count from which they beat single tiles by `GAIN` at every larger count
    timed, else at the kernels' default; timed once per kernels and machine, then read from the cache file."""
    def timings(single: dict[int, float]) -> dict[tuple[int, bool], float]:
        return {**{(r, True): 1.0 for r in single}, **{(r, False): s for r, s in single.items()}}

    assert pair_rows.threshold(timings({1: 0.95, 2: 1.06, 3: 1.15})) == 2
    assert pair_rows.threshold(timings({1: 1.10, 2: 1.01, 3: 1.15})) == 3  # 2 rows within the noise
    assert pair_rows.threshold(timings({1: 1.10, 2: 1.10, 3: 1.10})) == 1
    assert pair_rows.threshold(timings({1: 0.90, 2: 0.95, 3: 1.0})) == pair_rows.DEFAULT
    calls = []

    def timer(rows: int, pairs: bool) -> float:
        calls.append((rows, pairs))
        return 1.0 if pairs or rows == 1 else 1.2

    path = tmp_path / "pair-rows.json"
    assert pair_rows.measured_pair_rows(timer, "digest", cache_file=path, quiet=True) == 2
    timed = len(calls)
    assert timed == len(pair_rows.CANDIDATES) * (1 + 2 * pair_rows.SWEEPS)
    assert pair_rows.measured_pair_rows(timer, "digest", cache_file=path, quiet=True) == 2 and len(calls) == timed
    pair_rows.forget_measured_pair_rows(path)
    assert not path.exists()


def test_the_prefetch_distance_is_the_shortest_near_the_fastest_and_timed_once(tmp_path) -> None:  # noqa: ANN001
    """The default stays unless another distance is `GAIN` faster; among distances within `NEAR` of the fastest
    the shortest wins.  Timed once per kernels and machine: the second call reads the cache file."""
    assert prefetch.choose({4096: 1.0, 8192: 0.99, 16384: 0.985}) == 4096  # within the noise
    assert prefetch.choose({4096: 1.0, 8192: 0.85, 16384: 0.84}) == 8192  # 16384 no faster than 8192 by NEAR
    assert prefetch.choose({4096: 1.0, 8192: 0.9, 16384: 0.8}) == 16384
    calls = []

    def sweep(distance: int) -> float:
        calls.append(distance)
        return {4096: 5.0, 8192: 4.0, 16384: 4.5}[distance]

    path = tmp_path / "prefetch.json"
    assert prefetch.measured_distance(sweep, "digest", cache_file=path, quiet=True) == 8192
    timed = len(calls)
    assert timed == 1 + prefetch.SWEEPS * len(prefetch.CANDIDATES)
    assert prefetch.measured_distance(sweep, "digest", cache_file=path, quiet=True) == 8192 and len(calls) == timed
    prefetch.forget_measured_distance(path)
    assert not path.exists()
