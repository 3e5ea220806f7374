// Cache writes and block copies of ops.h: plain memcpy, parallel when there is enough to copy;
// a float8 cache's writes round each value (vec.h's scalar conversions).
#include <omp.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "block_mapping.h"
#include "ops.h"

// This file is built with the baseline flags, as the generic kernel variant is: its inline
// scalar conversions are the same definitions.
#define PAGEDSERVE_ISA_NS generic
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// Below this many bytes a copy runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelCopyBytes = int64_t{1} << 20;
// Values a float8 write rounds before it is worth the pool (each ~2 ns on one core).
constexpr int64_t kParallelConvert = int64_t{1} << 16;

int64_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3:
      break;
  }
  throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                              " is not supported (0 float32, 1 bfloat16, 2 float16)");
}

// Every token's K and V rows into a float8 cache of elements C, each value rounded from
// float32.
template <typename T, typename C>
void write_float8(const T* key, int64_t key_token_stride, const T* value,
                  int64_t value_token_stride, const int64_t* slot_mapping, int64_t num_tokens,
                  const PagedKVCache& cache, bool parallel) {
  using generic::from_float;
  using generic::to_float;
  const int64_t head_size = cache.head_size;
  const int64_t head_stride = cache.block_size * head_size;
  auto* key_cache = static_cast<C*>(cache.key_cache);
  auto* value_cache = static_cast<C*>(cache.value_cache);
#pragma omp parallel for num_threads(get_num_threads()) if (parallel) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / cache.block_size;
    const int64_t in_block = slot % cache.block_size * head_size;
    for (int64_t h = 0; h < cache.num_kv_heads; ++h) {
      const T* k = key + t * key_token_stride + h * head_size;
      const T* v = value + t * value_token_stride + h * head_size;
      C* k_dst = key_cache + block * cache.key_block_stride + h * head_stride + in_block;
      C* v_dst = value_cache + block * cache.value_block_stride + h * head_stride + in_block;
      for (int64_t d = 0; d < head_size; ++d) {
        k_dst[d] = from_float<C>(to_float(k[d]));
        v_dst[d] = from_float<C>(to_float(v[d]));
      }
    }
  }
}

void copy_pairs(const char* src, char* dst, int64_t block_bytes, const int64_t* block_mapping,
                int64_t num_pairs) {
  const bool parallel = num_pairs > 1 && num_pairs * block_bytes >= kParallelCopyBytes;
#pragma omp parallel for num_threads(get_num_threads()) if (parallel) schedule(static)
  for (int64_t i = 0; i < num_pairs; ++i) {
    std::memcpy(dst + block_mapping[2 * i + 1] * block_bytes,
                src + block_mapping[2 * i] * block_bytes, block_bytes);
  }
}

}  // namespace

void reshape_and_cache(const void* key, int64_t key_token_stride, const void* value,
                       int64_t value_token_stride, const int64_t* slot_mapping, int64_t num_tokens,
                       const PagedKVCache& cache) {
  const int64_t elem = element_bytes(cache.dtype);
  const bool float8 =
      cache.cache_dtype == DType::kFloat8E5M2 || cache.cache_dtype == DType::kFloat8E4M3;
  if (cache.cache_dtype != cache.dtype && !float8) {
    throw std::invalid_argument("cache dtype code " +
                                std::to_string(static_cast<int>(cache.cache_dtype)) +
                                " is neither the activations' dtype nor 3 (float8 e5m2) or 4 "
                                "(float8 e4m3)");
  }
  const int64_t num_slots = cache.num_blocks * cache.block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot_mapping[t] >= num_slots) {
      throw std::invalid_argument("slot_mapping[" + std::to_string(t) +
                                  "] = " + std::to_string(slot_mapping[t]) +
                                  " is past the last slot of the cache (num_blocks * block_size"
                                  " = " +
                                  std::to_string(num_slots) + ")");
    }
  }
  const int64_t row_bytes = cache.head_size * elem;
  if (float8) {
    const bool parallel = 2 * num_tokens * cache.num_kv_heads * cache.head_size >= kParallelConvert;
    generic::with_dtype(cache.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const auto* k = static_cast<const T*>(key);
      const auto* v = static_cast<const T*>(value);
      if (cache.cache_dtype == DType::kFloat8E4M3) {
        write_float8<T, Float8E4M3>(k, key_token_stride, v, value_token_stride, slot_mapping,
                                    num_tokens, cache, parallel);
      } else {
        write_float8<T, Float8E5M2>(k, key_token_stride, v, value_token_stride, slot_mapping,
                                    num_tokens, cache, parallel);
      }
    });
    return;
  }
  const int64_t head_stride = cache.block_size * cache.head_size;  // elements
  const char* key_bytes = static_cast<const char*>(key);
  const char* value_bytes = static_cast<const char*>(value);
  char* key_cache = static_cast<char*>(cache.key_cache);
  char* value_cache = static_cast<char*>(cache.value_cache);
  const bool parallel = 2 * num_tokens * cache.num_kv_heads * row_bytes >= kParallelCopyBytes;
#pragma omp parallel for num_threads(get_num_threads()) if (parallel) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / cache.block_size;
    const int64_t offset = slot % cache.block_size;
    for (int64_t h = 0; h < cache.num_kv_heads; ++h) {
      const int64_t in_block = h * head_stride + offset * cache.head_size;
      std::memcpy(key_cache + (block * cache.key_block_stride + in_block) * elem,
                  key_bytes + (t * key_token_stride + h * cache.head_size) * elem, row_bytes);
      std::memcpy(value_cache + (block * cache.value_block_stride + in_block) * elem,
                  value_bytes + (t * value_token_stride + h * cache.head_size) * elem, row_bytes);
    }
  }
}

void copy_blocks(void* kv_cache, int64_t num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping, int64_t num_pairs) {
  check_block_mapping(block_mapping, num_pairs, num_blocks, num_blocks, /*same_pool=*/true);
  copy_pairs(static_cast<const char*>(kv_cache), static_cast<char*>(kv_cache), block_bytes,
             block_mapping, num_pairs);
}

void swap_blocks(const void* src_kv_cache, int64_t src_num_blocks, void* dst_kv_cache,
                 int64_t dst_num_blocks, int64_t block_bytes, const int64_t* block_mapping,
                 int64_t num_pairs) {
  check_block_mapping(block_mapping, num_pairs, src_num_blocks, dst_num_blocks,
                      /*same_pool=*/false);
  copy_pairs(static_cast<const char*>(src_kv_cache), static_cast<char*>(dst_kv_cache), block_bytes,
             block_mapping, num_pairs);
}

}  // namespace pagedserve::cpu
