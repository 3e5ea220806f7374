// The interface between the fused elementwise ops of ops.h (elementwise_ops.cpp: checks, thread
// count) and their kernels, compiled once per ISA variant (elementwise_kernels.cpp) into the
// namespaces pagedserve::cpu::{generic, avx2, avx512} like the attention kernels.
#pragma once

#include <cstdint>

#include "ops.h"

namespace pagedserve::cpu {

// rms_norm, and fused_add_rms_norm when residual is set; shapes as in ops.h.
struct RmsNormProblem {
  void* out;  // [num_tokens, hidden_size]: rms_norm's out, fused_add_rms_norm's x
  int64_t out_token_stride;
  const void* input;  // [num_tokens, hidden_size]: rms_norm's x, fused_add_rms_norm's x
  int64_t input_token_stride;
  void* residual;  // [num_tokens, hidden_size], or nullptr for plain rms_norm
  int64_t residual_token_stride;
  const void* weight;  // [hidden_size]
  int64_t num_tokens;
  int64_t hidden_size;
  float eps;
  DType dtype;
  int num_threads;
};

struct RotaryProblem {
  const int64_t* positions;  // [num_tokens], all in [0, max_positions)
  void* query;               // [num_tokens, num_heads, head_size]
  int64_t query_token_stride;
  int64_t num_heads;
  void* key;  // [num_tokens, num_kv_heads, head_size]
  int64_t key_token_stride;
  int64_t num_kv_heads;
  int64_t head_size;
  const float* cos;  // [max_positions, head_size / 2]
  const float* sin;  // [max_positions, head_size / 2]
  int64_t num_tokens;
  DType dtype;
  int num_threads;
};

struct SiluAndMulProblem {
  void* out;  // [num_tokens, intermediate_size]
  int64_t out_token_stride;
  const void* x;  // [num_tokens, 2 * intermediate_size]: gate | up
  int64_t x_token_stride;
  int64_t num_tokens;
  int64_t intermediate_size;
  DType dtype;
  int num_threads;
};

struct ElementwiseKernels {
  void (*rms_norm)(const RmsNormProblem&);
  void (*rotary_embedding)(const RotaryProblem&);
  void (*silu_and_mul)(const SiluAndMulProblem&);
};

// The variant of the ISA the attention kernels run (dispatch.cpp chooses one for both).
const ElementwiseKernels& elementwise_kernels();

namespace generic {
extern const ElementwiseKernels kElementwiseKernels;
}
#if defined(PAGEDSERVE_HAVE_AVX2)
namespace avx2 {
extern const ElementwiseKernels kElementwiseKernels;
}
#endif
#if defined(PAGEDSERVE_HAVE_AVX512)
namespace avx512 {
extern const ElementwiseKernels kElementwiseKernels;
}
#endif

}  // namespace pagedserve::cpu
