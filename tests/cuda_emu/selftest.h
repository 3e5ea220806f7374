// The emulator self-test's host functions (selftest_kernels.cu), bound by selftest_bindings.cpp.
// Addresses are host memory (torch CPU tensors' data_ptr()).
#pragma once

#include <cstdint>

namespace pagedserve_emu_selftest {

// out[i] = in[(i + 1) % 128] through shared memory, with or without a __syncthreads between
// the write and the read.
void neighbour(uintptr_t in, uintptr_t out, bool with_barrier);
// Per warp of 128 floats: the butterfly sum (every lane), the shfl_down sum (lane 0), lane 5's
// value broadcast, and lane (i + 1) % 32's value through shfl_up/width 8 rotation checks.
void warp_ops(uintptr_t in, uintptr_t xor_sum, uintptr_t down_sum, uintptr_t broadcast);
void divergent_shuffle(uintptr_t out);
void shuffle_after_exit(uintptr_t out);
void barrier_in_one_warp(uintptr_t out);
void read_unwritten_shared(uintptr_t out);
// Launches a kernel with this configuration; returns cudaGetLastError()'s code afterwards.
int launch_config(int grid_x, int grid_y, int threads, int dynamic_shared_bytes, bool opt_in,
                  uintptr_t out);
// out[i] = in[i * stride] through __ldg, for the load statistics (PAGEDSERVE_CUDA_EMU_LOAD_STATS).
void strided_loads(uintptr_t in, uintptr_t out, int n, int stride);
void convert(uintptr_t in, int64_t n, uintptr_t half_bits, uintptr_t bfloat16_bits);

}  // namespace pagedserve_emu_selftest
