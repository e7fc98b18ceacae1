// Attention over the KV cache, each query row computed alone: bit-identical whatever else is in the pass.
//
// Why: with int8-quantised activations (qlinear.cpp) a last-bit difference anywhere can move an activation
// across a rounding boundary, and the difference then grows through the layers.  PyTorch's attention rounds
// a row differently depending on how many rows share the call (measured: a 7-row prompt pass and a 6 + 1
// split gave logits 0.86 apart on the int4 SmolLM2), so a verified tree would not reproduce one-token
// decoding.  Here every (sequence, head, query row) is one task with a fixed order of operations:
//   s_j = (q . k_j) * scale + bias_j     over the row's visible keys j, in slot order (8 partial sums)
//   p_j = exp(s_j - max s);  out = (sum_j p_j v_j) / (sum_j p_j)
// Masked keys (bias -inf) are skipped, so a row sees the same keys in the same order in a one-token pass and
// in a tree pass (a node's ancestors precede it in pre-order, as decoding wrote them), and its result is the
// same bits.  exp is our own polynomial, so every instruction set gives the same bits too.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0: Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes' expf coefficients),
// written with plain float operations so that every compiler target computes the same bits.
inline float exp_nonpositive(float x) {
  if (x < -87.f) return 0.f;
  const float magic = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer (half to even)
  const float n = (x * 1.44269504088896341f + magic) - magic;
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

template <typename T>
inline float as_float(T v) {
  return static_cast<float>(v);
}

// One query row against S keys.  q: D floats; k/v rows at stride `kvs`; bias: S values or null; out: D floats.
template <typename T>
__attribute__((target_clones("avx2", "default"))) void attend_row(const float* q, const T* k, const T* v,
                                                                   int64_t kvs, int64_t S, int64_t D,
                                                                   const T* bias, float scale, float* scores,
                                                                   float* out) {
  float top = kNegInf;
  for (int64_t j = 0; j < S; ++j) {
    const float b = bias ? as_float(bias[j]) : 0.f;
    if (b == kNegInf) {
      scores[j] = kNegInf;
      continue;
    }
    const T* kj = k + j * kvs;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * as_float(kj[d + l]);
    for (; d < D; ++d) acc[d % 8] += q[d] * as_float(kj[d]);
    const float s = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) * scale + b;
    scores[j] = s;
    top = s > top ? s : top;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (top == kNegInf) return;  // no visible key (a padding row): zeros
  float total = 0.f;
  for (int64_t j = 0; j < S; ++j) {
    if (scores[j] == kNegInf) continue;
    const float p = exp_nonpositive(scores[j] - top);
    total += p;
    const T* vj = v + j * kvs;
    for (int64_t d = 0; d < D; ++d) out[d] += p * as_float(vj[d]);
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor* bias,
                double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(2), G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1);
  TORCH_CHECK(values.stride(2) == ks2, "attention: keys and values must share their slot stride");
  const T* bp = bias ? bias->data_ptr<T>() : nullptr;
  // bias [rows, S] or [B, 1, rows, S] (rows = T or G*T, the first T rows are the queries' own)
  const int64_t brow = bias ? bias->stride(-2) : 0, bbatch = (bias && bias->dim() == 4) ? bias->stride(0) : 0;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * T_, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), qf(D), of(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * T_), h = (i / T_) % H, t = i % T_;
      const T* qrow = qp + ((b * H + h) * T_ + t) * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = as_float(qrow[d]);
      const T* k = kp + b * ks0 + (h / G) * ks1;
      const T* v = vp + b * vs0 + (h / G) * vs1;
      const T* brow_ptr = bp ? bp + b * bbatch + t * brow : nullptr;
      attend_row<T>(qf.data(), k, v, ks2, S, D, brow_ptr, sc, scores.data(), of.data());
      T* orow = op + ((b * H + h) * T_ + t) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(of[d]);
    }
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "attention: q, keys, values must be 4-D");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "attention: q, keys and values must share a dtype");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention: the head axis must be contiguous");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0, "attention: query heads must be a multiple of key heads");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(q.scalar_type());
    TORCH_CHECK(b.size(-1) == keys.size(2) && b.stride(-1) == 1, "attention: bias must be [rows, S] with S keys");
  }
  const at::Tensor* bp = b.defined() ? &b : nullptr;
  if (q.scalar_type() == at::kFloat)
    attend_all<float>(qc, keys, values, bp, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    attend_all<at::BFloat16>(qc, keys, values, bp, scale, out);
  else
    TORCH_CHECK(false, "attention: fp32 or bf16 only");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) { m.impl("attention", &attention); }
