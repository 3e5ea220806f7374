// The attention ops of ops.h: argument checks, work planning (decode partitions, prefill tiles),
// workspace, thread count; and the choice of the ISA variant, for the attention and the
// elementwise kernels alike. Compiled for the baseline ISA.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention_kernels.h"
#include "elementwise_kernels.h"
#include "linear_kernels.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Shortest partition the automatic choice makes: shorter ones spend more on the reduction
// step than they gain in parallelism.
constexpr int64_t kMinAutoPartitionSize = 256;

// Below this much work an op runs on the calling thread: waking the OpenMP pool costs more
// than it saves. Decode counts cached positions x kv heads: one unit (a K and a V row for a
// group of query heads) takes ~0.02 us on one core, and on 2 cores two threads already win
// from ~400 units (8 sequences of 16 tokens, 3 kv heads: 29 -> 25 us). The old shared
// threshold of 16k units kept 64 sequences of 64 tokens on one core (265 us vs 2 threads'
// ~140). Prefill counts query rows x keys, each a fraction of a decode unit.
constexpr int64_t kMinParallelDecodeWork = int64_t{1} << 9;
constexpr int64_t kMinParallelPrefillWork = int64_t{1} << 14;

// One ISA variant's kernel tables; its name is attention->isa.
struct IsaVariant {
  const AttentionKernels* attention;
  const ElementwiseKernels* elementwise;
  const LinearKernels* linear;
};

// Every variant of this build, best first.
const IsaVariant kVariants[] = {
#if defined(PAGEDSERVE_HAVE_AVX512)
    {&avx512::kAttentionKernels, &avx512::kElementwiseKernels, &avx512::kLinearKernels},
#endif
#if defined(PAGEDSERVE_HAVE_AVX2)
    {&avx2::kAttentionKernels, &avx2::kElementwiseKernels, &avx2::kLinearKernels},
#endif
    {&generic::kAttentionKernels, &generic::kElementwiseKernels, &generic::kLinearKernels},
};

std::atomic<int> g_num_threads{0};  // 0: not set, use omp_get_max_threads()
std::atomic<const IsaVariant*> g_variant{nullptr};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool cpu_supports(const IsaVariant& variant) {
  const std::string isa = variant.attention->isa;
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

std::vector<const IsaVariant*> supported_variants() {  // best first
  std::vector<const IsaVariant*> variants;
  for (const IsaVariant& variant : kVariants) {
    if (cpu_supports(variant)) variants.push_back(&variant);
  }
  return variants;
}

const IsaVariant* find_variant(const std::string& name) {
  for (const IsaVariant* v : supported_variants()) {
    if (name == v->attention->isa) return v;
  }
  std::string supported;
  for (const IsaVariant* v : supported_variants()) {
    supported += std::string(supported.empty() ? "" : ", ") + v->attention->isa;
  }
  throw std::invalid_argument("CPU ISA variant '" + name +
                              "' is not available on this CPU/build; supported: " + supported);
}

const IsaVariant& variant() {
  const IsaVariant* v = g_variant.load(std::memory_order_acquire);
  if (v == nullptr) {
    const char* requested = std::getenv("PAGEDSERVE_CPU_ISA");
    v = requested != nullptr && requested[0] != '\0' ? find_variant(requested)
                                                     : supported_variants().front();
    g_variant.store(v, std::memory_order_release);
  }
  return *v;
}

const AttentionKernels& kernels() { return *variant().attention; }

// A 64-byte aligned scratch buffer owned by the calling thread, reused across calls.
float* workspace(int64_t num_floats) {
  thread_local std::vector<float> buffer;
  const size_t needed = static_cast<size_t>(num_floats) + 16;
  if (buffer.size() < needed) buffer.resize(needed);
  const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
}

std::string index_name(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_cache(const PagedKVCache& c) {
  const int64_t h = c.head_size;
  if (h != 64 && h != 80 && h != 96 && h != 128 && h != 192 && h != 256) {
    throw std::invalid_argument("head_size " + std::to_string(h) +
                                " is not supported (64, 80, 96, 128, 192, 256)");
  }
  if (c.block_size != 8 && c.block_size != 16 && c.block_size != 32) {
    throw std::invalid_argument("block_size " + std::to_string(c.block_size) +
                                " is not supported (8, 16, 32)");
  }
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16 && c.dtype != DType::kFloat16) {
    throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(c.dtype)) +
                                " is not supported (0 float32, 1 bfloat16, 2 float16)");
  }
  if (c.cache_dtype != c.dtype && c.cache_dtype != DType::kFloat8E5M2 &&
      c.cache_dtype != DType::kFloat8E4M3) {
    throw std::invalid_argument(
        "cache dtype code " + std::to_string(static_cast<int>(c.cache_dtype)) +
        " is neither the activations' dtype code " + std::to_string(static_cast<int>(c.dtype)) +
        " nor 3 (float8 e5m2) or 4 (float8 e4m3)");
  }
}

// Checks every sequence length and every block-table entry the kernels may read; returns the
// longest sequence. With a sliding window the kernels read from the block holding the first
// position the sequence's first query token attends to: entries before it are not checked
// (blocks wholly outside the window need not be in the table). query_start_loc is null for a
// decode (one query token per sequence); it is checked afterwards, so a query length outside
// [1, seq_len] is clamped here.
int64_t check_tables(const BlockTables& t, const PagedKVCache& c, int64_t sliding_window,
                     const int32_t* query_start_loc) {
  int64_t max_seq_len = 0;
  for (int64_t s = 0; s < t.num_seqs; ++s) {
    const int64_t seq_len = t.seq_lens[s];
    if (seq_len < 0 || seq_len > t.max_blocks_per_seq * c.block_size) {
      throw std::invalid_argument(index_name("seq_lens", s) + " = " + std::to_string(seq_len) +
                                  " is outside [0, " +
                                  std::to_string(t.max_blocks_per_seq * c.block_size) +
                                  "] (max_blocks_per_seq * block_size)");
    }
    max_seq_len = std::max(max_seq_len, seq_len);
    int64_t q_len = 1;
    if (query_start_loc != nullptr) {
      q_len = int64_t{query_start_loc[s + 1]} - query_start_loc[s];
      q_len = std::clamp<int64_t>(q_len, 1, std::max<int64_t>(seq_len, 1));
    }
    const int64_t first_query = seq_len - q_len;
    const int64_t first_read =
        sliding_window > 0 ? std::max<int64_t>(0, first_query - sliding_window + 1) : 0;
    const int32_t* row = t.block_tables + s * t.row_stride;
    for (int64_t i = first_read / c.block_size; i < ceil_div(seq_len, c.block_size); ++i) {
      if (row[i] < 0 || row[i] >= c.num_blocks) {
        throw std::invalid_argument(
            "block_tables[" + std::to_string(s) + "][" + std::to_string(i) +
            "] = " + std::to_string(row[i]) +
            " is not a block of the cache (num_blocks = " + std::to_string(c.num_blocks) + ")");
      }
    }
  }
  return max_seq_len;
}

void check_sliding_window(int64_t sliding_window) {
  if (sliding_window < 0) {
    throw std::invalid_argument("sliding_window " + std::to_string(sliding_window) +
                                " must be >= 0 (tokens; 0: full attention)");
  }
}

void check_logits_soft_cap(float logits_soft_cap) {
  if (!std::isfinite(logits_soft_cap) || logits_soft_cap < 0.0f) {
    throw std::invalid_argument("logits_soft_cap " + std::to_string(logits_soft_cap) +
                                " must be finite and >= 0 (0: no soft-capping)");
  }
}

void check_sinks(const float* sinks, int64_t num_heads) {
  if (sinks == nullptr) return;
  for (int64_t h = 0; h < num_heads; ++h) {
    if (!std::isfinite(sinks[h])) {
      throw std::invalid_argument("sinks[" + std::to_string(h) + "] = " + std::to_string(sinks[h]) +
                                  " must be finite");
    }
  }
}

// Positions one query token of a sequence with seq_len cached tokens attends to, at most.
int64_t attended_len(int64_t seq_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::min(seq_len, sliding_window) : seq_len;
}

void check_heads(int64_t num_heads, const PagedKVCache& c) {
  if (c.num_kv_heads <= 0 || num_heads <= 0 || num_heads % c.num_kv_heads != 0) {
    throw std::invalid_argument("num_heads " + std::to_string(num_heads) +
                                " must be a positive multiple of num_kv_heads " +
                                std::to_string(c.num_kv_heads));
  }
}

// Split-K when there are too few sequences (work items) to keep every thread busy with a few
// items each; then as many partitions per sequence as that takes, each >= 256 tokens.
int64_t choose_partition_size(const AttentionProblem& p) {
  const int64_t items = p.tables.num_seqs;
  const int64_t partitions_wanted =
      ceil_div(4 * int64_t{p.num_threads}, std::max<int64_t>(items, 1));
  if (partitions_wanted <= 1) return 0;
  const int64_t block_size = p.cache.block_size;
  int64_t size = ceil_div(ceil_div(p.max_attended_len, partitions_wanted), block_size) * block_size;
  size = std::max(size, ceil_div(kMinAutoPartitionSize, block_size) * block_size);
  return size >= p.max_attended_len ? 0 : size;
}

}  // namespace

void paged_attention_decode(void* out, int64_t out_token_stride, const void* query,
                            int64_t query_token_stride, int64_t num_heads, float scale,
                            int64_t sliding_window, float logits_soft_cap, const float* sinks,
                            const PagedKVCache& cache, const BlockTables& tables,
                            int64_t partition_size) {
  check_cache(cache);
  check_heads(num_heads, cache);
  check_sliding_window(sliding_window);
  check_logits_soft_cap(logits_soft_cap);
  check_sinks(sinks, num_heads);
  if (partition_size > 0 && partition_size % cache.block_size != 0) {
    throw std::invalid_argument("partition_size " + std::to_string(partition_size) +
                                " must be a multiple of block_size " +
                                std::to_string(cache.block_size));
  }
  AttentionProblem p{out,
                     out_token_stride,
                     query,
                     query_token_stride,
                     num_heads,
                     scale,
                     sliding_window,
                     logits_soft_cap,
                     sinks,
                     cache,
                     tables,
                     0,
                     get_num_threads()};
  p.max_attended_len =
      attended_len(check_tables(tables, cache, sliding_window, nullptr), sliding_window);
  if (tables.num_seqs == 0) return;
  int64_t work = 0;
  for (int64_t s = 0; s < tables.num_seqs; ++s) {
    work += attended_len(tables.seq_lens[s], sliding_window);
  }
  if (work * cache.num_kv_heads < kMinParallelDecodeWork) p.num_threads = 1;
  if (partition_size < 0) partition_size = choose_partition_size(p);
  const AttentionKernels& k = kernels();
  float* ws = workspace(k.decode_workspace_floats(p, partition_size));
  k.decode_attention(p, partition_size, ws);
}

void paged_prefill_attention(void* out, int64_t out_token_stride, const void* query,
                             int64_t query_token_stride, int64_t num_tokens, int64_t num_heads,
                             const int32_t* query_start_loc, float scale, int64_t sliding_window,
                             float logits_soft_cap, const float* sinks, const PagedKVCache& cache,
                             const BlockTables& tables) {
  check_cache(cache);
  check_heads(num_heads, cache);
  check_sliding_window(sliding_window);
  check_logits_soft_cap(logits_soft_cap);
  check_sinks(sinks, num_heads);
  AttentionProblem p{out,
                     out_token_stride,
                     query,
                     query_token_stride,
                     num_heads,
                     scale,
                     sliding_window,
                     logits_soft_cap,
                     sinks,
                     cache,
                     tables,
                     0,
                     get_num_threads()};
  p.max_attended_len =
      attended_len(check_tables(tables, cache, sliding_window, query_start_loc), sliding_window);
  if (query_start_loc[0] != 0) {
    throw std::invalid_argument("query_start_loc[0] = " + std::to_string(query_start_loc[0]) +
                                " must be 0");
  }
  for (int64_t s = 0; s < tables.num_seqs; ++s) {
    const int64_t q_len = int64_t{query_start_loc[s + 1]} - query_start_loc[s];
    if (q_len < 0 || q_len > tables.seq_lens[s]) {
      throw std::invalid_argument("query length " + index_name("query_start_loc", s + 1) + " - " +
                                  index_name("query_start_loc", s) + " = " + std::to_string(q_len) +
                                  " is outside [0, " + index_name("seq_lens", s) + " = " +
                                  std::to_string(tables.seq_lens[s]) + "]");
    }
  }
  if (query_start_loc[tables.num_seqs] != num_tokens) {
    throw std::invalid_argument(index_name("query_start_loc", tables.num_seqs) + " = " +
                                std::to_string(query_start_loc[tables.num_seqs]) +
                                " must equal num_tokens " + std::to_string(num_tokens));
  }

  // Tiles of rows (query token x query head of the group) of one kv head; the costliest first
  // so the dynamic schedule ends evenly. A single query token is a decode: one item covering all
  // heads of the sequence, run by the decode kernel.
  const AttentionKernels& k = kernels();
  const int64_t group = num_heads / cache.num_kv_heads;
  std::vector<std::pair<int64_t, PrefillItem>> planned;
  for (int64_t s = 0; s < tables.num_seqs; ++s) {
    const int64_t q_len = int64_t{query_start_loc[s + 1]} - query_start_loc[s];
    const int64_t context = tables.seq_lens[s] - q_len;
    if (q_len == 1) {
      planned.push_back(
          {num_heads * attended_len(context + 1, sliding_window) / 4,
           PrefillItem{static_cast<int32_t>(s), 0, 0, static_cast<int32_t>(num_heads)}});
      continue;
    }
    const int64_t rows = q_len * group;
    for (int64_t kv_head = 0; kv_head < cache.num_kv_heads; ++kv_head) {
      for (int64_t row = 0; row < rows; row += k.prefill_rows_per_tile) {
        const int64_t row_end = std::min(rows, row + k.prefill_rows_per_tile);
        const int64_t cost =
            (row_end - row) * attended_len(context + (row_end - 1) / group + 1, sliding_window);
        planned.push_back(
            {cost, PrefillItem{static_cast<int32_t>(s), static_cast<int32_t>(kv_head),
                               static_cast<int32_t>(row), static_cast<int32_t>(row_end)}});
      }
    }
  }
  std::stable_sort(planned.begin(), planned.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<PrefillItem> items(planned.size());
  int64_t work = 0;
  for (size_t i = 0; i < planned.size(); ++i) {
    items[i] = planned[i].second;
    work += planned[i].first;
  }
  if (items.empty()) return;
  if (work < kMinParallelPrefillWork) p.num_threads = 1;
  float* ws = workspace(k.prefill_workspace_floats(p));
  k.prefill_attention(p, query_start_loc, items.data(), static_cast<int64_t>(items.size()), ws);
}

void set_num_threads(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("num_threads " + std::to_string(num_threads) + " must be >= 1");
  }
  g_num_threads.store(num_threads);
}

int get_num_threads() {
  const int n = g_num_threads.load();
  return n > 0 ? n : omp_get_max_threads();
}

const char* isa() { return kernels().isa; }

void force_isa(const char* name) { g_variant.store(find_variant(name), std::memory_order_release); }

const ElementwiseKernels& elementwise_kernels() { return *variant().elementwise; }

const LinearKernels& linear_kernels() { return *variant().linear; }

}  // namespace pagedserve::cpu
