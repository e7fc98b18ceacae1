// One decoder layer of a quantised Llama-family model (Llama, Qwen2, Mistral) in one call.
//
// Why: a SmolLM2-135M pass is 30 layers of about 25 small operations each; from Python every one costs
// a module call and an operator dispatch (a few microseconds each), which at one row is as much time as
// streaming the weights.  This op runs the same operations, in the same order, from C++: the native
// kernels (RMSNorm, the quantised linear layers, attention) through the dispatcher, and the glue between
// them (bias adds, RoPE, the cache writes, the residual joins) as plain loops that round every product and
// sum to the tensors' dtype, as ATen's elementwise ops do.  SiLU stays ATen's (the Python path's MLP calls
// it).  The result is therefore the Python path's, bit for bit (tested), and as row-exact as it is.
//
// Steps (x [B, T, hidden] as rows [B T, hidden]; every linear is y = qlinear(x) (+ bias)):
//   qkv = linear_qkv(rms_norm(x, attn_norm))            [B T, (H + 2 Hkv) D]
//   q, k = (q|k) * cos + flip_halves(q|k) * sin;  k, v written at cache slots [start, start + T)
//   a = attention(q, keys[:width], values[:width], mask, scale);  x = x + linear_o(a as [B T, H D])
//   g, u = chunk(linear_up(rms_norm(x, mlp_norm)), 2);  x = x + linear_down(silu(g) * u)
//
// At one row the glue as ATen calls (views, flip, muls, adds, copies) cost a large share of a layer beside its
// linear layers (docs/measurements.md, "ATen glue of a decoder layer on a Zen 3 EPYC").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
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

// T-typed arithmetic with one rounding per operation, as ATen's elementwise ops on T tensors do (they compute
// in float and round the result to T).
template <typename T> inline T add(T a, T b) { return static_cast<T>(static_cast<float>(a) + static_cast<float>(b)); }
template <typename T> inline T mul(T a, T b) { return static_cast<T>(static_cast<float>(a) * static_cast<float>(b)); }

// The four linear layers (qkv, o, up, down) of one decoder layer, on rows [R, K]: layer i's segments are
// formats/outs[first .. first + splits[i]); its bias, where there is one, is added in place (y + bias, as the
// Python layer does).
struct Linears {
  const at::Tensor* packed;  // 4
  at::IntArrayRef formats, outs;
  const int64_t* splits;     // 4
  const std::optional<at::Tensor>* biases;  // 4
  int64_t isa;

  at::Tensor operator()(int i, const at::Tensor& x) const {
    int64_t first = 0;
    for (int j = 0; j < i; ++j) first += splits[j];
    at::Tensor y = ops().qlinear.call(x, packed[i], formats.slice(first, splits[i]), outs.slice(first, splits[i]), isa);
    const std::optional<at::Tensor>& bias = biases[i];
    if (bias.has_value()) {
      const at::Tensor b = bias->to(y.scalar_type()).contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "decoder_layer_bias", [&] {
        scalar_t* yp = y.data_ptr<scalar_t>();
        const scalar_t* bp = b.data_ptr<scalar_t>();
        const int64_t N = y.size(1);
        for (int64_t r = 0; r < y.size(0); ++r)
          for (int64_t n = 0; n < N; ++n) yp[r * N + n] = add(yp[r * N + n], bp[n]);
      });
    }
    return y;
  }
};

// RoPE on the q and k heads of qkv [B*T, (H + 2 Hkv) D] (x * cos + flip_halves(x) * sin, each product and the
// sum rounded to T, as `transformer.apply_rope` computes it): q into q [B, H, T, D], k into the key cache at
// slots [start, start + T), v copied into the value cache.  cos/sin: [1 or B, 1, T, D].
template <typename T>
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q,
                    at::Tensor& k_cache, at::Tensor& v_cache, int64_t start, int64_t B, int64_t Tn, int64_t H,
                    int64_t Hkv, int64_t D) {
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), ct = cos.stride(2), sb = sin.size(0) == 1 ? 0 : sin.stride(0),
                st = sin.stride(2);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), ks = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vs = v_cache.stride(2);
  const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
  // rows split between threads where a pass has many (a prompt); each element is computed as before
  at::parallel_for(0, B * Tn, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const T* row = src + r * width;
      const T* c = cp + b * cb + t * ct;
      const T* sn = sp + b * sb + t * st;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const T* x = row + h * D;
        T* out = h < H ? qp + ((b * H + h) * Tn + t) * D : kp + b * kb + (h - H) * kh + (start + t) * ks;
        for (int64_t d = 0; d < half; ++d) out[d] = add(mul(x[d], c[d]), mul(x[d + half], sn[d]));
        for (int64_t d = half; d < D; ++d) out[d] = add(mul(x[d], c[d]), mul(x[d - half], sn[d]));
      }
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(vp + b * vb + h * vh + (start + t) * vs, row + (H + Hkv + h) * D, D * sizeof(T));
    }
  });
}

// out[r, :] = x[r, :] + y[r, :], rounded to T (the residual join).
template <typename T>
void residual(const at::Tensor& x, const at::Tensor& y, at::Tensor& out) {
  const T* xp = x.data_ptr<T>();
  const T* yp = y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, out.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = add(xp[i], yp[i]);
  });
}

// What every layer of a pass shares.
struct PassArgs {
  double eps;
  const at::Tensor& cos;
  const at::Tensor& sin;
  double scale;
  int64_t n_heads, n_kv_heads, isa;
};

// Rows that attend over one cache pair: rows [row0, row0 + B T) of the pass, B sequences of T rows, whose keys
// and values go to cache slots [start, start + T).  A plain pass is one; a ragged pass (several requests'
// passes in one, `ragged_layers`) has one per request.
struct AttnSegment {
  at::Tensor k_caches, v_caches;  // every layer's: [layers, B, Hkv, S, D]
  int64_t start;
  const std::optional<at::Tensor>& mask;
  int64_t row0, B, T;
};

void check_pass(const at::Tensor& x, const PassArgs& p, const at::Tensor& k_cache, const at::Tensor& v_cache,
                int64_t start) {
  TORCH_CHECK(x.dim() == 3 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "decoder_layer: x must be [B, T, hidden] and the caches' head axis contiguous");
  TORCH_CHECK(p.cos.dim() == 4 && p.sin.dim() == 4 && p.cos.stride(3) == 1 && p.sin.stride(3) == 1 &&
                  p.cos.size(2) == x.size(1) && p.sin.size(2) == x.size(1) && p.cos.size(3) == k_cache.size(-1) &&
                  p.sin.size(3) == k_cache.size(-1) && p.cos.scalar_type() == x.scalar_type() &&
                  p.sin.scalar_type() == x.scalar_type(),
              "decoder_layer: cos/sin must be [1 or B, 1, T, D] in x's dtype");
  const int64_t B = x.size(0), T = x.size(1), D = k_cache.size(-1);
  TORCH_CHECK(D % 2 == 0 && k_cache.size(2) >= start + T && v_cache.size(2) >= start + T,
              "decoder_layer: the caches must hold slots [start, start + T)");
  TORCH_CHECK((p.cos.size(0) == 1 || p.cos.size(0) == B) && (p.sin.size(0) == 1 || p.sin.size(0) == B),
              "decoder_layer: cos/sin must have 1 or B rows of positions");
}

// Layer l's attention of one segment's rows qkv [B T, (H + 2 Hkv) D] (RoPE, cache writes, attention): [B T, H D].
at::Tensor attend(const at::Tensor& qkv, const AttnSegment& s, int64_t l, const PassArgs& p) {
  const int64_t H = p.n_heads, Hkv = p.n_kv_heads, D = s.k_caches.size(-1), B = s.B, T = s.T;
  const at::Tensor cos = p.cos.narrow(2, s.row0, T), sin = p.sin.narrow(2, s.row0, T);
  at::Tensor q = at::empty({B, H, T, D}, qkv.options());
  at::Tensor k_cache = s.k_caches.select(0, l), v_cache = s.v_caches.select(0, l);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "decoder_layer_rope", [&] {
    rope_and_cache<scalar_t>(qkv, cos, sin, q, k_cache, v_cache, s.start, B, T, H, Hkv, D);
  });
  const int64_t width = s.mask.has_value() ? s.mask->size(-1) : s.start + T;
  const at::Tensor a =
      ops().attention.call(q, k_cache.narrow(2, 0, width), v_cache.narrow(2, 0, width), s.mask, p.scale, p.isa);
  return a.transpose(1, 2).reshape({B * T, H * D});  // [B, H, T, D] -> rows of H * D
}

// Layer l on rows x2 [R, C]; returns the new rows.  Rows no segment covers (a ragged pass's padding) attend
// to nothing: their attention output is zero, as the Python ragged pass has it.
at::Tensor layer_rows(const at::Tensor& x2, const std::vector<AttnSegment>& segments, int64_t l, const Linears& linear,
                      const at::Tensor& attn_norm, const at::Tensor& mlp_norm, const PassArgs& p) {
  const at::Tensor qkv = linear(0, ops().rms_norm.call(x2, attn_norm, p.eps));
  const AttnSegment& first = segments[0];
  at::Tensor heads;
  if (segments.size() == 1 && first.row0 == 0 && first.B * first.T == x2.size(0)) {
    heads = attend(qkv, first, l, p);
  } else {
    heads = at::zeros({x2.size(0), p.n_heads * first.k_caches.size(-1)}, x2.options());
    for (const AttnSegment& s : segments)
      heads.narrow(0, s.row0, s.B * s.T).copy_(attend(qkv.narrow(0, s.row0, s.B * s.T), s, l, p));
  }
  at::Tensor x1 = at::empty_like(x2), out = at::empty_like(x2);
  const at::Tensor o = linear(1, heads);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x2.scalar_type(), "decoder_layer_residual", [&] {
    residual<scalar_t>(x2, o, x1);
  });
  const at::Tensor gate_up = linear(2, ops().rms_norm.call(x1, mlp_norm, p.eps));
  const std::vector<at::Tensor> g_u = gate_up.chunk(2, -1);
  const at::Tensor down = linear(3, at::silu(g_u[0]) * g_u[1]);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x2.scalar_type(), "decoder_layer_residual", [&] {
    residual<scalar_t>(x1, down, out);
  });
  return out;
}

std::vector<std::optional<at::Tensor>> optional_list(const c10::List<std::optional<at::Tensor>>& list) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
  return out;
}

at::Tensor decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& packed, at::IntArrayRef formats,
                         at::IntArrayRef outs, at::IntArrayRef splits, const c10::List<std::optional<at::Tensor>>& biases,
                         const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                         const std::optional<at::Tensor>& mask, double scale, int64_t n_heads, int64_t n_kv_heads,
                         int64_t isa) {
  TORCH_CHECK(packed.size() == 4 && splits.size() == 4 && biases.size() == 4, "decoder_layer: four linear layers");
  const PassArgs p{eps, cos, sin, scale, n_heads, n_kv_heads, isa};
  check_pass(x, p, k_cache, v_cache, start);
  const std::vector<std::optional<at::Tensor>> bias = optional_list(biases);
  const Linears linear{packed.data(), formats, outs, splits.data(), bias.data(), isa};
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const std::vector<AttnSegment> segment{AttnSegment{k_cache.unsqueeze(0), v_cache.unsqueeze(0), start, mask, 0, B, T}};
  return layer_rows(x.contiguous().view({B * T, C}), segment, 0, linear, attn_norm, mlp_norm, p).view({B, T, C});
}

// Every layer on rows [R, C]: layer l's four linear layers are packed[4l .. 4l + 4), their segments the next
// sum(splits[4l .. 4l + 4)) entries of formats/outs.
at::Tensor run_layers(at::Tensor rows, const std::vector<AttnSegment>& segments, const std::vector<at::Tensor>& packed,
                      at::IntArrayRef formats, at::IntArrayRef outs, at::IntArrayRef splits,
                      const c10::List<std::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& attn_norms,
                      const std::vector<at::Tensor>& mlp_norms, const PassArgs& p) {
  const size_t L = attn_norms.size();
  TORCH_CHECK(packed.size() == 4 * L && splits.size() == 4 * L && biases.size() == 4 * L && mlp_norms.size() == L,
              "decoder_layers: four linear layers and two norms per layer");
  for (const AttnSegment& s : segments)
    TORCH_CHECK(s.k_caches.size(0) == static_cast<int64_t>(L) && s.v_caches.size(0) == static_cast<int64_t>(L) &&
                    s.k_caches.stride(4) == 1 && s.v_caches.stride(4) == 1,
                "decoder_layers: caches [layers, B, Hkv, S, D], one per layer");
  int64_t n_segments = 0;
  for (int64_t n : splits) n_segments += n;
  TORCH_CHECK(n_segments == static_cast<int64_t>(formats.size()) && formats.size() == outs.size(),
              "decoder_layers: one format and output count per segment");
  const std::vector<std::optional<at::Tensor>> bias = optional_list(biases);
  int64_t first = 0;
  for (size_t l = 0; l < L; ++l) {
    const int64_t* sp = splits.data() + 4 * l;
    const int64_t n = sp[0] + sp[1] + sp[2] + sp[3];
    const Linears linear{packed.data() + 4 * l, formats.slice(first, n), outs.slice(first, n), sp, bias.data() + 4 * l,
                         p.isa};
    rows = layer_rows(rows, segments, static_cast<int64_t>(l), linear, attn_norms[l], mlp_norms[l], p);
    first += n;
  }
  return rows;
}

// Every layer of a pass in one call: layer l's four linear layers are packed[4l .. 4l + 4), their segments the
// next sum(splits[4l .. 4l + 4)) entries of formats/outs.  Why: one call per layer cost about 50-70 us of Python
// argument boxing and dispatch (measured on the AVX2 EPYC, SmolLM2-135M's 30 layers at one row).
at::Tensor decoder_layers(const at::Tensor& x, const std::vector<at::Tensor>& packed, at::IntArrayRef formats,
                          at::IntArrayRef outs, at::IntArrayRef splits, const c10::List<std::optional<at::Tensor>>& biases,
                          const std::vector<at::Tensor>& attn_norms, const std::vector<at::Tensor>& mlp_norms, double eps,
                          const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_caches, at::Tensor v_caches,
                          int64_t start, const std::optional<at::Tensor>& mask,
                          double scale, int64_t n_heads, int64_t n_kv_heads, int64_t isa) {
  TORCH_CHECK(k_caches.dim() == 5 && v_caches.dim() == 5 && k_caches.size(0) >= 1,
              "decoder_layers: caches [layers, B, Hkv, S, D]");
  const PassArgs p{eps, cos, sin, scale, n_heads, n_kv_heads, isa};
  check_pass(x, p, k_caches.select(0, 0), v_caches.select(0, 0), start);
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const std::vector<AttnSegment> segments{AttnSegment{k_caches, v_caches, start, mask, 0, B, T}};
  return run_layers(x.contiguous().view({B * T, C}), segments, packed, formats, outs, splits, biases, attn_norms,
                    mlp_norms, p)
      .view({B, T, C});
}

// Several requests' passes as one (`stagedspec.models.ragged`): x [1, R, hidden] holds their rows one after
// another (rows[i] of request i, then any padding rows), cos/sin [1, 1, R, D] their positions; request i's
// caches are k_caches[i] / v_caches[i] [layers, 1, Hkv, S, D], written at slots [starts[i], starts[i] + rows[i])
// under masks[i].  The row-wise steps run over all R rows at once; RoPE, the cache writes and attention run per
// request, as that request's own pass runs them: so each request's rows get its solo pass's bits (the linear
// layers are row-independent).  Padding rows attend to nothing.
at::Tensor ragged_layers(const at::Tensor& x, const std::vector<at::Tensor>& packed, at::IntArrayRef formats,
                         at::IntArrayRef outs, at::IntArrayRef splits, const c10::List<std::optional<at::Tensor>>& biases,
                         const std::vector<at::Tensor>& attn_norms, const std::vector<at::Tensor>& mlp_norms, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, at::IntArrayRef starts, at::IntArrayRef rows,
                         const c10::List<std::optional<at::Tensor>>& masks, double scale, int64_t n_heads,
                         int64_t n_kv_heads, int64_t isa) {
  const size_t S = k_caches.size();
  TORCH_CHECK(S >= 1 && v_caches.size() == S && starts.size() == S && rows.size() == S && masks.size() == S,
              "ragged_layers: one cache pair, start, row count and mask per request");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "ragged_layers: x must be [1, R, hidden]");
  const PassArgs p{eps, cos, sin, scale, n_heads, n_kv_heads, isa};
  const std::vector<std::optional<at::Tensor>> mask = optional_list(masks);
  std::vector<AttnSegment> segments;
  int64_t row0 = 0;
  for (size_t i = 0; i < S; ++i) {
    TORCH_CHECK(k_caches[i].dim() == 5 && v_caches[i].dim() == 5 && k_caches[i].size(1) == 1,
                "ragged_layers: caches must be [layers, 1, Hkv, S, D]");
    TORCH_CHECK(k_caches[i].size(3) >= starts[i] + rows[i] && v_caches[i].size(3) >= starts[i] + rows[i] && rows[i] >= 1,
                "ragged_layers: each request's caches must hold its slots");
    segments.push_back(AttnSegment{k_caches[i], v_caches[i], starts[i], mask[i], row0, 1, rows[i]});
    row0 += rows[i];
  }
  TORCH_CHECK(row0 <= x.size(1) && cos.dim() == 4 && cos.size(2) == x.size(1) && sin.size(2) == x.size(1),
              "ragged_layers: more request rows than rows, or cos/sin not [1, 1, R, D]");
  return run_layers(x.contiguous().view({x.size(1), x.size(2)}), segments, packed, formats, outs, splits, biases,
                    attn_norms, mlp_norms, p)
      .view(x.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedspec_qlinear, m) {
  m.def("decoder_layer(Tensor x, Tensor[] packed, int[] formats, int[] outs, int[] splits, Tensor?[] biases, "
        "Tensor attn_norm, Tensor mlp_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int start, Tensor? mask, float scale, int n_heads, int n_kv_heads, int isa) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] packed, int[] formats, int[] outs, int[] splits, Tensor?[] biases, "
        "Tensor[] attn_norms, Tensor[] mlp_norms, float eps, Tensor cos, Tensor sin, Tensor(a!) k_caches, "
        "Tensor(b!) v_caches, int start, Tensor? mask, float scale, int n_heads, int n_kv_heads, int isa) -> Tensor");
  m.def("ragged_layers(Tensor x, Tensor[] packed, int[] formats, int[] outs, int[] splits, Tensor?[] biases, "
        "Tensor[] attn_norms, Tensor[] mlp_norms, float eps, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int[] starts, int[] rows, Tensor?[] masks, float scale, int n_heads, int n_kv_heads, "
        "int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedspec_qlinear, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("ragged_layers", &ragged_layers);
}
