// Weight-only quantised linear layers for the CPU: y[r, :] = x[r, :] W^T with W in int4 or int8 groups.
//
// Why this file exists: at batch size 1 a decoding pass streams every weight once, so it is bound by
// memory bandwidth; a speculative verification pass of R rows should cost about the same, because each
// weight loaded from memory can serve every row before the next one loads.  PyTorch's int4 CPU kernel
// dequantises for every multiply-add and grows linearly in rows; these kernels keep the weights as
// integers and multiply them with int8 activations (the way llama.cpp's Q8 activations work).
//
// Exactness contract (tested): a row's output depends only on that row and the weights, bit for bit,
// whatever the number of rows in the pass, the row's position in it, the thread count, and the
// instruction set (scalar, AVX2, AVX-512 VNNI all give the same bits).  That holds because
//   - activations are quantised per row and per group of 32 (scale = amax / 127, round half to even);
//   - a group's integer dot product is exact (no saturation is possible: see the bounds below);
//   - each output accumulates its groups in order, with the same float operations in every path:
//       acc = fma(float(isum), w_scale * a_scale, acc);  acc = fma(w_min, a_scale * float(sum(a)), acc)
//   - threads split output features, never the input axis.
//
// Packed layouts (built in Python by stagedspec.kernels.packing), tiles of 8 output features:
//   int4: per (tile, group of 32 inputs) 160 bytes: 4 vectors of 32 code bytes, then 8 fp16 scales d,
//         then 8 fp16 mins m; weight = d * code + m, code in 0..15.  Vector v, byte 4*o + i holds
//         input 4v+i of output o in its low nibble and input 16+4v+i in its high nibble.
//   int8: per (tile, group) 272 bytes: 8 vectors of 32 int8 codes (vector v, byte 4*o + i = input
//         4v+i of output o), then 8 fp16 scales; weight = d * code, code in -127..127.
//
// Instruction sets are chosen at run time by the caller (`isa` argument); functions are compiled with
// per-function target attributes, so the library loads on any x86-64 CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STAGEDSPEC_X86 1
#endif

namespace {

constexpr int64_t kGroup = 32;                      // inputs per quantisation group
constexpr int64_t kTile = 8;                        // output features per tile
constexpr int64_t kQ4Bytes = 4 * 32 + 2 * kTile * 2;  // 160
constexpr int64_t kQ8Bytes = 8 * 32 + kTile * 2;      // 272
constexpr int64_t kRowBlock = 4;                    // rows computed together against one loaded tile
constexpr int64_t kRowChunk = 64;                   // rows whose activations stay in cache per weight sweep
constexpr int64_t kPrefetchBytes = 4096;            // how far ahead of the tile being read to prefetch

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// ---------------------------------------------------------------------------------------------------------
// Activations: int8 per row and group of 32, with the group's scale d and d * sum(codes).

struct QuantizedRows {
  int64_t rows = 0, K = 0, G = 0;
  std::vector<int8_t> q;  // [rows, K]
  std::vector<float> d;   // [rows, G]
  std::vector<float> s;   // [rows, G] = d * sum(q over the group)
};

inline float group_amax_scalar(const float* x) {
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

void quantize_group_scalar(const float* x, int8_t* q, float* d, float* s) {
  const float amax = group_amax_scalar(x);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    float v = std::nearbyint(x[i] * inv);
    v = std::min(127.f, std::max(-127.f, v));
    q[i] = static_cast<int8_t>(v);
    sum += q[i];
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(sum);
}

#ifdef STAGEDSPEC_X86
__attribute__((target("avx2,fma,f16c"))) void quantize_group_avx2(const float* x, int8_t* q, float* d,
                                                                   float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i iv[4];
  for (int j = 0; j < 4; ++j) {
    // cvtps rounds half to even (the default MXCSR mode), as std::nearbyint does
    __m256 t = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[j], vinv),
                                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    iv[j] = _mm256_cvtps_epi32(t);
  }
  // pack 4 x 8 int32 into 32 int8 in order
  __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]);
  __m256i p23 = _mm256_packs_epi32(iv[2], iv[3]);
  __m256i p = _mm256_packs_epi16(p01, p23);
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *d = amax / 127.f;
  *s = *d * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t K, int64_t isa) {
  QuantizedRows out;
  out.rows = rows;
  out.K = K;
  out.G = K / kGroup;
  out.q.resize(rows * K);
  out.d.resize(rows * out.G);
  out.s.resize(rows * out.G);
  const int64_t G = out.G;
  at::parallel_for(0, rows * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / G, g = i % G;
      const float* src = x + r * K + g * kGroup;
      int8_t* q = out.q.data() + r * K + g * kGroup;
#ifdef STAGEDSPEC_X86
      if (isa != kScalar) {
        quantize_group_avx2(src, q, &out.d[i], &out.s[i]);
        continue;
      }
#endif
      quantize_group_scalar(src, q, &out.d[i], &out.s[i]);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// One tile (8 outputs) against a block of RB rows.  `out` receives RB x 8 floats.

struct RowsView {
  const int8_t* q;  // first row's codes; rows at stride K
  const float* d;   // first row's group scales; rows at stride G
  const float* s;
  int64_t K, G;
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <int RB>
void q4_tile_scalar(const uint8_t* w, const RowsView& a, float* out) {
  float acc[RB][kTile] = {};
  for (int64_t g = 0; g < a.G; ++g, w += kQ4Bytes) {
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.q + r * a.K + g * kGroup;
      const float da = a.d[r * a.G + g], sa = a.s[r * a.G + g];
      for (int o = 0; o < kTile; ++o) {
        int32_t isum = 0;
        for (int v = 0; v < 4; ++v)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = w[32 * v + 4 * o + i];
            isum += static_cast<int32_t>(b & 0x0F) * x[4 * v + i] + static_cast<int32_t>(b >> 4) * x[16 + 4 * v + i];
          }
        const float dw = half_to_float(w + 128 + 2 * o), mw = half_to_float(w + 144 + 2 * o);
        const float scale = dw * da;
        acc[r][o] = std::fma(static_cast<float>(isum), scale, acc[r][o]);
        acc[r][o] = std::fma(mw, sa, acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < kTile; ++o) out[r * kTile + o] = acc[r][o];
}

template <int RB>
void q8_tile_scalar(const uint8_t* w, const RowsView& a, float* out) {
  float acc[RB][kTile] = {};
  for (int64_t g = 0; g < a.G; ++g, w += kQ8Bytes) {
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.q + r * a.K + g * kGroup;
      const float da = a.d[r * a.G + g];
      for (int o = 0; o < kTile; ++o) {
        int32_t isum = 0;
        for (int v = 0; v < 8; ++v)
          for (int i = 0; i < 4; ++i)
            isum += static_cast<int32_t>(static_cast<int8_t>(w[32 * v + 4 * o + i])) * x[4 * v + i];
        const float scale = half_to_float(w + 256 + 2 * o) * da;
        acc[r][o] = std::fma(static_cast<float>(isum), scale, acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < kTile; ++o) out[r * kTile + o] = acc[r][o];
}

#ifdef STAGEDSPEC_X86
// Every cache line of the group kPrefetchBytes ahead: a group spans 2.5 (int4) or 4.25 (int8) lines, and the
// hardware prefetcher alone kept one thread's stream at about 6 GB/s on the AVX2 EPYC (11 GB/s possible).
inline void prefetch_group(const uint8_t* w, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + b), _MM_HINT_T1);
}

__attribute__((target("avx2"))) inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// int4 x int8 with vpmaddubsw: a byte pair gives at most 2 * 15 * 127 = 3810, and a group adds 8 such
// pairs per 16-bit lane (30480 < 32767), so the 16-bit sums never saturate.
template <int RB>
__attribute__((target("avx2,fma,f16c"))) void q4_tile_avx2(const uint8_t* w, const RowsView& a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ4Bytes) {
    prefetch_group(w, kQ4Bytes);
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i lo = _mm256_and_si256(wv, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = a.q + r * a.K + g * kGroup;
        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(lo, broadcast4(x + 4 * v)));
        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(hi, broadcast4(x + 16 + 4 * v)));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 144)));
    for (int r = 0; r < RB; ++r) {
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r], ones));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g]));
      acc[r] = _mm256_fmadd_ps(sum, scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[r * a.G + g]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// int8 x int8: |w| * sign(x, w) with vpmaddubsw (at most 2 * 127 * 127 = 32258 per 16-bit lane), widened
// to 32 bits at once.
template <int RB>
__attribute__((target("avx2,fma,f16c"))) void q8_tile_avx2(const uint8_t* w, const RowsView& a, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ8Bytes) {
    prefetch_group(w, kQ8Bytes);
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < RB; ++r) {
        const __m256i x = _mm256_sign_epi8(broadcast4(a.q + r * a.K + g * kGroup + 4 * v), wv);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256)));
    for (int r = 0; r < RB; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// AVX-512 VNNI (256-bit forms, AVX512VL): vpdpbusd sums u8 x s8 quadruples straight into 32-bit lanes.
// Integer sums are the same numbers as above, so the results are the same bits.
template <int RB>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void q4_tile_vnni(
    const uint8_t* w, const RowsView& a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ4Bytes) {
    prefetch_group(w, kQ4Bytes);
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i lo = _mm256_and_si256(wv, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = a.q + r * a.K + g * kGroup;
        isum[r] = _mm256_dpbusd_epi32(isum[r], lo, broadcast4(x + 4 * v));
        isum[r] = _mm256_dpbusd_epi32(isum[r], hi, broadcast4(x + 16 + 4 * v));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 144)));
    for (int r = 0; r < RB; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[r * a.G + g]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// int8 weights on VNNI: codes + 128 as u8, minus 128 * sum(x) per group (exact in 32 bits).
template <int RB>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void q8_tile_vnni(
    const uint8_t* w, const RowsView& a, float* out) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones8 = _mm256_set1_epi8(1);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ8Bytes) {
    prefetch_group(w, kQ8Bytes);
    __m256i isum[RB], xsum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = xsum[r] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v)), bias);
      for (int r = 0; r < RB; ++r) {
        const __m256i x = broadcast4(a.q + r * a.K + g * kGroup + 4 * v);
        isum[r] = _mm256_dpbusd_epi32(isum[r], wu, x);
        xsum[r] = _mm256_dpbusd_epi32(xsum[r], ones8, x);
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256)));
    for (int r = 0; r < RB; ++r) {
      const __m256i exact = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(xsum[r], 7));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}
#endif

// ---------------------------------------------------------------------------------------------------------

using TileFn = void (*)(const uint8_t*, const RowsView&, float*);

struct TileKernels {
  TileFn fn[kRowBlock + 1];
};

#define STAGEDSPEC_TABLE(name, f)                                                    \
  TileKernels name() { return TileKernels{{nullptr, &f<1>, &f<2>, &f<3>, &f<4>}}; }

STAGEDSPEC_TABLE(q4_scalar, q4_tile_scalar)
STAGEDSPEC_TABLE(q8_scalar, q8_tile_scalar)
#ifdef STAGEDSPEC_X86
STAGEDSPEC_TABLE(q4_avx2, q4_tile_avx2)
STAGEDSPEC_TABLE(q8_avx2, q8_tile_avx2)
STAGEDSPEC_TABLE(q4_vnni, q4_tile_vnni)
STAGEDSPEC_TABLE(q8_vnni, q8_tile_vnni)
#endif

TileKernels kernels_for(bool int4, int64_t isa) {
#ifdef STAGEDSPEC_X86
  if (isa == kAvx512Vnni) return int4 ? q4_vnni() : q8_vnni();
  if (isa == kAvx2) return int4 ? q4_avx2() : q8_avx2();
#endif
  return int4 ? q4_scalar() : q8_scalar();
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool int4, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "qlinear: x must be [rows, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qlinear: packed weights must be contiguous uint8");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be fp32 or bf16");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "qlinear: K must be a multiple of 32");
  const int64_t G = K / kGroup, tiles = (N + kTile - 1) / kTile;
  const int64_t group_bytes = int4 ? kQ4Bytes : kQ8Bytes;
  TORCH_CHECK(packed.numel() == tiles * G * group_bytes, "qlinear: packed weights do not match N and K");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  const QuantizedRows qa = quantize_rows(xf.data_ptr<float>(), R, K, isa);
  const TileKernels table = kernels_for(int4, isa);
  const uint8_t* wbase = packed.data_ptr<uint8_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  at::BFloat16* yb = bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
  for (int64_t r0 = 0; r0 < R; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, R - r0);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      float tmp[kRowBlock * kTile];
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* w = wbase + t * G * group_bytes;
        const int64_t cols = std::min(kTile, N - t * kTile);
        for (int64_t rb = 0; rb < rows; rb += kRowBlock) {
          const int64_t n = std::min(kRowBlock, rows - rb);
          const int64_t r = r0 + rb;
          const RowsView view{qa.q.data() + r * K, qa.d.data() + r * G, qa.s.data() + r * G, K, G};
          table.fn[n](w, view, tmp);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t o = 0; o < cols; ++o) {
              const int64_t at = (r + i) * N + t * kTile + o;
              if (bf16)
                yb[at] = at::BFloat16(tmp[i * kTile + o]);
              else
                yf[at] = tmp[i * kTile + o];
            }
        }
      }
    });
  }
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  return quantized_linear(x, packed, N, true, isa);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  return quantized_linear(x, packed, N, false, isa);
}

// The best instruction set this CPU runs: 2 (AVX-512 VNNI), 1 (AVX2 + FMA + F16C) or 0 (portable C++).
int64_t best_isa() {
#ifdef STAGEDSPEC_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return kAvx512Vnni;
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

}  // namespace

// Schemas here, CPU kernels below: a CPU (not composite) registration lets `torch.compile` trace the ops
// through the shape functions `native.py` registers.
TORCH_LIBRARY(stagedspec_qlinear, m) {
  m.def("q4_linear(Tensor x, Tensor packed, int N, int isa) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int N, int isa) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor? bias, float scale) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
