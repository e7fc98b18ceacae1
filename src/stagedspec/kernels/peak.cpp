// The int8 multiply-add peak of this CPU's integer dot-product instructions, so that the quantised tiles can be
// measured as a fraction of it (`scripts/kernels/floor.py`, docs/kernels.md "Fraction of the int8 floor").
//
// Why measured rather than looked up: the rate differs by core generation at the same instruction set (Zen 4
// splits a 512-bit `vpdpbusd` in two 256-bit halves, Zen 5 and Intel's server cores do not), and a VM's clock is
// not the one on the box.  Each thread runs `kChains` independent accumulator chains, enough to cover the
// instruction's latency on every core measured, so the loop is bound by throughput alone.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STAGEDSPEC_X86 1
#endif

namespace {

constexpr int kChains = 12;

#ifdef STAGEDSPEC_X86
// `rounds` x kChains `vpdpbusd` of `width` bits (256 or 512); returns a sum of the accumulators so that the
// compiler keeps the work.
__attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512vnni"))) int64_t vnni_rounds(int64_t width,
                                                                                            int64_t rounds) {
  int64_t out = 0;
  if (width == 512) {
    __m512i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
    __m512i a = _mm512_set1_epi8(static_cast<char>(rounds | 1)), b = _mm512_set1_epi8(3);
    asm volatile("" : "+v"(a), "+v"(b));  // opaque to the compiler: no folding of the loop
    for (int64_t r = 0; r < rounds; ++r)
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    for (int i = 0; i < kChains; ++i) out += _mm512_reduce_add_epi32(acc[i]);
  } else {
    __m256i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
    __m256i a = _mm256_set1_epi8(static_cast<char>(rounds | 1)), b = _mm256_set1_epi8(3);
    asm volatile("" : "+v"(a), "+v"(b));
    for (int64_t r = 0; r < rounds; ++r)
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_dpbusd_epi32(acc[i], a, b);
    alignas(32) int32_t lanes[8];
    for (int i = 0; i < kChains; ++i) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[i]);
      for (int j = 0; j < 8; ++j) out += lanes[j];
    }
  }
  return out;
}

// AVX2 without VNNI: the tiles' pair `vpmaddubsw` + `vpaddw` (32 multiply-adds into 16-bit sums).
__attribute__((target("avx2"))) int64_t avx2_rounds(int64_t rounds) {
  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi16(static_cast<int16_t>(i));
  __m256i a = _mm256_set1_epi8(static_cast<char>(rounds | 1)), b = _mm256_set1_epi8(3);
  asm volatile("" : "+v"(a), "+v"(b));
  for (int64_t r = 0; r < rounds; ++r)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
  int64_t out = 0;
  alignas(32) int16_t lanes[16];
  for (int i = 0; i < kChains; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[i]);
    for (int j = 0; j < 16; ++j) out += lanes[j];
  }
  return out;
}
#endif

// Runs `rounds` x kChains instructions on each of the `threads` threads (isa 2 or 3: `vpdpbusd` of `width` bits; isa 1:
// `vpmaddubsw` + `vpaddw`).  The caller times it: multiply-adds = threads x rounds x kChains x width / 8.
// Returns a checksum; -1 where this CPU or build has no such instruction.
int64_t int8_peak(int64_t isa, int64_t width, int64_t rounds, int64_t threads) {
#ifdef STAGEDSPEC_X86
  __builtin_cpu_init();
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  const bool wide = isa == 2 || isa == 3;  // the VNNI paths, 256-bit tiles or 512-bit pairs of them
  if ((wide && (!vnni || (width != 256 && width != 512))) ||
      (isa == 1 && (!__builtin_cpu_supports("avx2") || width != 256)) || (isa != 1 && !wide))
    return -1;
  std::atomic<int64_t> sum{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sum += wide ? vnni_rounds(width, rounds) : avx2_rounds(rounds);
  });
  return sum.load() & 0x7fffffff;
#else
  (void)isa, (void)width, (void)rounds, (void)threads;
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedspec_qlinear, m) {
  m.def("int8_peak(int isa, int width, int rounds, int threads) -> int", &int8_peak);
  m.def("int8_peak_chains() -> int", []() -> int64_t { return kChains; });
}
