// The fused elementwise kernels of a decoder layer (ops.h), compiled once per ISA variant; see
// vec.h. Each reproduces the rounding of the torch expression it replaces: math in float32, and a
// rounding to the activation dtype wherever torch ends an op and stores a bf16/fp16 tensor.
//
// NOTE: CMakeLists.txt compiles this file with -ffp-contract=off. A multiply-add contracted into
// an FMA rounds once where torch rounds twice, and fp32 results would no longer match torch's
// bit for bit (which keeps greedy decoding token-identical to HF). The only FMAs here are the
// explicit ones of exp_like_torch, which mirror SLEEF's.
//
// Rows are independent: the tokens are split into one contiguous range per thread. Row tails
// shorter than a vector go through the same vector code via a zero-padded buffer, so they round
// exactly like the rest of the row (silu_and_mul's tail follows torch's scalar path instead).
#include "elementwise_kernels.h"

#include <omp.h>

#include <cmath>
#include <type_traits>

#include "vec.h"

namespace pagedserve::cpu::PAGEDSERVE_ISA_NS {
namespace {

// Runs body(begin, end) over one contiguous token range per thread; with one thread, on the
// calling thread without opening an OpenMP region (most calls are small).
template <typename Body>
void for_token_ranges(int64_t num_tokens, int num_threads, const Body& body) {
  if (num_threads <= 1) {
    body(int64_t{0}, num_tokens);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t n = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    body(num_tokens * i / n, num_tokens * (i + 1) / n);
  }
}

// The first n (< kWidth) elements at p, zero-padded.
template <typename T>
VecF load_partial(const T* p, int64_t n) {
  float buffer[kWidth] = {};
  for (int64_t i = 0; i < n; ++i) buffer[i] = to_float(p[i]);
  return VecF::load(buffer);
}

// Stores the first n (< kWidth) lanes of x at p.
template <typename T>
void store_partial(T* p, int64_t n, VecF x) {
  float buffer[kWidth];
  x.store(buffer);
  for (int64_t i = 0; i < n; ++i) p[i] = from_float<T>(buffer[i]);
}

// --- rms_norm ------------------------------------------------------------------------------
//
// HF: h = x.float(); var = h.pow(2).mean(-1); h = h * rsqrt(var + eps); out = w * h.to(dtype).
// Every step is one correctly rounded float op except the sum inside mean(), whose result
// depends on the order of its additions; sum_in_torch_order repeats the order of torch's CPU sum
// of a contiguous float32 row (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum),
// which runs 8-lane float vectors (its AVX2 build, also on AVX-512 CPUs; the default build's
// vectors are 8 lanes too):
//
//   row:  | v0 v1 v2 v3 | v4 v5 v6 v7 | ... groups of 4 vectors ... | leftover vectors | tail |
//          acc0 acc1 acc2 acc3 += one group at a time, cascaded: every 16 groups level 0 is
//          added into level 1 (and level 1 into 2 every 256, ...), so only similar sizes meet;
//   then acc0 += leftover vectors, acc0 += acc1, += acc2, += acc3;
//   sum = ((0 + tail[0]) + tail[1] + ...) + acc0 lane 0 + lane 1 + ... + lane 7.
//
// Rows shorter than 8 take torch's scalar path instead, which this does not mirror.
constexpr int kTorchSumLanes = 8;
constexpr int kTorchSumRows = 4;  // accumulators (torch's ilp_factor)
constexpr int kTorchSumLevels = 4;
constexpr int kGroupFloats = kTorchSumLanes * kTorchSumRows;
constexpr int kGroupVecs = kGroupFloats / kWidth;
static_assert(kGroupFloats % kWidth == 0 && kWidth % kTorchSumLanes == 0,
              "a vector must hold whole torch vectors, and a group whole vectors");

int64_t ceil_log2(int64_t x) {  // torch's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  while ((int64_t{1} << bits) < x) ++bits;
  return bits;
}

// Source provides the values to sum: vec(i) the kWidth values from index i, scalar(i) one value;
// each index is asked for exactly once.
template <typename Source>
float sum_in_torch_order(int64_t n, Source& source) {
  const int64_t num_vectors = n / kTorchSumLanes;
  const int64_t num_groups = num_vectors / kTorchSumRows;
  const int64_t level_power = max_i64(4, ceil_log2(num_groups) / kTorchSumLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;

  VecF acc[kTorchSumLevels][kGroupVecs];
  for (auto& level : acc) {
    for (VecF& a : level) a = VecF::zero();
  }
  const auto add_group = [&](int64_t group) {
    for (int j = 0; j < kGroupVecs; ++j) {
      acc[0][j] = acc[0][j] + source.vec(group * kGroupFloats + j * kWidth);
    }
  };
  int64_t group = 0;
  while (group + level_step <= num_groups) {
    for (int64_t i = 0; i < level_step; ++i, ++group) add_group(group);
    for (int level = 1; level < kTorchSumLevels; ++level) {
      for (int j = 0; j < kGroupVecs; ++j) {
        acc[level][j] = acc[level][j] + acc[level - 1][j];
        acc[level - 1][j] = VecF::zero();
      }
      if ((group & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; group < num_groups; ++group) add_group(group);
  for (int level = 1; level < kTorchSumLevels; ++level) {
    for (int j = 0; j < kGroupVecs; ++j) acc[0][j] = acc[0][j] + acc[level][j];
  }

  // Torch's accumulator k is partial[8k .. 8k + 7].
  float partial[kGroupFloats];
  for (int j = 0; j < kGroupVecs; ++j) acc[0][j].store(partial + j * kWidth);
  for (int64_t v = num_groups * kTorchSumRows; v < num_vectors; ++v) {
    for (int lane = 0; lane < kTorchSumLanes; ++lane) {
      partial[lane] += source.scalar(v * kTorchSumLanes + lane);
    }
  }
  for (int k = 1; k < kTorchSumRows; ++k) {
    for (int lane = 0; lane < kTorchSumLanes; ++lane) {
      partial[lane] += partial[k * kTorchSumLanes + lane];
    }
  }
  float sum = 0.0f;
  for (int64_t i = num_vectors * kTorchSumLanes; i < n; ++i) sum += source.scalar(i);
  for (int lane = 0; lane < kTorchSumLanes; ++lane) sum += partial[lane];
  return sum;
}

// The squares of a row's values (x.float().pow(2)).
template <typename T>
struct Squares {
  const T* row;

  VecF vec(int64_t i) const {
    const VecF x = VecF::load(row + i);
    return x * x;
  }
  float scalar(int64_t i) const {
    const float x = to_float(row[i]);
    return x * x;
  }
};

// Adds x into the residual row (residual = x + residual, rounded to T as torch's add rounds)
// while handing out the squares of the new residual values.
template <typename T>
struct AddResidualSquares {
  const T* x;
  T* residual;

  VecF vec(int64_t i) const {
    const VecF r = round_to<T>(VecF::load(x + i) + VecF::load(residual + i));
    r.store(residual + i);
    return r * r;
  }
  float scalar(int64_t i) const {
    const float r = to_float(from_float<T>(to_float(x[i]) + to_float(residual[i])));
    residual[i] = from_float<T>(r);
    return r * r;
  }
};

// out = weight * to_T(row * inv_rms), rounded to T.
template <typename T>
VecF scale_row_values(VecF x, VecF weight, VecF inv_rms) {
  return weight * round_to<T>(x * inv_rms);
}

template <typename T>
void scale_row(const T* row, const T* weight, T* out, int64_t n, float inv_rms) {
  const VecF scale = VecF::broadcast(inv_rms);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    scale_row_values<T>(VecF::load(row + i), VecF::load(weight + i), scale).store(out + i);
  }
  if (i < n) {
    store_partial(
        out + i, n - i,
        scale_row_values<T>(load_partial(row + i, n - i), load_partial(weight + i, n - i), scale));
  }
}

template <typename T>
void rms_norm_rows(const RmsNormProblem& p, int64_t begin, int64_t end) {
  const int64_t n = p.hidden_size;
  const T* weight = static_cast<const T*>(p.weight);
  for (int64_t t = begin; t < end; ++t) {
    const T* input = static_cast<const T*>(p.input) + t * p.input_token_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_token_stride;
    const T* normed = input;
    float sum;
    if (p.residual != nullptr) {
      T* residual = static_cast<T*>(p.residual) + t * p.residual_token_stride;
      AddResidualSquares<T> source{input, residual};
      sum = sum_in_torch_order(n, source);
      normed = residual;
    } else {
      Squares<T> source{input};
      sum = sum_in_torch_order(n, source);
    }
    // torch: mean = sum / n; rsqrt(mean + eps) = 1 / sqrt(mean + eps).
    const float variance = sum / static_cast<float>(n);
    scale_row(normed, weight, out, n, 1.0f / std::sqrt(variance + p.eps));
  }
}

void rms_norm(const RmsNormProblem& p) {
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_token_ranges(p.num_tokens, p.num_threads,
                     [&](int64_t begin, int64_t end) { rms_norm_rows<T>(p, begin, end); });
  });
}

// --- rotary_embedding ------------------------------------------------------------------------
//
// HF (rotate-half): c = cos[pos].to(T); s = sin[pos].to(T);
//   first half = x1 * c + (-x2) * s;  second half = x2 * c + x1 * s
// with every product and sum rounded to T. (-x2) * s rounds to exactly -(x2 * s) and
// a + (-b) is a - b, so the first half is round(x1 c) - round(x2 s).

template <typename T>
void rotate_values(VecF& x1, VecF& x2, VecF c, VecF s) {
  const VecF first = round_to<T>(x1 * c) - round_to<T>(x2 * s);
  x2 = round_to<T>(x2 * c) + round_to<T>(x1 * s);
  x1 = first;
}

// Rotates the heads of one token: row [num_heads, head_size].
template <typename T>
void rotate_heads(T* row, int64_t num_heads, int64_t head_size, const float* cos_row,
                  const float* sin_row) {
  const int64_t half = head_size / 2;
  for (int64_t i = 0; i < half; i += kWidth) {
    const int64_t n = min_i64(kWidth, half - i);
    const bool full = n == kWidth;
    const VecF c = round_to<T>(full ? VecF::load(cos_row + i) : load_partial(cos_row + i, n));
    const VecF s = round_to<T>(full ? VecF::load(sin_row + i) : load_partial(sin_row + i, n));
    for (int64_t h = 0; h < num_heads; ++h) {
      T* first = row + h * head_size + i;
      T* second = first + half;
      VecF x1 = full ? VecF::load(first) : load_partial(first, n);
      VecF x2 = full ? VecF::load(second) : load_partial(second, n);
      rotate_values<T>(x1, x2, c, s);
      if (full) {
        x1.store(first);
        x2.store(second);
      } else {
        store_partial(first, n, x1);
        store_partial(second, n, x2);
      }
    }
  }
}

void rotary_embedding(const RotaryProblem& p) {
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t half = p.head_size / 2;
    for_token_ranges(p.num_tokens, p.num_threads, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos_row = p.cos + p.positions[t] * half;
        const float* sin_row = p.sin + p.positions[t] * half;
        rotate_heads(static_cast<T*>(p.query) + t * p.query_token_stride, p.num_heads, p.head_size,
                     cos_row, sin_row);
        rotate_heads(static_cast<T*>(p.key) + t * p.key_token_stride, p.num_kv_heads, p.head_size,
                     cos_row, sin_row);
      }
    });
  });
}

// --- silu_and_mul ----------------------------------------------------------------------------
//
// torch: F.silu(gate) * up, silu = x / (1 + exp(-x)) in float32 (bf16/fp16 widened first), its
// result rounded to T, then the product rounded to T. torch's elementwise loop runs each row two
// of its vectors at a time (2 x 16 floats or 2 x 32 bf16/fp16 values on AVX-512, half that with
// AVX2 or without SIMD: always 2 * kWidth * 4 / sizeof(T) elements here) with its vectorized exp,
// which exp_like_torch repeats, and the columns past the last whole step with libm's expf, which
// the same columns here use too.

template <typename T>
constexpr int64_t kTorchLoopStep = 2 * kWidth * static_cast<int64_t>(sizeof(float) / sizeof(T));

template <typename T>
VecF silu_and_mul_values(VecF gate, VecF up) {
  const VecF exp_neg = exp_like_torch(VecF::zero() - gate);
  return round_to<T>(gate / (VecF::broadcast(1.0f) + exp_neg)) * up;
}

template <typename T>
T silu_and_mul_value(float gate, float up) {
  return from_float<T>(to_float(from_float<T>(gate / (1.0f + std::exp(-gate)))) * up);
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
  const int64_t vector_end = d - d % kTorchLoopStep<T>;
  int64_t i = 0;
  for (; i < vector_end; i += kWidth) {
    silu_and_mul_values<T>(VecF::load(gate + i), VecF::load(up + i)).store(out + i);
  }
  for (; i < d; ++i) out[i] = silu_and_mul_value<T>(to_float(gate[i]), to_float(up[i]));
}

void silu_and_mul(const SiluAndMulProblem& p) {
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t d = p.intermediate_size;
    for_token_ranges(p.num_tokens, p.num_threads, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = static_cast<const T*>(p.x) + t * p.x_token_stride;
        silu_and_mul_row(gate, gate + d, static_cast<T*>(p.out) + t * p.out_token_stride, d);
      }
    });
  });
}

}  // namespace

extern const ElementwiseKernels kElementwiseKernels = {rms_norm, rotary_embedding, silu_and_mul};

}  // namespace pagedserve::cpu::PAGEDSERVE_ISA_NS
