// One thread block of the emulator: its threads as fibers, barriers, warp collectives, shared
// memory and load statistics (see cuda_emu.h).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fiber.h"
#include "runtime.h"

namespace pagedserve_emu {

// --- fibers --------------------------------------------------------------------------------------

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
  FiberContext context;
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
      thread.context.prepare(thread.stack->bottom(), kStackBytes, &Block::entry);
    }
    std::vector<int> order(num_threads_);
    for (int i = 0; i < num_threads_; ++i)
      order[i] = schedule_ == kReverse ? num_threads_ - 1 - i : i;
    warp_order_.resize((num_threads_ + kWarp - 1) / kWarp);
    for (size_t warp = 0; warp < warp_order_.size(); ++warp) warp_order_[warp] = warp;
    if (schedule_ == kRandom) std::shuffle(warp_order_.begin(), warp_order_.end(), random_);
    current_block() = this;
    while (true) {
      if (schedule_ == kRandom) std::shuffle(order.begin(), order.end(), random_);
      for (int i : order) {
        Thread& thread = threads_[i];
        if (thread.wait != Wait::kRunnable) continue;
        current_ = &thread;
        scheduler_.switch_to(thread.context);
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
    thread.context.switch_to(block->scheduler_);  // never switched back to
  }

  void yield() { current_->context.switch_to(scheduler_); }

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
      if (schedule_ == kRandom) std::shuffle(warp_order_.begin(), warp_order_.end(), random_);
      return true;
    }
    bool released = false;
    for (int warp : warp_order_) {
      if (!error_.empty()) break;
      if (!release_warp(warp)) continue;
      released = true;
      // Under the random schedule, warps run one after another between barriers: only the
      // first ready warp of this phase's order goes on, so one warp can finish its phase
      // while another has not passed its first collective, the widest drift warps on a GPU
      // may have.
      if (schedule_ == kRandom) break;
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
  Schedule schedule_ = kForward;
  std::mt19937 random_;
  std::vector<int> warp_order_;  // the order warps at collectives go on in (see release())
  FiberContext scheduler_;
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

}  // namespace pagedserve_emu
