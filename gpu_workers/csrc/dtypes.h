// The scalar types the engine's CPU kernels serve: float, bf16 and fp16 read as fp32, stored back
// rounded as torch rounds, and a dispatch from a tensor's dtype to the C++ type.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tokenstream {

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

inline float f32(c10::BFloat16 x) {  // bf16 is the top half of an fp32
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T to(float x) { return static_cast<T>(x); }

template <>
inline c10::BFloat16 to<c10::BFloat16>(float x) {  // round to nearest even, as torch does (finite values)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

template <typename T>
inline float round_to(float x) { return f32(to<T>(x)); }  // an intermediate stored in the dtype

// the scalar type's C++ type: f(T{}) for float, bf16 and fp16
template <typename F>
void by_dtype(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": float32, bfloat16 or float16");
  }
}

}  // namespace tokenstream
