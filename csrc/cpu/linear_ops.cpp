// The packed linear of ops.h: argument checks and the thread count; the kernels are in
// linear_kernels.cpp. Compiled for the baseline ISA.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "linear_kernels.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Below this many multiply-adds a call runs on the calling thread: waking the OpenMP pool and
// joining it again (a few us) costs more than a second thread saves. One row of a 576 x 576
// matrix is 330k; measured on 2 cores, two threads win from about 2 rows of it.
constexpr int64_t kMinParallelWork = int64_t{1} << 19;

void check_at_least(const char* name, int64_t value, int64_t minimum) {
  if (value < minimum) {
    throw std::invalid_argument(std::string(name) + " " + std::to_string(value) +
                                " must be >= " + std::to_string(minimum));
  }
}

void run_linear(void* out, int64_t out_row_stride, const void* x, int64_t x_row_stride,
                const void* packed_weight, const float* weight_scales, const void* bias,
                int64_t num_rows, int64_t in_features, int64_t out_features, DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                                " is not supported (0 float32, 1 bfloat16, 2 float16)");
  }
  check_at_least("num_rows", num_rows, 0);
  check_at_least("in_features", in_features, 1);
  check_at_least("out_features", out_features, 1);
  if (num_rows > 1) {
    check_at_least("x_row_stride", x_row_stride, in_features);
    check_at_least("out_row_stride", out_row_stride, out_features);
  }
  if (num_rows == 0) return;
  const int64_t work = num_rows * in_features * out_features;
  const int num_threads = work < kMinParallelWork ? 1 : get_num_threads();
  const LinearProblem p{out,           out_row_stride, x,     x_row_stride,
                        packed_weight, weight_scales,  bias,  num_rows,
                        in_features,   out_features,   dtype, num_threads};
  linear_kernels().linear_packed(p);
}

}  // namespace

void linear_packed(void* out, int64_t out_row_stride, const void* x, int64_t x_row_stride,
                   const void* packed_weight, const void* bias, int64_t num_rows,
                   int64_t in_features, int64_t out_features, DType dtype) {
  run_linear(out, out_row_stride, x, x_row_stride, packed_weight, nullptr, bias, num_rows,
             in_features, out_features, dtype);
}

void linear_packed_int8(void* out, int64_t out_row_stride, const void* x, int64_t x_row_stride,
                        const int8_t* packed_weight, const float* weight_scales, const void* bias,
                        int64_t num_rows, int64_t in_features, int64_t out_features, DType dtype) {
  if (weight_scales == nullptr && num_rows > 0) {
    throw std::invalid_argument("weight_scales must be set: one float32 per output feature");
  }
  run_linear(out, out_row_stride, x, x_row_stride, packed_weight, weight_scales, bias, num_rows,
             in_features, out_features, dtype);
}

}  // namespace pagedserve::cpu
