// The emulator's CUDA runtime API: errors, devices, attributes, copies (see cuda_emu.h).
#pragma once

#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>

#include "device_types.h"

// --- the runtime API -----------------------------------------------------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace pagedserve_emu {

// The emulated machine: one H200 (132 SMs; 227 KiB of shared memory per block at most).
constexpr int kDeviceCount = 1;
constexpr int kMultiprocessors = 132;
constexpr size_t kDefaultDynamicSharedBytes = 48 * 1024;
constexpr size_t kMaxDynamicSharedBytes = 227 * 1024;
constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;

struct Runtime {
  std::mutex launch_mutex;  // one launch at a time (shared memory is per process)
  int device = 0;
  cudaError_t last_error = cudaSuccess;
  std::map<const void*, size_t> dynamic_shared_limit;  // kernel -> opted-in bytes
};
inline Runtime& runtime() {
  static Runtime instance;
  return instance;
}

}  // namespace pagedserve_emu

inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
  }
  return "unknown error";
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t error = pagedserve_emu::runtime().last_error;
  pagedserve_emu::runtime().last_error = cudaSuccess;
  return error;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = pagedserve_emu::runtime().device;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= pagedserve_emu::kDeviceCount) return cudaErrorInvalidDevice;
  pagedserve_emu::runtime().device = device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= pagedserve_emu::kDeviceCount) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = pagedserve_emu::kMultiprocessors;
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > pagedserve_emu::kMaxDynamicSharedBytes) {
    return cudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lock(pagedserve_emu::runtime().launch_mutex);
  pagedserve_emu::runtime().dynamic_shared_limit[reinterpret_cast<const void*>(kernel)] =
      static_cast<size_t>(value);
  return cudaSuccess;
}
// Synchronous: the emulated stream has run everything before it already.
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return cudaErrorInvalidValue;
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
