// Finding the 4-bit grid a group of 32 weights already sits on (a Q4_0 / Q4_1 / Q4_K source, dequantised).
//
// Why native: a 1.5B model has 40 million groups; sorting each in PyTorch took minutes on 2 cores, while
// this scan takes a few seconds.  Semantics match `stagedspec.kernels.grid.grid_steps_reference`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kGroup = 32;

// (low, step, levels) of one group; levels = 0 where no even grid of at most max_levels levels holds every
// value.
void one_group(const float* v, int64_t max_levels, float* low, float* step, float* levels) {
  float lo = v[0], hi = v[0];
  for (int i = 1; i < kGroup; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  *low = lo;
  if (!(hi > lo)) {  // constant group (or NaN): one level
    *step = 1.f;
    *levels = 1.f;
    return;
  }
  const float tol = 1e-5f * (hi - lo);
  float smallest = hi - lo;
  for (int i = 0; i < kGroup; ++i) {
    const float d = v[i] - lo;
    if (d > tol) smallest = std::min(smallest, d);
  }
  const float most = static_cast<float>(max_levels) - 0.5f;
  for (int m = 1; m <= 15; ++m) {
    const float s = smallest / static_cast<float>(m);
    const float n = (hi - lo) / s;
    if (n > most) break;
    bool ok = true;
    for (int i = 0; i < kGroup && ok; ++i) {
      const float p = (v[i] - lo) / s;
      ok = std::fabs(p - std::nearbyint(p)) < 1e-3f;
    }
    if (ok) {
      *step = s;
      *levels = std::nearbyint(n) + 1.f;
      return;
    }
  }
  *step = (hi - lo) / static_cast<float>(max_levels - 1);
  *levels = 0.f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grid_groups(const at::Tensor& w, int64_t max_levels) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % kGroup == 0, "grid_groups: w must be [N, K] with K a multiple of 32");
  const at::Tensor x = w.to(at::kFloat).contiguous();
  const int64_t N = x.size(0), G = x.size(1) / kGroup;
  at::Tensor low = at::empty({N, G}, x.options()), step = at::empty({N, G}, x.options()),
             levels = at::empty({N, G}, x.options());
  const float* src = x.data_ptr<float>();
  float *lo = low.data_ptr<float>(), *st = step.data_ptr<float>(), *lv = levels.data_ptr<float>();
  at::parallel_for(0, N * G, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) one_group(src + i * kGroup, max_levels, lo + i, st + i, lv + i);
  });
  return {low, step, levels};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedspec_qlinear, m) {
  m.def("grid_groups(Tensor w, int max_levels) -> (Tensor, Tensor, Tensor)", &grid_groups);
}
