// A CPU emulator of the CUDA execution model, for checking the logic of csrc/cuda's kernels on
// machines without a GPU (tests/cuda_emu). It runs the kernels' own source, translated by
// tests/cuda_emu/build.py (launches, __shared__), against this header in place of the CUDA
// headers. It says nothing about speed or the GPU's memory model; the GPU tests (tests/cuda)
// remain the acceptance.
//
// What it models:
// - A launch runs its thread blocks one after another. A block's threads are fibers (ucontext)
//   on the calling thread, each with its own guarded stack, switched only at barriers
//   (__syncthreads, __syncwarp) and warp collectives (__shfl*_sync). Between two such points a
//   thread runs alone, so the emulation is deterministic for a given schedule.
// - The schedule (PAGEDSERVE_CUDA_EMU_SCHEDULE=forward|reverse|random[:seed]) orders the threads
//   within each phase between barriers: a kernel that reads shared memory another thread writes
//   in the same phase (a missing __syncthreads) gives different results under different orders.
// - Shared memory (static and dynamic) starts every block filled with 0xff bytes (NaN as float),
//   so a read of a shared element nobody wrote shows up in the output.
// - Collectives check what hardware leaves undefined: every lane named in a mask must reach the
//   same collective, none may have exited; a state where no thread can go on is a deadlock.
//   Either raises an error naming the kernel's block, the threads and where they wait.
// - Launch configurations are checked as the runtime does (block of 1 to 1024 threads, grid
//   dimensions in range and non-zero, dynamic shared memory within 48 KiB unless the kernel opted
//   in with cudaFuncSetAttribute, and within an H100/H200 block's 227 KiB): a bad one sets the
//   error cudaGetLastError returns and runs nothing.
// Device memory is host memory: kernels read and write the pointers they are given.
#pragma once

#include <immintrin.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

// --- the CUDA keywords ---------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

// --- vector and storage types -------------------------------------------------------------------

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

inline float __uint_as_float(unsigned bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
inline unsigned __float_as_uint(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// float16 through the CPU's F16C instructions (IEEE round to nearest even, like __float2half_rn).
struct __half {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;
};
inline float __half2float(__half h) { return _cvtsh_ss(h.bits); }
inline __half __float2half_rn(float f) {
  return __half{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

// bfloat16: the upper half of a float32, rounded to nearest even (NaN kept quiet).
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned>(b.bits) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned bits = __float_as_uint(f);
  if (std::isnan(f)) return __nv_bfloat16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  const unsigned rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(rounded >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return {__bfloat162float(b.x), __bfloat162float(b.y)};
}

// --- device math
// ----------------------------------------------------------------------------------

template <typename A, typename B>
inline auto min(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B>
inline auto max(A a, B b) -> std::common_type_t<A, B> {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// --- the runtime API ----------------------------------------------------------------------------

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

namespace pagedserve_emu {

// --- fibers
// ---------------------------------------------------------------------------------------

enum class Wait { kRunnable, kBlockBarrier, kWarpCollective, kExited };

enum class Collective { kSyncWarp, kShflXor, kShflIdx, kShflDown, kShflUp };

inline const char* collective_name(Collective op) {
  switch (op) {
    case Collective::kSyncWarp:
      return "__syncwarp";
    case Collective::kShflXor:
      return "__shfl_xor_sync";
    case Collective::kShflIdx:
      return "__shfl_sync";
    case Collective::kShflDown:
      return "__shfl_down_sync";
    case Collective::kShflUp:
      return "__shfl_up_sync";
  }
  return "?";
}

// A stack with an inaccessible guard page below it: an overflow faults instead of corrupting
// the neighbouring fiber.
class Stack {
 public:
  Stack() {
    const size_t page = 4096;
    base_ = static_cast<char*>(mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base_ == MAP_FAILED) throw std::bad_alloc();
    mprotect(base_, page, PROT_NONE);
    top_ = base_ + page;
  }
  ~Stack() { munmap(base_, kStackBytes + 4096); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  char* bottom() const { return top_; }

 private:
  char* base_;
  char* top_;
};

struct Thread {
  ucontext_t context;
  Stack* stack = nullptr;
  dim3 index;
  int linear = 0;
  Wait wait = Wait::kRunnable;
  // The collective this lane waits in, its operands and its result.
  Collective op = Collective::kSyncWarp;
  unsigned mask = 0;
  int operand = 0;  // lane mask, source lane or delta
  int width = kWarp;
  uint64_t value = 0;
  uint64_t result = 0;
  // Where it waits (the source line of the barrier or collective).
  const char* file = "";
  int line = 0;
  // Global loads through __ldg, for the coalescing statistics: a lane's n-th load at a source
  // line since its last barrier or collective is one warp-wide load instruction with the other
  // lanes' n-th loads there.
  uint64_t epoch = 0;
  std::map<std::pair<const char*, int>, int> loads_at_site;
  std::vector<std::tuple<uint64_t, const char*, int, int, uintptr_t, size_t>> loads;

  void passed_sync_point() {
    ++epoch;
    loads_at_site.clear();
  }
};

// Global loads of one launch, counted as the hardware serves them: in 32-byte sectors.
struct LoadStats {
  uint64_t requests = 0;         // warp-wide load instructions
  uint64_t requested_bytes = 0;  // bytes the lanes asked for
  uint64_t sectors = 0;          // distinct 32-byte sectors each request touched, summed
};

class Block;
inline Block*& current_block() {
  static Block* block = nullptr;
  return block;
}

class Block {
 public:
  Block(dim3 block_dim, size_t dynamic_shared_bytes)
      : block_dim_(block_dim),
        num_threads_(static_cast<int>(block_dim.x * block_dim.y * block_dim.z)),
        threads_(num_threads_),
        dynamic_shared_(dynamic_shared_bytes / sizeof(double) + 1) {
    static std::vector<std::unique_ptr<Stack>> stacks;  // kept across launches
    while (stacks.size() < static_cast<size_t>(num_threads_)) {
      stacks.push_back(std::make_unique<Stack>());
    }
    for (int i = 0; i < num_threads_; ++i) {
      threads_[i].stack = stacks[i].get();
      threads_[i].linear = i;
      threads_[i].index =
          dim3(i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y));
    }
    dynamic_shared_bytes_ = dynamic_shared_bytes;
    const char* schedule = std::getenv("PAGEDSERVE_CUDA_EMU_SCHEDULE");
    std::string name = schedule ? schedule : "forward";
    if (name == "forward") {
      schedule_ = kForward;
    } else if (name == "reverse") {
      schedule_ = kReverse;
    } else if (name.rfind("random", 0) == 0) {
      schedule_ = kRandom;
      const size_t colon = name.find(':');
      random_.seed(colon == std::string::npos ? 0 : std::stoul(name.substr(colon + 1)));
    } else {
      throw std::invalid_argument("PAGEDSERVE_CUDA_EMU_SCHEDULE=" + name +
                                  ": expected forward, reverse or random[:seed]");
    }
  }

  // Runs body() as every thread of the block at block_idx; throws on a kernel fault.
  void run(dim3 block_idx, dim3 grid_dim, const std::function<void()>& body) {
    block_idx_ = block_idx;
    grid_dim_ = grid_dim;
    body_ = &body;
    error_.clear();
    poisoned_.clear();
    std::memset(dynamic_shared_.data(), 0xff, dynamic_shared_.size() * sizeof(double));
    for (Thread& thread : threads_) {
      thread.wait = Wait::kRunnable;
      thread.epoch = 0;
      thread.loads_at_site.clear();
      thread.loads.clear();
      getcontext(&thread.context);
      thread.context.uc_stack.ss_sp = thread.stack->bottom();
      thread.context.uc_stack.ss_size = kStackBytes;
      thread.context.uc_link = nullptr;
      makecontext(&thread.context, &Block::entry, 0);
    }
    std::vector<int> order(num_threads_);
    for (int i = 0; i < num_threads_; ++i)
      order[i] = schedule_ == kReverse ? num_threads_ - 1 - i : i;
    current_block() = this;
    while (true) {
      if (schedule_ == kRandom) std::shuffle(order.begin(), order.end(), random_);
      for (int i : order) {
        Thread& thread = threads_[i];
        if (thread.wait != Wait::kRunnable) continue;
        current_ = &thread;
        swapcontext(&scheduler_, &thread.context);
        current_ = nullptr;
        if (!error_.empty()) break;
      }
      if (!error_.empty()) break;
      if (!release()) break;
    }
    current_block() = nullptr;
    if (!error_.empty()) throw std::runtime_error(where() + error_);
    if (record_loads_) count_loads();
  }

  Thread& self() { return *current_; }
  const dim3& block_idx() const { return block_idx_; }
  const dim3& block_dim() const { return block_dim_; }
  const dim3& grid_dim() const { return grid_dim_; }

  void sync_threads(const char* file, int line) {
    current_->wait = Wait::kBlockBarrier;
    current_->file = file;
    current_->line = line;
    yield();
    current_->passed_sync_point();
  }

  template <typename T>
  T warp_collective(Collective op, unsigned mask, T value, int operand, int width, const char* file,
                    int line) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffled value is at most 8 bytes");
    Thread& thread = *current_;
    thread.wait = Wait::kWarpCollective;
    thread.file = file;
    thread.line = line;
    thread.op = op;
    thread.mask = mask;
    thread.operand = operand;
    thread.width = width;
    thread.value = 0;
    std::memcpy(&thread.value, &value, sizeof(T));
    yield();
    thread.passed_sync_point();
    T result;
    std::memcpy(&result, &thread.result, sizeof(T));
    return result;
  }

  void record_load(const void* pointer, size_t bytes, const char* file, int line) {
    if (!record_loads_) return;
    Thread& thread = *current_;
    const int occurrence = thread.loads_at_site[{file, line}]++;
    thread.loads.emplace_back(thread.epoch, file, line, occurrence,
                              reinterpret_cast<uintptr_t>(pointer), bytes);
  }

  const LoadStats& load_stats() const { return load_stats_; }

  template <typename T>
  T* dynamic_shared() {
    return reinterpret_cast<T*>(dynamic_shared_.data());
  }

  // The first thread of a block to reach a __shared__ declaration fills it with 0xff bytes.
  void shared_declared(void* pointer, size_t bytes) {
    if (poisoned_.insert(pointer).second) std::memset(pointer, 0xff, bytes);
  }

 private:
  enum Schedule { kForward, kReverse, kRandom };

  static void entry() {
    Block* block = current_block();
    Thread& thread = *block->current_;
    try {
      (*block->body_)();
    } catch (const std::exception& error) {
      block->fail("thread " + std::to_string(thread.linear) + " threw: " + error.what());
    } catch (...) {
      block->fail("thread " + std::to_string(thread.linear) + " threw");
    }
    thread.wait = Wait::kExited;
    setcontext(&block->scheduler_);
  }

  void yield() { swapcontext(&current_->context, &scheduler_); }

  void fail(const std::string& message) {
    if (error_.empty()) error_ = message;
  }

  std::string where() const {
    std::ostringstream out;
    out << "emulated kernel fault in block (" << block_idx_.x << ", " << block_idx_.y << ", "
        << block_idx_.z << ") of " << num_threads_ << " threads: ";
    return out.str();
  }

  // Every live thread now waits at a barrier or collective (or has exited): release what can
  // go on. False when all have exited, or on a fault (error_ set).
  bool release() {
    int live = 0, at_barrier = 0;
    for (const Thread& thread : threads_) {
      if (thread.wait == Wait::kExited) continue;
      ++live;
      if (thread.wait == Wait::kBlockBarrier) ++at_barrier;
    }
    if (live == 0) return false;
    if (at_barrier == live) {
      // CUDA allows __syncthreads in conditional code only where the condition is the same for
      // the whole block: every thread must wait at the same one.
      const Thread* first = nullptr;
      for (const Thread& thread : threads_) {
        if (thread.wait != Wait::kBlockBarrier) continue;
        if (first == nullptr) {
          first = &thread;
        } else if (thread.line != first->line || std::strcmp(thread.file, first->file) != 0) {
          fail("threads wait at different __syncthreads: thread " + std::to_string(first->linear) +
               " at " + site(*first) + ", thread " + std::to_string(thread.linear) + " at " +
               site(thread) + " (a barrier in code the block does not run uniformly)");
          return false;
        }
      }
      for (Thread& thread : threads_) {
        if (thread.wait == Wait::kBlockBarrier) thread.wait = Wait::kRunnable;
      }
      return true;
    }
    bool released = false;
    const int num_warps = (num_threads_ + kWarp - 1) / kWarp;
    for (int warp = 0; warp < num_warps && error_.empty(); ++warp) {
      released |= release_warp(warp);
    }
    if (!error_.empty()) return false;
    if (!released) {
      std::ostringstream out;
      out << "deadlock: " << at_barrier << " of " << live
          << " live threads wait at __syncthreads; waiting in warp collectives:";
      for (const Thread& thread : threads_) {
        if (thread.wait == Wait::kWarpCollective) {
          out << " thread " << thread.linear << " (" << collective_name(thread.op) << ", mask 0x"
              << std::hex << thread.mask << std::dec << ", " << site(thread) << ")";
        }
      }
      out << "; a barrier or collective in divergent code, or lanes that exited before it";
      fail(out.str());
      return false;
    }
    return true;
  }

  bool release_warp(int warp) {
    const int first = warp * kWarp;
    const int lanes = std::min(kWarp, num_threads_ - first);
    Thread* waiting = nullptr;
    for (int lane = 0; lane < lanes; ++lane) {
      Thread& thread = threads_[first + lane];
      if (thread.wait == Wait::kWarpCollective) {
        waiting = &thread;
        break;
      }
    }
    if (waiting == nullptr) return false;
    const unsigned mask = waiting->mask;
    const Collective op = waiting->op;
    // Every lane named in the mask must be here, in the same collective, with the same mask.
    for (int lane = 0; lane < kWarp; ++lane) {
      const bool named = (mask >> lane) & 1u;
      if (lane >= lanes) {
        if (named) {
          fail(std::string(collective_name(op)) + " in warp " + std::to_string(warp) +
               " names lane " + std::to_string(lane) + ", which the block does not have");
          return false;
        }
        continue;
      }
      Thread& thread = threads_[first + lane];
      if (named && thread.wait == Wait::kExited) {
        fail(std::string(collective_name(op)) + " at " + site(*waiting) + " in warp " +
             std::to_string(warp) + " names lane " + std::to_string(lane) +
             ", which has exited (or never reached it)");
        return false;
      }
      if (thread.wait != Wait::kWarpCollective) {
        if (named) return false;  // not there yet: a deadlock unless something else moves
        continue;
      }
      if (!named || thread.op != op || thread.mask != mask) {
        fail("warp " + std::to_string(warp) + " lanes disagree: lane " +
             std::to_string(waiting->linear - first) + " is in " + collective_name(op) +
             " with mask 0x" + hex(mask) + " at " + site(*waiting) + ", lane " +
             std::to_string(lane) + " in " + collective_name(thread.op) + " with mask 0x" +
             hex(thread.mask) + " at " + site(thread));
        return false;
      }
    }
    for (int lane = 0; lane < lanes; ++lane) {
      Thread& thread = threads_[first + lane];
      if (!((mask >> lane) & 1u)) continue;
      int source = lane;
      const int width = thread.width;
      const int segment = lane - lane % width;
      switch (op) {
        case Collective::kSyncWarp:
          break;
        case Collective::kShflXor:
          source = lane ^ thread.operand;
          if (source >= segment + width) source = lane;
          break;
        case Collective::kShflIdx:
          source = segment + thread.operand % width;
          break;
        case Collective::kShflDown:
          source = lane + thread.operand;
          if (source >= segment + width) source = lane;
          break;
        case Collective::kShflUp:
          source = lane - thread.operand;
          if (source < segment) source = lane;
          break;
      }
      if (source < 0 || source >= lanes || !((mask >> source) & 1u)) {
        fail(std::string(collective_name(op)) + " in warp " + std::to_string(warp) + ": lane " +
             std::to_string(lane) + " reads lane " + std::to_string(source) +
             ", which is not in the mask 0x" + hex(mask));
        return false;
      }
      thread.result = threads_[first + source].value;
    }
    for (int lane = 0; lane < lanes; ++lane) {
      if ((mask >> lane) & 1u) threads_[first + lane].wait = Wait::kRunnable;
    }
    return true;
  }

  void count_loads() {
    const int num_warps = (num_threads_ + kWarp - 1) / kWarp;
    for (int warp = 0; warp < num_warps; ++warp) {
      // (epoch, file, line, occurrence) -> the lanes' (address, bytes)
      std::map<std::tuple<uint64_t, const char*, int, int>,
               std::vector<std::pair<uintptr_t, size_t>>>
          requests;
      for (int lane = 0; lane < kWarp && warp * kWarp + lane < num_threads_; ++lane) {
        for (const auto& [epoch, file, line, occurrence, address, bytes] :
             threads_[warp * kWarp + lane].loads) {
          requests[{epoch, file, line, occurrence}].emplace_back(address, bytes);
        }
      }
      for (const auto& [key, lanes] : requests) {
        std::unordered_set<uintptr_t> sectors;
        for (const auto& [address, bytes] : lanes) {
          load_stats_.requested_bytes += bytes;
          for (uintptr_t sector = address / 32; sector <= (address + bytes - 1) / 32; ++sector) {
            sectors.insert(sector);
          }
        }
        load_stats_.requests += 1;
        load_stats_.sectors += sectors.size();
      }
    }
  }

  static std::string site(const Thread& thread) {
    return std::string(thread.file) + ":" + std::to_string(thread.line);
  }

  static std::string hex(unsigned value) {
    std::ostringstream out;
    out << std::hex << value;
    return out.str();
  }

  dim3 block_dim_;
  int num_threads_;
  std::vector<Thread> threads_;
  std::vector<double> dynamic_shared_;
  size_t dynamic_shared_bytes_ = 0;
  Schedule schedule_ = kForward;
  std::mt19937 random_;
  ucontext_t scheduler_;
  Thread* current_ = nullptr;
  dim3 block_idx_, grid_dim_;
  const std::function<void()>* body_ = nullptr;
  std::string error_;
  std::unordered_set<void*> poisoned_;
  bool record_loads_ = std::getenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS") != nullptr;
  LoadStats load_stats_;
};

// `kernel<<<grid, block, shared_bytes, stream>>>(args...)` becomes
// `Launcher(grid, block, shared_bytes, stream).run("kernel", kernel, args...)`
// (tests/cuda_emu/build.py). With PAGEDSERVE_CUDA_EMU_LOAD_STATS=<file>, each launch appends a
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

// --- built-in variables and device functions
// -------------------------------------------------------

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
