// Prefill / chunked-prefill attention over the paged cache (ops.h:
// cuda::paged_prefill_attention), flash-attention style on CUDA cores in float32.
//
// A row is one (query token, query head of a kv head's group) pair, so the query heads of a GQA
// group share every K/V tile. One thread block per (tile of kRows rows, kv head, sequence):
//
//   Q tile [kRows][head_size] (float, pre-scaled to base-2 logits) in shared memory
//   for each key tile of kKeys positions, from the first row's window start (0 without a
//   sliding window) up to the tile's last query position:
//     K, V tiles [kKeys][head_size] gathered through the block table into shared memory
//     S = Q K^T; soft-cap S (logits_soft_cap > 0); mask keys past each row's position or
//     before its window (position - W < key);
//     online softmax (m, l per row)
//     O = O * alpha + P V
//   out = O / l, or with sinks O times output_factor_log2 (the head's sink joins l)
//
// Threads: four per row (a quad of adjacent lanes); each computes the logits of every fourth
// key of the tile and owns every fourth output dimension of its row. Rows of shared memory are
// padded by one float, which keeps the quads' reads on distinct banks.
#include "cuda_common.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kRows = 32;
constexpr int kKeys = 16;
constexpr int kThreadsPerRow = 4;
constexpr int kPrefillThreads = kRows * kThreadsPerRow;
constexpr int kKeysPerThread = kKeys / kThreadsPerRow;
constexpr float kLog2e = 1.4426950408889634f;

struct PrefillArgs {
  void* out;
  int64_t out_token_stride;
  const void* query;
  int64_t query_token_stride;
  const int32_t* query_start_loc;
  const void* key_cache;
  const void* value_cache;
  int64_t key_block_stride;
  int64_t value_block_stride;
  int group_size;
  int block_size;
  int block_size_log2;
  float scale_log2;
  float soft_cap_log2;  // logits_soft_cap * log2(e); 0: off (see cuda_common.cuh)
  const float* sinks;   // device [num_heads], natural-log sink logits; null: none
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  int sliding_window;  // tokens; 0: full attention
};

template <int kHeadSize>
struct PrefillSmem {
  static constexpr int kPitch = kHeadSize + 1;  // floats per padded row
  static constexpr int kFloats = (kRows + 2 * kKeys) * kPitch + kRows * (kKeys + 1);
  static constexpr size_t kBytes = kFloats * sizeof(float);
};

template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kPrefillThreads) prefill_kernel(const PrefillArgs args) {
  using Smem = PrefillSmem<kHeadSize>;
  constexpr int kPitch = Smem::kPitch;
  constexpr int kVec = kVecElems<T>;
  constexpr int kRowVecs = kHeadSize / kVec;
  constexpr int kDimsPerThread = kHeadSize / kThreadsPerRow;

  extern __shared__ float smem[];
  float* q_tile = smem;                     // [kRows][kPitch]
  float* k_tile = q_tile + kRows * kPitch;  // [kKeys][kPitch]
  float* v_tile = k_tile + kKeys * kPitch;  // [kKeys][kPitch]
  float* p_tile = v_tile + kKeys * kPitch;  // [kRows][kKeys + 1]

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int query_start = args.query_start_loc[seq];
  const int query_len = args.query_start_loc[seq + 1] - query_start;
  const int first_row = blockIdx.x * kRows;
  const int num_rows = query_len * args.group_size;
  if (first_row >= num_rows) return;
  const int seq_len = args.seq_lens[seq];
  const int context_start = seq_len - query_len;  // position of the first query token

  // Load the Q tile: row r is (token (first_row + r) / group, head (first_row + r) % group).
  const T* query = static_cast<const T*>(args.query);
  for (int index = threadIdx.x; index < kRows * kHeadSize; index += kPrefillThreads) {
    const int r = index / kHeadSize;
    const int d = index % kHeadSize;
    const int row = first_row + r;
    float value = 0.0f;
    if (row < num_rows) {
      const int token = query_start + row / args.group_size;
      const int head = kv_head * args.group_size + row % args.group_size;
      value =
          to_float(query[token * args.query_token_stride + head * kHeadSize + d]) * args.scale_log2;
    }
    q_tile[r * kPitch + d] = value;
  }

  const int r = threadIdx.x / kThreadsPerRow;
  const int quad = threadIdx.x % kThreadsPerRow;
  const int row = first_row + r;
  const bool row_active = row < num_rows;
  // Keys at positions in [first_visible, limit] are visible to this row (limit -1: none, an
  // inactive row).
  const int limit = row_active ? context_start + row / args.group_size : -1;
  const int first_visible = args.sliding_window > 0 ? limit - args.sliding_window + 1 : 0;
  const int last_row = min(first_row + kRows, num_rows) - 1;
  const int keys_end = context_start + last_row / args.group_size + 1;  // exclusive
  // The tile's first row sees the earliest window: keys before it are never read.
  const int first_position = context_start + first_row / args.group_size;
  const int keys_begin =
      args.sliding_window > 0 ? max(0, first_position - args.sliding_window + 1) : 0;

  float m = -INFINITY, l = 0.0f;
  float acc[kDimsPerThread];
#pragma unroll
  for (int j = 0; j < kDimsPerThread; ++j) acc[j] = 0.0f;

  const int32_t* table = args.block_tables + seq * args.block_table_stride;
  const int64_t in_block = static_cast<int64_t>(kv_head) * args.block_size * kHeadSize;
  const T* key_cache = static_cast<const T*>(args.key_cache);
  const T* value_cache = static_cast<const T*>(args.value_cache);

  for (int key_start = keys_begin; key_start < keys_end; key_start += kKeys) {
    __syncthreads();  // the previous tile's K, V and P are no longer read
    for (int index = threadIdx.x; index < kKeys * kRowVecs; index += kPrefillThreads) {
      const int key = index / kRowVecs;
      const int vec = index % kRowVecs;
      const int position = key_start + key;
      float k[kVec], v[kVec];
      if (position < keys_end) {
        const int64_t block = table[position >> args.block_size_log2];
        const int64_t offset = in_block +
                               static_cast<int64_t>(position & (args.block_size - 1)) * kHeadSize +
                               vec * kVec;
        unpack(load16(key_cache + block * args.key_block_stride + offset), k, T{});
        unpack(load16(value_cache + block * args.value_block_stride + offset), v, T{});
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) k[e] = v[e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        k_tile[key * kPitch + vec * kVec + e] = k[e];
        v_tile[key * kPitch + vec * kVec + e] = v[e];
      }
    }
    __syncthreads();

    float logit[kKeysPerThread];
#pragma unroll
    for (int c = 0; c < kKeysPerThread; ++c) logit[c] = 0.0f;
    const float* q_row = q_tile + r * kPitch;
#pragma unroll 8
    for (int d = 0; d < kHeadSize; ++d) {
      const float q = q_row[d];
#pragma unroll
      for (int c = 0; c < kKeysPerThread; ++c) {
        logit[c] = fmaf(q, k_tile[(quad + c * kThreadsPerRow) * kPitch + d], logit[c]);
      }
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kKeysPerThread; ++c) {
      const int position = key_start + quad + c * kThreadsPerRow;
      logit[c] = soft_cap_log2(logit[c], args.soft_cap_log2);  // before the mask, as HF
      if (position > limit || position < first_visible) logit[c] = -INFINITY;
      tile_max = fmaxf(tile_max, logit[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    const float new_max = fmaxf(m, tile_max);
    // -inf while the row has seen no visible key (inactive rows, and rows whose window starts
    // past the tiles read so far).
    const float alpha = new_max == -INFINITY ? 1.0f : exp2f(m - new_max);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kKeysPerThread; ++c) {
      const float p = new_max == -INFINITY ? 0.0f : exp2f(logit[c] - new_max);
      p_tile[r * (kKeys + 1) + quad + c * kThreadsPerRow] = p;
      sum += p;
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    l = l * alpha + sum;
    m = new_max;
    __syncwarp();  // the quad's P entries are written (a row's quad is one warp's lanes)

    const float* p_row = p_tile + r * (kKeys + 1);
#pragma unroll
    for (int j = 0; j < kDimsPerThread; ++j) acc[j] *= alpha;
#pragma unroll 4
    for (int key = 0; key < kKeys; ++key) {
      const float p = p_row[key];
      const float* v_row = v_tile + key * kPitch + quad;
#pragma unroll
      for (int j = 0; j < kDimsPerThread; ++j) {
        acc[j] = fmaf(p, v_row[j * kThreadsPerRow], acc[j]);
      }
    }
  }

  if (!row_active) return;
  const int token = query_start + row / args.group_size;
  const int head = kv_head * args.group_size + row % args.group_size;
  const bool has_sink = args.sinks != nullptr;
  const float inverse =
      output_factor_log2(m, l, has_sink, has_sink ? args.sinks[head] * kLog2e : 0.0f);
  T* out = static_cast<T*>(args.out) + token * args.out_token_stride + head * kHeadSize;
#pragma unroll
  for (int j = 0; j < kDimsPerThread; ++j) {
    out[quad + j * kThreadsPerRow] = from_float<T>(acc[j] * inverse);
  }
}

template <typename T, int kHeadSize>
void launch_prefill(const PrefillArgs& args, dim3 grid, cudaStream_t stream) {
  constexpr size_t kBytes = PrefillSmem<kHeadSize>::kBytes;
  if constexpr (kBytes > 48 * 1024) {
    // Above the default limit a kernel must opt in to more shared memory (once per device and
    // kernel; cheap enough to repeat).
    check_cuda(
        cudaFuncSetAttribute(prefill_kernel<T, kHeadSize>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBytes)),
        "cudaFuncSetAttribute(prefill_kernel)");
  }
  prefill_kernel<T, kHeadSize><<<grid, kPrefillThreads, kBytes, stream>>>(args);
}

}  // namespace

void paged_prefill_attention(void* out, int64_t out_token_stride, const void* query,
                             int64_t query_token_stride, int64_t num_tokens, int64_t num_heads,
                             const int32_t* query_start_loc, int64_t max_query_len, float scale,
                             int64_t sliding_window, float logits_soft_cap, const float* sinks,
                             const PagedKVCache& cache, const BlockTables& tables,
                             const Stream& stream) {
  check_block_size(cache.block_size);
  check_sliding_window(sliding_window);
  check_logits_soft_cap(logits_soft_cap);
  check_cache_alignment(cache);
  if (cache.num_kv_heads < 1 || num_heads % cache.num_kv_heads != 0) {
    throw std::invalid_argument("num_heads " + std::to_string(num_heads) +
                                " is not a multiple of num_kv_heads " +
                                std::to_string(cache.num_kv_heads));
  }
  if (max_query_len < 0 || max_query_len > num_tokens) {
    throw std::invalid_argument("max_query_len " + std::to_string(max_query_len) +
                                " is outside [0, num_tokens = " + std::to_string(num_tokens) + "]");
  }
  if (tables.num_seqs > 65535 || cache.num_kv_heads > 65535) {
    throw std::invalid_argument("num_seqs and num_kv_heads must be at most 65535");
  }
  if (tables.num_seqs == 0 || max_query_len == 0) return;
  const int64_t group_size = num_heads / cache.num_kv_heads;

  PrefillArgs args{};
  args.out = out;
  args.out_token_stride = out_token_stride;
  args.query = query;
  args.query_token_stride = query_token_stride;
  args.query_start_loc = query_start_loc;
  args.key_cache = cache.key_cache;
  args.value_cache = cache.value_cache;
  args.key_block_stride = cache.key_block_stride;
  args.value_block_stride = cache.value_block_stride;
  args.group_size = static_cast<int>(group_size);
  args.block_size = static_cast<int>(cache.block_size);
  args.block_size_log2 = log2_exact(cache.block_size);
  args.scale_log2 = scale * kLog2e;
  args.soft_cap_log2 = logits_soft_cap * kLog2e;
  args.sinks = sinks;
  args.block_tables = tables.block_tables;
  args.block_table_stride = tables.row_stride;
  args.seq_lens = tables.seq_lens;
  args.sliding_window = static_cast<int>(sliding_window);

  DeviceGuard guard(stream.device);
  const dim3 grid(static_cast<unsigned>(ceil_div(max_query_len * group_size, kRows)),
                  static_cast<unsigned>(cache.num_kv_heads),
                  static_cast<unsigned>(tables.num_seqs));
  dispatch_dtype(cache.dtype, [&](auto type) {
    using T = decltype(type);
    dispatch_head_size(cache.head_size, [&](auto head_size) {
      launch_prefill<T, decltype(head_size)::value>(args, grid, to_stream(stream));
    });
  });
  check_launch("paged_prefill_attention kernel");
}

}  // namespace pagedserve::cuda
