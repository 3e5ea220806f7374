// KV cache writes and block copies (ops.h: cuda::reshape_and_cache, copy_blocks, swap_blocks).
// All three move bytes only, so the kernels are templated on the vector width, not the dtype.
#include <algorithm>

#include "block_mapping.h"
#include "cuda_common.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kCopyThreads = 256;
// Thread blocks per copied block (all layers): enough to spread one large block over the SMs.
constexpr int64_t kMaxChunksPerBlock = 1024;

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = uint32_t;
};
template <>
struct VecOf<2> {
  using type = uint16_t;
};
template <>
struct VecOf<1> {
  using type = uint8_t;
};

// The widest vector (16, 8, 4, 2 or 1 bytes) that divides every address and stride.
int widest_vector(std::initializer_list<int64_t> values) {
  for (int bytes : {16, 8, 4, 2}) {
    if (std::all_of(values.begin(), values.end(), [&](int64_t v) { return v % bytes == 0; })) {
      return bytes;
    }
  }
  return 1;
}

template <typename Body>
void dispatch_vector(int bytes, Body&& body) {
  switch (bytes) {
    case 16:
      body(IntConstant<16>{});
      return;
    case 8:
      body(IntConstant<8>{});
      return;
    case 4:
      body(IntConstant<4>{});
      return;
    case 2:
      body(IntConstant<2>{});
      return;
    default:
      body(IntConstant<1>{});
      return;
  }
}

struct CacheWriteArgs {
  const char* key;
  const char* value;
  int64_t key_token_bytes;  // bytes between key[t] and key[t + 1]
  int64_t value_token_bytes;
  const int64_t* slot_mapping;
  char* key_cache;
  char* value_cache;
  int64_t key_block_bytes;  // bytes between key_cache[b] and key_cache[b + 1]
  int64_t value_block_bytes;
  int64_t num_slots;
  int64_t block_size;
  int64_t row_bytes;  // head_size * element size
  int64_t num_kv_heads;
};

// One thread block per token: its K and V rows (all kv heads) into the slot's block.
template <int kBytes>
__global__ void reshape_and_cache_kernel(const CacheWriteArgs args) {
  using Vec = typename VecOf<kBytes>::type;
  const int64_t token = blockIdx.x;
  const int64_t slot = args.slot_mapping[token];
  if (slot < 0 || slot >= args.num_slots) return;  // padding (or out of range: never written)
  const int64_t block = slot / args.block_size;
  const int64_t offset = slot % args.block_size;
  const int64_t row_vecs = args.row_bytes / kBytes;
  const int64_t num_vecs = args.num_kv_heads * row_vecs;
  for (int64_t index = threadIdx.x; index < num_vecs; index += blockDim.x) {
    const int64_t head = index / row_vecs;
    const int64_t within_row = (index % row_vecs) * kBytes;
    const int64_t source = head * args.row_bytes + within_row;  // heads contiguous in a token
    const int64_t target = (head * args.block_size + offset) * args.row_bytes + within_row;
    *reinterpret_cast<Vec*>(args.key_cache + block * args.key_block_bytes + target) =
        *reinterpret_cast<const Vec*>(args.key + token * args.key_token_bytes + source);
    *reinterpret_cast<Vec*>(args.value_cache + block * args.value_block_bytes + target) =
        *reinterpret_cast<const Vec*>(args.value + token * args.value_token_bytes + source);
  }
}

// blockIdx.x: the pair; blockIdx.y: a chunk of the block's bytes.
template <int kBytes>
__global__ void copy_blocks_kernel(char* kv_cache, const int64_t* block_mapping,
                                   int64_t block_bytes) {
  using Vec = typename VecOf<kBytes>::type;
  const int64_t pair = blockIdx.x;
  const Vec* source =
      reinterpret_cast<const Vec*>(kv_cache + block_mapping[2 * pair] * block_bytes);
  Vec* target = reinterpret_cast<Vec*>(kv_cache + block_mapping[2 * pair + 1] * block_bytes);
  const int64_t num_vecs = block_bytes / kBytes;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < num_vecs;
       i += step) {
    target[i] = source[i];
  }
}

}  // namespace

void reshape_and_cache(const void* key, int64_t key_token_stride, const void* value,
                       int64_t value_token_stride, const int64_t* slot_mapping, int64_t num_tokens,
                       const PagedKVCache& cache, const Stream& stream) {
  if (num_tokens == 0) return;
  if (num_tokens > 0x7fffffff) {
    throw std::invalid_argument("num_tokens " + std::to_string(num_tokens) + " is too large");
  }
  const int64_t elem = element_bytes(cache.dtype);
  CacheWriteArgs args{};
  args.key = static_cast<const char*>(key);
  args.value = static_cast<const char*>(value);
  args.key_token_bytes = key_token_stride * elem;
  args.value_token_bytes = value_token_stride * elem;
  args.slot_mapping = slot_mapping;
  args.key_cache = static_cast<char*>(cache.key_cache);
  args.value_cache = static_cast<char*>(cache.value_cache);
  args.key_block_bytes = cache.key_block_stride * elem;
  args.value_block_bytes = cache.value_block_stride * elem;
  args.num_slots = cache.num_blocks * cache.block_size;
  args.block_size = cache.block_size;
  args.row_bytes = cache.head_size * elem;
  args.num_kv_heads = cache.num_kv_heads;
  const int bytes = widest_vector(
      {static_cast<int64_t>(reinterpret_cast<uintptr_t>(key)),
       static_cast<int64_t>(reinterpret_cast<uintptr_t>(value)),
       static_cast<int64_t>(reinterpret_cast<uintptr_t>(cache.key_cache)),
       static_cast<int64_t>(reinterpret_cast<uintptr_t>(cache.value_cache)), args.key_token_bytes,
       args.value_token_bytes, args.key_block_bytes, args.value_block_bytes, args.row_bytes});
  const int64_t num_vecs = cache.num_kv_heads * args.row_bytes / bytes;
  const int threads = static_cast<int>(std::min<int64_t>(
      kCopyThreads, std::max<int64_t>(kWarpSize, ceil_div(num_vecs, kWarpSize) * kWarpSize)));

  DeviceGuard guard(stream.device);
  dispatch_vector(bytes, [&](auto vector) {
    reshape_and_cache_kernel<decltype(vector)::value>
        <<<static_cast<unsigned>(num_tokens), threads, 0, to_stream(stream)>>>(args);
  });
  check_launch("reshape_and_cache kernel");
}

void copy_blocks(void* kv_cache, int64_t num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping, const int64_t* device_block_mapping,
                 int64_t num_pairs, const Stream& stream) {
  check_block_mapping(block_mapping, num_pairs, num_blocks, num_blocks, /*same_pool=*/true);
  if (num_pairs == 0 || block_bytes == 0) return;
  if (num_pairs > 0x7fffffff) {
    throw std::invalid_argument("num_pairs " + std::to_string(num_pairs) + " is too large");
  }
  const int bytes =
      widest_vector({static_cast<int64_t>(reinterpret_cast<uintptr_t>(kv_cache)), block_bytes});
  const int64_t chunks =
      std::min(kMaxChunksPerBlock, ceil_div(block_bytes / bytes, int64_t{kCopyThreads} * 4));
  const dim3 grid(static_cast<unsigned>(num_pairs),
                  static_cast<unsigned>(std::max<int64_t>(chunks, 1)));

  DeviceGuard guard(stream.device);
  dispatch_vector(bytes, [&](auto vector) {
    copy_blocks_kernel<decltype(vector)::value><<<grid, kCopyThreads, 0, to_stream(stream)>>>(
        static_cast<char*>(kv_cache), device_block_mapping, block_bytes);
  });
  check_launch("copy_blocks kernel");
}

void swap_blocks(const void* src_kv_cache, int64_t src_num_blocks, void* dst_kv_cache,
                 int64_t dst_num_blocks, int64_t block_bytes, const int64_t* block_mapping,
                 int64_t num_pairs, const Stream& stream) {
  check_block_mapping(block_mapping, num_pairs, src_num_blocks, dst_num_blocks,
                      /*same_pool=*/false);
  DeviceGuard guard(stream.device);
  const char* src = static_cast<const char*>(src_kv_cache);
  char* dst = static_cast<char*>(dst_kv_cache);
  // Pairs that continue a run on both sides ((s, d), (s + 1, d + 1), ...) make one copy.
  int64_t i = 0;
  while (i < num_pairs) {
    const int64_t first_src = block_mapping[2 * i];
    const int64_t first_dst = block_mapping[2 * i + 1];
    int64_t run = 1;
    while (i + run < num_pairs && block_mapping[2 * (i + run)] == first_src + run &&
           block_mapping[2 * (i + run) + 1] == first_dst + run) {
      ++run;
    }
    check_cuda(cudaMemcpyAsync(dst + first_dst * block_bytes, src + first_src * block_bytes,
                               run * block_bytes, cudaMemcpyDefault, to_stream(stream)),
               "swap_blocks cudaMemcpyAsync");
    i += run;
  }
}

}  // namespace pagedserve::cuda
