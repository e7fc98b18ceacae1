// Attention over the KV cache, each query row computed alone: bit-identical whatever else is in the pass.
//
// Why: with int8-quantised activations (qlinear.cpp) a last-bit difference anywhere can move an activation
// across a rounding boundary, and the difference then grows through the layers.  PyTorch's attention rounds
// a row differently depending on how many rows share the call (measured: a 7-row prompt pass and a 6 + 1
// split gave logits 0.86 apart on the int4 SmolLM2), so a verified tree would not reproduce one-token
// decoding.  Here every (sequence, head, query row) is one task with a fixed order of operations:
//   s_j = dot(q, k_j) * scale + bias_j   over the row's visible keys j (bias_j > -inf), where dot keeps 8
//         lanes for fp32 keys (lane l = fma chain over d = l, l + 8, ... in order) and adds them as
//         ((0+1)+(2+3))+((4+5)+(6+7)); bf16 keys keep 32 lanes folded to those 8 (`dot_lanes` below)
//   p_j = exp(s_j - max s)               our own polynomial, plain float operations
//   total = the same tree over 8 lanes, lane c mod 8 summing the c-th visible key's p in order
//   out = (sum_j fma(p_j, v_j, .) over visible j in slot order) * (1 / total)
// Masked keys take no part, so a row sees the same keys in the same order in a one-token pass and in a tree
// pass (a node's ancestors precede it in pre-order, as decoding wrote them): the same bits.  Nothing depends
// on a key's slot index, only on its rank among the visible keys.
//
// The AVX2 path computes 8 keys' dot products at once (their lane vectors reduced together with vhaddps,
// whose pairwise sums are the tree's) and the exponentials 8 at a time; the AVX-512 path does the same for the
// query heads of one key head together (`attend_group_avx512`); the portable path does the same operations one
// key at a time.  All give the same bits (checked at load and in the tests).  Every path reads only the keys
// from a row's first visible one to its last (`visible_span`).
//
// At a small model's shape, one key at a time with separate multiplies and adds took much longer than this path
// for 1 to 8 query rows (docs/measurements.md, "The AVX2 attention path against one key at a time on a Zen 3 EPYC").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STAGEDSPEC_X86 1
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kExpFloor = -87.f;
constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer (half to even)

// exp(x) for x <= 0: Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes' expf coefficients),
// written with plain float operations so that every compiler target computes the same bits.
inline float exp_nonpositive(float x) {
  if (x < kExpFloor) return 0.f;
  const float n = (x * 1.44269504088896341f + kMagic) - kMagic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

inline float tree8(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// The 8-lane dot product of the header: lane d % 8 takes fma(q[d], k[d], lane) in order of d.
template <typename T>
inline float dot_lanes(const float* q, const T* k, int64_t D) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t d = 0; d < D; ++d) acc[d % 8] = std::fma(q[d], as_float(k[d]), acc[d % 8]);
  return tree8(acc);
}

// bf16 keys: 32 lanes.  Element d of each block of 32 goes to lane (d % 2) * 16 + (d % 32) / 2 (a fma chain over the
// blocks in order), and the lanes are added as w[m] = (L[m] + L[m + 16]) + (L[m + 8] + L[m + 24]), then the 8 w as
// above.  Why not the 8 lanes of fp32: a bf16 pair in one 32-bit word widens to two floats with a shift and a mask
// (even and odd elements in separate registers), where keeping element order needs a shuffle per 8 elements, and
// the shuffles bounded the vector paths.
inline int64_t bf16_lane(int64_t d) { const int64_t r = d % 32; return (r % 2) * 16 + r / 2; }

inline float dot_lanes(const float* q, const at::BFloat16* k, int64_t D) {
  float acc[32] = {};
  for (int64_t d = 0; d < D; ++d) {
    float& lane = acc[bf16_lane(d)];
    lane = std::fma(q[d], static_cast<float>(k[d]), lane);
  }
  float w[8];
  for (int m = 0; m < 8; ++m) w[m] = (acc[m] + acc[m + 16]) + (acc[m + 8] + acc[m + 24]);
  return tree8(w);
}

// q in bf16 lane order (D a multiple of 32): qp[32 b + lane] = q[32 b + r], so the vector paths load lanes as they lie.
inline void bf16_lane_order(const float* q, int64_t D, float* qp) {
  for (int64_t d = 0; d < D; ++d) qp[d / 32 * 32 + bf16_lane(d)] = q[d];
}

// Step 1 of a row, one key at a time: scores (-inf where masked) and their maximum.
template <typename T>
float scores_portable(const float* q, const T* k, int64_t kvs, int64_t j0, int64_t S, int64_t D, const T* bias,
                      float scale, float* scores) {
  float top = kNegInf;
  for (int64_t j = j0; j < S; ++j) {
    const float b = bias ? as_float(bias[j]) : 0.f;
    if (b == kNegInf) {
      scores[j] = kNegInf;
      continue;
    }
    const float s = dot_lanes(q, k + j * kvs, D) * scale + b;
    scores[j] = s;
    top = s > top ? s : top;
  }
  return top;
}

// Steps 2-3: turns visible scores into p_j in place (from `j0` on; earlier ones are done) and returns total.
inline void exps_portable(float* scores, int64_t j0, int64_t S, float top) {
  for (int64_t j = j0; j < S; ++j)
    if (scores[j] != kNegInf) scores[j] = exp_nonpositive(scores[j] - top);
}

inline float total_of(const float* p, int64_t S) {
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (int64_t j = 0; j < S; ++j)
    if (p[j] != kNegInf) lanes[c++ % 8] += p[j];
  return tree8(lanes);
}

// The first and one past the last visible key of a bias row (0 / -inf), or [0, S) without one.
template <typename T>
inline void visible_span(const T* bias, int64_t S, int64_t& lo, int64_t& hi) {
  lo = 0, hi = S;
  if (!bias) return;
  while (lo < S && as_float(bias[lo]) == kNegInf) ++lo;
  while (hi > lo && as_float(bias[hi - 1]) == kNegInf) --hi;
}

template <typename T>
void attend_row_portable(const float* q, const T* k, const T* v, int64_t kvs, int64_t S, int64_t D, const T* bias,
                         float scale, float* scores, float* out) {
  int64_t lo, hi;
  visible_span(bias, S, lo, hi);
  const float top = scores_portable(q, k, kvs, lo, hi, D, bias, scale, scores);
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (top == kNegInf) return;  // no visible key (a padding row): zeros
  exps_portable(scores, lo, hi, top);
  const float inv = 1.f / total_of(scores + lo, hi - lo);
  for (int64_t j = lo; j < hi; ++j) {
    if (scores[j] == kNegInf) continue;
    const T* vj = v + j * kvs;
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(scores[j], as_float(vj[d]), out[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

#ifdef STAGEDSPEC_X86
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// One bf16 key's 8 w values (the bf16 contract above) on AVX2: even and odd elements widened by shift and mask.
__attribute__((target("avx2,fma"))) inline __m256 key_w8(const float* qp, const at::BFloat16* k, int64_t D) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < D; b += 32) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + b));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + b + 16));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + b), _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + b + 8), _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + b + 16), _mm256_castsi256_ps(_mm256_and_si256(x0, high)), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + b + 24), _mm256_castsi256_ps(_mm256_and_si256(x1, high)), a3);
  }
  return _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
}

// exp_nonpositive on 8 lanes: the same operations, so the same bits per lane.
__attribute__((target("avx2,fma"))) inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 magic = _mm256_set1_ps(kMagic);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
  // below the floor n can leave the exponent's range: those lanes are 0, as in the scalar branch
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  const __m256i nn = _mm256_cvttps_epi32(_mm256_andnot_ps(below, n));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(nn, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, scale));
}

// The row on AVX2 for D = 8 V: 8 keys' lane vectors at a time, reduced together.  V is a compile-time
// constant so that q and the output stay in registers.
template <typename T, int V>
__attribute__((target("avx2,fma"))) void attend_row_avx2(const float* q, const T* k, const T* v, int64_t kvs,
                                                          int64_t S, const T* bias, float scale, float* scores,
                                                          float* out) {
  constexpr int64_t D = 8 * V;
  __m256 qv[V];
  for (int64_t i = 0; i < V; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  alignas(32) float qp[D];
  if constexpr (kBf16) bf16_lane_order(q, D, qp);
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  __m256 top8 = ninf;
  int64_t lo, hi;
  visible_span(bias, S, lo, hi);
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    __m256 lanes[8];
    for (int u = 0; u < 8; ++u) {
      const T* kj = k + (j + u) * kvs;
      if constexpr (kBf16) {
        lanes[u] = key_w8(qp, kj, D);
      } else {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < V; ++i) acc = _mm256_fmadd_ps(qv[i], load8(kj + 8 * i), acc);
        lanes[u] = acc;
      }
    }
    const __m256 h01 = _mm256_hadd_ps(lanes[0], lanes[1]), h23 = _mm256_hadd_ps(lanes[2], lanes[3]);
    const __m256 h45 = _mm256_hadd_ps(lanes[4], lanes[5]), h67 = _mm256_hadd_ps(lanes[6], lanes[7]);
    const __m256 g0 = _mm256_hadd_ps(h01, h23), g1 = _mm256_hadd_ps(h45, h67);  // per 128-bit half: keys' halves
    const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
    const __m256 b = bias ? load8(bias + j) : _mm256_setzero_ps();
    const __m256 masked = _mm256_cmp_ps(b, ninf, _CMP_EQ_OQ);
    const __m256 s = _mm256_blendv_ps(_mm256_add_ps(_mm256_mul_ps(dots, vscale), b), ninf, masked);
    _mm256_storeu_ps(scores + j, s);
    top8 = _mm256_max_ps(top8, s);
  }
  float tops[8];
  _mm256_storeu_ps(tops, top8);
  float top = scores_portable(q, k, kvs, j, hi, D, bias, scale, scores);
  for (float t : tops) top = t > top ? t : top;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (top == kNegInf) return;
  const __m256 vtop = _mm256_set1_ps(top);
  int64_t e = lo;
  for (; e + 8 <= hi; e += 8) {
    const __m256 s = _mm256_loadu_ps(scores + e);
    const __m256 masked = _mm256_cmp_ps(s, ninf, _CMP_EQ_OQ);
    _mm256_storeu_ps(scores + e, _mm256_blendv_ps(exp8_nonpositive(_mm256_sub_ps(s, vtop)), ninf, masked));
  }
  exps_portable(scores, e, hi, top);
  const float inv = 1.f / total_of(scores + lo, hi - lo);
  // value sums, elementwise in slot order; bf16 values widened by shift and mask (o[2 b], o[2 b + 1]: the even
  // and odd elements of block b of 16), put back in element order at the end
  __m256 o[V];
  for (int64_t i = 0; i < V; ++i) o[i] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t jj = lo; jj < hi; ++jj) {
    if (scores[jj] == kNegInf) continue;
    const __m256 pj = _mm256_set1_ps(scores[jj]);
    const T* vj = v + jj * kvs;
    if constexpr (kBf16) {
      for (int64_t b = 0; b < V / 2; ++b) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vj + 16 * b));
        o[2 * b] = _mm256_fmadd_ps(pj, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), o[2 * b]);
        o[2 * b + 1] = _mm256_fmadd_ps(pj, _mm256_castsi256_ps(_mm256_and_si256(x, high)), o[2 * b + 1]);
      }
    } else {
      for (int64_t i = 0; i < V; ++i) o[i] = _mm256_fmadd_ps(pj, load8(vj + 8 * i), o[i]);
    }
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  if constexpr (kBf16) {
    alignas(32) float pair[16];
    for (int64_t b = 0; b < V / 2; ++b) {
      _mm256_store_ps(pair, _mm256_mul_ps(o[2 * b], vinv));
      _mm256_store_ps(pair + 8, _mm256_mul_ps(o[2 * b + 1], vinv));
      for (int i = 0; i < 8; ++i) out[16 * b + 2 * i] = pair[i], out[16 * b + 2 * i + 1] = pair[8 + i];
    }
  } else {
    for (int64_t i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(o[i], vinv));
  }
}

// The same operations on AVX-512 for the G query heads that share a key head (GQA), from one query row: each key
// and value is loaded and widened to float once for all of them.  Per head, every step is the row path's:
//   the dot keeps its lanes (fp32: 8, fma over d in order; bf16: the 32 of the contract above, widened by shift
//   and mask) and reduces 8 keys together with vhaddps; exp and the value sums are elementwise, so they run 16
//   lanes wide (value sums in slot order per element).
// Keys before the row's first visible key and after its last one are not read at all (a causal prompt pass skips
// the future half of the cache); masked keys between them take no part, as on the row path.
constexpr int kMaxGroup = 16;  // query heads per key head handled in one task (more run as several tasks)

__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp8_nonpositive on 16 lanes: the same operations per lane.
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 magic = _mm512_set1_ps(kMagic);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.f));
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  const __m512i nn = _mm512_cvttps_epi32(_mm512_mask_blend_ps(below, n, _mm512_setzero_ps()));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(nn, _mm512_set1_epi32(127)), 23));
  return _mm512_mask_blend_ps(below, _mm512_mul_ps(p, scale), _mm512_setzero_ps());
}

// total_of for n values none of which is masked, 8 at a time (lane c % 8 takes the c-th in order, as there).
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) inline float total_dense(const float* p, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + c));
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (; c < n; ++c) lanes[c % 8] += p[c];
  return tree8(lanes);
}


// Scores of `nh` heads (q rows `qf`, D floats apart) over keys [lo, hi): 8 keys at a time, each key widened once.
template <typename T, int V>
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) void group_scores(const float* qf, int nh, const T* k,
                                                                        int64_t kvs, int64_t lo, int64_t hi,
                                                                        const T* bias, float scale, float* scores,
                                                                        int64_t S, float* tops) {
  constexpr int64_t D = 8 * V;
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  alignas(64) float qlanes[std::is_same_v<T, at::BFloat16> ? kMaxGroup * D : 1];
  if constexpr (std::is_same_v<T, at::BFloat16>)
    for (int h = 0; h < nh; ++h) bf16_lane_order(qf + h * D, D, qlanes + h * D);
  __m256 top8[kMaxGroup];
  for (int h = 0; h < nh; ++h) top8[h] = ninf;
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    __m256 lanes[kMaxGroup][8];
    for (int u = 0; u < 8; ++u) {
      const T* kj = k + (j + u) * kvs;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        constexpr int NB = V / 4;  // blocks of 32 elements
        const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
        __m512 even[NB], odd[NB];
        for (int b = 0; b < NB; ++b) {
          const __m512i x = _mm512_loadu_si512(kj + 32 * b);
          even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
          odd[b] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        }
        for (int h = 0; h < nh; ++h) {
          const float* qh = qlanes + h * D;
          __m512 ae = _mm512_setzero_ps(), ao = ae;
          for (int b = 0; b < NB; ++b) {
            ae = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 32 * b), even[b], ae);
            ao = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 32 * b + 16), odd[b], ao);
          }
          const __m512 sum = _mm512_add_ps(ae, ao);
          lanes[h][u] = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
        }
      } else {
        __m256 kv[V];
        for (int i = 0; i < V; ++i) kv[i] = load8(kj + 8 * i);
        for (int h = 0; h < nh; ++h) {
          const float* qh = qf + h * D;
          __m256 acc = _mm256_setzero_ps();
          for (int i = 0; i < V; ++i) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), kv[i], acc);
          lanes[h][u] = acc;
        }
      }
    }
    const __m256 b = bias ? load8(bias + j) : _mm256_setzero_ps();
    const __m256 masked = _mm256_cmp_ps(b, ninf, _CMP_EQ_OQ);
    for (int h = 0; h < nh; ++h) {
      const __m256* l = lanes[h];
      const __m256 h01 = _mm256_hadd_ps(l[0], l[1]), h23 = _mm256_hadd_ps(l[2], l[3]);
      const __m256 h45 = _mm256_hadd_ps(l[4], l[5]), h67 = _mm256_hadd_ps(l[6], l[7]);
      const __m256 g0 = _mm256_hadd_ps(h01, h23), g1 = _mm256_hadd_ps(h45, h67);
      const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
      const __m256 s = _mm256_blendv_ps(_mm256_add_ps(_mm256_mul_ps(dots, vscale), b), ninf, masked);
      _mm256_storeu_ps(scores + h * S + j, s);
      top8[h] = _mm256_max_ps(top8[h], s);
    }
  }
  for (int h = 0; h < nh; ++h) {
    float t8[8];
    _mm256_storeu_ps(t8, top8[h]);
    float top = scores_portable(qf + h * D, k, kvs, j, hi, D, bias, scale, scores + h * S);
    for (float t : t8) top = t > top ? t : top;
    tops[h] = top;
  }
}

// Value sums of `nh` heads over keys [lo, hi) in slot order, each value widened once: out (nh x D) = sum p v.
template <typename T, int Z, int NH>
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) void group_values(const float* p, int nh, const T* v,
                                                                        int64_t kvs, int64_t lo, int64_t hi,
                                                                        int64_t S, float* out) {
  constexpr int64_t D = 16 * Z;
  for (int h0 = 0; h0 < nh; h0 += NH) {
    const int n = nh - h0 < NH ? nh - h0 : NH;
    __m512 o[NH][Z];
    for (int h = 0; h < NH; ++h)
      for (int z = 0; z < Z; ++z) o[h][z] = _mm512_setzero_ps();
    for (int64_t j = lo; j < hi; ++j) {
      const T* vj = v + j * kvs;
      __m512 vv[Z];
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // vv[2 b], vv[2 b + 1]: block b's even and odd elements
        const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
        for (int b = 0; b < Z / 2; ++b) {
          const __m512i x = _mm512_loadu_si512(vj + 32 * b);
          vv[2 * b] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
          vv[2 * b + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        }
      } else {
        for (int z = 0; z < Z; ++z) vv[z] = load16(vj + 16 * z);
      }
      for (int h = 0; h < NH; ++h) {
        if (h >= n) break;
        const float pj = p[(h0 + h) * S + j];
        if (pj == kNegInf) continue;
        const __m512 pv = _mm512_set1_ps(pj);
        for (int z = 0; z < Z; ++z) o[h][z] = _mm512_fmadd_ps(pv, vv[z], o[h][z]);
      }
    }
    for (int h = 0; h < n; ++h) {
      float* oh = out + (h0 + h) * D;
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // back to element order
        alignas(64) float pair[32];
        for (int b = 0; b < Z / 2; ++b) {
          _mm512_store_ps(pair, o[h][2 * b]);
          _mm512_store_ps(pair + 16, o[h][2 * b + 1]);
          for (int i = 0; i < 16; ++i) oh[32 * b + 2 * i] = pair[i], oh[32 * b + 2 * i + 1] = pair[16 + i];
        }
      } else {
        for (int z = 0; z < Z; ++z) _mm512_storeu_ps(oh + 16 * z, o[h][z]);
      }
    }
  }
}

// One query row's heads h0 .. h0 + nh (all reading one key head): the row path's results for each.
template <typename T, int V>
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma"))) void attend_group_avx512(const float* qf, int nh, const T* k,
                                                                               const T* v, int64_t kvs, int64_t S,
                                                                               const T* bias, float scale,
                                                                               float* scores, float* out) {
  constexpr int64_t D = 8 * V;
  int64_t lo, hi;
  visible_span(bias, S, lo, hi);
  for (int64_t d = 0; d < nh * D; ++d) out[d] = 0.f;
  if (lo >= hi) return;  // no visible key (a padding row): zeros
  float tops[kMaxGroup], inv[kMaxGroup];
  group_scores<T, V>(qf, nh, k, kvs, lo, hi, bias, scale, scores, S, tops);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  for (int h = 0; h < nh; ++h) {
    float* sh = scores + h * S;
    if (tops[h] == kNegInf) {  // every visible score -inf: the row path returns zeros for this head
      for (int64_t j = lo; j < hi; ++j) sh[j] = kNegInf;
      inv[h] = 0.f;
      continue;
    }
    const __m512 vtop = _mm512_set1_ps(tops[h]);
    int64_t e = lo;
    __mmask16 any_masked = 0;
    for (; e + 16 <= hi; e += 16) {
      const __m512 s = _mm512_loadu_ps(sh + e);
      const __mmask16 masked = _mm512_cmp_ps_mask(s, ninf, _CMP_EQ_OQ);
      any_masked |= masked;
      _mm512_storeu_ps(sh + e, _mm512_mask_blend_ps(masked, exp16_nonpositive(_mm512_sub_ps(s, vtop)), ninf));
    }
    for (int64_t j = e; j < hi; ++j) any_masked |= sh[j] == kNegInf;
    exps_portable(sh, e, hi, tops[h]);
    // no masked key inside the span (a prompt's causal rows): the c-th key is the c-th visible one, so lane c % 8
    // adds 8 keys at a time in the same order
    inv[h] = 1.f / (any_masked ? total_of(sh + lo, hi - lo) : total_dense(sh + lo, hi - lo));
  }
  if constexpr (V == 8) group_values<T, 4, 5>(scores, nh, v, kvs, lo, hi, S, out);
  else if constexpr (V == 16) group_values<T, 8, 2>(scores, nh, v, kvs, lo, hi, S, out);
  else group_values<T, 16, 1>(scores, nh, v, kvs, lo, hi, S, out);
  for (int h = 0; h < nh; ++h) {
    const __m512 vinv = _mm512_set1_ps(inv[h]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + h * D + d, _mm512_mul_ps(_mm512_loadu_ps(out + h * D + d), vinv));
  }
}
#endif

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor* bias,
                double scale, bool avx2, bool avx512, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(2), G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1);
  TORCH_CHECK(values.stride(2) == ks2, "attention: keys and values must share their slot stride");
  const T* bp = bias ? bias->data_ptr<T>() : nullptr;
  // bias [rows, S] or [B, 1, rows, S] (rows = T or G*T, the first T rows are the queries' own)
  const int64_t brow = bias ? bias->stride(-2) : 0, bbatch = (bias && bias->dim() == 4) ? bias->stride(0) : 0;
  const float sc = static_cast<float>(scale);
  using RowFn = void (*)(const float*, const T*, const T*, int64_t, int64_t, const T*, float, float*, float*);
  RowFn vector = nullptr;
#ifdef STAGEDSPEC_X86
  if (avx2 && D == 64) vector = &attend_row_avx2<T, 8>;
  if (avx2 && D == 128) vector = &attend_row_avx2<T, 16>;
  if (avx2 && D == 256) vector = &attend_row_avx2<T, 32>;
#endif
#ifdef STAGEDSPEC_X86
  using GroupFn = void (*)(const float*, int, const T*, const T*, int64_t, int64_t, const T*, float, float*, float*);
  GroupFn grouped = nullptr;
  if (avx512 && D == 64) grouped = &attend_group_avx512<T, 8>;
  if (avx512 && D == 128) grouped = &attend_group_avx512<T, 16>;
  if (avx512 && D == 256) grouped = &attend_group_avx512<T, 32>;
  if (grouped) {
    // A task: one query row's heads that share a key head, split in two or more parts where there would be
    // fewer tasks than twice the threads (one-row decoding), so that both cores get work.
    int64_t per = std::min<int64_t>(G, kMaxGroup);
    while (per > 1 && B * Hkv * T_ * ((G + per - 1) / per) < 2 * at::get_num_threads()) per = (per + 1) / 2;
    const int64_t parts = (G + per - 1) / per;
    at::parallel_for(0, B * Hkv * T_ * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(per * S), qf(per * D), of(per * D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t part = i % parts, t = (i / parts) % T_, g = (i / (parts * T_)) % Hkv, b = i / (parts * T_ * Hkv);
        const int64_t h0 = g * G + part * per, nh = std::min(per, G - part * per);
        for (int64_t h = 0; h < nh; ++h) {
          const T* qrow = qp + ((b * H + h0 + h) * T_ + t) * D;
          for (int64_t d = 0; d < D; ++d) qf[h * D + d] = as_float(qrow[d]);
        }
        const T* brow_ptr = bp ? bp + b * bbatch + t * brow : nullptr;
        grouped(qf.data(), static_cast<int>(nh), kp + b * ks0 + g * ks1, vp + b * vs0 + g * vs1, ks2, S, brow_ptr,
                sc, scores.data(), of.data());
        for (int64_t h = 0; h < nh; ++h) {
          T* orow = op + b * os0 + (h0 + h) * os1 + t * os2;
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(of[h * D + d]);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * H * T_, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), qf(D), of(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * T_), h = (i / T_) % H, t = i % T_;
      const T* qrow = qp + ((b * H + h) * T_ + t) * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = as_float(qrow[d]);
      const T* k = kp + b * ks0 + (h / G) * ks1;
      const T* v = vp + b * vs0 + (h / G) * vs1;
      const T* brow_ptr = bp ? bp + b * bbatch + t * brow : nullptr;
      if (vector)
        vector(qf.data(), k, v, ks2, S, brow_ptr, sc, scores.data(), of.data());
      else
        attend_row_portable<T>(qf.data(), k, v, ks2, S, D, brow_ptr, sc, scores.data(), of.data());
      T* orow = op + b * os0 + h * os1 + t * os2;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(of[d]);
    }
  });
}

// isa: 0 the portable path, 1 AVX2 where the CPU has it, 2 or more (or -1, the best this CPU runs) the grouped
// AVX-512 path where it has AVX-512F/VL, else AVX2.
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "attention: q, keys, values must be 4-D");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "attention: q, keys and values must share a dtype");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention: the head axis must be contiguous");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0, "attention: query heads must be a multiple of key heads");
  bool avx2 = false, avx512 = false;
#ifdef STAGEDSPEC_X86
  __builtin_cpu_init();
  avx2 = isa != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // isa 2 and up (AVX-512 VNNI, its 512-bit pairs, AMX): the grouped AVX-512 path
  avx512 = avx2 && (isa < 0 || isa >= 2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
#endif
  const at::Tensor qc = q.contiguous();
  // [B, H, T, D] lying as [B, T, H, D]: the next step reads rows of H * D (the output layer), with no copy
  at::Tensor out = at::empty({qc.size(0), qc.size(2), qc.size(1), qc.size(3)}, qc.options()).permute({0, 2, 1, 3});
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(q.scalar_type());
    TORCH_CHECK(b.size(-1) == keys.size(2) && b.stride(-1) == 1, "attention: bias must be [rows, S] with S keys");
  }
  const at::Tensor* bp = b.defined() ? &b : nullptr;
  if (q.scalar_type() == at::kFloat)
    attend_all<float>(qc, keys, values, bp, scale, avx2, avx512, out);
  else if (q.scalar_type() == at::kBFloat16)
    attend_all<at::BFloat16>(qc, keys, values, bp, scale, avx2, avx512, out);
  else
    TORCH_CHECK(false, "attention: fp32 or bf16 only");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) { m.impl("attention", &attention); }
