// The interface between the packed linear op of ops.h (linear_ops.cpp: checks, thread
// count) and its kernels, compiled once per ISA variant (linear_kernels.cpp) into the namespaces
// pagedserve::cpu::{generic, avx2, avx512} like the attention kernels.
#pragma once

#include <cstdint>

#include "ops.h"

namespace pagedserve::cpu {

struct LinearProblem {
  void* out;  // [num_rows, out_features]
  int64_t out_row_stride;
  const void* x;  // [num_rows, in_features]
  int64_t x_row_stride;
  const void* packed_weight;   // ops.h's panel layout, in dtype or (weight_scales set) int8
  const float* weight_scales;  // int8 weights: W[n][k] == packed[n / 16][k][n % 16] * this[n]
  const void* bias;            // [out_features] or nullptr
  int64_t num_rows;
  int64_t in_features;
  int64_t out_features;
  DType dtype;  // of x, bias, out and (unless int8) the weights
  int num_threads;
};

struct LinearKernels {
  void (*linear_packed)(const LinearProblem&);
};

// The variant of the ISA the attention kernels run (dispatch.cpp chooses one for all).
const LinearKernels& linear_kernels();

namespace generic {
extern const LinearKernels kLinearKernels;
}
#if defined(PAGEDSERVE_HAVE_AVX2)
namespace avx2 {
extern const LinearKernels kLinearKernels;
}
#endif
#if defined(PAGEDSERVE_HAVE_AVX512)
namespace avx512 {
extern const LinearKernels kLinearKernels;
}
#endif

}  // namespace pagedserve::cpu
