// Fused element-wise steps of a Llama layer for the engine's own forward on the CPU (gpu_workers/llama_step.py).
//
// transformers runs RMSNorm, the rotary embedding and SiLU-times-up as 2-10 small torch ops each,
// every one a pass over memory and a dispatch; these do each in one pass (the residual sum with the
// next norm). Each rounds where the transformers code rounds (its intermediate results in the
// model's dtype), so in bf16 the results equal transformers' own up to the order of the norm's fp32 sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtypes.h"

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

// No fused multiply-adds here: each product is rounded as transformers' separate ops round it.
#pragma GCC optimize("fp-contract=off")

namespace {

using tokenstream::by_dtype;
using tokenstream::f32;
using tokenstream::round_to;
using tokenstream::to;

// LlamaRMSNorm: w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype), x and w of one dtype
template <typename T>
void rms_rows(const T* xp, const T* wp, T* op, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.f / std::sqrt(ss / h + eps);
      T* o = op + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = to<T>(f32(wp[i]) * round_to<T>(f32(xr[i]) * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.size(-1) == w_in.numel(), "rms_norm: CPU, weight of the last dim");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "rms_norm: x and weight of one dtype");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t h = x.size(-1);
  at::Tensor out = at::empty_like(x);
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), x.numel() / h, h, static_cast<float>(eps));
  });
  return out;
}

// silu_and_mul(x [.., 2I]) = silu(x[.., :I]) * x[.., I:]: the MLP's activation on a fused gate-up output
template <typename T>
void silu_and_mul_rows(const T* xp, T* op, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float a = f32(g[i]);
        o[i] = to<T>(round_to<T>(a / (1.f + std::exp(-a))) * f32(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.size(-1) % 2 == 0, "silu_and_mul: an even last dim (gate, up)");
  const at::Tensor x = x_in.contiguous();
  const int64_t inter = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  by_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.numel() / x.size(-1), inter);
  });
  return out;
}

// add_rms_norm(x, residual, w) = (s, rms_norm(s)) with s = x + residual rounded to the dtype: a layer's
// residual sum and the next norm in one pass
template <typename T>
void add_rms_rows(const T* xp, const T* rp, const T* wp, T* sp, T* op, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *xr = xp + r * h, *rr = rp + r * h;
      T* s = sp + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const T v = to<T>(f32(xr[i]) + f32(rr[i]));
        s[i] = v;
        ss += f32(v) * f32(v);
      }
      const float inv = 1.f / std::sqrt(ss / h + eps);
      T* o = op + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = to<T>(f32(wp[i]) * round_to<T>(f32(s[i]) * inv));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& r_in, const at::Tensor& w_in,
                                                double eps) {
  TORCH_CHECK(x_in.sizes() == r_in.sizes() && x_in.size(-1) == w_in.numel(), "add_rms_norm: x, residual alike");
  TORCH_CHECK(x_in.scalar_type() == r_in.scalar_type() && x_in.scalar_type() == w_in.scalar_type(), "add_rms_norm: one dtype");
  const at::Tensor x = x_in.contiguous(), r = r_in.contiguous(), w = w_in.contiguous();
  const int64_t h = x.size(-1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    add_rms_rows<T>(x.data_ptr<T>(), r.data_ptr<T>(), w.data_ptr<T>(), sum.data_ptr<T>(), out.data_ptr<T>(),
                    x.numel() / h, h, static_cast<float>(eps));
  });
  return {sum, out};
}

// q [B, H, T, D] (any strides), cos/sin [B, T, D] -> q * cos + rotate_half(q) * sin, returned as a
// [B, T, H, D]-contiguous tensor viewed [B, H, T, D] (the layout attention reads tokens from)
template <typename T>
at::Tensor rotate_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = D / 2;
  at::Tensor out = at::empty({B, L, H, D}, x.options());
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
  at::parallel_for(0, B * L, 4, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / L, t = bt % L;
      const T* c = cp + bt * D;
      const T* s = sp + bt * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = xp + b * xb + h * xh + t * xt;
        T* o = op + (bt * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -f32(xr[d + half]) : f32(xr[d - half]);
          o[d] = to<T>(round_to<T>(f32(xr[d]) * f32(c[d])) + round_to<T>(rot * f32(s[d])));
        }
      }
    }
  });
  return out.transpose(1, 2);
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos_in.dim() == 3, "rotary: q, k [B, H, T, D], cos, sin [B, T, D]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && q.size(3) % 2 == 0, "rotary: unit stride on an even head dim");
  TORCH_CHECK(q.scalar_type() == cos_in.scalar_type() && k.scalar_type() == q.scalar_type(), "rotary: one dtype");
  const at::Tensor cos = cos_in.expand({q.size(0), q.size(2), q.size(3)}).contiguous();
  const at::Tensor sin = sin_in.expand({q.size(0), q.size(2), q.size(3)}).contiguous();
  at::Tensor qo, ko;
  by_dtype(q.scalar_type(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    qo = rotate_one<T>(q, cos, sin);
    ko = rotate_one<T>(k, cos, sin);
  });
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenstream, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenstream, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("add_rms_norm", &add_rms_norm);
}
