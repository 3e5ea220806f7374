// A CPU emulator of the CUDA execution model, for checking the logic of csrc/cuda's kernels on
// machines without a GPU (tests/cuda_emu). It runs the kernels' own source, translated by
// tests/cuda_emu/build.py (launches, __shared__), against this header in place of the CUDA
// headers. It says nothing about speed or the GPU's memory model; the GPU tests (tests/cuda)
// remain the acceptance.
//
// What it models:
// - A launch runs its thread blocks one after another. A block's threads are fibers (fiber.h)
//   on the calling thread, each with its own guarded stack, switched only at barriers
//   (__syncthreads, __syncwarp) and warp collectives (__shfl*_sync). Between two such points a
//   thread runs alone, so the emulation is deterministic for a given schedule.
// - The schedule (PAGEDSERVE_CUDA_EMU_SCHEDULE=forward|reverse|random[:seed]) orders the threads
//   within each phase between barriers: a kernel that reads shared memory another thread writes
//   in the same phase (a missing __syncthreads) gives different results under different orders.
//   Under random, warps also run one after another between barriers, in an order drawn anew at
//   each barrier: a warp can finish its phase before another passes its first collective, so
//   a missing barrier between one warp's reads of shared memory and another's next writes
//   shows up too.
// - Shared memory (static and dynamic) starts every block filled with 0xff bytes (NaN as float),
//   so a read of a shared element nobody wrote shows up in the output.
// - Collectives check what hardware leaves undefined: every lane named in a mask must reach the
//   same collective, none may have exited; a state where no thread can go on is a deadlock.
//   Either raises an error naming the kernel's block, the threads and where they wait.
// - Launch configurations are checked as the runtime does (block of 1 to 1024 threads, grid
//   dimensions in range and non-zero, dynamic shared memory within 48 KiB unless the kernel opted
//   in with cudaFuncSetAttribute, and within an H100/H200 block's 227 KiB): a bad one sets the
//   error cudaGetLastError returns and runs nothing.
// - With PAGEDSERVE_CUDA_EMU_LOAD_STATS=<file>, each launch appends a JSON line to that file:
//   its warp-wide __ldg loads (a lane's n-th load at a source line since its last barrier or
//   collective, with the other lanes' n-th loads there) and the distinct 32-byte sectors each
//   touched, as the hardware serves them: how well the kernel coalesces its reads.
// Device memory is host memory: kernels read and write the pointers they are given.
//
// Files: device_types.h (keywords, types, conversions, math), runtime.h (the runtime API),
// block.h (a thread block's fibers, barriers, collectives, shared memory, load statistics),
// fiber.h (switching between fibers), launch.h (launches, built-in variables, device functions).
#pragma once

#include "block.h"
#include "device_types.h"
#include "launch.h"
#include "runtime.h"
