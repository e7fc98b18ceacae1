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
//   q4_k: GGUF's Q4_K kept exactly.  Per (tile, super-block of 256 inputs) 1184 bytes: 8 fp16 d, 8 fp16
//         dmin, then 8 groups of 144 bytes: the int4 code vectors as above, 8 uint8 scales sc and 8 uint8
//         mins m (6-bit values); weight = (d * sc) * code - dmin * m.  Both products are exact in fp32.
//   q6_k: GGUF's Q6_K kept exactly.  Per (tile, super-block) 1680 bytes: 8 fp16 d, then 8 groups of 208
//         bytes: 4 vectors of low nibbles (as int4: code vectors v and v+4), 2 vectors of high 2-bit
//         pairs (vector u, byte j, bits 2k..2k+1 = code vector 4u+k), 8 int8 scales of inputs 0..15 and
//         8 of inputs 16..31; weight = d * sc * (code - 32), code in 0..63.
//   q5_0: GGUF's Q5_0 kept exactly.  Per (tile, group) 176 bytes: the int4 code vectors (low 4 bits), one
//         vector of fifth bits (byte j, bit k = code vector k: inputs 4k..4k+3), 8 fp16 d;
//         weight = d * (code - 16), code in 0..31.
//
// A layer may hold several formats one after another along its outputs (a fused q|k|v whose parts a
// GGUF stores differently): `qlinear` takes the formats and output counts of its segments.
//
// Instruction sets are chosen at run time by the caller (`isa` argument); functions are compiled with
// per-function target attributes, so the library loads on any x86-64 CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
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
constexpr int64_t kSuper = 256;                     // inputs per K-quant super-block
constexpr int64_t kGroupsPerSuper = kSuper / kGroup;  // 8
constexpr int64_t kQ4KGroupBytes = 128 + 2 * kTile;   // 144
constexpr int64_t kQ4KSuperBytes = 4 * kTile + kGroupsPerSuper * kQ4KGroupBytes;  // 1184
constexpr int64_t kQ6KGroupBytes = 128 + 64 + 2 * kTile;  // 208
constexpr int64_t kQ6KSuperBytes = 2 * kTile + kGroupsPerSuper * kQ6KGroupBytes;  // 1680
constexpr int64_t kQ5Bytes = 128 + 32 + 2 * kTile;  // 176
constexpr int64_t kRowBlock = 4;                    // rows computed together against one loaded tile
// The int4 / Q4_K / Q5_0 / Q6_K tiles take 8 rows, so a 5-8 row pass sweeps each tile once: their per-row
// integer sums fit in registers (AVX2 int8's do not, and stay at 4; the VNNI forms have AVX-512VL's 32 registers).
// On AVX2 one sweep of 6 or 8 rows of a streamed Q4_K layer costs less than two 4-row sweeps.  On VNNI the int4
// and Q4_K rows sum their low and high nibbles in two chains (twice the vpdpbusd in flight; integer sums, so the
// same bits), and 8-row tiles make a 16-row pass cheaper against a one-row pass
// (docs/measurements.md, "8-row tiles of the int4 and K-quant kernels").
constexpr int64_t kMaxRowBlock = 8;
constexpr int64_t kRowChunk = 64;                   // rows whose activations stay in cache per weight sweep
// How far ahead of the tile being read to prefetch, in bytes: set per process (`prefetch_ahead`), read (a relaxed
// load) by each group's prefetches.
std::atomic<int64_t> g_prefetch_ahead{4096};
inline int64_t prefetch_distance() { return g_prefetch_ahead.load(std::memory_order_relaxed); }
// The row count from which the 512-bit path pairs tiles: set per process (`pair_min_rows`, timed per machine by
// `kernels/pair_rows.py`), 4 until then.  Below it a pass may still be bound by reading the weights, where two
// streams read side by side can run slower than one: on Zen 5 a whole Qwen2.5-Coder-1.5B pass of 2 / 3 rows took
// 1.06-1.13x / 1.04-1.17x the 256-bit tiles' time, 4 rows 0.89x (docs/kernels.md, "Pairs of tiles from 4 rows up
// on Zen 5"); on Zen 4, 0.94x / 0.86x ("Pairs of tiles from 2 rows up on Zen 4").
std::atomic<int64_t> g_pair_min_rows{4};

// kAvx512Vnni512: the VNNI tiles two at a time in 512-bit registers (the same bits; chosen where it pays).
// kAmx: AMX int8 tiles for every row block (qlinear_amx.inc; the same bits); the caller picks it by row count.
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kAvx512Vnni512 = 3, kAmx = 4 };
enum Format : int64_t { kInt4 = 0, kInt8 = 1, kQ4K = 2, kQ6K = 3, kQ5 = 4 };

// Bytes of one tile (8 outputs) over K inputs, or -1 where the format cannot hold K inputs.
int64_t tile_bytes(int64_t format, int64_t K) {
  switch (format) {
    case kInt4: return K % kGroup ? -1 : K / kGroup * kQ4Bytes;
    case kInt8: return K % kGroup ? -1 : K / kGroup * kQ8Bytes;
    case kQ4K: return K % kSuper ? -1 : K / kSuper * kQ4KSuperBytes;
    case kQ6K: return K % kSuper ? -1 : K / kSuper * kQ6KSuperBytes;
    case kQ5: return K % kGroup ? -1 : K / kGroup * kQ5Bytes;
    default: return -1;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Activations: int8 per row and group of 32, with the group's scale d and d * sum(codes).

// Rows are kept in blocks of kBlockRows, and within a block group by group: group g of the block's rows is 16 x 32
// contiguous codes (and 16 contiguous scales), so a tile reaches every row of its block at a constant offset from
// one pointer per group, and an AMX tile loads a block's group as it lies.  Kept row-major (rows at stride K),
// the tiles recomputed eight row addresses each group and the compiler parked them in vector or mask registers (docs/kernels.md, "Activations in
// blocks of rows").
// 16 rows: an AMX tile's rows (qlinear_amx.inc); the vector tiles take 8 or 4 of them at a time.
constexpr int64_t kBlockRows = 16;
static_assert(kBlockRows % kMaxRowBlock == 0 && kRowChunk % kBlockRows == 0 && kBlockRows % kRowBlock == 0,
              "a tile's rows must lie in one block");

// Index of row r's group g in the blocked order (for codes, times kGroup).
inline int64_t blocked(int64_t r, int64_t g, int64_t G) { return ((r / kBlockRows) * G + g) * kBlockRows + r % kBlockRows; }

struct QuantizedRows {
  int64_t rows = 0, K = 0, G = 0;  // the arrays hold rows padded to whole blocks (zeros, never read)
  std::vector<int8_t> q;  // [blocks, G, kBlockRows, 32]
  std::vector<float> d;   // [blocks, G, kBlockRows]
  std::vector<float> s;   // the same, d * sum(q over the group)
  std::vector<int32_t> h;  // [blocks, G, kBlockRows, 2] sum(q) over each half group of 16 (Q6_K's sub-blocks)
  std::vector<int32_t> hn;  // [blocks, G, kBlockRows] the same negated, as two int16 (low: inputs 0..15) for vpmaddwd
};

inline float group_amax_scalar(const float* x) {
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

void quantize_group_scalar(const float* x, int8_t* q, float* d, float* s, int32_t* h) {
  const float amax = group_amax_scalar(x);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t half[2] = {0, 0};
  for (int64_t i = 0; i < kGroup; ++i) {
    float v = std::nearbyint(x[i] * inv);
    v = std::min(127.f, std::max(-127.f, v));
    q[i] = static_cast<int8_t>(v);
    half[i / 16] += q[i];
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(half[0] + half[1]);
  h[0] = half[0];
  h[1] = half[1];
}

#ifdef STAGEDSPEC_X86
__attribute__((target("avx2,fma,f16c"))) void quantize_group_avx2(const float* x, int8_t* q, float* d,
                                                                   float* s, int32_t* h) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 top = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  top = _mm_max_ps(top, _mm_movehl_ps(top, top));
  top = _mm_max_ss(top, _mm_movehdup_ps(top));
  const float amax = _mm_cvtss_f32(top);
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
  int32_t half[2];
  for (int j = 0; j < 2; ++j) {
    __m256i sum = _mm256_add_epi32(iv[2 * j], iv[2 * j + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    half[j] = _mm_cvtsi128_si32(s4);
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(half[0] + half[1]);
  h[0] = half[0];
  h[1] = half[1];
}
#endif

// `packed_halves`: also fill `hn` (only the AVX2 Q6_K tile reads it).
// `x` rows of K floats, or of K bf16 where `xb` is given instead (each group widened to floats first: the same values).
// `out`'s arrays are reused from call to call (a thread's scratch: `scratch_rows`), not reallocated.
void quantize_rows(const float* x, const at::BFloat16* xb, int64_t rows, int64_t K, int64_t isa, bool packed_halves,
                   QuantizedRows& out) {
  out.rows = rows;
  out.K = K;
  out.G = K / kGroup;
  const int64_t G = out.G, B = kBlockRows, padded = (rows + B - 1) / B * B;
  out.q.assign(padded * K, 0);
  out.d.assign(padded * G, 0.f);
  out.s.assign(padded * G, 0.f);
  out.h.assign(padded * G * 2, 0);
  if (packed_halves) out.hn.assign(padded * G, 0);
  else out.hn.clear();
  // Threads take whole (block, group) units in the blocked order, so two of them share a cache line only at the
  // ends of their shares; about 256 groups each, so that one or a few rows stay on the calling thread.
  const int64_t per_unit = std::min(rows, B);
  at::parallel_for(0, padded / B * G, std::max<int64_t>(1, 256 / per_unit), [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t first = u / G * B, g = u % G, n = std::min(B, rows - first);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = u * B + i;  // = blocked(first + i, g, G)
        float widened[kGroup];
        const float* src = x + (first + i) * K + g * kGroup;
        if (xb != nullptr) {
          const at::BFloat16* from = xb + (first + i) * K + g * kGroup;
          for (int64_t e = 0; e < kGroup; ++e) widened[e] = static_cast<float>(from[e]);
          src = widened;
        }
        int8_t* q = out.q.data() + b * kGroup;
#ifdef STAGEDSPEC_X86
        if (isa != kScalar)
          quantize_group_avx2(src, q, &out.d[b], &out.s[b], &out.h[2 * b]);
        else
#endif
          quantize_group_scalar(src, q, &out.d[b], &out.s[b], &out.h[2 * b]);
        // |sum| <= 16 * 127 = 2032, so the negated sums fit 16 bits each
        if (packed_halves)
          out.hn[b] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(-out.h[2 * b])) |
                                           (static_cast<uint32_t>(static_cast<uint16_t>(-out.h[2 * b + 1])) << 16));
      }
    }
  });
}

// The calling thread's quantised-rows arrays: a pass calls the linear layers one after another on one thread, and
// allocating and freeing them in every call cost about a microsecond of a one-row call's few.
QuantizedRows& scratch_rows() {
  thread_local QuantizedRows rows;
  return rows;
}

// ---------------------------------------------------------------------------------------------------------
// One tile (8 outputs) against a block of RB rows.  `out` receives RB x 8 floats.

// Rows of one block, from one of its rows on: row r of the view is r rows further in the block.
struct RowsView {
  const int8_t* q;   // the view's first row, group 0
  const float* d;
  const float* s;
  const int32_t* h;
  const int32_t* hn;  // null where not filled
  int64_t G;
  // Whether the tile prefetches the weights ahead of it: in the first row block of a chunk of rows only; the
  // later blocks read the same tile from L1 and the next tiles are on their way already.
  bool prefetch;

  // Row r's group g, counted in groups from the view's first.
  static int64_t at(int64_t r, int64_t g) { return g * kBlockRows + r; }
  const int8_t* x(int64_t r, int64_t g) const { return q + at(r, g) * kGroup; }
  float scale(int64_t r, int64_t g) const { return d[at(r, g)]; }
  float sum(int64_t r, int64_t g) const { return s[at(r, g)]; }
  const int32_t* halves(int64_t r, int64_t g) const { return h + 2 * at(r, g); }
  int32_t neg_halves(int64_t r, int64_t g) const { return hn[at(r, g)]; }
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
      const int8_t* x = a.x(r, g);
      const float da = a.scale(r, g), sa = a.sum(r, g);
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
      const int8_t* x = a.x(r, g);
      const float da = a.scale(r, g);
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


// The integer dot product of one int4 code group (int4 layout, 128 bytes) with 32 activation codes, output o.
inline int32_t q4_group_isum_scalar(const uint8_t* w, const int8_t* x, int o) {
  int32_t isum = 0;
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < 4; ++i) {
      const uint8_t b = w[32 * v + 4 * o + i];
      isum += static_cast<int32_t>(b & 0x0F) * x[4 * v + i] + static_cast<int32_t>(b >> 4) * x[16 + 4 * v + i];
    }
  return isum;
}

template <int RB>
void q4k_tile_scalar(const uint8_t* w, const RowsView& a, float* out) {
  float acc[RB][kTile] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* head = w + (g / kGroupsPerSuper) * kQ4KSuperBytes;
    const uint8_t* grp = head + 4 * kTile + (g % kGroupsPerSuper) * kQ4KGroupBytes;
    for (int o = 0; o < kTile; ++o) {
      const float dw = half_to_float(head + 2 * o) * static_cast<float>(grp[128 + o]);
      const float mw = -(half_to_float(head + 2 * kTile + 2 * o) * static_cast<float>(grp[136 + o]));
      for (int r = 0; r < RB; ++r) {
        const int32_t isum = q4_group_isum_scalar(grp, a.x(r, g), o);
        const float scale = dw * a.scale(r, g);
        acc[r][o] = std::fma(static_cast<float>(isum), scale, acc[r][o]);
        acc[r][o] = std::fma(mw, a.sum(r, g), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < kTile; ++o) out[r * kTile + o] = acc[r][o];
}

// Q6_K code of input 4v+i of output o in a 208-byte group (see the layout in the header).
inline int32_t q6k_code(const uint8_t* grp, int v, int o, int i) {
  const int j = 4 * o + i;
  const uint8_t nib = v < 4 ? (grp[32 * v + j] & 0x0F) : (grp[32 * (v - 4) + j] >> 4);
  const uint8_t hi = (grp[128 + 32 * (v / 4) + j] >> (2 * (v % 4))) & 3;
  return static_cast<int32_t>(nib | (hi << 4));
}

// The group's exact integer sum over both sub-blocks: sum_sub sc_sub * (sum code * x - 32 * sum x).
inline int32_t q6k_group_isum_scalar(const uint8_t* grp, const int8_t* x, const int32_t* h, int o) {
  int32_t isum = 0;
  for (int sub = 0; sub < 2; ++sub) {
    int32_t dot = 0;
    for (int v = 4 * sub; v < 4 * sub + 4; ++v)
      for (int i = 0; i < 4; ++i) dot += q6k_code(grp, v, o, i) * x[4 * v + i];
    const int32_t sc = static_cast<int8_t>(grp[192 + 8 * sub + o]);
    isum += sc * dot - ((sc * h[sub]) << 5);
  }
  return isum;
}

template <int RB>
void q6k_tile_scalar(const uint8_t* w, const RowsView& a, float* out) {
  float acc[RB][kTile] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* head = w + (g / kGroupsPerSuper) * kQ6KSuperBytes;
    const uint8_t* grp = head + 2 * kTile + (g % kGroupsPerSuper) * kQ6KGroupBytes;
    for (int o = 0; o < kTile; ++o) {
      const float dw = half_to_float(head + 2 * o);
      for (int r = 0; r < RB; ++r) {
        const int32_t isum = q6k_group_isum_scalar(grp, a.x(r, g), a.halves(r, g), o);
        acc[r][o] = std::fma(static_cast<float>(isum), dw * a.scale(r, g), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < kTile; ++o) out[r * kTile + o] = acc[r][o];
}


// Q5_0: code of input 4v+i of output o in a 176-byte group.
inline int32_t q5_code(const uint8_t* grp, int v, int o, int i) {
  const int j = 4 * o + i;
  const uint8_t nib = v < 4 ? (grp[32 * v + j] & 0x0F) : (grp[32 * (v - 4) + j] >> 4);
  return static_cast<int32_t>(nib | (((grp[128 + j] >> v) & 1) << 4));
}

template <int RB>
void q5_tile_scalar(const uint8_t* w, const RowsView& a, float* out) {
  float acc[RB][kTile] = {};
  for (int64_t g = 0; g < a.G; ++g, w += kQ5Bytes) {
    for (int o = 0; o < kTile; ++o) {
      const float dw = half_to_float(w + 160 + 2 * o);
      const float mw = -16.f * dw;
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = a.x(r, g);
        int32_t isum = 0;
        for (int v = 0; v < 8; ++v)
          for (int i = 0; i < 4; ++i) isum += q5_code(w, v, o, i) * x[4 * v + i];
        acc[r][o] = std::fma(static_cast<float>(isum), dw * a.scale(r, g), acc[r][o]);
        acc[r][o] = std::fma(mw, a.sum(r, g), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < kTile; ++o) out[r * kTile + o] = acc[r][o];
}

#ifdef STAGEDSPEC_X86
// Every cache line of the group `prefetch_distance()` bytes ahead: a group spans 2.5 (int4) or 4.25 (int8) lines, and the
// hardware prefetcher alone kept one thread's stream at about 6 GB/s on the AVX2 EPYC (11 GB/s possible).
inline void prefetch_group(const uint8_t* w, int64_t bytes) {
  const uint8_t* ahead = w + prefetch_distance();
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
}

__attribute__((target("avx2"))) inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Keeps RB vectors in registers at this point: GCC otherwise reassociates the integer sums of a whole group into
// wide trees whose temporaries spill to the stack (measured on the AVX2 EPYC: 3 of every 8 vpmaddubsw results
// went through memory).  It emits no instruction.
template <int RB>
__attribute__((target("avx2"))) inline void pin(__m256i* v) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) asm volatile("" : "+x"(v[r]));
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
    const int8_t* x0 = a.x(0, g);
    if (a.prefetch) prefetch_group(w, kQ4Bytes);
    __m256i isum[RB];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i lo = _mm256_and_si256(wv, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = x0 + r * kGroup;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x + 4 * v)),
                                           _mm256_maddubs_epi16(hi, broadcast4(x + 16 + 4 * v)));
        isum[r] = v == 0 ? p : _mm256_add_epi16(isum[r], p);
      }
      pin<RB>(isum);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 144)));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r], ones));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(sum, scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sum(r, g)), acc[r]);
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
    if (a.prefetch) prefetch_group(w, kQ8Bytes);
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < RB; ++r) {
        const __m256i x = _mm256_sign_epi8(broadcast4(a.x(r, g) + 4 * v), wv);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
      }
      pin<RB>(isum);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256)));
    for (int r = 0; r < RB; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
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
    if (a.prefetch) prefetch_group(w, kQ4Bytes);
    __m256i isum[RB], isum2[RB];  // two chains per row (low, high nibbles): twice the vpdpbusd in flight
    for (int r = 0; r < RB; ++r) isum[r] = isum2[r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i lo = _mm256_and_si256(wv, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = a.x(r, g);
        isum[r] = _mm256_dpbusd_epi32(isum[r], lo, broadcast4(x + 4 * v));
        isum2[r] = _mm256_dpbusd_epi32(isum2[r], hi, broadcast4(x + 16 + 4 * v));
      }
      pin<RB>(isum);
      pin<RB>(isum2);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 144)));
    for (int r = 0; r < RB; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum[r], isum2[r])), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sum(r, g)), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// int8 weights on VNNI: codes + 128 as u8, minus 128 * sum(x) per group (exact in 32 bits).  The group's sum of
// x is the row's (`quantize_rows`: its two half sums), so each code vector costs one vpdpbusd per row; up to 4
// rows, two chains per row (even and odd code vectors: twice the vpdpbusd in flight), summed as integers.  A
// second vpdpbusd per vector had summed x again for every tile: the int8 head of Qwen2.5-Coder-1.5B (151,936 x
// 1,536) is a quarter of its pass's bytes and all of a tree's rows run through it.
template <int RB>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void q8_tile_vnni(
    const uint8_t* w, const RowsView& a, float* out) {
  constexpr bool kTwo = RB <= 4;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ8Bytes) {
    if (a.prefetch) prefetch_group(w, kQ8Bytes);
    __m256i isum[RB], isum2[RB];
    for (int r = 0; r < RB; ++r) isum[r] = isum2[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v)), bias);
      for (int r = 0; r < RB; ++r) {
        const __m256i x = broadcast4(a.x(r, g) + 4 * v);
        if (kTwo && (v & 1))
          isum2[r] = _mm256_dpbusd_epi32(isum2[r], wu, x);
        else
          isum[r] = _mm256_dpbusd_epi32(isum[r], wu, x);
      }
      pin<RB>(isum);
      if constexpr (kTwo) pin<RB>(isum2);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256)));
    for (int r = 0; r < RB; ++r) {
      const int32_t* h = a.halves(r, g);
      const __m256i sum = kTwo ? _mm256_add_epi32(isum[r], isum2[r]) : isum[r];
      const __m256i exact = _mm256_sub_epi32(sum, _mm256_set1_epi32((h[0] + h[1]) * 128));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// Q4_K on AVX2 / VNNI: the int4 group core, with each group's scale and low made from the super-block's
// d and dmin (converted once per super-block) and the group's 6-bit sc and m (exact products), then the same
// float steps as int4.
#define STAGEDSPEC_Q4K_TILE(NAME, TARGET) \
template <int RB, bool Vnni> \
__attribute__((target(TARGET))) void NAME(const uint8_t* w, const RowsView& a, float* out) { \
  const __m256i low = _mm256_set1_epi8(0x0F); \
  const __m256i ones = _mm256_set1_epi16(1); \
  __m256 acc[RB]; \
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps(); \
  for (int64_t g0 = 0; g0 < a.G; g0 += kGroupsPerSuper, w += kQ4KSuperBytes) { \
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); \
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * kTile))); \
    for (int64_t j = 0; j < kGroupsPerSuper; ++j) { \
    const int64_t g = g0 + j; \
    const uint8_t* grp = w + 4 * kTile + j * kQ4KGroupBytes; \
    if (a.prefetch) prefetch_group(grp, kQ4KGroupBytes); \
    __m256i isum[RB], isum2[RB]; \
    for (int r = 0; r < RB; ++r) isum[r] = isum2[r] = _mm256_setzero_si256(); \
    for (int v = 0; v < 4; ++v) { \
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * v)); \
      const __m256i lo = _mm256_and_si256(wv, low); \
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low); \
      for (int r = 0; r < RB; ++r) { \
        const int8_t* x = a.x(r, g); \
        if constexpr (Vnni) { \
          isum[r] = _mm256_dpbusd_epi32(isum[r], lo, broadcast4(x + 4 * v)); \
          isum2[r] = _mm256_dpbusd_epi32(isum2[r], hi, broadcast4(x + 16 + 4 * v)); \
        } else { \
          isum[r] = _mm256_add_epi16(isum[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x + 4 * v)), \
                                                               _mm256_maddubs_epi16(hi, broadcast4(x + 16 + 4 * v)))); \
        } \
      } \
      pin<RB>(isum); \
      if constexpr (Vnni) pin<RB>(isum2); \
    } \
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 128)))); \
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 136)))); \
    const __m256 dw = _mm256_mul_ps(d, sc); \
    const __m256 mw = _mm256_xor_ps(_mm256_mul_ps(dmin, m), _mm256_set1_ps(-0.f)); \
    for (int r = 0; r < RB; ++r) { \
      const __m256i exact = Vnni ? _mm256_add_epi32(isum[r], isum2[r]) : _mm256_madd_epi16(isum[r], ones); \
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g))); \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]); \
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sum(r, g)), acc[r]); \
    } \
    } \
  } \
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]); \
}

STAGEDSPEC_Q4K_TILE(q4k_tile_avx2_impl, "avx2,fma,f16c")
STAGEDSPEC_Q4K_TILE(q4k_tile_vnni_impl, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#undef STAGEDSPEC_Q4K_TILE

// The 8 code vectors (0..63 as bytes) of a Q6_K group: low nibbles | high pairs << 4.
template <int K>
__attribute__((target("avx2"))) inline __m256i q6k_high(__m256i h) {
  const __m256i mask = _mm256_set1_epi8(0x30);
  if constexpr (K == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), mask);
  if constexpr (K == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), mask);
  if constexpr (K == 2) return _mm256_and_si256(h, mask);
  return _mm256_and_si256(_mm256_srli_epi16(h, 2), mask);
}

__attribute__((target("avx2"))) inline void q6k_codes(const uint8_t* grp, __m256i* code) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128));
  const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 160));
  __m256i nib[4];
  for (int p = 0; p < 4; ++p) nib[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * p));
  code[0] = _mm256_or_si256(_mm256_and_si256(nib[0], low), q6k_high<0>(h0));
  code[1] = _mm256_or_si256(_mm256_and_si256(nib[1], low), q6k_high<1>(h0));
  code[2] = _mm256_or_si256(_mm256_and_si256(nib[2], low), q6k_high<2>(h0));
  code[3] = _mm256_or_si256(_mm256_and_si256(nib[3], low), q6k_high<3>(h0));
  code[4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[0], 4), low), q6k_high<0>(h1));
  code[5] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[1], 4), low), q6k_high<1>(h1));
  code[6] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[2], 4), low), q6k_high<2>(h1));
  code[7] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[3], 4), low), q6k_high<3>(h1));
}

// Q6_K on AVX2, in the int4 tiles' order: each pair of code vectors is unpacked once per row block and serves
// every row before the next pair, so only 4 code vectors and the rows' 32-bit sums are live (the earlier form
// held all 8 code vectors across rows and spilled).  vpmaddubsw pairs a code with an activation (at most
// 2 * 63 * 127 = 16002 per 16-bit lane; two vectors add to 32004 < 32767), vpmaddwd applies the sub-block's
// scale into 32 bits, and one more vpmaddwd subtracts 32 * sc * sum(x) from the packed negated half sums
// (|32 sc| <= 4096 fits 16 bits).  The integer is sum_sub sc * (sum code * x - 32 * sum x), as in every path.
template <int RB>
__attribute__((target("avx2,fma,f16c"))) void q6k_tile_avx2(const uint8_t* w, const RowsView& a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  __m256 dw = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* head = w + (g / kGroupsPerSuper) * kQ6KSuperBytes;
    const uint8_t* grp = head + 2 * kTile + (g % kGroupsPerSuper) * kQ6KGroupBytes;
    if (g % kGroupsPerSuper == 0) dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
    if (a.prefetch) prefetch_group(grp, kQ6KGroupBytes);
    const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 192)));
    const __m256i sc2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 200)));
    const int8_t* x0 = a.x(0, g);
    __m256i isum[RB];
#pragma GCC unroll 4
    for (int quarter = 0; quarter < 4; ++quarter) {
      // code vectors 2q, 2q + 1: low nibbles of vectors 0..3 (sub-block 1), then their high nibbles (sub-block 2)
      const int pair = quarter & 1, sub = quarter >> 1;
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128 + 32 * sub));
      __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * pair));
      __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * pair + 32));
      if (sub) {
        n0 = _mm256_srli_epi16(n0, 4);
        n1 = _mm256_srli_epi16(n1, 4);
      }
      const __m256i c0 = _mm256_or_si256(_mm256_and_si256(n0, low), pair ? q6k_high<2>(h) : q6k_high<0>(h));
      const __m256i c1 = _mm256_or_si256(_mm256_and_si256(n1, low), pair ? q6k_high<3>(h) : q6k_high<1>(h));
      const __m256i sc = sub ? sc2 : sc1;
      const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(sc, lo16), _mm256_slli_epi32(sc, 16));
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = x0 + r * kGroup + 16 * sub + 8 * pair;
        const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(x)),
                                           _mm256_maddubs_epi16(c1, broadcast4(x + 4)));
        const __m256i t = _mm256_madd_epi16(s, sc16);
        isum[r] = quarter == 0 ? t : _mm256_add_epi32(isum[r], t);
      }
      pin<RB>(isum);
    }
    const __m256i sc32 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(sc1, 5), lo16), _mm256_slli_epi32(sc2, 21));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256i hn = _mm256_set1_epi32(a.neg_halves(r, g));
      const __m256i exact = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sc32, hn));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// Q6_K on VNNI: vpdpbusd sums a sub-block straight into 32 bits and vpmulld applies the scale; the -32 offset's
// term comes from the packed negated half sums in one vpmaddwd, as on AVX2 (faster than two vpmulld:
// docs/measurements.md, "Q6_K on VNNI: vpdpbusd against two vpmulld").  The same integer as above, so the same bits.
template <int RB>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void q6k_tile_vnni(
    const uint8_t* w, const RowsView& a, float* out) {
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  __m256 dw = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* head = w + (g / kGroupsPerSuper) * kQ6KSuperBytes;
    const uint8_t* grp = head + 2 * kTile + (g % kGroupsPerSuper) * kQ6KGroupBytes;
    if (g % kGroupsPerSuper == 0) dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
    if (a.prefetch) prefetch_group(grp, kQ6KGroupBytes);
    __m256i code[8];
    q6k_codes(grp, code);
    const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 192)));
    const __m256i sc2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 200)));
    const __m256i sc32 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(sc1, 5), lo16), _mm256_slli_epi32(sc2, 21));
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.x(r, g);
      __m256i u1 = _mm256_setzero_si256(), u2 = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        u1 = _mm256_dpbusd_epi32(u1, code[v], broadcast4(x + 4 * v));
        u2 = _mm256_dpbusd_epi32(u2, code[v + 4], broadcast4(x + 16 + 4 * v));
      }
      const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(u1, sc1), _mm256_mullo_epi32(u2, sc2));
      const __m256i exact = _mm256_add_epi32(t, _mm256_madd_epi16(sc32, _mm256_set1_epi32(a.neg_halves(r, g))));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

template <int RB> void q4k_tile_avx2(const uint8_t* w, const RowsView& a, float* out) { q4k_tile_avx2_impl<RB, false>(w, a, out); }
template <int RB> void q4k_tile_vnni(const uint8_t* w, const RowsView& a, float* out) { q4k_tile_vnni_impl<RB, true>(w, a, out); }

// The fifth bit of code vector K, moved to bit 4 of each byte.
template <int K>
__attribute__((target("avx2"))) inline __m256i q5_high(__m256i h) {
  const __m256i mask = _mm256_set1_epi8(0x10);
  if constexpr (K <= 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - K), mask);
  return _mm256_and_si256(_mm256_srli_epi16(h, K - 4), mask);
}

__attribute__((target("avx2"))) inline void q5_codes(const uint8_t* grp, __m256i* code) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128));
  __m256i nib[4];
  for (int p = 0; p < 4; ++p) nib[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * p));
  code[0] = _mm256_or_si256(_mm256_and_si256(nib[0], low), q5_high<0>(h));
  code[1] = _mm256_or_si256(_mm256_and_si256(nib[1], low), q5_high<1>(h));
  code[2] = _mm256_or_si256(_mm256_and_si256(nib[2], low), q5_high<2>(h));
  code[3] = _mm256_or_si256(_mm256_and_si256(nib[3], low), q5_high<3>(h));
  code[4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[0], 4), low), q5_high<4>(h));
  code[5] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[1], 4), low), q5_high<5>(h));
  code[6] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[2], 4), low), q5_high<6>(h));
  code[7] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib[3], 4), low), q5_high<7>(h));
}

// Q5_0: codes 0..31 against int8 activations (vpmaddubsw at most 2 * 31 * 127 = 7874 per 16-bit lane, four
// vectors 31496 < 32767), then the int4 path's float steps with low = -16 d (exact).
#define STAGEDSPEC_Q5_TILE(NAME, TARGET) \
template <int RB, bool Vnni> \
__attribute__((target(TARGET))) void NAME(const uint8_t* w, const RowsView& a, float* out) { \
  const __m256i ones = _mm256_set1_epi16(1); \
  __m256 acc[RB]; \
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps(); \
  for (int64_t g = 0; g < a.G; ++g, w += kQ5Bytes) { \
    if (a.prefetch) prefetch_group(w, kQ5Bytes); \
    __m256i code[8]; \
    q5_codes(w, code); \
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 160))); \
    const __m256 mw = _mm256_mul_ps(dw, _mm256_set1_ps(-16.f)); \
    for (int r = 0; r < RB; ++r) { \
      const int8_t* x = a.x(r, g); \
      __m256i exact; \
      if constexpr (Vnni) { \
        __m256i e0 = _mm256_setzero_si256(), e1 = _mm256_setzero_si256(); \
        for (int v = 0; v < 4; ++v) { \
          e0 = _mm256_dpbusd_epi32(e0, code[v], broadcast4(x + 4 * v)); \
          e1 = _mm256_dpbusd_epi32(e1, code[v + 4], broadcast4(x + 16 + 4 * v)); \
        } \
        exact = _mm256_add_epi32(e0, e1); \
      } else { \
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); \
        for (int v = 0; v < 4; ++v) { \
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(code[v], broadcast4(x + 4 * v))); \
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(code[v + 4], broadcast4(x + 16 + 4 * v))); \
        } \
        exact = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones)); \
      } \
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g))); \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]); \
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sum(r, g)), acc[r]); \
    } \
  } \
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]); \
}

STAGEDSPEC_Q5_TILE(q5_tile_vnni_impl, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#undef STAGEDSPEC_Q5_TILE

// Q5_0 on AVX2 in the int4 tiles' order: code vectors 2h, 2h + 1 (inputs 8h..8h+7) and 2h + 4, 2h + 5 (inputs
// 16 + 8h..) are unpacked once per row block and serve every row before the next four, so only four code
// vectors and the rows' sums are live (all eight, held across rows, spilled).  Four vpmaddubsw results add to
// at most 4 * 7874 = 31496 < 32767 in 16 bits; vpmaddwd widens each half group's, and the two halves add in 32
// bits: the integer of the other paths, so the same bits.
template <int RB>
__attribute__((target("avx2,fma,f16c"))) void q5_tile_avx2(const uint8_t* w, const RowsView& a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += kQ5Bytes) {
    const int8_t* x0 = a.x(0, g);
    if (a.prefetch) prefetch_group(w, kQ5Bytes);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128));
    __m256i isum[RB];
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * half));
      const __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * half + 32));
      const __m256i c0 = _mm256_or_si256(_mm256_and_si256(n0, low), half ? q5_high<2>(h) : q5_high<0>(h));
      const __m256i c1 = _mm256_or_si256(_mm256_and_si256(n1, low), half ? q5_high<3>(h) : q5_high<1>(h));
      const __m256i c4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), low),
                                         half ? q5_high<6>(h) : q5_high<4>(h));
      const __m256i c5 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), low),
                                         half ? q5_high<7>(h) : q5_high<5>(h));
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = x0 + r * kGroup + 8 * half;
        const __m256i s = _mm256_add_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(x)), _mm256_maddubs_epi16(c1, broadcast4(x + 4))),
            _mm256_add_epi16(_mm256_maddubs_epi16(c4, broadcast4(x + 16)), _mm256_maddubs_epi16(c5, broadcast4(x + 20))));
        const __m256i t = _mm256_madd_epi16(s, ones);
        isum[r] = half == 0 ? t : _mm256_add_epi32(isum[r], t);
      }
      pin<RB>(isum);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 160)));
    const __m256 mw = _mm256_mul_ps(dw, _mm256_set1_ps(-16.f));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.scale(r, g)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sum(r, g)), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}
template <int RB> void q5_tile_vnni(const uint8_t* w, const RowsView& a, float* out) { q5_tile_vnni_impl<RB, true>(w, a, out); }

// ---------------------------------------------------------------------------------------------------------
// Two adjacent tiles (16 outputs) in 512-bit registers, for cores that run 512-bit operations whole (Zen 5,
// Intel's server cores: twice the int8 multiply-adds of 256-bit `vpdpbusd` at the same instruction rate;
// `peak.cpp`).  Lanes 0-7 are the first tile's outputs, lanes 8-15 the second's, and each lane goes through
// the 256-bit VNNI tile's operations in the same order (exact integer sums, then the same float steps), so
// the results are the same bits.  Half the instructions per output; the tiles' bytes are not moved, so every
// path reads one packing.
#define STAGEDSPEC_W512 "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"

// Prefetching for a pair of adjacent tiles t, t + 1 (`w1 - w0` bytes each), read side by side: tile t + 1's
// stream runs on into tile t + 2, where the next pair starts; tile t's would run into t + 1, read already, so
// past its end it goes to tile t + 3 instead.  `p0`, `p1`: the groups being read in each.
inline void prefetch_pair(const uint8_t* w0, const uint8_t* w1, const uint8_t* p0, const uint8_t* p1, int64_t bytes) {
  const int64_t tile = w1 - w0, distance = prefetch_distance();
  for (int64_t b = 0; b < bytes; b += 64) {
    const uint8_t* ahead = p0 + distance + b;
    if (ahead >= w1) ahead += 2 * tile;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p1 + distance + b), _MM_HINT_T1);
  }
}

__attribute__((target(STAGEDSPEC_W512))) inline __m512i pair_load(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// 8 fp16 values from each tile -> 16 floats.
__attribute__((target(STAGEDSPEC_W512))) inline __m512 pair_halves(const uint8_t* p0, const uint8_t* p1) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
  return _mm512_cvtph_ps(h);
}

// 8 bytes from each tile -> 16 int32 (unsigned or signed bytes).
template <bool Signed>
__attribute__((target(STAGEDSPEC_W512))) inline __m512i pair_bytes(const uint8_t* p0, const uint8_t* p1) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  return Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

__attribute__((target(STAGEDSPEC_W512))) inline __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int RB>
__attribute__((target(STAGEDSPEC_W512))) inline void pin512(__m512i* v) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) asm volatile("" : "+v"(v[r]));
}

template <int RB>
__attribute__((target(STAGEDSPEC_W512))) inline void store_pair(const __m512* acc, float* out) {
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out + r * 2 * kTile, acc[r]);
}

// The 4-bit group core of the int4 and Q4_K pairs: the low and high nibbles of a group's four code vectors
// (two tiles side by side) against each row's int8 activations, summed in two 32-bit chains per row.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) inline void nibble_sums512(const uint8_t* g0, const uint8_t* g1,
                                                                     const RowsView& a, int64_t g, __m512i* isum,
                                                                     __m512i* isum2) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < RB; ++r) isum[r] = isum2[r] = _mm512_setzero_si512();
  for (int v = 0; v < 4; ++v) {
    const __m512i wv = pair_load(g0 + 32 * v, g1 + 32 * v);
    const __m512i lo = _mm512_and_si512(wv, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.x(r, g);
      isum[r] = _mm512_dpbusd_epi32(isum[r], lo, broadcast4_512(x + 4 * v));
      isum2[r] = _mm512_dpbusd_epi32(isum2[r], hi, broadcast4_512(x + 16 + 4 * v));
    }
    pin512<RB>(isum);
    pin512<RB>(isum2);
  }
}

// int4: `q4_tile_vnni` on two tiles.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) void q4_pair_vnni512(const uint8_t* w0, const uint8_t* w1, const RowsView& a,
                                                              float* out) {
  const uint8_t *base0 = w0, *base1 = w1;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w0 += kQ4Bytes, w1 += kQ4Bytes) {
    if (a.prefetch) prefetch_pair(base0, base1, w0, w1, kQ4Bytes);
    __m512i isum[RB], isum2[RB];
    nibble_sums512<RB>(w0, w1, a, g, isum, isum2);
    const __m512 dw = pair_halves(w0 + 128, w1 + 128);
    const __m512 mw = pair_halves(w0 + 144, w1 + 144);
    for (int r = 0; r < RB; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.scale(r, g)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(isum[r], isum2[r])), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sum(r, g)), acc[r]);
    }
  }
  store_pair<RB>(acc, out);
}

// int8: `q8_tile_vnni` on two tiles.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) void q8_pair_vnni512(const uint8_t* w0, const uint8_t* w1, const RowsView& a,
                                                              float* out) {
  constexpr bool kTwo = RB <= 4;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t *base0 = w0, *base1 = w1;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w0 += kQ8Bytes, w1 += kQ8Bytes) {
    if (a.prefetch) prefetch_pair(base0, base1, w0, w1, kQ8Bytes);
    __m512i isum[RB], isum2[RB];
    for (int r = 0; r < RB; ++r) isum[r] = isum2[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const __m512i wu = _mm512_xor_si512(pair_load(w0 + 32 * v, w1 + 32 * v), bias);
      for (int r = 0; r < RB; ++r) {
        const __m512i x = broadcast4_512(a.x(r, g) + 4 * v);
        if (kTwo && (v & 1))
          isum2[r] = _mm512_dpbusd_epi32(isum2[r], wu, x);
        else
          isum[r] = _mm512_dpbusd_epi32(isum[r], wu, x);
      }
      pin512<RB>(isum);
      if constexpr (kTwo) pin512<RB>(isum2);
    }
    const __m512 dw = pair_halves(w0 + 256, w1 + 256);
    for (int r = 0; r < RB; ++r) {
      const int32_t* h = a.halves(r, g);
      const __m512i sum = kTwo ? _mm512_add_epi32(isum[r], isum2[r]) : isum[r];
      const __m512i exact = _mm512_sub_epi32(sum, _mm512_set1_epi32((h[0] + h[1]) * 128));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.scale(r, g)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  store_pair<RB>(acc, out);
}

// Q4_K: `q4k_tile_vnni` on two tiles.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) void q4k_pair_vnni512(const uint8_t* w0, const uint8_t* w1, const RowsView& a,
                                                               float* out) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const uint8_t *base0 = w0, *base1 = w1;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < a.G; g0 += kGroupsPerSuper, w0 += kQ4KSuperBytes, w1 += kQ4KSuperBytes) {
    const __m512 d = pair_halves(w0, w1);
    const __m512 dmin = pair_halves(w0 + 2 * kTile, w1 + 2 * kTile);
    for (int64_t j = 0; j < kGroupsPerSuper; ++j) {
      const int64_t g = g0 + j;
      const uint8_t* grp0 = w0 + 4 * kTile + j * kQ4KGroupBytes;
      const uint8_t* grp1 = w1 + 4 * kTile + j * kQ4KGroupBytes;
      if (a.prefetch) prefetch_pair(base0, base1, grp0, grp1, kQ4KGroupBytes);
      __m512i isum[RB], isum2[RB];
      nibble_sums512<RB>(grp0, grp1, a, g, isum, isum2);
      const __m512 sc = _mm512_cvtepi32_ps(pair_bytes<false>(grp0 + 128, grp1 + 128));
      const __m512 m = _mm512_cvtepi32_ps(pair_bytes<false>(grp0 + 136, grp1 + 136));
      const __m512 dw = _mm512_mul_ps(d, sc);
      // -(dmin * m): the sign flipped by xor, as `_mm256_xor_ps` with -0.f does
      const __m512 mw = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, m)), sign));
      for (int r = 0; r < RB; ++r) {
        const __m512i exact = _mm512_add_epi32(isum[r], isum2[r]);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.scale(r, g)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sum(r, g)), acc[r]);
      }
    }
  }
  store_pair<RB>(acc, out);
}

// Q6_K: the code vectors of `q6k_codes`, two tiles at a time.
template <int K>
__attribute__((target(STAGEDSPEC_W512))) inline __m512i q6k_high512(__m512i h) {
  const __m512i mask = _mm512_set1_epi8(0x30);
  if constexpr (K == 0) return _mm512_and_si512(_mm512_slli_epi16(h, 4), mask);
  if constexpr (K == 1) return _mm512_and_si512(_mm512_slli_epi16(h, 2), mask);
  if constexpr (K == 2) return _mm512_and_si512(h, mask);
  return _mm512_and_si512(_mm512_srli_epi16(h, 2), mask);
}

__attribute__((target(STAGEDSPEC_W512))) inline void q6k_codes512(const uint8_t* g0, const uint8_t* g1, __m512i* code) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i h0 = pair_load(g0 + 128, g1 + 128);
  const __m512i h1 = pair_load(g0 + 160, g1 + 160);
  __m512i nib[4];
  for (int p = 0; p < 4; ++p) nib[p] = pair_load(g0 + 32 * p, g1 + 32 * p);
  code[0] = _mm512_or_si512(_mm512_and_si512(nib[0], low), q6k_high512<0>(h0));
  code[1] = _mm512_or_si512(_mm512_and_si512(nib[1], low), q6k_high512<1>(h0));
  code[2] = _mm512_or_si512(_mm512_and_si512(nib[2], low), q6k_high512<2>(h0));
  code[3] = _mm512_or_si512(_mm512_and_si512(nib[3], low), q6k_high512<3>(h0));
  code[4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[0], 4), low), q6k_high512<0>(h1));
  code[5] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[1], 4), low), q6k_high512<1>(h1));
  code[6] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[2], 4), low), q6k_high512<2>(h1));
  code[7] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[3], 4), low), q6k_high512<3>(h1));
}

// Q6_K: `q6k_tile_vnni` on two tiles.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) void q6k_pair_vnni512(const uint8_t* w0, const uint8_t* w1, const RowsView& a,
                                                               float* out) {
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dw = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* head0 = w0 + (g / kGroupsPerSuper) * kQ6KSuperBytes;
    const uint8_t* head1 = w1 + (g / kGroupsPerSuper) * kQ6KSuperBytes;
    const uint8_t* grp0 = head0 + 2 * kTile + (g % kGroupsPerSuper) * kQ6KGroupBytes;
    const uint8_t* grp1 = head1 + 2 * kTile + (g % kGroupsPerSuper) * kQ6KGroupBytes;
    if (g % kGroupsPerSuper == 0) dw = pair_halves(head0, head1);
    if (a.prefetch) prefetch_pair(w0, w1, grp0, grp1, kQ6KGroupBytes);
    __m512i code[8];
    q6k_codes512(grp0, grp1, code);
    const __m512i sc1 = pair_bytes<true>(grp0 + 192, grp1 + 192);
    const __m512i sc2 = pair_bytes<true>(grp0 + 200, grp1 + 200);
    const __m512i sc32 = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(sc1, 5), lo16), _mm512_slli_epi32(sc2, 21));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.x(r, g);
      __m512i u1 = _mm512_setzero_si512(), u2 = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        u1 = _mm512_dpbusd_epi32(u1, code[v], broadcast4_512(x + 4 * v));
        u2 = _mm512_dpbusd_epi32(u2, code[v + 4], broadcast4_512(x + 16 + 4 * v));
      }
      const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(u1, sc1), _mm512_mullo_epi32(u2, sc2));
      const __m512i exact = _mm512_add_epi32(t, _mm512_madd_epi16(sc32, _mm512_set1_epi32(a.neg_halves(r, g))));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.scale(r, g)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
    }
  }
  store_pair<RB>(acc, out);
}

// Q5_0: the code vectors of `q5_codes`, two tiles at a time.
template <int K>
__attribute__((target(STAGEDSPEC_W512))) inline __m512i q5_high512(__m512i h) {
  const __m512i mask = _mm512_set1_epi8(0x10);
  if constexpr (K <= 4) return _mm512_and_si512(_mm512_slli_epi16(h, 4 - K), mask);
  return _mm512_and_si512(_mm512_srli_epi16(h, K - 4), mask);
}

// Q5_0: `q5_tile_vnni` on two tiles.
template <int RB>
__attribute__((target(STAGEDSPEC_W512))) void q5_pair_vnni512(const uint8_t* w0, const uint8_t* w1, const RowsView& a,
                                                              float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 minus16 = _mm512_set1_ps(-16.f);
  const uint8_t *base0 = w0, *base1 = w1;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w0 += kQ5Bytes, w1 += kQ5Bytes) {
    if (a.prefetch) prefetch_pair(base0, base1, w0, w1, kQ5Bytes);
    const __m512i h = pair_load(w0 + 128, w1 + 128);
    __m512i nib[4], code[8];
    for (int p = 0; p < 4; ++p) nib[p] = pair_load(w0 + 32 * p, w1 + 32 * p);
    code[0] = _mm512_or_si512(_mm512_and_si512(nib[0], low), q5_high512<0>(h));
    code[1] = _mm512_or_si512(_mm512_and_si512(nib[1], low), q5_high512<1>(h));
    code[2] = _mm512_or_si512(_mm512_and_si512(nib[2], low), q5_high512<2>(h));
    code[3] = _mm512_or_si512(_mm512_and_si512(nib[3], low), q5_high512<3>(h));
    code[4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[0], 4), low), q5_high512<4>(h));
    code[5] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[1], 4), low), q5_high512<5>(h));
    code[6] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[2], 4), low), q5_high512<6>(h));
    code[7] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib[3], 4), low), q5_high512<7>(h));
    const __m512 dw = pair_halves(w0 + 160, w1 + 160);
    const __m512 mw = _mm512_mul_ps(dw, minus16);
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = a.x(r, g);
      __m512i e0 = _mm512_setzero_si512(), e1 = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        e0 = _mm512_dpbusd_epi32(e0, code[v], broadcast4_512(x + 4 * v));
        e1 = _mm512_dpbusd_epi32(e1, code[v + 4], broadcast4_512(x + 16 + 4 * v));
      }
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.scale(r, g)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(e0, e1)), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sum(r, g)), acc[r]);
    }
  }
  store_pair<RB>(acc, out);
}
#undef STAGEDSPEC_W512
#endif

#include "qlinear_amx.inc"

// ---------------------------------------------------------------------------------------------------------

using TileFn = void (*)(const uint8_t*, const RowsView&, float*);

using PairFn = void (*)(const uint8_t*, const uint8_t*, const RowsView&, float*);

// fn[n] computes a block of n rows, for n up to `block`; pair[n], where set, the same for two adjacent tiles at
// once (out: [n, 2 * kTile]).
struct TileKernels {
  TileFn fn[kMaxRowBlock + 1];
  int64_t block;
  PairFn pair[kMaxRowBlock + 1];
};

#define STAGEDSPEC_TABLE(name, f)                                                    \
  TileKernels name() { return TileKernels{{nullptr, &f<1>, &f<2>, &f<3>, &f<4>}, kRowBlock}; }
#define STAGEDSPEC_TABLE8(name, f)                                                   \
  TileKernels name() {                                                               \
    return TileKernels{{nullptr, &f<1>, &f<2>, &f<3>, &f<4>, &f<5>, &f<6>, &f<7>, &f<8>}, 8}; \
  }

STAGEDSPEC_TABLE(q4_scalar, q4_tile_scalar)
STAGEDSPEC_TABLE(q8_scalar, q8_tile_scalar)
STAGEDSPEC_TABLE(q4k_scalar, q4k_tile_scalar)
STAGEDSPEC_TABLE(q6k_scalar, q6k_tile_scalar)
STAGEDSPEC_TABLE(q5_scalar, q5_tile_scalar)
#ifdef STAGEDSPEC_X86
STAGEDSPEC_TABLE8(q4_avx2, q4_tile_avx2)
STAGEDSPEC_TABLE(q8_avx2, q8_tile_avx2)
STAGEDSPEC_TABLE8(q4_vnni, q4_tile_vnni)
STAGEDSPEC_TABLE8(q8_vnni, q8_tile_vnni)
STAGEDSPEC_TABLE8(q4k_avx2, q4k_tile_avx2)
STAGEDSPEC_TABLE8(q4k_vnni, q4k_tile_vnni)
STAGEDSPEC_TABLE8(q6k_avx2, q6k_tile_avx2)
STAGEDSPEC_TABLE8(q6k_vnni, q6k_tile_vnni)
STAGEDSPEC_TABLE8(q5_avx2, q5_tile_avx2)
STAGEDSPEC_TABLE8(q5_vnni, q5_tile_vnni)
#define STAGEDSPEC_PAIRS(name, single, f)                                                                      \
  TileKernels name() {                                                                                         \
    TileKernels t = single();                                                                                  \
    const PairFn pairs[] = {nullptr, &f<1>, &f<2>, &f<3>, &f<4>, &f<5>, &f<6>, &f<7>, &f<8>};                   \
    for (int64_t n = 1; n <= t.block; ++n) t.pair[n] = pairs[n];                                               \
    return t;                                                                                                  \
  }
STAGEDSPEC_PAIRS(q4_vnni512, q4_vnni, q4_pair_vnni512)
STAGEDSPEC_PAIRS(q8_vnni512, q8_vnni, q8_pair_vnni512)
STAGEDSPEC_PAIRS(q4k_vnni512, q4k_vnni, q4k_pair_vnni512)
STAGEDSPEC_PAIRS(q6k_vnni512, q6k_vnni, q6k_pair_vnni512)
STAGEDSPEC_PAIRS(q5_vnni512, q5_vnni, q5_pair_vnni512)
#undef STAGEDSPEC_PAIRS
#endif

TileKernels kernels_for(int64_t format, int64_t isa) {
#ifdef STAGEDSPEC_X86
  if (isa == kAvx512Vnni512 || isa == kAmx) {
    switch (format) {
      case kInt4: return q4_vnni512();
      case kInt8: return q8_vnni512();
      case kQ4K: return q4k_vnni512();
      case kQ5: return q5_vnni512();
      default: return q6k_vnni512();
    }
  }
  if (isa == kAvx512Vnni) {
    switch (format) {
      case kInt4: return q4_vnni();
      case kInt8: return q8_vnni();
      case kQ4K: return q4k_vnni();
      case kQ5: return q5_vnni();
      default: return q6k_vnni();
    }
  }
  if (isa == kAvx2) {
    switch (format) {
      case kInt4: return q4_avx2();
      case kInt8: return q8_avx2();
      case kQ4K: return q4k_avx2();
      case kQ5: return q5_avx2();
      default: return q6k_avx2();
    }
  }
#endif
  switch (format) {
    case kInt4: return q4_scalar();
    case kInt8: return q8_scalar();
    case kQ4K: return q4k_scalar();
    case kQ5: return q5_scalar();
    default: return q6k_scalar();
  }
}

// A run of output features stored in one format: tiles [first_tile, first_tile + tiles) of the pass.
struct Segment {
  TileKernels table;
#ifdef STAGEDSPEC_X86
  AmxKernels amx;
#endif
  int64_t first_tile, tiles, out_offset, N, bytes_per_tile;
  const uint8_t* w;
};

// The first `prefetch_distance()` bytes of a thread's share of the weights, requested at once: the tile kernels
// prefetch that far ahead of what they read, so without this the start of every call waits on one memory latency
// per group, one after another.  Measured on the AVX2 EPYC (2 threads): a 47 MB int4 matrix read as 96 calls
// of 492 KB ran at 9.4 GB/s against 14.4 GB/s as one call.
void prefetch_start(const std::vector<Segment>& segments, int64_t t0, int64_t t1) {
#ifdef STAGEDSPEC_X86
  int64_t left = prefetch_distance();
  for (const Segment& seg : segments) {
    const int64_t first = std::max(t0, seg.first_tile), last = std::min(t1, seg.first_tile + seg.tiles);
    if (first >= last) continue;
    const uint8_t* w = seg.w + (first - seg.first_tile) * seg.bytes_per_tile;
    const int64_t bytes = std::min(left, (last - first) * seg.bytes_per_tile);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + b), _MM_HINT_T0);
    left -= bytes;
    if (left <= 0) break;
  }
#endif
}

// Rows [r, r + n) x columns [col0, col0 + cols) of y (N wide; fp32 `yf` or bf16 `yb`, the other null) from a
// block of results `width` floats apart per row.
inline void store_block(const float* tmp, int64_t width, int64_t r, int64_t n, int64_t col0, int64_t cols, int64_t N,
                        float* yf, at::BFloat16* yb) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < cols; ++o) {
      const int64_t at = (r + i) * N + col0 + o;
      if (yb != nullptr)
        yb[at] = at::BFloat16(tmp[i * width + o]);
      else
        yf[at] = tmp[i * width + o];
    }
}

#ifdef STAGEDSPEC_X86
// The AMX form of `segmented_linear`'s sweep: threads split the tiles as there; each takes its tiles two at a
// time and runs every row of a chunk through them, 16 rows (one A tile) at a time.  Each thread loads the tile
// configuration at the start of its share (and again where a segment's format needs the other one) and releases
// the tiles at its end.
void amx_linear(const std::vector<Segment>& segments, int64_t tiles, const QuantizedRows& qa, int64_t R, int64_t N,
                float* yf, at::BFloat16* yb) {
  for (int64_t r0 = 0; r0 < R; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, R - r0);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<AmxGroup> groups(qa.G);
      std::vector<float> tmp(kRowChunk * 2 * kTile);
      size_t s = 0;
      int config = -1;  // none loaded yet by this share
      if (r0 == 0) prefetch_start(segments, t0, t1);
      for (int64_t t = t0; t < t1;) {
        while (t >= segments[s].first_tile + segments[s].tiles) ++s;
        const Segment& seg = segments[s];
        if (config != static_cast<int>(seg.amx.sub)) {
          config = seg.amx.sub;
          load_tile_config(seg.amx.sub);
        }
        const int64_t local = t - seg.first_tile;
        const uint8_t* w = seg.w + local * seg.bytes_per_tile;
        const bool pair = t + 1 < t1 && local + 1 < seg.tiles;
        const int64_t cols = std::min(pair ? 2 * kTile : kTile, seg.N - local * kTile);
        const int64_t col0 = seg.out_offset + local * kTile;
        seg.amx.fn(w, pair ? w + seg.bytes_per_tile : w, qa, r0, rows, r0 == 0, groups.data(), tmp.data());
        store_block(tmp.data(), 2 * kTile, r0, rows, col0, cols, N, yf, yb);
        t += pair ? 2 : 1;
      }
      if (config >= 0) release_tiles();
    });
  }
}
#endif

// y = x W^T for a weight stored as segments along its outputs (one segment for most layers).  The
// activations are quantised once; threads split the tiles of all segments; each tile serves every row.
at::Tensor segmented_linear(const at::Tensor& x, const at::Tensor& packed, at::IntArrayRef formats,
                            at::IntArrayRef outs, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "qlinear: x must be [rows, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qlinear: packed weights must be contiguous uint8");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be fp32 or bf16");
  TORCH_CHECK(formats.size() == outs.size() && !formats.empty(), "qlinear: one output count per format");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "qlinear: K must be a multiple of 32");
  const int64_t G = K / kGroup;
  std::vector<Segment> segments;
  int64_t tiles = 0, N = 0, bytes = 0;
  for (size_t i = 0; i < formats.size(); ++i) {
    const int64_t per_tile = tile_bytes(formats[i], K);
    TORCH_CHECK(per_tile > 0, "qlinear: format ", formats[i], " cannot hold K = ", K, " inputs");
    const int64_t n = outs[i], t = (n + kTile - 1) / kTile;
    TORCH_CHECK(n >= 0, "qlinear: negative output count");
    Segment seg{};
    seg.table = kernels_for(formats[i], isa);
#ifdef STAGEDSPEC_X86
    seg.amx = amx_kernels_for(formats[i]);
#endif
    seg.first_tile = tiles, seg.tiles = t, seg.out_offset = N, seg.N = n, seg.bytes_per_tile = per_tile;
    seg.w = packed.data_ptr<uint8_t>() + bytes;
    segments.push_back(seg);
    tiles += t;
    N += n;
    bytes += t * per_tile;
  }
  TORCH_CHECK(packed.numel() == bytes, "qlinear: packed weights do not match the formats, outputs and K");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0) return y;
  const bool q6k = std::find(formats.begin(), formats.end(), kQ6K) != formats.end();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  QuantizedRows& qa = scratch_rows();
  quantize_rows(bf16 ? nullptr : xc.data_ptr<float>(), bf16 ? xc.data_ptr<at::BFloat16>() : nullptr, R, K, isa, q6k, qa);
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  at::BFloat16* yb = bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
#ifdef STAGEDSPEC_X86
  if (isa == kAmx) {
    TORCH_CHECK(amx_usable(), "qlinear: AMX tiles are not usable in this process");
    amx_linear(segments, tiles, qa, R, N, yf, yb);
    return y;
  }
#endif
  for (int64_t r0 = 0; r0 < R; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, R - r0);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      float tmp[kMaxRowBlock * 2 * kTile];
      size_t s = 0;
      if (r0 == 0) prefetch_start(segments, t0, t1);
      for (int64_t t = t0; t < t1;) {
        while (t >= segments[s].first_tile + segments[s].tiles) ++s;
        const Segment& seg = segments[s];
        const int64_t local = t - seg.first_tile;
        const uint8_t* w = seg.w + local * seg.bytes_per_tile;
        // two tiles at once where the path pairs them, both are this thread's and this segment's
        const bool pair = rows >= g_pair_min_rows.load(std::memory_order_relaxed) && seg.table.pair[1] != nullptr &&
                          t + 1 < t1 && local + 1 < seg.tiles;
        const int64_t width = pair ? 2 * kTile : kTile;
        const int64_t cols = std::min(width, seg.N - local * kTile);
        const int64_t col0 = seg.out_offset + local * kTile;
        for (int64_t rb = 0; rb < rows; rb += seg.table.block) {
          const int64_t n = std::min(seg.table.block, rows - rb);
          const int64_t r = r0 + rb;
          const int64_t at0 = blocked(r, 0, G);  // row r's block, at its place in the block
          const RowsView view{qa.q.data() + at0 * kGroup, qa.d.data() + at0, qa.s.data() + at0,
                              qa.h.data() + 2 * at0, qa.hn.empty() ? nullptr : qa.hn.data() + at0, G, rb == 0};
          if (pair)
            seg.table.pair[n](w, w + seg.bytes_per_tile, view, tmp);
          else
            seg.table.fn[n](w, view, tmp);
          store_block(tmp, width, r, n, col0, cols, N, yf, yb);
        }
        t += pair ? 2 : 1;
      }
    });
  }
  return y;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, at::IntArrayRef formats, at::IntArrayRef outs,
                   int64_t isa) {
  return segmented_linear(x, packed, formats, outs, isa);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  const int64_t format = kInt4;
  return segmented_linear(x, packed, at::IntArrayRef(&format, 1), at::IntArrayRef(&N, 1), isa);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  const int64_t format = kInt8;
  return segmented_linear(x, packed, at::IntArrayRef(&format, 1), at::IntArrayRef(&N, 1), isa);
}

// The best instruction set this CPU runs: 4 (AMX int8 tiles, with AVX-512 VNNI below them), 3 (AVX-512 VNNI, also
// in 512-bit pairs of tiles), 1 (AVX2 + FMA + F16C) or 0 (portable C++).
int64_t best_isa() {
#ifdef STAGEDSPEC_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return amx_usable() ? kAmx : kAvx512Vnni512;  // runs both VNNI forms; `native.py` measures whether the 512-bit one pays
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

// How far ahead the tiles prefetch the weights they stream, in bytes: set to `bytes` when it is positive (64 to
// 1 MiB, whole cache lines), and returned.  A process-wide setting, as the thread count is: `native.py` chooses it
// by timing (`prefetch_pays`); the results do not depend on it, only the speed.
int64_t prefetch_ahead(int64_t bytes) {
  if (bytes > 0) {
    TORCH_CHECK(bytes % 64 == 0 && bytes <= (1 << 20), "prefetch_ahead: whole cache lines up to 1 MiB, got ", bytes);
    g_prefetch_ahead.store(bytes, std::memory_order_relaxed);
  }
  return g_prefetch_ahead.load(std::memory_order_relaxed);
}

// From how many rows the 512-bit path pairs tiles: set to `rows` when it is positive, and returned.  Process-wide,
// as the prefetch distance is; the results do not depend on it, only the speed.
int64_t pair_min_rows(int64_t rows) {
  if (rows > 0) g_pair_min_rows.store(rows, std::memory_order_relaxed);
  return g_pair_min_rows.load(std::memory_order_relaxed);
}

// `amx_state` where this build has the AMX path, else 4 (not built in).
int64_t amx_state_or_absent() {
#ifdef STAGEDSPEC_X86
  return amx_state();
#else
  return 4;
#endif
}

}  // namespace

// Schemas here, CPU kernels below: a CPU (not composite) registration lets `torch.compile` trace the ops
// through the shape functions `native.py` registers.
TORCH_LIBRARY(stagedspec_qlinear, m) {
  m.def("q4_linear(Tensor x, Tensor packed, int N, int isa) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int N, int isa) -> Tensor");
  m.def("qlinear(Tensor x, Tensor packed, int[] formats, int[] outs, int isa) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor? bias, float scale, int isa=-1) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
  m.def("prefetch_ahead(int bytes) -> int", &prefetch_ahead);
  m.def("pair_min_rows(int rows) -> int", &pair_min_rows);
  m.def("amx_state() -> int", &amx_state_or_absent);
}

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("qlinear", &qlinear);
}
