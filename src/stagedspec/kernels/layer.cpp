// One decoder layer of a quantised Llama-family model (Llama, Qwen2, Mistral) in one call.
//
// Why: a SmolLM2-135M pass is 30 layers of about 25 small operations each; from Python every one costs
// a module call and an operator dispatch (a few microseconds each), which at one row is as much time as
// streaming the weights.  This op runs the same operations, in the same order, from C++: the native
// kernels (RMSNorm, the quantised linear layers, attention) through the dispatcher and the elementwise
// steps (RoPE, residual adds, SiLU) as the same ATen calls the Python path makes.  The result is therefore
// the Python path's, bit for bit (tested), and as row-exact as it is.
//
// Steps (x [B, T, hidden]; every linear is y = qlinear(x) (+ bias)):
//   h = rms_norm(x, attn_norm);  qkv = linear(h) viewed [B, H + 2 Hkv, T, D];  qk, v = split
//   qk = qk * cos + flip_halves(qk) * sin;  q, k = split;  k, v written at cache slots [start, start + T)
//   a = attention(q, keys[:width], values[:width], mask, scale);  x = x + linear_o(a as [B, T, H D])
//   g, u = chunk(linear_up(rms_norm(x, mlp_norm)), 2);  x = x + linear_down(silu(g) * u)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef, int64_t)>
      qlinear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, double, int64_t)>
      attention;
};

const Ops& ops() {
  static const Ops o{
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("stagedspec_qlinear::qlinear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef, int64_t)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("stagedspec_qlinear::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("stagedspec_qlinear::attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            double, int64_t)>(),
  };
  return o;
}

// Linear layer i of the four (qkv, o, up, down): its segments are formats/outs[first .. first + count).
struct Linears {
  const std::vector<at::Tensor>& packed;
  at::IntArrayRef formats, outs, splits;
  const c10::List<std::optional<at::Tensor>>& biases;
  int64_t isa;

  at::Tensor operator()(int i, const at::Tensor& x) const {
    int64_t first = 0;
    for (int j = 0; j < i; ++j) first += splits[j];
    const at::IntArrayRef f = formats.slice(first, splits[i]), o = outs.slice(first, splits[i]);
    int64_t n = 0;
    for (int64_t v : o) n += v;
    std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1);
    at::Tensor y = ops().qlinear.call(x.reshape({-1, x.size(-1)}), packed[i], f, o, isa);
    lead.push_back(n);
    y = y.view(lead);
    const std::optional<at::Tensor> bias = biases.get(i);
    return bias.has_value() ? y + *bias : y;
  }
};

at::Tensor decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& packed, at::IntArrayRef formats,
                         at::IntArrayRef outs, at::IntArrayRef splits, const c10::List<std::optional<at::Tensor>>& biases,
                         const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                         const std::optional<at::Tensor>& mask, double scale, int64_t n_heads, int64_t n_kv_heads,
                         int64_t isa) {
  TORCH_CHECK(packed.size() == 4 && splits.size() == 4 && biases.size() == 4, "decoder_layer: four linear layers");
  const Linears linear{packed, formats, outs, splits, biases, isa};
  const int64_t B = x.size(0), T = x.size(1), H = n_heads, Hkv = n_kv_heads, D = k_cache.size(-1);
  const at::Tensor h = ops().rms_norm.call(x, attn_norm, eps);
  const at::Tensor qkv = linear(0, h).view({B, T, H + 2 * Hkv, D}).transpose(1, 2);
  const std::vector<at::Tensor> qk_v = qkv.split_with_sizes({H + Hkv, Hkv}, 1);
  const at::Tensor halves = qk_v[0].unflatten(-1, {2, D / 2});
  const at::Tensor qk = qk_v[0] * cos + halves.flip({-2}).flatten(-2) * sin;
  const std::vector<at::Tensor> q_k = qk.split_with_sizes({H, Hkv}, 1);
  k_cache.narrow(2, start, T).copy_(q_k[1]);
  v_cache.narrow(2, start, T).copy_(qk_v[1]);
  const int64_t width = mask.has_value() ? mask->size(-1) : start + T;
  const at::Tensor a = ops().attention.call(q_k[0], k_cache.narrow(2, 0, width), v_cache.narrow(2, 0, width), mask, scale, isa);
  const at::Tensor x1 = x + linear(1, a.reshape({B, H, T, D}).transpose(1, 2).reshape({B, T, H * D}));
  const std::vector<at::Tensor> gate_up = linear(2, ops().rms_norm.call(x1, mlp_norm, eps)).chunk(2, -1);
  return x1 + linear(3, at::silu(gate_up[0]) * gate_up[1]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedspec_qlinear, m) {
  m.def("decoder_layer(Tensor x, Tensor[] packed, int[] formats, int[] outs, int[] splits, Tensor?[] biases, "
        "Tensor attn_norm, Tensor mlp_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int start, Tensor? mask, float scale, int n_heads, int n_kv_heads, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
