// A small float32 SIMD vector type for the CPU kernels, one definition per ISA.
//
// This header is compiled once per ISA variant (see CMakeLists.txt); everything lives in the
// namespace PAGEDSERVE_ISA_NS so the variants never share a symbol. Code compiled with
// -mavx512f must not leak into the generic variant through a shared inline function or
// template instantiation, which is also why the kernels use no std:: containers.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ops.h"
#include "scalar_types.h"

#if defined(PAGEDSERVE_ISA_AVX512) || defined(PAGEDSERVE_ISA_AVX2)
#include <immintrin.h>
#endif

#ifndef PAGEDSERVE_ISA_NS
#error "PAGEDSERVE_ISA_NS must name the ISA variant being compiled"
#endif

namespace pagedserve::cpu::PAGEDSERVE_ISA_NS {

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }  // int8-quantized weights
inline float to_float(BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000) << 16;
  uint32_t exponent = (x.bits >> 10) & 0x1f;
  uint32_t mantissa = x.bits & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float to_float(Float8E5M2 x) { return to_float(Half{static_cast<uint16_t>(x.bits << 8)}); }
// e4m3's 7 magnitude bits placed 7 bits up in a float16 keep their mantissa, and the exponent
// bias 15 instead of 7 makes the value 256 times smaller (subnormals included): exact.
inline float to_float(Float8E4M3 x) {
  if ((x.bits & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  const auto half = static_cast<uint16_t>(((x.bits & 0x80) << 8) | ((x.bits & 0x7f) << 7));
  return to_float(Half{half}) * 256.0f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return BFloat16{0x7fc0};
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}
template <>
inline Half from_float<Half>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u)
    return Half{static_cast<uint16_t>(sign | (bits > 0x7f800000u ? 0x7e00 : 0x7c00))};
  if (bits >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00)};  // overflow to inf
  if (bits < 0x38800000u) {  // result is subnormal or zero: add 0.5 to shift mantissa out
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof(magnitude));
    magnitude += 0.5f;
    uint32_t m;
    std::memcpy(&m, &magnitude, sizeof(m));
    return Half{static_cast<uint16_t>(sign | (m - 0x3f000000u))};
  }
  const uint32_t odd = (bits >> 13) & 1;
  bits += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return Half{static_cast<uint16_t>(sign | (bits >> 13))};
}
// A non-negative float32 (its bits, below the format's overflow) rounded to a float8 with
// kMantissa mantissa bits and exponent bias kBias, to nearest even, as c10 rounds: a subnormal
// by adding a power of two whose last mantissa bit is the float8's smallest step (the FPU
// rounds as it shifts the rest out), a normal by rebiasing the exponent and rounding the
// dropped bits.
template <int kMantissa, int kBias>
inline uint8_t round_to_float8(uint32_t bits) {
  constexpr int kDropped = 23 - kMantissa;
  if (bits < (uint32_t{128 - kBias} << 23)) {  // below the float8's smallest normal
    constexpr uint32_t kDenormMagic = uint32_t{151 - kBias - kMantissa} << 23;
    float magnitude, magic;
    std::memcpy(&magnitude, &bits, sizeof(magnitude));
    std::memcpy(&magic, &kDenormMagic, sizeof(magic));
    magnitude += magic;
    uint32_t m;
    std::memcpy(&m, &magnitude, sizeof(m));
    return static_cast<uint8_t>(m - kDenormMagic);
  }
  const uint32_t odd = (bits >> kDropped) & 1;
  bits += (static_cast<uint32_t>(kBias - 127) << 23) + ((uint32_t{1} << (kDropped - 1)) - 1) + odd;
  return static_cast<uint8_t>(bits >> kDropped);
}

// Straight from float32, as c10's fp8e5m2_from_fp32_value (torch's .to(torch.float8_e5m2)):
// rounding through float16 first could round twice.
template <>
inline Float8E5M2 from_float<Float8E5M2>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (uint32_t{143} << 23)) {  // |x| >= 65536, inf or NaN
    result = bits > 0x7f800000u ? 0x7f : 0x7c;
  } else {
    result = round_to_float8<2, 15>(bits);
  }
  return Float8E5M2{static_cast<uint8_t>(result | (sign >> 24))};
}
// As c10's fp8e4m3fn_from_fp32_value (torch's .to(torch.float8_e4m3fn)) for |x| < 448, to
// nearest even; but saturating, as vLLM's CUDA conversion (__NV_SATFINITE): |x| >= 448 and
// infinities give +-448 where torch gives NaN (a NaN key would poison every later attention
// over it). NaN stays NaN.
template <>
inline Float8E4M3 from_float<Float8E4M3>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits > 0x7f800000u) {  // NaN
    result = 0x7f;
  } else if (bits >= 0x43e00000u) {  // |x| >= 448, inf included: the largest finite
    result = 0x7e;
  } else {
    result = round_to_float8<3, 7>(bits);
  }
  return Float8E4M3{static_cast<uint8_t>(result | (sign >> 24))};
}

// SLEEF's expf_u10 (sleefsimdsp.c, xexpf), which torch's vectorized float exp calls
// (Sleef_expf16_u10 / Sleef_expf8_u10): exp_like_torch repeats it operation for operation, FMAs
// included, so results are bit-identical to torch's.
namespace sleef_expf {
constexpr float kRLn2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kL2U = 0.693145751953125f;  // ln 2 = kL2U + kL2L (Cody-Waite)
constexpr float kL2L = 1.428606765330187045e-06f;
constexpr float kC5 = 0.000198527617612853646278381f;  // polynomial, highest degree first
constexpr float kC4 = 0.00139304355252534151077271f;
constexpr float kC3 = 0.00833336077630519866943359f;
constexpr float kC2 = 0.0416664853692054748535156f;
constexpr float kC1 = 0.166666671633720397949219f;
constexpr float kC0 = 0.5f;
constexpr float kUnderflow = -104.0f;  // below: 0
constexpr float kOverflow = 100.0f;    // above: inf
}  // namespace sleef_expf

#if defined(PAGEDSERVE_ISA_AVX512)

struct VecF {
  static constexpr int kWidth = 16;
  static constexpr int kNumRegisters = 32;
  __m512 v;

  VecF() = default;
  explicit VecF(__m512 x) : v(x) {}
  static VecF zero() { return VecF(_mm512_setzero_ps()); }
  static VecF broadcast(float x) { return VecF(_mm512_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm512_loadu_ps(p)); }
  static VecF load(const BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return VecF(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  static VecF load(const Half* p) {
    return VecF(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static VecF load(const int8_t* p) {
    return VecF(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  }
  static VecF load(const Float8E5M2* p) {  // each byte the top of a float16
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return VecF(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8)));
  }
  static VecF load(const Float8E4M3* p) {  // as the scalar to_float: via a float16, * 256
    const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i magnitude = _mm256_and_si256(raw, _mm256_set1_epi16(0x7f));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_xor_si256(raw, magnitude), 8),
                                         _mm256_slli_epi16(magnitude, 7));
    const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7f));
    return VecF(
        _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(BFloat16* p) const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  void store(Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  friend VecF operator+(VecF a, VecF b) { return VecF(_mm512_add_ps(a.v, b.v)); }
  friend VecF operator-(VecF a, VecF b) { return VecF(_mm512_sub_ps(a.v, b.v)); }
  friend VecF operator*(VecF a, VecF b) { return VecF(_mm512_mul_ps(a.v, b.v)); }
  friend VecF operator/(VecF a, VecF b) { return VecF(_mm512_div_ps(a.v, b.v)); }
  // a * b + c
  friend VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm512_fmadd_ps(a.v, b.v, c.v)); }
  friend VecF max(VecF a, VecF b) { return VecF(_mm512_max_ps(a.v, b.v)); }
  // NaN in a gives b, NaN in b gives NaN (as max): put a constant bound first.
  friend VecF min(VecF a, VecF b) { return VecF(_mm512_min_ps(a.v, b.v)); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  // Lanes where `position` < key_position become -inf (causal mask).
  VecF mask_future(VecF position, float key_position) const {
    const __mmask16 future =
        _mm512_cmp_ps_mask(position.v, _mm512_set1_ps(key_position), _CMP_LT_OQ);
    return VecF(_mm512_mask_blend_ps(future, v, _mm512_set1_ps(-INFINITY)));
  }
  // Lanes where key_position < `first` (before a sliding window) become -FLT_MAX: finite, so a
  // row whose first keys all lie before its window keeps a finite running max and its later
  // rescale exp(-FLT_MAX - m) is 0, where -inf - -inf would make it NaN.
  VecF mask_before(VecF first, float key_position) const {
    const __mmask16 before = _mm512_cmp_ps_mask(_mm512_set1_ps(key_position), first.v, _CMP_LT_OQ);
    return VecF(_mm512_mask_blend_ps(before, v, _mm512_set1_ps(-FLT_MAX)));
  }
  // 2^n for integral-valued n (no range checks: callers clamp n).
  static VecF exp2_integral(VecF n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return VecF(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
  }
  static VecF round(VecF x) {
    return VecF(_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Lanes where x < limit become zero.
  VecF zero_below(VecF x, float limit) const {
    const __mmask16 below = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_LT_OQ);
    return VecF(_mm512_maskz_mov_ps(static_cast<__mmask16>(~below), v));
  }
};

// Lane i of the result is the sum of all lanes of parts[i] (a transposed horizontal add).
inline VecF reduce_add_transposed(const VecF* parts) {
  __m512 x[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = parts[2 * i].v, b = parts[2 * i + 1].v;
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 y[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Each 128-bit chunk c of y[i] now holds, for sources 4i..4i+3, the sum over chunk c.
  const __m512 z0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 z1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return VecF(
      _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd)));
}

// In-place transpose of a kWidth x kWidth block: lane j of v[i] becomes lane i of v[j].
inline void transpose(VecF* v) {
  __m512 t[16], r[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i].v, v[i + 1].v);
    t[i + 1] = _mm512_unpackhi_ps(v[i].v, v[i + 1].v);
  }
  for (int i = 0; i < 16; i += 4) {
    for (int k = 0; k < 2; ++k) {
      const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
      r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  // r[4m + k] now holds, in each 128-bit chunk c, elements k of rows 4m..4m+3 of chunk c.
  for (int m = 0; m < 2; ++m) {
    for (int k = 0; k < 4; ++k) {
      t[8 * m + k] = _mm512_shuffle_f32x4(r[8 * m + k], r[8 * m + 4 + k], 0x88);
      t[8 * m + 4 + k] = _mm512_shuffle_f32x4(r[8 * m + k], r[8 * m + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    v[k].v = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    v[k + 8].v = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
}

// bf16 rows in "interleaved order": 2 * kWidth elements from one load and two unpacks, which
// leave each vector holding 4-element runs from alternating halves of every 128-bit lane
// (cheaper than widening 16 elements at a time). Dot products and element-wise accumulation
// do not care about the order as long as every operand uses it; store_pair undoes it.
constexpr bool kInterleavedBFloat16 = true;
inline void load_pair(const BFloat16* p, VecF& a, VecF& b) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i zero = _mm512_setzero_si512();
  a = VecF(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)));
  b = VecF(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)));
}
inline __m512i bfloat16_bits(VecF x) {  // round to nearest even, in the low 16 bits
  const __m512i bits = _mm512_castps_si512(x.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}
inline void store_pair(BFloat16* p, VecF a, VecF b) {
  // packus interleaves per 128-bit lane exactly as the unpacks split.
  _mm512_storeu_si512(p, _mm512_packus_epi32(bfloat16_bits(a), bfloat16_bits(b)));
}

// x rounded to the 16-bit type's precision (round to nearest even), as a float again.
inline VecF round_to_bfloat16(VecF x) {
  return VecF(_mm512_castsi512_ps(_mm512_slli_epi32(bfloat16_bits(x), 16)));
}
inline VecF round_to_half(VecF x) {
  return VecF(_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

inline VecF exp_like_torch(VecF x) {
  using namespace sleef_expf;
  const __m512 d = x.v;
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(kRLn2)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2U), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2L), s);
  __m512 u = _mm512_set1_ps(kC5);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kC4));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kC3));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kC2));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kC1));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kC0));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // u * 2^q in two steps (2^(q/2) each), so q down to -149 still gives denormals.
  const __m512i half_q = _mm512_srai_epi32(q, 1);
  const auto pow2 = [](__m512i e) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
  };
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half_q)), pow2(_mm512_sub_epi32(q, half_q)));
  const __mmask16 underflow = _mm512_cmp_ps_mask(d, _mm512_set1_ps(kUnderflow), _CMP_LT_OQ);
  u = _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), u);
  const __mmask16 overflow = _mm512_cmp_ps_mask(_mm512_set1_ps(kOverflow), d, _CMP_LT_OQ);
  return VecF(_mm512_mask_mov_ps(u, overflow, _mm512_set1_ps(INFINITY)));
}

#elif defined(PAGEDSERVE_ISA_AVX2)

struct VecF {
  static constexpr int kWidth = 8;
  static constexpr int kNumRegisters = 16;
  __m256 v;

  VecF() = default;
  explicit VecF(__m256 x) : v(x) {}
  static VecF zero() { return VecF(_mm256_setzero_ps()); }
  static VecF broadcast(float x) { return VecF(_mm256_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm256_loadu_ps(p)); }
  static VecF load(const BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  static VecF load(const Half* p) {
    return VecF(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static VecF load(const int8_t* p) {
    return VecF(_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  }
  static VecF load(const Float8E5M2* p) {  // each byte the top of a float16
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return VecF(_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8)));
  }
  static VecF load(const Float8E4M3* p) {  // as the scalar to_float: via a float16, * 256
    const __m128i raw = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i magnitude = _mm_and_si128(raw, _mm_set1_epi16(0x7f));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_xor_si128(raw, magnitude), 8),
                                      _mm_slli_epi16(magnitude, 7));
    const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f)));
    return VecF(_mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                                 _mm256_castsi256_ps(nan)));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(BFloat16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    // Pack the 32-bit lanes (each < 2^16) to 16 bits; packus works per 128-bit half.
    const __m256i packed = _mm256_packus_epi32(rounded, rounded);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  void store(Half* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  friend VecF operator+(VecF a, VecF b) { return VecF(_mm256_add_ps(a.v, b.v)); }
  friend VecF operator-(VecF a, VecF b) { return VecF(_mm256_sub_ps(a.v, b.v)); }
  friend VecF operator*(VecF a, VecF b) { return VecF(_mm256_mul_ps(a.v, b.v)); }
  friend VecF operator/(VecF a, VecF b) { return VecF(_mm256_div_ps(a.v, b.v)); }
  friend VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm256_fmadd_ps(a.v, b.v, c.v)); }
  friend VecF max(VecF a, VecF b) { return VecF(_mm256_max_ps(a.v, b.v)); }
  friend VecF min(VecF a, VecF b) { return VecF(_mm256_min_ps(a.v, b.v)); }
  float reduce_add() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  float reduce_max() const {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  VecF mask_future(VecF position, float key_position) const {
    const __m256 future = _mm256_cmp_ps(position.v, _mm256_set1_ps(key_position), _CMP_LT_OQ);
    return VecF(_mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), future));
  }
  // See the AVX-512 variant.
  VecF mask_before(VecF first, float key_position) const {
    const __m256 before = _mm256_cmp_ps(_mm256_set1_ps(key_position), first.v, _CMP_LT_OQ);
    return VecF(_mm256_blendv_ps(v, _mm256_set1_ps(-FLT_MAX), before));
  }
  static VecF exp2_integral(VecF n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  }
  static VecF round(VecF x) {
    return VecF(_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  VecF zero_below(VecF x, float limit) const {
    const __m256 below = _mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_LT_OQ);
    return VecF(_mm256_andnot_ps(below, v));
  }
};

inline VecF reduce_add_transposed(const VecF* parts) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = parts[2 * i].v, b = parts[2 * i + 1].v;
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  __m256 y[2];
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
    y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  // Each 128-bit half h of y[i] holds, for sources 4i..4i+3, the sum over half h.
  return VecF(_mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                            _mm256_permute2f128_ps(y[0], y[1], 0x31)));
}

inline void transpose(VecF* v) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i].v, v[i + 1].v);
    t[i + 1] = _mm256_unpackhi_ps(v[i].v, v[i + 1].v);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    v[k].v = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
    v[k + 4].v = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
  }
}

// See the AVX-512 variant: the same interleaving, per 128-bit lane of 256-bit vectors.
constexpr bool kInterleavedBFloat16 = true;
inline void load_pair(const BFloat16* p, VecF& a, VecF& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  a = VecF(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)));
  b = VecF(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)));
}
inline __m256i bfloat16_bits(VecF x) {
  const __m256i bits = _mm256_castps_si256(x.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  rounded = _mm256_srli_epi32(rounded, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}
inline void store_pair(BFloat16* p, VecF a, VecF b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_packus_epi32(bfloat16_bits(a), bfloat16_bits(b)));
}

inline VecF round_to_bfloat16(VecF x) {
  return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(bfloat16_bits(x), 16)));
}
inline VecF round_to_half(VecF x) {
  return VecF(_mm256_cvtph_ps(_mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

inline VecF exp_like_torch(VecF x) {  // see the AVX-512 variant
  using namespace sleef_expf;
  const __m256 d = x.v;
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(kRLn2)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2U), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2L), s);
  __m256 u = _mm256_set1_ps(kC5);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kC4));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kC3));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kC2));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kC1));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kC0));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i half_q = _mm256_srai_epi32(q, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
  };
  u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half_q)), pow2(_mm256_sub_epi32(q, half_q)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(kUnderflow), _CMP_LT_OQ), u);
  const __m256 overflow = _mm256_cmp_ps(_mm256_set1_ps(kOverflow), d, _CMP_LT_OQ);
  return VecF(_mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), overflow));
}

#else  // portable: plain loops the compiler vectorizes for the baseline ISA

struct VecF {
  static constexpr int kWidth = 8;
  static constexpr int kNumRegisters = 8;
  float v[kWidth];

  static VecF zero() { return broadcast(0.0f); }
  static VecF broadcast(float x) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static VecF load(const T* p) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <typename T>
  void store(T* p) const {
    for (int i = 0; i < kWidth; ++i) p[i] = from_float<T>(v[i]);
  }
  template <typename F>
  static VecF map2(VecF a, VecF b, F f) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = f(a.v[i], b.v[i]);
    return r;
  }
  friend VecF operator+(VecF a, VecF b) {
    return map2(a, b, [](float x, float y) { return x + y; });
  }
  friend VecF operator-(VecF a, VecF b) {
    return map2(a, b, [](float x, float y) { return x - y; });
  }
  friend VecF operator*(VecF a, VecF b) {
    return map2(a, b, [](float x, float y) { return x * y; });
  }
  friend VecF operator/(VecF a, VecF b) {
    return map2(a, b, [](float x, float y) { return x / y; });
  }
  friend VecF fma(VecF a, VecF b, VecF c) { return a * b + c; }
  friend VecF max(VecF a, VecF b) {
    return map2(a, b, [](float x, float y) { return x > y ? x : y; });
  }
  float reduce_add() const {
    float s = 0.0f;
    for (int i = 0; i < kWidth; ++i) s += v[i];
    return s;
  }
  float reduce_max() const {
    float m = v[0];
    for (int i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  VecF mask_future(VecF position, float key_position) const {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = position.v[i] < key_position ? -INFINITY : v[i];
    return r;
  }
  // See the AVX-512 variant.
  VecF mask_before(VecF first, float key_position) const {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = key_position < first.v[i] ? -FLT_MAX : v[i];
    return r;
  }
};

inline VecF reduce_add_transposed(const VecF* parts) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = parts[i].reduce_add();
  return r;
}

inline void transpose(VecF* v) {
  for (int i = 0; i < VecF::kWidth; ++i) {
    for (int j = i + 1; j < VecF::kWidth; ++j) {
      const float x = v[i].v[j];
      v[i].v[j] = v[j].v[i];
      v[j].v[i] = x;
    }
  }
}

constexpr bool kInterleavedBFloat16 = false;

inline VecF round_to_bfloat16(VecF x) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = to_float(from_float<BFloat16>(x.v[i]));
  return r;
}
inline VecF round_to_half(VecF x) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = to_float(from_float<Half>(x.v[i]));
  return r;
}

// torch's default-capability build (no SIMD) maps std::exp over the lanes, and so does this.
inline VecF exp_like_torch(VecF x) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

#endif

constexpr int kWidth = VecF::kWidth;

template <typename T>
struct TypeTag {
  using type = T;
};

// fn(TypeTag<T>{}) for the element type of dtype (validated by the caller), and its result.
template <typename Fn>
auto with_dtype(DType dtype, const Fn& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(TypeTag<float>{});
    case DType::kBFloat16:
      return fn(TypeTag<BFloat16>{});
    default:
      return fn(TypeTag<Half>{});
  }
}

// Whether rows of T load in interleaved order (see load_pair); other types load in order.
template <typename T>
constexpr bool kInterleaved = std::is_same_v<T, BFloat16> && kInterleavedBFloat16;

template <typename T>
inline void load_pair(const T* p, VecF& a, VecF& b) {
  a = VecF::load(p);
  b = VecF::load(p + kWidth);
}
template <typename T>
inline void store_pair(T* p, VecF a, VecF b) {
  a.store(p);
  b.store(p + kWidth);
}

// x rounded to T's precision and widened again: what a torch op computing in float32 and
// returning a T tensor hands to the next op. A no-op for float.
template <typename T>
inline VecF round_to(VecF x) {
  if constexpr (std::is_same_v<T, BFloat16>) return round_to_bfloat16(x);
  if constexpr (std::is_same_v<T, Half>) return round_to_half(x);
  return x;
}

// exp(x) for x <= 0 (softmax arguments), about 2 ulp; exp(-inf) == 0.
inline VecF exp_nonpositive(VecF x) {
#if defined(PAGEDSERVE_ISA_AVX512) || defined(PAGEDSERVE_ISA_AVX2)
  constexpr float kLowest = -87.3365447f;  // below this the result is denormal: return 0
  const VecF clamped = max(x, VecF::broadcast(kLowest));
  const VecF n = VecF::round(clamped * VecF::broadcast(1.44269504088896341f));
  // r = x - n * ln(2), in two parts so r keeps its precision (Cody-Waite).
  VecF r = fma(n, VecF::broadcast(-0.693359375f), clamped);
  r = fma(n, VecF::broadcast(2.12194440e-4f), r);
  VecF p = VecF::broadcast(1.9875691500e-4f);
  p = fma(p, r, VecF::broadcast(1.3981999507e-3f));
  p = fma(p, r, VecF::broadcast(8.3334519073e-3f));
  p = fma(p, r, VecF::broadcast(4.1665795894e-2f));
  p = fma(p, r, VecF::broadcast(1.6666665459e-1f));
  p = fma(p, r, VecF::broadcast(5.0000001201e-1f));
  p = fma(p, r * r, r + VecF::broadcast(1.0f));
  return (p * VecF::exp2_integral(n)).zero_below(x, kLowest);
#else
  VecF r;
  for (int i = 0; i < kWidth; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
#endif
}

// tanh(x), at most 5 ulp from the exact value (4.4 measured over [-12, 12]); NaN stays NaN.
// Eigen's float rational approximation (generic_fast_tanh_float): odd degree-13 over even
// degree-6 polynomials on x clamped to +-7.99881, where tanh rounds to +-1 in float.
inline VecF tanh(VecF x) {
#if defined(PAGEDSERVE_ISA_AVX512) || defined(PAGEDSERVE_ISA_AVX2)
  constexpr float kClamp = 7.99881172180175781f;
  // The constant first: max / min return their second operand for NaN, which keeps it.
  const VecF c = min(VecF::broadcast(kClamp), max(VecF::broadcast(-kClamp), x));
  const VecF c2 = c * c;
  VecF p = fma(c2, VecF::broadcast(-2.76076847742355e-16f), VecF::broadcast(2.00018790482477e-13f));
  p = fma(c2, p, VecF::broadcast(-8.60467152213735e-11f));
  p = fma(c2, p, VecF::broadcast(5.12229709037114e-08f));
  p = fma(c2, p, VecF::broadcast(1.48572235717979e-05f));
  p = fma(c2, p, VecF::broadcast(6.37261928875436e-04f));
  p = fma(c2, p, VecF::broadcast(4.89352455891786e-03f));
  VecF q = fma(c2, VecF::broadcast(1.19825839466702e-06f), VecF::broadcast(1.18534705686654e-04f));
  q = fma(c2, q, VecF::broadcast(2.26843463243900e-03f));
  q = fma(c2, q, VecF::broadcast(4.89352518554385e-03f));
  return c * p / q;
#else
  VecF r;
  for (int i = 0; i < kWidth; ++i) r.v[i] = std::tanh(x.v[i]);
  return r;
#endif
}

// Attention logit soft-capping (Gemma 2): cap * tanh(logit / cap), in HF's order of operations.
inline VecF soft_cap(VecF logit, VecF cap) { return tanh(logit / cap) * cap; }

inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

}  // namespace pagedserve::cpu::PAGEDSERVE_ISA_NS
