// Cache writes and block copies of ops.h: plain memcpy, parallel when there is enough to copy.
#include <omp.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "block_mapping.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Below this many bytes a copy runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelCopyBytes = int64_t{1} << 20;

int64_t element_bytes(DType dtype) {
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
