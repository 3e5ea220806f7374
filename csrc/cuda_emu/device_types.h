// The emulator's CUDA keywords, vector and 16-bit types and device math (see cuda_emu.h).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// --- the CUDA keywords ---------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

// --- vector and storage types --------------------------------------------------------------------

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

inline float __uint_as_float(unsigned bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
inline unsigned __float_as_uint(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// float16 through the CPU's F16C instructions (IEEE round to nearest even, like __float2half_rn).
struct __half {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;
};
inline float __half2float(__half h) { return _cvtsh_ss(h.bits); }
inline __half __float2half_rn(float f) {
  return __half{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

// bfloat16: the upper half of a float32, rounded to nearest even (NaN kept quiet).
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned>(b.bits) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned bits = __float_as_uint(f);
  if (std::isnan(f)) return __nv_bfloat16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  const unsigned rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(rounded >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return {__bfloat162float(b.x), __bfloat162float(b.y)};
}

// --- device math ---------------------------------------------------------------------------------

template <typename A, typename B>
inline auto min(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B>
inline auto max(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
