// Decode paged attention (ops.h: cuda::paged_attention_decode).
//
// One thread block per (partition of a sequence's context, kv head, chunk of that head's query
// heads); a single pass is the case of one partition spanning the whole context. Its four warps
// take turns over the context, kUnroll * kRowsPerStep token rows at a time, and all the query
// heads of the chunk (a tile of 1, 4 or 8) share every K/V row they load (GQA). Groups of more
// than 8 heads take decode_wide_kernel: a warp per 8 heads, the block's warps sharing each round
// of rows through shared memory, so every K/V byte is read once per step for groups up to 64.
//
// Coalesced reads: a (block, kv head) tile of the cache is block_size contiguous rows of
// head_size elements. A warp reads kRowsPerStep consecutive rows per load instruction, each lane
// a 16-byte vector, so one instruction covers one contiguous span of the tile:
//
//   lanes:  [ 0 .. kRowLanes-1 ][ kRowLanes .. 2 kRowLanes-1 ] ...
//   rows:   [ token t          ][ token t + 1                ] ...   (lanes past a row idle)
//
// A row of more than 32 vectors takes ceil(vectors / 32) per lane, lane i vectors i, i + 32, ...
// (a head of 192 float32 values, 48 vectors: lanes 0-15 two, lanes 16-31 one, their second
// idle).
//
// Each lane holds the query's matching elements, so a row's logit is a sum over its kRowLanes
// lanes (xor shuffles). Per warp and query head an online softmax keeps the running max m, the
// sum l and the unnormalized output, lane-distributed like the rows. Logits are kept in base 2:
// q is scaled by scale * log2(e), so exp2 replaces exp.
//
// Split-K: each partition writes its normalized output, max and sum to the workspace; the
// reduction kernel rescales the partitions to the global max and combines them.
//
// Soft-capping (logits_soft_cap c > 0): each base-2 logit x becomes c2 * tanh(x / c2), c2 = c *
// log2(e), which is c * tanh(s / c) of the natural logit s = x / log2(e), before the mask.
//
// Sinks (gpt-oss): a single pass folds the head's sink into its normalization; with split-K
// the partitions are stored without it and the reduction adds it as one more partition (max the
// sink, exp-sum 1, output 0).
//
// Sliding window: a sequence attends to its positions [window_start, seq_len), window_start =
// max(0, seq_len - sliding_window). Partitions count from window_start, so the grid holds
// ceil(min(context, window) / partition_size) of them and none is launched for positions
// outside the window:
//
//   positions:  0 ....... window_start | part 0 | part 1 | ... | seq_len - 1
//               never read               partition_size tokens each
#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>

#include "cuda_common.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kReduceThreads = 128;
// decode_wide_kernel: groups above the plain kernel's largest tile, 8 heads a warp and at most
// 8 warps a block (64 heads share one pass over their kv head's rows).
constexpr int kWideGroupTile = 8;
constexpr int kWideMaxWarps = 8;
constexpr int kWideMaxThreads = kWideMaxWarps * kWarpSize;
// Tokens per partition when the partition size is chosen automatically.
constexpr int64_t kDefaultPartitionSize = 512;
constexpr float kLog2e = 1.4426950408889634f;

constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// How a warp's lanes cover rows of head_size elements of T (see the top of the file).
template <typename T, int kHeadSize>
struct RowLayout {
  static constexpr int kVec = kVecElems<T>;          // elements per 16-byte load
  static constexpr int kNumVecs = kHeadSize / kVec;  // 16-byte loads per row
  static constexpr int kRowLanes = kNumVecs >= kWarpSize ? kWarpSize : next_pow2(kNumVecs);
  static constexpr int kVecsPerLane =
      kNumVecs >= kWarpSize ? (kNumVecs + kWarpSize - 1) / kWarpSize : 1;
  static constexpr int kRowsPerStep = kWarpSize / kRowLanes;
  static constexpr int kLaneElems = kVecsPerLane * kVec;
  static_assert(kHeadSize % kVec == 0, "a row is whole 16-byte vectors");

  // The head dimension of a lane's element e.
  __device__ static int dim(int lane_in_row, int e) {
    return (lane_in_row + (e / kVec) * kWarpSize) * kVec + e % kVec;
  }
  // Whether a lane's vector v lies in the row (not past its end).
  __device__ static bool has_vec(int lane_in_row, int v) {
    return lane_in_row + v * kWarpSize < kNumVecs;
  }
  // Whether a lane holds any of its row (lanes past a short row idle).
  __device__ static bool lane_active(int lane_in_row) { return lane_in_row < kNumVecs; }
};

struct DecodeArgs {
  void* out;
  int64_t out_token_stride;
  const void* query;
  int64_t query_token_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t key_block_stride;
  int64_t value_block_stride;
  int num_heads;
  int group_size;       // query heads per kv head
  int num_head_chunks;  // ceil(group_size / group tile)
  int block_size;
  int block_size_log2;
  float scale_log2;     // softmax scale * log2(e)
  float soft_cap_log2;  // logits_soft_cap * log2(e), the cap of base-2 logits; 0: off
  const float* sinks;   // device [num_heads], natural-log sink logits; null: none
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  int sliding_window;  // tokens; 0: full attention
  int partition_size;  // tokens per partition; 0: one pass over the whole window
  int max_partitions;
  float* partial_out;  // [num_seqs, num_heads, max_partitions, head_size]
  float* partial_max;  // [num_seqs, num_heads, max_partitions]
  float* partial_sum;  // [num_seqs, num_heads, max_partitions]
};

// Rows a lane has in flight per chunk: fewer when more query heads (and their accumulators)
// share the registers.
template <int kGroupTile, int kVecsPerLane>
struct UnrollRows {
  static constexpr int kBase = kGroupTile == 1 ? 8 : kGroupTile == 4 ? 4 : 2;
  static constexpr int value = kBase / kVecsPerLane > 1 ? kBase / kVecsPerLane : 1;
};

// The first position a sequence's decode query (at seq_len - 1) attends to.
__device__ inline int window_start(const DecodeArgs& args, int seq_len) {
  return args.sliding_window > 0 ? max(0, seq_len - args.sliding_window) : 0;
}

// The positions [start, end) the partition of a thread block attends to; false when it lies
// past the sequence's end.
__device__ inline bool partition_span(const DecodeArgs& args, int seq, int partition, int& start,
                                      int& end) {
  const int seq_len = args.seq_lens[seq];
  start = window_start(args, seq_len) + partition * args.partition_size;
  if (args.partition_size > 0 && start >= seq_len) return false;
  end = args.partition_size > 0 ? min(seq_len, start + args.partition_size) : seq_len;
  return true;
}

// One warp's view of up to kGroupTile query heads: the lane's query elements and, per head, the
// online softmax over the rows the warp has seen (running max m, sum l, unnormalized output).
template <typename T, int kHeadSize, int kGroupTile>
struct WarpHeads {
  using Layout = RowLayout<T, kHeadSize>;
  static constexpr int kVec = Layout::kVec;
  static constexpr int kLaneElems = Layout::kLaneElems;
  static constexpr int kVecsPerLane = Layout::kVecsPerLane;
  static constexpr int kUnroll = UnrollRows<kGroupTile, kVecsPerLane>::value;
  static constexpr int kChunkRows = kUnroll * Layout::kRowsPerStep;

  float q[kGroupTile][kLaneElems];
  float m[kGroupTile], l[kGroupTile], acc[kGroupTile][kLaneElems];

  // Loads the query elements of heads [first_head, first_head + num_heads) (pre-scaled: base-2
  // logits); the tile's other heads get zeros.
  __device__ void start(const DecodeArgs& args, int seq, int first_head, int num_heads,
                        int lane_in_row) {
    const T* query = static_cast<const T*>(args.query) + seq * args.query_token_stride;
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) {
        q[g][e] =
            (g < num_heads && Layout::has_vec(lane_in_row, e / kVec))
                ? to_float(query[(first_head + g) * kHeadSize + Layout::dim(lane_in_row, e)]) *
                      args.scale_log2
                : 0.0f;
      }
      m[g] = -INFINITY;
      l[g] = 0.0f;
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) acc[g][e] = 0.0f;
    }
  }

  // Folds a chunk of kChunkRows rows (row i * kRowsPerStep + the lane's row in a step) into every
  // head; rows not valid count as masked. The chunk's first row must be valid, so that the new
  // max is finite.
  __device__ void attend(const uint4 (&k_raw)[kUnroll][kVecsPerLane],
                         const uint4 (&v_raw)[kUnroll][kVecsPerLane], const bool (&valid)[kUnroll],
                         float soft_cap) {
    float logit[kUnroll][kGroupTile];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      float k[kLaneElems];
#pragma unroll
      for (int v = 0; v < kVecsPerLane; ++v) unpack(k_raw[i][v], k + v * kVec, T{});
#pragma unroll
      for (int g = 0; g < kGroupTile; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
        for (int offset = Layout::kRowLanes / 2; offset > 0; offset /= 2) {
          dot += __shfl_xor_sync(kFullMask, dot, offset);
        }
        logit[i][g] = valid[i] ? soft_cap_log2(dot, soft_cap) : -INFINITY;
      }
    }

    float p[kUnroll][kGroupTile];
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
      float chunk_max = logit[0][g];
#pragma unroll
      for (int i = 1; i < kUnroll; ++i) chunk_max = fmaxf(chunk_max, logit[i][g]);
#pragma unroll
      for (int offset = kWarpSize / 2; offset >= Layout::kRowLanes; offset /= 2) {
        chunk_max = fmaxf(chunk_max, __shfl_xor_sync(kFullMask, chunk_max, offset));
      }
      const float new_max = fmaxf(m[g], chunk_max);
      const float alpha = exp2f(m[g] - new_max);  // 0 while m is -inf
      m[g] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        p[i][g] = exp2f(logit[i][g] - new_max);  // 0 for masked rows
        sum += p[i][g];
      }
      l[g] = l[g] * alpha + sum;
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) acc[g][e] *= alpha;
    }

#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      float v[kLaneElems];
#pragma unroll
      for (int w = 0; w < kVecsPerLane; ++w) unpack(v_raw[i][w], v + w * kVec, T{});
#pragma unroll
      for (int g = 0; g < kGroupTile; ++g) {
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) acc[g][e] = fmaf(p[i][g], v[e], acc[g][e]);
      }
    }
  }

  // Rows of a warp sit in different lane groups: adds the groups' sums and outputs (m is already
  // the same in every lane of the warp).
  __device__ void gather_lane_groups() {
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
#pragma unroll
      for (int offset = kWarpSize / 2; offset >= Layout::kRowLanes; offset /= 2) {
        l[g] += __shfl_xor_sync(kFullMask, l[g], offset);
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) {
          acc[g][e] += __shfl_xor_sync(kFullMask, acc[g][e], offset);
        }
      }
    }
  }
};

// Writes element d of a head's result over the partition: its output with a single pass, else
// its normalized output, max and sum for the reduction.
template <typename T>
__device__ inline void store_head(const DecodeArgs& args, int seq, int head, int partition,
                                  int head_size, int d, float out, float max_all, float sum) {
  if (args.partition_size == 0) {
    const bool has_sink = args.sinks != nullptr;
    const float factor =
        output_factor_log2(max_all, sum, has_sink, has_sink ? args.sinks[head] * kLog2e : 0.0f);
    T* out_row = static_cast<T*>(args.out) + seq * args.out_token_stride;
    out_row[head * head_size + d] = from_float<T>(out * factor);  // seq_len 0: zeros
  } else {
    const int64_t slot =
        (static_cast<int64_t>(seq) * args.num_heads + head) * args.max_partitions + partition;
    args.partial_out[slot * head_size + d] = sum > 0.0f ? out / sum : 0.0f;
    if (d == 0) {
      args.partial_max[slot] = max_all;
      args.partial_sum[slot] = sum;
    }
  }
}

template <typename T, int kHeadSize, int kGroupTile>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeArgs args) {
  using Heads = WarpHeads<T, kHeadSize, kGroupTile>;
  using Layout = typename Heads::Layout;
  constexpr int kVec = Layout::kVec;
  constexpr int kLaneElems = Layout::kLaneElems;
  constexpr int kVecsPerLane = Layout::kVecsPerLane;
  constexpr int kUnroll = Heads::kUnroll;
  constexpr int kChunkRows = Heads::kChunkRows;

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y / args.num_head_chunks;
  const int first_in_group = (blockIdx.y % args.num_head_chunks) * kGroupTile;
  const int num_chunk_heads = min(kGroupTile, args.group_size - first_in_group);
  const int first_head = kv_head * args.group_size + first_in_group;
  const int partition = blockIdx.x;
  int start, end;
  if (!partition_span(args, seq, partition, start, end)) return;  // the reduction skips it

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int lane_in_row = lane % Layout::kRowLanes;  // which part of a row this lane holds
  const int row_in_step = lane / Layout::kRowLanes;  // which row of a step
  const bool lane_active = Layout::lane_active(lane_in_row);

  Heads heads;
  heads.start(args, seq, first_head, num_chunk_heads, lane_in_row);

  const int32_t* table = args.block_tables + seq * args.block_table_stride;
  const int64_t in_block = static_cast<int64_t>(kv_head) * args.block_size * kHeadSize;
  const T* key_cache = static_cast<const T*>(args.key_cache);
  const T* value_cache = static_cast<const T*>(args.value_cache);

  for (int chunk = start + warp * kChunkRows; chunk < end; chunk += kDecodeWarps * kChunkRows) {
    // Issue every load of the chunk before using any.
    uint4 k_raw[kUnroll][kVecsPerLane], v_raw[kUnroll][kVecsPerLane];
    bool valid[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int token = chunk + i * Layout::kRowsPerStep + row_in_step;
      valid[i] = token < end;
      if (valid[i] && lane_active) {
        const int64_t block = table[token >> args.block_size_log2];
        const int64_t row =
            in_block + static_cast<int64_t>(token & (args.block_size - 1)) * kHeadSize;
        const T* k_row = key_cache + block * args.key_block_stride + row;
        const T* v_row = value_cache + block * args.value_block_stride + row;
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          const int offset = (lane_in_row + v * kWarpSize) * kVec;
          const bool in_row = Layout::has_vec(lane_in_row, v);
          k_raw[i][v] = in_row ? __ldg(reinterpret_cast<const uint4*>(k_row + offset))
                               : make_uint4(0, 0, 0, 0);
          v_raw[i][v] = in_row ? __ldg(reinterpret_cast<const uint4*>(v_row + offset))
                               : make_uint4(0, 0, 0, 0);
        }
      } else {
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          k_raw[i][v] = make_uint4(0, 0, 0, 0);
          v_raw[i][v] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    heads.attend(k_raw, v_raw, valid, args.soft_cap_log2);
  }
  heads.gather_lane_groups();

  __shared__ float warp_max[kDecodeWarps][kGroupTile];
  __shared__ float warp_sum[kDecodeWarps][kGroupTile];
  __shared__ float warp_out[kDecodeWarps][kGroupTile][kHeadSize];
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
      warp_max[warp][g] = heads.m[g];
      warp_sum[warp][g] = heads.l[g];
    }
  }
  if (row_in_step == 0 && lane_active) {
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) {
        if (Layout::has_vec(lane_in_row, e / kVec)) {
          warp_out[warp][g][Layout::dim(lane_in_row, e)] = heads.acc[g][e];
        }
      }
    }
  }
  __syncthreads();

  for (int index = threadIdx.x; index < num_chunk_heads * kHeadSize; index += kDecodeThreads) {
    const int g = index / kHeadSize;
    const int d = index % kHeadSize;
    float max_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) max_all = fmaxf(max_all, warp_max[w][g]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      // A warp that saw no row has max -inf and contributes nothing.
      const float weight = warp_max[w][g] == -INFINITY ? 0.0f : exp2f(warp_max[w][g] - max_all);
      sum += warp_sum[w][g] * weight;
      out += warp_out[w][g][d] * weight;
    }
    store_head<T>(args, seq, first_head + g, partition, kHeadSize, d, out, max_all, sum);
  }
}

// Rows staged in shared memory per round of decode_wide_kernel: 16 KiB of K (and of V), a power
// of two and a whole number of a warp's chunks.
template <int kRowBytes, int kChunkRows>
struct StageRows {
  static constexpr int kFit = 16384 / kRowBytes;
  static constexpr int kPow2 = kFit >= 32 ? 32 : kFit >= 16 ? 16 : kFit >= 8 ? 8 : 4;
  static constexpr int value = kPow2 > kChunkRows ? kPow2 : kChunkRows;
};

// Groups of more than kGroupTile heads (kWideGroupTile): one thread block per (partition, kv
// head, up to kWideMaxWarps tiles of heads), a warp per tile of 8 heads. The block stages each
// round of K/V rows in shared memory, every thread loading its share (consecutive threads,
// consecutive 16-byte vectors of the rows: whole sectors), and every warp reads the round there
// for its own heads; so each K/V byte of the kv head leaves global memory once for up to
// kWideMaxWarps * 8 heads (Falcon's and StarCoder's multi-query heads among them), where tiles in
// separate blocks would read it once per tile.
//
//   round:   [ rows staged by the whole block ] __syncthreads [ warp w: heads 8w .. 8w + 7 ]
template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kWideMaxThreads) decode_wide_kernel(const DecodeArgs args) {
  using Heads = WarpHeads<T, kHeadSize, kWideGroupTile>;
  using Layout = typename Heads::Layout;
  constexpr int kVec = Layout::kVec;
  constexpr int kNumVecs = Layout::kNumVecs;
  constexpr int kLaneElems = Layout::kLaneElems;
  constexpr int kVecsPerLane = Layout::kVecsPerLane;
  constexpr int kUnroll = Heads::kUnroll;
  constexpr int kChunkRows = Heads::kChunkRows;
  constexpr int kStageRows = StageRows<kHeadSize* static_cast<int>(sizeof(T)), kChunkRows>::value;
  __shared__ uint4 stage_k[kStageRows * kNumVecs];
  __shared__ uint4 stage_v[kStageRows * kNumVecs];

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y / args.num_head_chunks;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int first_in_group =
      ((blockIdx.y % args.num_head_chunks) * num_warps + warp) * kWideGroupTile;
  const int num_warp_heads = min(kWideGroupTile, args.group_size - first_in_group);  // may be <= 0
  const int first_head = kv_head * args.group_size + first_in_group;
  const int partition = blockIdx.x;
  int start, end;
  if (!partition_span(args, seq, partition, start, end)) return;  // the reduction skips it

  const int lane = threadIdx.x % kWarpSize;
  const int lane_in_row = lane % Layout::kRowLanes;  // which part of a row this lane holds
  const int row_in_step = lane / Layout::kRowLanes;  // which row of a step
  const bool lane_active = Layout::lane_active(lane_in_row);

  Heads heads;
  heads.start(args, seq, first_head, num_warp_heads, lane_in_row);

  const int32_t* table = args.block_tables + seq * args.block_table_stride;
  const int64_t in_block = static_cast<int64_t>(kv_head) * args.block_size * kHeadSize;
  const T* key_cache = static_cast<const T*>(args.key_cache);
  const T* value_cache = static_cast<const T*>(args.value_cache);

  for (int round = start; round < end; round += kStageRows) {
    const int rows = min(kStageRows, end - round);
#pragma unroll 4
    for (int index = threadIdx.x; index < rows * kNumVecs; index += blockDim.x) {
      const int token = round + index / kNumVecs;
      const int64_t block = table[token >> args.block_size_log2];
      const int64_t row =
          in_block + static_cast<int64_t>(token & (args.block_size - 1)) * kHeadSize;
      const int offset = (index % kNumVecs) * kVec;
      stage_k[index] = __ldg(
          reinterpret_cast<const uint4*>(key_cache + block * args.key_block_stride + row + offset));
      stage_v[index] = __ldg(reinterpret_cast<const uint4*>(
          value_cache + block * args.value_block_stride + row + offset));
    }
    __syncthreads();
    for (int chunk = 0; chunk < rows; chunk += kChunkRows) {
      uint4 k_raw[kUnroll][kVecsPerLane], v_raw[kUnroll][kVecsPerLane];
      bool valid[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int row = chunk + i * Layout::kRowsPerStep + row_in_step;
        valid[i] = row < rows;
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          const bool in_row = valid[i] && lane_active && Layout::has_vec(lane_in_row, v);
          const int index = row * kNumVecs + lane_in_row + v * kWarpSize;
          k_raw[i][v] = in_row ? stage_k[index] : make_uint4(0, 0, 0, 0);
          v_raw[i][v] = in_row ? stage_v[index] : make_uint4(0, 0, 0, 0);
        }
      }
      heads.attend(k_raw, v_raw, valid, args.soft_cap_log2);
    }
    __syncthreads();  // the next round overwrites the stage
  }
  heads.gather_lane_groups();

  // Each warp saw every row of the partition: its heads' results are its own.
  if (row_in_step == 0 && lane_active) {
#pragma unroll
    for (int g = 0; g < kWideGroupTile; ++g) {
      if (g >= num_warp_heads) break;
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) {
        if (Layout::has_vec(lane_in_row, e / kVec)) {
          store_head<T>(args, seq, first_head + g, partition, kHeadSize,
                        Layout::dim(lane_in_row, e), heads.acc[g][e], heads.m[g], heads.l[g]);
        }
      }
    }
  }
}

__device__ float block_reduce(float value, bool is_max, float* scratch) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, value, offset);
    value = is_max ? fmaxf(value, other) : value + other;
  }
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (threadIdx.x % kWarpSize == 0) scratch[warp] = value;
  __syncthreads();
  value = scratch[0];
  for (int w = 1; w < num_warps; ++w)
    value = is_max ? fmaxf(value, scratch[w]) : value + scratch[w];
  return value;
}

// Combines a sequence's partitions, one thread block per (head, sequence):
//   out = sum_p w_p * out_p / sum_p w_p,  w_p = sum_p * 2^(max_p - max_all)
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    decode_reduce_kernel(const DecodeArgs args, int head_size) {
  __shared__ float scratch[kReduceThreads / kWarpSize];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = args.seq_lens[seq];
  const int num_partitions =
      static_cast<int>(ceil_div(seq_len - window_start(args, seq_len), args.partition_size));
  const int64_t first = (static_cast<int64_t>(seq) * args.num_heads + head) * args.max_partitions;
  float local_max = -INFINITY;
  for (int p = threadIdx.x; p < num_partitions; p += blockDim.x) {
    local_max = fmaxf(local_max, args.partial_max[first + p]);
  }
  const bool has_sink = args.sinks != nullptr && num_partitions > 0;
  const float sink_log2 = has_sink ? args.sinks[head] * kLog2e : 0.0f;
  float max_all = block_reduce(local_max, true, scratch);
  if (has_sink) max_all = fmaxf(max_all, sink_log2);
  float local_sum = 0.0f;
  for (int p = threadIdx.x; p < num_partitions; p += blockDim.x) {
    local_sum += args.partial_sum[first + p] * exp2f(args.partial_max[first + p] - max_all);
  }
  float sum = block_reduce(local_sum, false, scratch);
  if (has_sink) sum += exp2f(sink_log2 - max_all);  // the sink's partition: exp-sum 1, output 0
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;  // seq_len 0: zeros
  T* out_row = static_cast<T*>(args.out) + seq * args.out_token_stride + head * head_size;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float out = 0.0f;
    for (int p = 0; p < num_partitions; ++p) {
      const float weight =
          args.partial_sum[first + p] * exp2f(args.partial_max[first + p] - max_all);
      out = fmaf(weight, args.partial_out[(first + p) * head_size + d], out);
    }
    out_row[d] = from_float<T>(out * inverse);
  }
}

int multiprocessor_count(int device) {
  static std::mutex mutex;
  static std::array<int, 64> counts{};
  if (device < 0 || device >= static_cast<int>(counts.size())) return 132;
  std::lock_guard<std::mutex> lock(mutex);
  if (counts[device] == 0) {
    check_cuda(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiProcessorCount)");
  }
  return counts[device];
}

// Query heads of one group a thread block takes: a tile of the plain kernel, or for groups above
// 8 the wide kernel's warps of 8 heads each.
int heads_per_block(int64_t group_size) {
  if (group_size > 8) {
    const int64_t warps = std::min<int64_t>(ceil_div(group_size, kWideGroupTile), kWideMaxWarps);
    return static_cast<int>(warps * kWideGroupTile);
  }
  return group_size == 1 ? 1 : group_size <= 4 ? 4 : 8;
}

template <typename T, int kHeadSize>
void launch_decode(const DecodeArgs& args, int group_tile, dim3 grid, cudaStream_t stream) {
  if (group_tile > 8) {
    const int threads = group_tile / kWideGroupTile * kWarpSize;
    decode_wide_kernel<T, kHeadSize><<<grid, threads, 0, stream>>>(args);
    return;
  }
  switch (group_tile) {
    case 1:
      decode_kernel<T, kHeadSize, 1><<<grid, kDecodeThreads, 0, stream>>>(args);
      break;
    case 4:
      decode_kernel<T, kHeadSize, 4><<<grid, kDecodeThreads, 0, stream>>>(args);
      break;
    default:
      decode_kernel<T, kHeadSize, 8><<<grid, kDecodeThreads, 0, stream>>>(args);
      break;
  }
}

}  // namespace

// The most positions one decode query attends to (the partitions' span).
int64_t max_attended_len(int64_t max_context_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::min(max_context_len, sliding_window) : max_context_len;
}

DecodePlan plan_paged_attention_decode(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_size, int64_t max_context_len,
                                       int64_t sliding_window, int64_t requested_partition_size,
                                       int device) {
  check_sliding_window(sliding_window);
  const int64_t attended_len = max_attended_len(max_context_len, sliding_window);
  int64_t partition_size = requested_partition_size;
  if (partition_size < 0) {
    // Split-K only pays when one pass leaves too few thread blocks to fill the SMs several
    // times over: the partitions' writes and the reduction launch cost a few microseconds.
    const int64_t group_size = num_heads / std::max<int64_t>(num_kv_heads, 1);
    const int64_t blocks =
        num_seqs * num_kv_heads * ceil_div(group_size, heads_per_block(group_size));
    const bool few_blocks = blocks < 32 * static_cast<int64_t>(multiprocessor_count(device));
    partition_size = attended_len > kDefaultPartitionSize && few_blocks ? kDefaultPartitionSize : 0;
  }
  if (partition_size == 0) return DecodePlan{0, 0};
  const int64_t num_partitions = ceil_div(std::max<int64_t>(attended_len, 1), partition_size);
  return DecodePlan{partition_size, num_seqs * num_heads * num_partitions * (head_size + 2)};
}

void paged_attention_decode(void* out, int64_t out_token_stride, const void* query,
                            int64_t query_token_stride, int64_t num_heads, float scale,
                            int64_t sliding_window, float logits_soft_cap, const float* sinks,
                            const PagedKVCache& cache, const BlockTables& tables,
                            int64_t partition_size, float* workspace, int64_t workspace_floats,
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
  if (partition_size < 0 || partition_size % cache.block_size != 0) {
    throw std::invalid_argument("partition_size must be 0 or a positive multiple of block_size " +
                                std::to_string(cache.block_size) + ", got " +
                                std::to_string(partition_size));
  }
  if (tables.num_seqs > 65535) {
    throw std::invalid_argument("num_seqs " + std::to_string(tables.num_seqs) +
                                " is above the kernel's limit of 65535 per call");
  }
  if (tables.num_seqs == 0) return;
  const int64_t attended_len =
      max_attended_len(tables.max_blocks_per_seq * cache.block_size, sliding_window);
  const int64_t num_partitions =
      partition_size > 0 ? ceil_div(std::max<int64_t>(attended_len, 1), partition_size) : 1;
  const int64_t needed =
      partition_size > 0 ? tables.num_seqs * num_heads * num_partitions * (cache.head_size + 2) : 0;
  if (workspace_floats < needed || (needed > 0 && workspace == nullptr)) {
    throw std::invalid_argument("the workspace holds " + std::to_string(workspace_floats) +
                                " floats; this call needs " + std::to_string(needed));
  }
  const int64_t group_size = num_heads / cache.num_kv_heads;
  const int group_tile = heads_per_block(group_size);
  const int64_t num_head_chunks = ceil_div(group_size, group_tile);
  if (cache.num_kv_heads * num_head_chunks > 65535) {
    throw std::invalid_argument("num_kv_heads " + std::to_string(cache.num_kv_heads) +
                                " is above the kernel's limit");
  }

  DecodeArgs args{};
  args.out = out;
  args.out_token_stride = out_token_stride;
  args.query = query;
  args.query_token_stride = query_token_stride;
  args.key_cache = cache.key_cache;
  args.value_cache = cache.value_cache;
  args.key_block_stride = cache.key_block_stride;
  args.value_block_stride = cache.value_block_stride;
  args.num_heads = static_cast<int>(num_heads);
  args.group_size = static_cast<int>(group_size);
  args.num_head_chunks = static_cast<int>(num_head_chunks);
  args.block_size = static_cast<int>(cache.block_size);
  args.block_size_log2 = log2_exact(cache.block_size);
  args.scale_log2 = scale * kLog2e;
  args.soft_cap_log2 = logits_soft_cap * kLog2e;
  args.sinks = sinks;
  args.block_tables = tables.block_tables;
  args.block_table_stride = tables.row_stride;
  args.seq_lens = tables.seq_lens;
  args.sliding_window = static_cast<int>(sliding_window);
  args.partition_size = static_cast<int>(partition_size);
  args.max_partitions = static_cast<int>(num_partitions);
  if (partition_size > 0) {
    const int64_t slots = tables.num_seqs * num_heads * num_partitions;
    args.partial_out = workspace;
    args.partial_max = workspace + slots * cache.head_size;
    args.partial_sum = args.partial_max + slots;
  }

  DeviceGuard guard(stream.device);
  const cudaStream_t cuda_stream = to_stream(stream);
  const dim3 grid(static_cast<unsigned>(num_partitions),
                  static_cast<unsigned>(cache.num_kv_heads * num_head_chunks),
                  static_cast<unsigned>(tables.num_seqs));
  dispatch_dtype(cache.dtype, [&](auto type) {
    using T = decltype(type);
    dispatch_head_size(cache.head_size, [&](auto head_size) {
      launch_decode<T, decltype(head_size)::value>(args, group_tile, grid, cuda_stream);
    });
    check_launch("paged_attention_decode kernel");
    if (partition_size > 0) {
      const dim3 reduce_grid(static_cast<unsigned>(num_heads),
                             static_cast<unsigned>(tables.num_seqs));
      decode_reduce_kernel<T><<<reduce_grid, kReduceThreads, 0, cuda_stream>>>(
          args, static_cast<int>(cache.head_size));
      check_launch("paged_attention_decode reduction kernel");
    }
  });
}

}  // namespace pagedserve::cuda
