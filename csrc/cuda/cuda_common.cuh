// What every CUDA kernel file shares: error checks, the device guard, dtype dispatch and
// conversions between the storage dtypes and float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "ops.h"

namespace pagedserve::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

inline void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}

// Kernels launch on the current device: make the tensors' device current for one op, then put
// the caller's back (torch keeps its own idea of the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

inline cudaStream_t to_stream(const Stream& stream) {
  return static_cast<cudaStream_t>(stream.stream);
}

inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// The kernels hold positions, hence the window, in int.
inline void check_sliding_window(int64_t sliding_window) {
  if (sliding_window < 0 || sliding_window > INT32_MAX) {
    throw std::invalid_argument("sliding_window " + std::to_string(sliding_window) +
                                " must be in [0, 2^31) (tokens; 0: full attention)");
  }
}

inline void check_logits_soft_cap(float logits_soft_cap) {
  if (!std::isfinite(logits_soft_cap) || logits_soft_cap < 0.0f) {
    throw std::invalid_argument("logits_soft_cap " + std::to_string(logits_soft_cap) +
                                " must be finite and >= 0 (0: no soft-capping)");
  }
}

// Logit soft-capping on base-2 logits (the kernels' x = s * log2(e) for a logit s): HF's
// c * tanh(s / c) in base 2 is c2 * tanh(x / c2) with c2 = c * log2(e), so callers pass the cap
// scaled like the logits. cap_log2 0: off.
__device__ inline float soft_cap_log2(float logit_log2, float cap_log2) {
  return cap_log2 > 0.0f ? cap_log2 * tanhf(logit_log2 / cap_log2) : logit_log2;
}

// The factor that turns a row's unnormalized output into its attention output, from its running
// max m and exp-sum l (base 2, l relative to m) and, with sinks, the head's sink logit sink_log2
// (base 2) joining the softmax as a key whose value is zero (ops.h). The output accumulator is
// relative to m too; when the sink is the larger the factor rescales it. A row that saw no key
// (l == 0: seq_len 0) gets 0, sink or not.
__device__ inline float output_factor_log2(float m, float l, bool has_sink, float sink_log2) {
  if (!(l > 0.0f)) return 0.0f;
  if (!has_sink) return 1.0f / l;
  if (sink_log2 <= m) return 1.0f / (l + exp2f(sink_log2 - m));
  const float rescale = exp2f(m - sink_log2);
  return rescale / (l * rescale + 1.0f);
}

inline int64_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                              " is not supported (0 float32, 1 bfloat16, 2 float16)");
}

inline bool is_aligned(const void* pointer, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int log2_exact(int64_t value) {
  int log = 0;
  while ((int64_t{1} << log) < value) ++log;
  return log;
}

// Calls body(T{}) with T the storage type of `dtype`.
template <typename Body>
void dispatch_dtype(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kFloat32:
      body(float{});
      return;
    case DType::kBFloat16:
      body(__nv_bfloat16{});
      return;
    case DType::kFloat16:
      body(__half{});
      return;
  }
  throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                              " is not supported (0 float32, 1 bfloat16, 2 float16)");
}

template <int N>
struct IntConstant {
  static constexpr int value = N;
};

// Calls body(IntConstant<head_size>{}) for the supported head sizes.
template <typename Body>
void dispatch_head_size(int64_t head_size, Body&& body) {
  switch (head_size) {
    case 64:
      body(IntConstant<64>{});
      return;
    case 80:
      body(IntConstant<80>{});
      return;
    case 96:
      body(IntConstant<96>{});
      return;
    case 128:
      body(IntConstant<128>{});
      return;
    case 192:  // DeepSeek's MLA heads: 128 + 64 query / key values
      body(IntConstant<192>{});
      return;
    case 256:
      body(IntConstant<256>{});
      return;
  }
  throw std::invalid_argument("head_size " + std::to_string(head_size) +
                              " is not supported; supported: 64, 80, 96, 128, 192, 256");
}

inline void check_block_size(int64_t block_size) {
  if (block_size != 8 && block_size != 16 && block_size != 32) {
    throw std::invalid_argument("block_size " + std::to_string(block_size) +
                                " is not supported; supported: 8, 16, 32");
  }
}

// The caches are read in 16-byte vectors.
inline void check_cache_alignment(const PagedKVCache& cache) {
  const int64_t elem = element_bytes(cache.dtype);
  if (!is_aligned(cache.key_cache, 16) || !is_aligned(cache.value_cache, 16) ||
      (cache.key_block_stride * elem) % 16 != 0 || (cache.value_block_stride * elem) % 16 != 0) {
    throw std::invalid_argument(
        "key_cache and value_cache must start on 16-byte boundaries and have block strides of "
        "a multiple of 16 bytes (the pool tensor's layer views do)");
  }
}

// --- device-side conversions ----------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

// The kVecElems<T> elements of a 16-byte vector as float32.
__device__ __forceinline__ void unpack(const uint4& raw, float* out, float) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(const uint4& raw, float* out, __half) {
  const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack(const uint4& raw, float* out, __nv_bfloat16) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Through the read-only data cache (the kernels never write what they read this way).
__device__ __forceinline__ uint4 load16(const void* pointer) {
  return __ldg(reinterpret_cast<const uint4*>(pointer));
}

}  // namespace pagedserve::cuda
