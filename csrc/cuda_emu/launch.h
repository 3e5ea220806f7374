// Kernel launches and the built-in variables and device functions kernels call (see cuda_emu.h).
#pragma once

#include <fstream>
#include <functional>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "block.h"

namespace pagedserve_emu {

// JSON line with its __ldg loads' statistics to that file.
class Launcher {
 public:
  Launcher(dim3 grid, dim3 block, size_t dynamic_shared_bytes = 0, cudaStream_t = nullptr)
      : grid_(grid), block_(block), dynamic_shared_bytes_(dynamic_shared_bytes) {}

  template <typename... Params, typename... Args>
  void run(const char* label, void (*kernel)(Params...), Args&&... args) {
    Runtime& state = runtime();
    std::lock_guard<std::mutex> lock(state.launch_mutex);
    if (!valid(state, reinterpret_cast<const void*>(kernel))) {
      state.last_error = cudaErrorInvalidConfiguration;
      return;
    }
    // The kernel's parameters, copied as a launch copies them.
    std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    const std::function<void()> body = [&] { std::apply(kernel, params); };
    Block block(block_, dynamic_shared_bytes_);
    for (unsigned z = 0; z < grid_.z; ++z) {
      for (unsigned y = 0; y < grid_.y; ++y) {
        for (unsigned x = 0; x < grid_.x; ++x) block.run(dim3(x, y, z), grid_, body);
      }
    }
    if (const char* path = std::getenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS")) {
      const LoadStats& stats = block.load_stats();
      std::ofstream out(path, std::ios::app);
      out << "{\"kernel\": \"" << label << "\", \"grid\": [" << grid_.x << ", " << grid_.y << ", "
          << grid_.z << "], \"block_threads\": " << block_.x * block_.y * block_.z
          << ", \"requests\": " << stats.requests
          << ", \"requested_bytes\": " << stats.requested_bytes
          << ", \"sectors\": " << stats.sectors << "}\n";
    }
  }

 private:
  bool valid(const Runtime& state, const void* kernel) const {
    const uint64_t threads = uint64_t{block_.x} * block_.y * block_.z;
    if (threads == 0 || threads > 1024 || block_.z > 64) return false;
    if (grid_.x == 0 || grid_.y == 0 || grid_.z == 0) return false;
    if (grid_.x > 0x7fffffffu || grid_.y > 65535 || grid_.z > 65535) return false;
    size_t limit = kDefaultDynamicSharedBytes;
    const auto opted = state.dynamic_shared_limit.find(kernel);
    if (opted != state.dynamic_shared_limit.end()) limit = std::max(limit, opted->second);
    return dynamic_shared_bytes_ <= std::min(limit, kMaxDynamicSharedBytes);
  }

  dim3 grid_, block_;
  size_t dynamic_shared_bytes_;
};

template <typename T>
T* dynamic_shared() {
  return current_block()->dynamic_shared<T>();
}

inline void shared_declared(void* pointer, size_t bytes) {
  current_block()->shared_declared(pointer, bytes);
}

}  // namespace pagedserve_emu

// --- built-in variables and device functions -----------------------------------------------------

#define threadIdx (::pagedserve_emu::current_block()->self().index)
#define blockIdx (::pagedserve_emu::current_block()->block_idx())
#define blockDim (::pagedserve_emu::current_block()->block_dim())
#define gridDim (::pagedserve_emu::current_block()->grid_dim())

// Default arguments name the call site (the original .cu line, through build.py's #line).
template <typename T>
T __ldg(const T* pointer, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  pagedserve_emu::current_block()->record_load(pointer, sizeof(T), file, line);
  return *pointer;
}

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  pagedserve_emu::current_block()->sync_threads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  pagedserve_emu::current_block()->warp_collective(pagedserve_emu::Collective::kSyncWarp, mask, 0,
                                                   0, pagedserve_emu::kWarp, file, line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return pagedserve_emu::current_block()->warp_collective(
      pagedserve_emu::Collective::kShflXor, mask, value, lane_mask, width, file, line);
}
template <typename T>
T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32,
              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return pagedserve_emu::current_block()->warp_collective(
      pagedserve_emu::Collective::kShflIdx, mask, value, source_lane, width, file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32,
                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return pagedserve_emu::current_block()->warp_collective(pagedserve_emu::Collective::kShflDown,
                                                          mask, value, static_cast<int>(delta),
                                                          width, file, line);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32,
                 const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return pagedserve_emu::current_block()->warp_collective(
      pagedserve_emu::Collective::kShflUp, mask, value, static_cast<int>(delta), width, file, line);
}
