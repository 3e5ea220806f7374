// Kernels for testing the emulator (tests/cuda_emu/test_emulator.py): correct ones whose results
// are known, and ones that break CUDA's rules, which the emulator must report.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "selftest.h"

namespace pagedserve_emu_selftest {
namespace {

constexpr unsigned kFull = 0xffffffffu;

template <typename T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void check(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
}

__global__ void neighbour_kernel(const float* in, float* out, bool with_barrier) {
  __shared__ float tile[128];
  tile[threadIdx.x] = in[threadIdx.x];
  if (with_barrier) __syncthreads();
  out[threadIdx.x] = tile[(threadIdx.x + 1) % 128];
}

__global__ void warp_ops_kernel(const float* in, float* xor_sum, float* down_sum,
                                float* broadcast) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float value = in[i];
  float sum = value;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
  float down = value;
  for (int offset = 16; offset > 0; offset /= 2) down += __shfl_down_sync(kFull, down, offset);
  xor_sum[i] = sum;
  down_sum[i] = down;
  broadcast[i] = __shfl_sync(kFull, value, 5);
}

__global__ void divergent_shuffle_kernel(float* out) {
  float value = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) value = __shfl_xor_sync(kFull, value, 1);
  out[threadIdx.x] = value;
}

__global__ void shuffle_after_exit_kernel(float* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(kFull, static_cast<float>(threadIdx.x), 1);
}

// Warp 0 waits at __syncthreads while warp 1 waits in a shuffle that warp 0 never joins.
__global__ void barrier_in_one_warp_kernel(float* out) {
  float value = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    value = __shfl_xor_sync(kFull, value, 1);
    __syncthreads();
  }
  out[threadIdx.x] = value;
}

__global__ void read_unwritten_shared_kernel(float* out) {
  __shared__ float tile[64];
  if (threadIdx.x < 32) tile[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = tile[threadIdx.x];
}

__global__ void dynamic_shared_kernel(float* out) {
  extern __shared__ float buffer[];
  buffer[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) sum += buffer[i];
    out[blockIdx.y * gridDim.x + blockIdx.x] = sum;
  }
}

__global__ void strided_loads_kernel(const float* in, float* out, int n, int stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __ldg(in + static_cast<int64_t>(i) * stride);
}

__global__ void convert_kernel(const float* in, int64_t n, uint16_t* half_bits,
                               uint16_t* bfloat16_bits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half h = __float2half_rn(in[i]);
  const __nv_bfloat16 b = __float2bfloat16_rn(in[i]);
  half_bits[i] = *reinterpret_cast<const uint16_t*>(&h);
  bfloat16_bits[i] = *reinterpret_cast<const uint16_t*>(&b);
}

}  // namespace

void neighbour(uintptr_t in, uintptr_t out, bool with_barrier) {
  neighbour_kernel<<<1, 128>>>(at<const float>(in), at<float>(out), with_barrier);
  check("neighbour");
}

void warp_ops(uintptr_t in, uintptr_t xor_sum, uintptr_t down_sum, uintptr_t broadcast) {
  warp_ops_kernel<<<2, 64>>>(at<const float>(in), at<float>(xor_sum), at<float>(down_sum),
                             at<float>(broadcast));
  check("warp_ops");
}

void divergent_shuffle(uintptr_t out) {
  divergent_shuffle_kernel<<<1, 64>>>(at<float>(out));
  check("divergent_shuffle");
}

void shuffle_after_exit(uintptr_t out) {
  shuffle_after_exit_kernel<<<1, 32>>>(at<float>(out));
  check("shuffle_after_exit");
}

void barrier_in_one_warp(uintptr_t out) {
  barrier_in_one_warp_kernel<<<1, 64>>>(at<float>(out));
  check("barrier_in_one_warp");
}

void read_unwritten_shared(uintptr_t out) {
  read_unwritten_shared_kernel<<<1, 64>>>(at<float>(out));
  check("read_unwritten_shared");
}

int launch_config(int grid_x, int grid_y, int threads, int dynamic_shared_bytes, bool opt_in,
                  uintptr_t out) {
  if (opt_in) {
    const cudaError_t error = cudaFuncSetAttribute(
        dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_shared_bytes);
    if (error != cudaSuccess) return static_cast<int>(error);
  }
  dynamic_shared_kernel<<<dim3(grid_x, grid_y), threads, dynamic_shared_bytes>>>(at<float>(out));
  return static_cast<int>(cudaGetLastError());
}

void strided_loads(uintptr_t in, uintptr_t out, int n, int stride) {
  strided_loads_kernel<<<(n + 63) / 64, 64>>>(at<const float>(in), at<float>(out), n, stride);
  check("strided_loads");
}

void convert(uintptr_t in, int64_t n, uintptr_t half_bits, uintptr_t bfloat16_bits) {
  const int threads = 128;
  convert_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads>>>(
      at<const float>(in), n, at<uint16_t>(half_bits), at<uint16_t>(bfloat16_bits));
  check("convert");
}

}  // namespace pagedserve_emu_selftest
