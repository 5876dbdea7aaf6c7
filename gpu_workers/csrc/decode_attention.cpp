// Decode attention on the CPU for the engine's packed step (gpu_workers/cpu_kernels.py loads it).
//
// Each decoding row has one new query token and attends the first `lengths[r]` keys of its slot in
// the KV pool, in place: no padding to the longest row, no mask, no copy of keys or values. Work is
// split over (row, kv head) pairs (ATen's parallel_for: torch's own OpenMP threads); the query heads
// that share a kv head (grouped-query attention) are served by the same item one after another, so
// the kv head's keys and values come from memory once and from the core's cache for the others.
// Scores are kept in fp32; bf16 and fp16 values are widened on the fly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtypes.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using tokenstream::by_dtype;
using tokenstream::f32;

// DIM > 0: the head dim known when compiling (loops unrolled and vectorised whole); 0: q.size(2)
template <typename T, int64_t DIM>
void decode(const at::Tensor& q, const at::Tensor& pool, const int64_t* slots, const int64_t* lengths,
            at::Tensor& out, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = DIM > 0 ? DIM : q.size(2);
  const int64_t kv_heads = pool.size(2), group = heads / kv_heads;
  const int64_t s_slot = pool.stride(0), s_kv = pool.stride(1), s_head = pool.stride(2), s_pos = pool.stride(3);
  const T* qp = q.data_ptr<T>();
  const T* pp = pool.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(dim), acc(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads, n = lengths[r];
      const T* keys = pp + slots[r] * s_slot + h * s_head;
      const T* values = keys + s_kv;
      scores.resize(n);
      // One query head at a time: the kv head's keys and values come from memory for the first and
      // from the core's cache for the others (a row's block is tens of KiB); the dot products and
      // sums then vectorise over the head dim with the accumulators in registers.
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = r * heads + h * group + g;
        for (int64_t d = 0; d < dim; ++d) qf[d] = f32(qp[head * dim + d]);
        const float* qv = qf.data();
        float top = -INFINITY;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {  // four keys per pass over the head dim: fewer horizontal sums
          const T *k0 = keys + t * s_pos, *k1 = k0 + s_pos, *k2 = k1 + s_pos, *k3 = k2 + s_pos;
          float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int64_t d = 0; d < dim; ++d) {
            s0 += qv[d] * f32(k0[d]);
            s1 += qv[d] * f32(k1[d]);
            s2 += qv[d] * f32(k2[d]);
            s3 += qv[d] * f32(k3[d]);
          }
          scores[t] = s0 * sc, scores[t + 1] = s1 * sc, scores[t + 2] = s2 * sc, scores[t + 3] = s3 * sc;
        }
        for (; t < n; ++t) {
          const T* k = keys + t * s_pos;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qv[d] * f32(k[d]);
          scores[t] = s * sc;
        }
        for (t = 0; t < n; ++t) top = scores[t] > top ? scores[t] : top;
        float total = 0.f;
#pragma omp simd reduction(+ : total)  // vectorised exp (glibc's libmvec)
        for (int64_t t = 0; t < n; ++t) {
          scores[t] = std::exp(scores[t] - top);
          total += scores[t];
        }
        float* a = acc.data();
        std::fill(a, a + dim, 0.f);
        for (t = 0; t + 4 <= n; t += 4) {  // four values per pass: the accumulators loaded and stored once
          const T *v0 = values + t * s_pos, *v1 = v0 + s_pos, *v2 = v1 + s_pos, *v3 = v2 + s_pos;
          const float p0 = scores[t], p1 = scores[t + 1], p2 = scores[t + 2], p3 = scores[t + 3];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d)
            a[d] += p0 * f32(v0[d]) + p1 * f32(v1[d]) + p2 * f32(v2[d]) + p3 * f32(v3[d]);
        }
        for (; t < n; ++t) {
          const T* v = values + t * s_pos;
          const float p = scores[t];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * f32(v[d]);
        }
        const float inv = 1.f / total;
        T* o = op + head * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d] * inv);
      }
    }
  });
}

template <typename T>
void by_dim(const at::Tensor& q, const at::Tensor& pool, const int64_t* slots, const int64_t* lengths, at::Tensor& out,
            double scale) {
  switch (q.size(2)) {
    case 64: decode<T, 64>(q, pool, slots, lengths, out, scale); break;
    case 128: decode<T, 128>(q, pool, slots, lengths, out, scale); break;
    default: decode<T, 0>(q, pool, slots, lengths, out, scale);
  }
}

// q [rows, heads, dim]; pool [slots, 2 (key, value), kv_heads, max_len, dim] with unit stride on dim;
// slots, lengths [rows] int64 -> [rows, heads, dim]
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& pool, const at::Tensor& slots_in,
                            const at::Tensor& lengths_in, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && pool.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(q_in.dim() == 3 && pool.dim() == 5, "q [rows, heads, dim], pool [slots, 2, kv_heads, len, dim]");
  TORCH_CHECK(q_in.scalar_type() == pool.scalar_type(), "q and the pool must share a dtype");
  TORCH_CHECK(pool.stride(4) == 1 && pool.size(4) == q_in.size(2), "the pool's last axis is the head dim, unit stride");
  TORCH_CHECK(q_in.size(1) % pool.size(2) == 0, "query heads must be a multiple of kv heads");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == q.size(0) && lengths.numel() == q.size(0), "one slot and one length per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < pool.size(0), "slot out of range");
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= pool.size(3), "length out of range");
  }
  at::Tensor out = at::empty_like(q);
  by_dtype(q.scalar_type(), "decode_attention", [&](auto tag) {
    by_dim<decltype(tag)>(q, pool, sp, lp, out, scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenstream, m) {
  m.def("decode_attention(Tensor q, Tensor pool, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenstream, CPU, m) { m.impl("decode_attention", &decode_attention); }
