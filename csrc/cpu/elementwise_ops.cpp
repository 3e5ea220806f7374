// The fused elementwise ops of ops.h: argument checks and the thread count; the kernels are in
// elementwise_kernels.cpp. Compiled for the baseline ISA.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "elementwise_kernels.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Below this much work (elements, weighted by their cost relative to an RMSNorm element) a call
// runs on the calling thread: waking the OpenMP pool and joining it again (a few us) costs more
// than a second thread saves. Measured on 2 cores, fp32 breaks even at about 20k RMSNorm
// elements (576-wide rows: 32 tokens), 33k RoPE elements (0.5x) and 7k SiLU elements (2x);
// bf16/fp16 elements cost 2-3x more and break even earlier, but near break-even either choice
// costs about the same.
constexpr int64_t kMinParallelWork = int64_t{1} << 14;

int threads_for(int64_t num_tokens, int64_t work_per_token) {
  if (num_tokens * work_per_token < kMinParallelWork) return 1;
  return static_cast<int>(std::min<int64_t>(get_num_threads(), num_tokens));
}

void check_dtype(DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                                " is not supported (0 float32, 1 bfloat16, 2 float16)");
  }
}

void check_positive(const char* name, int64_t value) {
  if (value < 1) {
    throw std::invalid_argument(std::string(name) + " " + std::to_string(value) + " must be >= 1");
  }
}

void check_rows(int64_t num_tokens, int64_t hidden_size, DType dtype) {
  check_dtype(dtype);
  if (num_tokens < 0) {
    throw std::invalid_argument("num_tokens " + std::to_string(num_tokens) + " must be >= 0");
  }
  check_positive("hidden_size", hidden_size);
}

}  // namespace

void rms_norm(void* out, int64_t out_token_stride, const void* x, int64_t x_token_stride,
              const void* weight, int64_t num_tokens, int64_t hidden_size, float eps, DType dtype) {
  check_rows(num_tokens, hidden_size, dtype);
  const RmsNormProblem p{out,         out_token_stride,
                         x,           x_token_stride,
                         nullptr,     0,
                         weight,      num_tokens,
                         hidden_size, eps,
                         dtype,       threads_for(num_tokens, hidden_size)};
  elementwise_kernels().rms_norm(p);
}

void fused_add_rms_norm(void* x, int64_t x_token_stride, void* residual,
                        int64_t residual_token_stride, const void* weight, int64_t num_tokens,
                        int64_t hidden_size, float eps, DType dtype) {
  check_rows(num_tokens, hidden_size, dtype);
  // Each row's x is read (into the residual) before it is overwritten with the normed row.
  const RmsNormProblem p{x,           x_token_stride,
                         x,           x_token_stride,
                         residual,    residual_token_stride,
                         weight,      num_tokens,
                         hidden_size, eps,
                         dtype,       threads_for(num_tokens, hidden_size)};
  elementwise_kernels().rms_norm(p);
}

void rotary_embedding(const int64_t* positions, void* query, int64_t query_token_stride,
                      int64_t num_heads, void* key, int64_t key_token_stride, int64_t num_kv_heads,
                      int64_t head_size, const float* cos, const float* sin, int64_t max_positions,
                      int64_t num_tokens, DType dtype) {
  check_rows(num_tokens, head_size, dtype);
  check_positive("num_heads", num_heads);
  check_positive("num_kv_heads", num_kv_heads);
  if (head_size % 2 != 0) {
    throw std::invalid_argument("head_size " + std::to_string(head_size) + " must be even");
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= max_positions) {
      throw std::invalid_argument("positions[" + std::to_string(t) +
                                  "] = " + std::to_string(positions[t]) + " is outside [0, " +
                                  std::to_string(max_positions) + ") (max_positions)");
    }
  }
  const RotaryProblem p{positions,
                        query,
                        query_token_stride,
                        num_heads,
                        key,
                        key_token_stride,
                        num_kv_heads,
                        head_size,
                        cos,
                        sin,
                        num_tokens,
                        dtype,
                        threads_for(num_tokens, (num_heads + num_kv_heads) * head_size / 2)};
  elementwise_kernels().rotary_embedding(p);
}

void silu_and_mul(void* out, int64_t out_token_stride, const void* x, int64_t x_token_stride,
                  int64_t num_tokens, int64_t intermediate_size, DType dtype) {
  check_rows(num_tokens, intermediate_size, dtype);
  const SiluAndMulProblem p{
      out,        out_token_stride,  x,     x_token_stride,
      num_tokens, intermediate_size, dtype, threads_for(num_tokens, 2 * intermediate_size)};
  elementwise_kernels().silu_and_mul(p);
}

}  // namespace pagedserve::cpu
