// Paged attention kernels (decode and prefill), compiled once per ISA variant; see vec.h.
//
// Decode: one work item per sequence (or partition of one, split-K) over all its kv heads. The
// query heads of a GQA group share every K/V row load; logits are dot products summed
// horizontally kWidth positions at a time (a transposed reduction), then softmax, then one
// pass over V with the accumulators in registers.
//
// Prefill: one work item per (sequence, kv head, tile of query rows), where a row is one
// (query token, query head of the group) pair. The tile's rows sit in the SIMD lanes, so the
// per-row online softmax (running max, rescale, sum) is plain vertical vector math:
//
//   for each key block (block_size positions, up to the tile's last position):
//     S^T[key][rows] = K_block . Q^T          (Q^T [head_size][rows], pre-scaled)
//     soft-cap S^T (cap * tanh(S / cap), when the problem has a cap);
//     mask keys past each row's position (and before its sliding window);
//     m_new = max(m, max_key S); alpha = exp(m - m_new)
//     P^T = exp(S^T - m_new); l = l * alpha + sum_key P^T
//     O^T[d][rows] = O^T * alpha + sum_key V[key][d] * P^T[key][rows]
//   out[row] = O^T[:, row] / l[row]
#include "attention_kernels.h"

#include <omp.h>

#include <cfloat>
#include <type_traits>

#include "vec.h"

namespace pagedserve::cpu::PAGEDSERVE_ISA_NS {
namespace {

// Query rows one prefill tile holds, in vectors.
constexpr int kPrefillRowVecs = 4;

constexpr int64_t kAlignFloats = 16;  // 64 bytes: no two threads' scratch share a cache line
inline int64_t aligned(int64_t num_floats) { return round_up(num_floats, kAlignFloats); }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int largest_divisor_at_most(int n, int limit) {
  for (int d = limit; d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

// Register blocking of the prefill micro-kernels for `row_vecs` vectors of query rows: the
// accumulators (block x row_vecs), the row vectors and one broadcast fit the register file.
constexpr int qk_keys_per_step(int row_vecs) {
  const int block = (VecF::kNumRegisters - row_vecs - 2) / row_vecs;
  return block > 8 ? 8 : (block < 1 ? 1 : block);
}
constexpr int pv_dims_per_step(int row_vecs) {  // a power of two: head sizes are multiples of 8
  const int block = (VecF::kNumRegisters - row_vecs - 2) / row_vecs;
  return block >= 8 ? 8 : (block >= 4 ? 4 : (block >= 2 ? 2 : 1));
}

// One (sequence, kv head)'s rows of the paged cache.
template <typename T, int D>
struct KVRows {
  const T* key_base;    // key_cache + kv_head * block_size * D
  const T* value_base;  // value_cache + kv_head * block_size * D
  int64_t key_block_stride;
  int64_t value_block_stride;
  const int32_t* block_table;  // [max_blocks_per_seq], the sequence's row
  int block_shift;             // log2(block_size)
  int64_t offset_mask;         // block_size - 1

  const T* key_block(int64_t block_index) const {
    return key_base + static_cast<int64_t>(block_table[block_index]) * key_block_stride;
  }
  const T* value_block(int64_t block_index) const {
    return value_base + static_cast<int64_t>(block_table[block_index]) * value_block_stride;
  }
};

template <typename T, int D>
KVRows<T, D> kv_rows(const AttentionProblem& p, int64_t seq, int64_t kv_head) {
  const PagedKVCache& c = p.cache;
  int shift = 0;
  while ((int64_t{1} << shift) < c.block_size) ++shift;
  const int64_t head_offset = kv_head * c.block_size * D;
  return KVRows<T, D>{static_cast<const T*>(c.key_cache) + head_offset,
                      static_cast<const T*>(c.value_cache) + head_offset,
                      c.key_block_stride,
                      c.value_block_stride,
                      p.tables.block_tables + seq * p.tables.row_stride,
                      shift,
                      c.block_size - 1};
}

template <typename T, int D>
void store_zero_rows(T* dst, int num_rows) {
  for (int i = 0; i < num_rows * D; i += kWidth) VecF::zero().store(dst + i);
}

// --- decode ------------------------------------------------------------------------------
//
// One work item is a sequence (or one partition of it) with all its kv heads: a block's rows
// of all heads are one contiguous chunk, [num_kv_heads][block_size][D], and longer contiguous
// reads make better use of memory than one head's rows at a time.

// Per-thread scratch of attend_range for num_q = num_kv_heads * group query rows over at most
// max_positions.
struct DecodeScratch {
  float* q;        // [num_q][D]
  float* acc;      // [num_q][D]
  float* partial;  // [group][kWidth][kWidth]
  float* logits;   // [num_q][round_up(max_positions, kWidth)]
  float* row_max;  // [num_q]
  float* row_sum;  // [num_q]

  static int64_t floats(int64_t num_q, int64_t group, int64_t head_size, int64_t max_positions) {
    return 2 * aligned(num_q * head_size) + aligned(group * kWidth * kWidth) +
           aligned(num_q * round_up(max_positions, kWidth)) + 2 * aligned(num_q);
  }
  static DecodeScratch carve(float* base, int64_t num_q, int64_t group, int64_t head_size,
                             int64_t max_positions) {
    DecodeScratch s;
    s.q = base;
    s.acc = s.q + aligned(num_q * head_size);
    s.partial = s.acc + aligned(num_q * head_size);
    s.logits = s.partial + aligned(group * kWidth * kWidth);
    s.row_max = s.logits + aligned(num_q * round_up(max_positions, kWidth));
    s.row_sum = s.row_max + aligned(num_q);
    return s;
  }
};

inline void prefetch_to_l1(const void* start, int64_t num_bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < num_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Walks one cache's blocks at consecutive positions of a sequence and returns, per position,
// its row in kv head 0's part of the block (head h's row is head_stride further). The blocks
// are scattered, so the hardware prefetcher cannot guess the next one: each position
// prefetches its 1/block_size share of the block kAheadBytes ahead into L1 and, optionally, of
// the current block of a companion cache (V while walking K) into L2.
template <typename T, int D>
struct BlockWalker {
  static constexpr int64_t kAheadBytes = 16384;
  const T* base;
  int64_t block_stride;
  const int32_t* block_table;
  int block_shift;
  int64_t offset_mask;
  int64_t end;
  const T* companion_base;  // nullptr: none
  int64_t companion_block_stride;
  int64_t num_kv_heads;
  int64_t share_bytes;  // one position's share of a block: num_kv_heads rows
  int64_t block_bytes;  // all kv heads' rows of one block
  int64_t ahead_blocks;
  const T* block = nullptr;
  const char* ahead = nullptr;
  const char* companion = nullptr;

  BlockWalker(const T* base_, int64_t block_stride_, const KVRows<T, D>& kv, int64_t kv_heads,
              int64_t end_, const T* companion_base_, int64_t companion_block_stride_)
      : base(base_),
        block_stride(block_stride_),
        block_table(kv.block_table),
        block_shift(kv.block_shift),
        offset_mask(kv.offset_mask),
        end(end_),
        companion_base(companion_base_),
        companion_block_stride(companion_block_stride_),
        num_kv_heads(kv_heads),
        share_bytes(kv_heads * D * static_cast<int64_t>(sizeof(T))),
        block_bytes(share_bytes * (offset_mask + 1)),
        ahead_blocks(max_i64(1, kAheadBytes / block_bytes)) {}

  const T* block_start(int64_t index) const {
    return base + static_cast<int64_t>(block_table[index]) * block_stride;
  }

  // Prefetches the offset-th 1/block_size share of a block, one head's row size at a time
  // (a compile-time count of lines, so the loop unrolls).
  template <int kLocality>
  void prefetch_share(const char* block_bytes_start, int64_t offset) const {
    constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
    const char* p = block_bytes_start + offset * share_bytes;
    for (int64_t h = 0; h < num_kv_heads; ++h, p += kRowBytes) {
      for (int b = 0; b < kRowBytes; b += 64) __builtin_prefetch(p + b, 0, kLocality);
    }
  }

  // Position is the previous call's position + 1, or any position on the first call.
  const T* next(int64_t position) {
    const int64_t index = position >> block_shift;
    const int64_t offset = position & offset_mask;
    if (block == nullptr) {  // request what the steady state would already have requested
      for (int64_t b = index; b < index + ahead_blocks && (b << block_shift) < end; ++b) {
        prefetch_to_l1(block_start(b), block_bytes);
      }
    }
    if (block == nullptr || offset == 0) {
      block = block_start(index);
      const int64_t ahead_index = index + ahead_blocks;
      ahead = (ahead_index << block_shift) < end
                  ? reinterpret_cast<const char*>(block_start(ahead_index))
                  : nullptr;
      companion = companion_base == nullptr
                      ? nullptr
                      : reinterpret_cast<const char*>(companion_base +
                                                      static_cast<int64_t>(block_table[index]) *
                                                          companion_block_stride);
    }
    if (ahead != nullptr) prefetch_share<3>(ahead, offset);
    if (companion != nullptr) prefetch_share<2>(companion, offset);
    return block + offset * D;
  }
};

// q . k over kN vectors, as one vector whose lanes still need summing.
template <int kN>
inline VecF dot(const float* q, const VecF* k) {
  if constexpr (kN <= 4) {
    VecF s = VecF::load(q) * k[0];
    for (int j = 1; j < kN; ++j) s = fma(VecF::load(q + j * kWidth), k[j], s);
    return s;
  } else {
    VecF s0 = VecF::load(q) * k[0];
    VecF s1 = VecF::load(q + kWidth) * k[1];
    for (int j = 2; j + 1 < kN; j += 2) {
      s0 = fma(VecF::load(q + j * kWidth), k[j], s0);
      s1 = fma(VecF::load(q + (j + 1) * kWidth), k[j + 1], s1);
    }
    if (kN % 2 == 1) s0 = fma(VecF::load(q + (kN - 1) * kWidth), k[kN - 1], s0);
    return s0 + s1;
  }
}

// T: the activations (query, out); C: the cache's elements (T, Float8E5M2 or Float8E4M3).
template <typename T, typename C, int D>
struct Decode {
  static constexpr int kVecs = D / kWidth;
  // K/V row vectors held in registers at once (the rest of the file leaves room for the
  // accumulators).
  static constexpr int kRowChunk = largest_divisor_at_most(kVecs, VecF::kNumRegisters / 2);
  static constexpr int kMaxRowsPerStep = 8;
  static constexpr int kVPositions = 32;
  // Vectors [0, kPaired) of a row load in pairs (interleaved order for a bf16 cache, see vec.h);
  // an odd last vector loads alone. q, acc and out rows use the cache's order.
  static constexpr int kPaired = kVecs / 2 * 2;
  static constexpr bool kPairs = kInterleaved<C>;  // then C is T (bf16)

  // Vectors [first, first + kCount) of a row (a cache row, or a query row), in storage order.
  template <int kCount, typename U>
  static void load_vecs(const U* row, int first, VecF* out) {
    if constexpr (!kPairs) {
      for (int i = 0; i < kCount; ++i) out[i] = VecF::load(row + (first + i) * kWidth);
    } else {
      for (int i = 0; i < kCount;) {
        const int j = first + i;
        if (j % 2 == 0 && i + 1 < kCount && j + 1 < kPaired) {
          load_pair(row + j * kWidth, out[i], out[i + 1]);
          i += 2;
        } else if (j < kPaired) {  // half a pair: rare register-blocking shapes only
          VecF a, b;
          load_pair(row + (j & ~1) * kWidth, a, b);
          out[i++] = j % 2 == 0 ? a : b;
        } else {
          out[i++] = VecF::load(row + j * kWidth);
        }
      }
    }
  }

  // row = src * scale for one row of D floats in storage order.
  static void store_row(const float* src, float scale, T* row) {
    const VecF s = VecF::broadcast(scale);
    if constexpr (kPairs) {
      for (int j = 0; j < kPaired; j += 2) {
        store_pair(row + j * kWidth, VecF::load(src + j * kWidth) * s,
                   VecF::load(src + (j + 1) * kWidth) * s);
      }
      if (kPaired < kVecs) (VecF::load(src + kPaired * kWidth) * s).store(row + kPaired * kWidth);
    } else {
      for (int j = 0; j < kVecs; ++j) (VecF::load(src + j * kWidth) * s).store(row + j * kWidth);
    }
  }

  // dst = src * scale for num_rows rows, into storage order.
  static void load_scaled_rows(const T* src, int num_rows, float scale, float* dst) {
    const VecF s = VecF::broadcast(scale);
    for (int r = 0; r < num_rows; ++r) {
      VecF v[kVecs];
      load_vecs<kVecs>(src + r * D, 0, v);
      for (int j = 0; j < kVecs; ++j) (v[j] * s).store(dst + r * D + j * kWidth);
    }
  }

  // Unnormalized attention of one sequence's query rows ws.q ([num_kv_heads][group][D], fp32,
  // pre-scaled) over its cache positions [begin, end), end > begin. With row r = h * group + g
  // attending to kv head h:
  //   s[r][t] = q[r] . k[h][t] (then cap * tanh(s / cap) with a logits_soft_cap > 0),
  //   row_max[r] = max_t s[r][t],
  //   row_sum[r] = sum_t exp(s[r][t] - row_max[r]),
  //   acc[r] = sum_t exp(s[r][t] - row_max[r]) v[h][t]
  // The query rows of a kv head share every K/V row load.
  static void attend_range(const DecodeScratch& ws, int num_kv_heads, int group,
                           const KVRows<C, D>& kv, int64_t begin, int64_t end,
                           float logits_soft_cap) {
    const int64_t n = end - begin;
    const int64_t n_pad = round_up(n, kWidth);
    const int num_q = num_kv_heads * group;
    const int64_t head_stride = (kv.offset_mask + 1) * D;
    float* const partial = ws.partial;
    const C* rows[kVPositions];
    static_assert(kVPositions >= kWidth, "rows[] holds a K chunk too");

    // K pass: kWidth positions at a time, so kWidth horizontal sums become one transposed one.
    BlockWalker<C, D> keys(kv.key_base, kv.key_block_stride, kv, num_kv_heads, end, kv.value_base,
                           kv.value_block_stride);
    for (int64_t c0 = 0; c0 < n; c0 += kWidth) {
      const int count = static_cast<int>(min_i64(kWidth, n - c0));
      for (int i = 0; i < count; ++i) rows[i] = keys.next(begin + c0 + i);
      for (int h = 0; h < num_kv_heads; ++h) {
        const float* q = ws.q + h * group * D;
        for (int i = 0; i < count; ++i) {
          const C* row = rows[i] + h * head_stride;
          for (int c = 0; c < kVecs; c += kRowChunk) {
            VecF k[kRowChunk];
            load_vecs<kRowChunk>(row, c, k);
            for (int g = 0; g < group; ++g) {
              const VecF s = dot<kRowChunk>(q + g * D + c * kWidth, k);
              float* dst = partial + (g * kWidth + i) * kWidth;
              (c == 0 ? s : VecF::load(dst) + s).store(dst);
            }
          }
        }
        // Lanes past `count` reduce stale scratch; they are overwritten with -inf below.
        for (int g = 0; g < group; ++g) {
          VecF parts[kWidth];
          for (int i = 0; i < kWidth; ++i) {
            parts[i] = VecF::load(partial + (g * kWidth + i) * kWidth);
          }
          reduce_add_transposed(parts).store(ws.logits + (h * group + g) * n_pad + c0);
        }
      }
    }
    for (int r = 0; r < num_q; ++r) {
      float* logits = ws.logits + r * n_pad;
      if (logits_soft_cap > 0.0f) {  // before the padding lanes become -inf (a capped -inf: -cap)
        const VecF cap = VecF::broadcast(logits_soft_cap);
        for (int64_t i = 0; i < n_pad; i += kWidth) {
          soft_cap(VecF::load(logits + i), cap).store(logits + i);
        }
      }
      for (int64_t i = n; i < n_pad; ++i) logits[i] = -INFINITY;
      VecF m = VecF::broadcast(-INFINITY);
      for (int64_t i = 0; i < n_pad; i += kWidth) m = max(m, VecF::load(logits + i));
      const float row_max = m.reduce_max();
      const VecF mv = VecF::broadcast(row_max);
      VecF sum = VecF::zero();
      for (int64_t i = 0; i < n_pad; i += kWidth) {
        const VecF e = exp_nonpositive(VecF::load(logits + i) - mv);
        e.store(logits + i);
        sum = sum + e;
      }
      ws.row_max[r] = row_max;
      ws.row_sum[r] = sum.reduce_add();
    }

    // V pass, kVPositions positions at a time (they stay in L1 while the accumulators sweep
    // over the head dim), at most kMaxRowsPerStep query rows at a time.
    for (int i = 0; i < num_q * D; i += kWidth) VecF::zero().store(ws.acc + i);
    BlockWalker<C, D> values(kv.value_base, kv.value_block_stride, kv, num_kv_heads, end, nullptr,
                             0);
    for (int64_t i0 = 0; i0 < n; i0 += kVPositions) {
      const int count = static_cast<int>(min_i64(kVPositions, n - i0));
      for (int i = 0; i < count; ++i) rows[i] = values.next(begin + i0 + i);
      for (int h = 0; h < num_kv_heads; ++h) {
        for (int g0 = 0; g0 < group; g0 += kMaxRowsPerStep) {
          const int r0 = h * group + g0;
          const float* weights = ws.logits + r0 * n_pad + i0;
          float* acc = ws.acc + r0 * D;
          const int64_t offset = h * head_stride;
          switch (group - g0 < kMaxRowsPerStep ? group - g0 : kMaxRowsPerStep) {
            case 1:
              pv_sweep<1>(weights, n_pad, rows, offset, count, acc);
              break;
            case 2:
              pv_sweep<2>(weights, n_pad, rows, offset, count, acc);
              break;
            case 3:
              pv_sweep<3>(weights, n_pad, rows, offset, count, acc);
              break;
            case 4:
              pv_sweep<4>(weights, n_pad, rows, offset, count, acc);
              break;
            case 5:
              pv_sweep<5>(weights, n_pad, rows, offset, count, acc);
              break;
            case 6:
              pv_sweep<6>(weights, n_pad, rows, offset, count, acc);
              break;
            case 7:
              pv_sweep<7>(weights, n_pad, rows, offset, count, acc);
              break;
            default:
              pv_sweep<8>(weights, n_pad, rows, offset, count, acc);
              break;
          }
        }
      }
    }
  }

  // acc[q] += sum_i weights[q][i] * (rows[i] + offset) for kRows query rows (weights row stride
  // weights_stride), kCols head-dim vectors of accumulators in registers at a time.
  template <int kRows>
  static void pv_sweep(const float* weights, int64_t weights_stride, const C* const* rows,
                       int64_t offset, int count, float* acc) {
    constexpr int kCols = largest_divisor_at_most(kVecs, (VecF::kNumRegisters - 2) / (kRows + 1));
    for (int c = 0; c < kVecs; c += kCols) {
      VecF a[kRows][kCols];
      for (int q = 0; q < kRows; ++q) {
        for (int j = 0; j < kCols; ++j) a[q][j] = VecF::load(acc + q * D + (c + j) * kWidth);
      }
      for (int i = 0; i < count; ++i) {
        const C* row = rows[i] + offset;
        VecF v[kCols];
        load_vecs<kCols>(row, c, v);
        for (int q = 0; q < kRows; ++q) {
          const VecF w = VecF::broadcast(weights[q * weights_stride + i]);
          for (int j = 0; j < kCols; ++j) a[q][j] = fma(w, v[j], a[q][j]);
        }
      }
      for (int q = 0; q < kRows; ++q) {
        for (int j = 0; j < kCols; ++j) a[q][j].store(acc + q * D + (c + j) * kWidth);
      }
    }
  }

  // out[r] = acc[r] / row_sum[r] for the num_q rows (query head r), with head r's sink in the
  // softmax when there are sinks.
  static void store_normalized(const DecodeScratch& ws, int num_q, const float* sinks, T* out) {
    for (int r = 0; r < num_q; ++r) {
      store_row(ws.acc + r * D, output_factor(ws.row_max[r], ws.row_sum[r], sinks, r), out + r * D);
    }
  }

  // Attention of all query heads of one sequence's last token over its window (the whole
  // context without one).
  static void attend_sequence(const AttentionProblem& p, const DecodeScratch& ws, int64_t seq,
                              const T* query_row, T* out_row) {
    const int num_heads = static_cast<int>(p.num_heads);
    const int num_kv_heads = static_cast<int>(p.cache.num_kv_heads);
    const int64_t seq_len = p.tables.seq_lens[seq];
    if (seq_len == 0) {
      store_zero_rows<T, D>(out_row, num_heads);
      return;
    }
    load_scaled_rows(query_row, num_heads, p.scale, ws.q);
    attend_range(ws, num_kv_heads, num_heads / num_kv_heads, kv_rows<C, D>(p, seq, 0),
                 window_begin(p, seq_len - 1), seq_len, p.logits_soft_cap);
    store_normalized(ws, num_heads, p.sinks, out_row);
  }

  static int64_t scratch_floats(const AttentionProblem& p, int64_t max_positions) {
    return aligned(
        DecodeScratch::floats(p.num_heads, p.num_heads / p.cache.num_kv_heads, D, max_positions));
  }

  static DecodeScratch carve(const AttentionProblem& p, float* base, int64_t max_positions) {
    return DecodeScratch::carve(base, p.num_heads, p.num_heads / p.cache.num_kv_heads, D,
                                max_positions);
  }

  static int64_t workspace_floats(const AttentionProblem& p, int64_t partition_size) {
    const int64_t positions = partition_size > 0 ? partition_size : p.max_attended_len;
    int64_t floats = scratch_floats(p, positions) * p.num_threads;
    if (partition_size > 0) {
      const int64_t num_parts = ceil_div(p.max_attended_len, partition_size);
      const int64_t rows = p.tables.num_seqs * p.num_heads * num_parts;
      floats += aligned(rows * D) + 2 * aligned(rows);
    }
    return floats;
  }

  static void run(const AttentionProblem& p, int64_t partition_size, float* workspace) {
    const int64_t num_seqs = p.tables.num_seqs;
    const int64_t num_heads = p.num_heads;
    const int num_kv_heads = static_cast<int>(p.cache.num_kv_heads);
    const int group = static_cast<int>(num_heads / num_kv_heads);
    const int64_t positions = partition_size > 0 ? partition_size : p.max_attended_len;
    const int64_t num_parts = partition_size > 0 ? ceil_div(p.max_attended_len, partition_size) : 1;
    const int64_t per_thread = scratch_floats(p, positions);
    // Partition results: rows [num_seqs][num_parts][num_heads] (of D floats for part_out).
    const int64_t part_rows = num_seqs * num_parts * num_heads;
    float* part_out = workspace + per_thread * p.num_threads;
    float* part_max = part_out + aligned(part_rows * D);
    float* part_sum = part_max + aligned(part_rows);
    const T* query = static_cast<const T*>(p.query);
    T* out = static_cast<T*>(p.out);
    const int64_t num_items = num_seqs * num_parts;

#pragma omp parallel num_threads(p.num_threads)
    {
      const DecodeScratch ws = carve(p, workspace + per_thread * omp_get_thread_num(), positions);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < num_items; ++item) {
        const int64_t part = item % num_parts;
        const int64_t seq = item / num_parts;
        const T* query_row = query + seq * p.query_token_stride;
        if (partition_size == 0) {
          attend_sequence(p, ws, seq, query_row, out + seq * p.out_token_stride);
          continue;
        }
        // Partitions count from the window's first position: none lies wholly before it.
        const int64_t seq_len = p.tables.seq_lens[seq];
        const int64_t begin =
            (seq_len > 0 ? window_begin(p, seq_len - 1) : 0) + part * partition_size;
        const int64_t end = min_i64(seq_len, begin + partition_size);
        if (begin >= end) continue;
        load_scaled_rows(query_row, static_cast<int>(num_heads), p.scale, ws.q);
        attend_range(ws, num_kv_heads, group, kv_rows<C, D>(p, seq, 0), begin, end,
                     p.logits_soft_cap);
        const int64_t first_row = (seq * num_parts + part) * num_heads;
        for (int64_t r = 0; r < num_heads; ++r) {
          for (int i = 0; i < D; i += kWidth) {
            VecF::load(ws.acc + r * D + i).store(part_out + (first_row + r) * D + i);
          }
          part_max[first_row + r] = ws.row_max[r];
          part_sum[first_row + r] = ws.row_sum[r];
        }
      }
      if (partition_size > 0) {
        // Reduction: rescale each partition by exp(its max - the global max) and normalize.
#pragma omp for schedule(static)
        for (int64_t seq_head = 0; seq_head < num_seqs * num_heads; ++seq_head) {
          const int64_t seq = seq_head / num_heads;
          const int64_t head = seq_head % num_heads;
          T* out_row = out + seq * p.out_token_stride + head * D;
          const int64_t seq_len = p.tables.seq_lens[seq];
          const int64_t attended = seq_len > 0 ? seq_len - window_begin(p, seq_len - 1) : 0;
          const int64_t parts = ceil_div(attended, partition_size);
          if (parts == 0) {
            store_zero_rows<T, D>(out_row, 1);
            continue;
          }
          const int64_t first_row = seq * num_parts * num_heads + head;
          float global_max = -INFINITY;
          for (int64_t q = 0; q < parts; ++q) {
            const float m = part_max[first_row + q * num_heads];
            global_max = m > global_max ? m : global_max;
          }
          // A sink joins the softmax as one more partition: max sink, exp-sum 1, output 0.
          if (p.sinks != nullptr && p.sinks[head] > global_max) global_max = p.sinks[head];
          float total = p.sinks == nullptr ? 0.0f : std::exp(p.sinks[head] - global_max);
          for (int i = 0; i < D; i += kWidth) VecF::zero().store(ws.acc + i);
          for (int64_t q = 0; q < parts; ++q) {
            const int64_t row = first_row + q * num_heads;
            const float weight = std::exp(part_max[row] - global_max);
            total += weight * part_sum[row];
            const VecF w = VecF::broadcast(weight);
            for (int i = 0; i < D; i += kWidth) {
              fma(w, VecF::load(part_out + row * D + i), VecF::load(ws.acc + i)).store(ws.acc + i);
            }
          }
          store_row(ws.acc, 1.0f / total, out_row);
        }
      }
    }
  }
};

// --- prefill -----------------------------------------------------------------------------

template <typename T, typename C, int D>
struct Prefill {
  static constexpr int kRowsPerTile = kPrefillRowVecs * kWidth;

  static int64_t tile_floats(int64_t block_size) {
    const int64_t rows = kRowsPerTile;
    return 2 * aligned(D * rows) + aligned(block_size * rows) + 2 * aligned(block_size * D) +
           4 * aligned(rows);
  }

  static int64_t scratch_floats(const AttentionProblem& p) {
    return aligned(max_i64(tile_floats(p.cache.block_size),
                           Decode<T, C, D>::scratch_floats(p, p.max_attended_len)));
  }

  // A block's rows [num_keys][D] as fp32: the cache itself for fp32, else converted into dst.
  static const float* rows_as_float(const C* src, int num_keys, float* dst) {
    if constexpr (std::is_same_v<C, float>) {
      return src;
    } else {
      for (int i = 0; i < num_keys * D; i += kWidth) VecF::load(src + i).store(dst + i);
      return dst;
    }
  }

  // s[key][rows] = sum_d k[key][d] * qT[d][rows] for kKeys keys.
  template <int kRowVecs, int kKeys>
  static void qk_step(const float* qT, const float* k, float* s) {
    constexpr int kRows = kRowVecs * kWidth;
    VecF acc[kKeys][kRowVecs];
    for (int c = 0; c < kKeys; ++c) {
      for (int r = 0; r < kRowVecs; ++r) acc[c][r] = VecF::zero();
    }
    for (int d = 0; d < D; ++d) {
      VecF q[kRowVecs];
      for (int r = 0; r < kRowVecs; ++r) q[r] = VecF::load(qT + d * kRows + r * kWidth);
      for (int c = 0; c < kKeys; ++c) {
        const VecF kb = VecF::broadcast(k[c * D + d]);
        for (int r = 0; r < kRowVecs; ++r) acc[c][r] = fma(kb, q[r], acc[c][r]);
      }
    }
    for (int c = 0; c < kKeys; ++c) {
      for (int r = 0; r < kRowVecs; ++r) acc[c][r].store(s + c * kRows + r * kWidth);
    }
  }

  // oT[d0 + i][rows] = oT[d0 + i][rows] * alpha[rows] + sum_key v[key][d0 + i] * prob[key][rows]
  // for kDims dims.
  template <int kRowVecs, int kDims>
  static void pv_step(const float* prob, const float* v, int num_keys, const VecF* alpha, float* oT,
                      int d0) {
    constexpr int kRows = kRowVecs * kWidth;
    VecF acc[kDims][kRowVecs];
    for (int i = 0; i < kDims; ++i) {
      for (int r = 0; r < kRowVecs; ++r) {
        acc[i][r] = VecF::load(oT + (d0 + i) * kRows + r * kWidth) * alpha[r];
      }
    }
    for (int c = 0; c < num_keys; ++c) {
      VecF pr[kRowVecs];
      for (int r = 0; r < kRowVecs; ++r) pr[r] = VecF::load(prob + c * kRows + r * kWidth);
      for (int i = 0; i < kDims; ++i) {
        const VecF vb = VecF::broadcast(v[c * D + d0 + i]);
        for (int r = 0; r < kRowVecs; ++r) acc[i][r] = fma(vb, pr[r], acc[i][r]);
      }
    }
    for (int i = 0; i < kDims; ++i) {
      for (int r = 0; r < kRowVecs; ++r) acc[i][r].store(oT + (d0 + i) * kRows + r * kWidth);
    }
  }

  // One tile: query rows [item.row_begin, item.row_end) of a sequence with q_len >= 2.
  template <int kRowVecs>
  static void tile(const AttentionProblem& p, const PrefillItem& item, int64_t q_start,
                   int64_t q_len, float* scratch) {
    constexpr int kRows = kRowVecs * kWidth;
    constexpr int kKeys = qk_keys_per_step(kRowVecs);
    constexpr int kDims = pv_dims_per_step(kRowVecs);
    const int64_t block_size = p.cache.block_size;
    const int64_t group = p.num_heads / p.cache.num_kv_heads;
    const int64_t context = p.tables.seq_lens[item.seq] - q_len;
    const int rows = item.row_end - item.row_begin;

    float* qT = scratch;                          // [D][kRows]
    float* oT = qT + aligned(D * kRows);          // [D][kRows]
    float* s = oT + aligned(D * kRows);           // [block_size][kRows]
    float* kf = s + aligned(block_size * kRows);  // [block_size][D]
    float* vf = kf + aligned(block_size * D);     // [block_size][D]
    float* pos = vf + aligned(block_size * D);    // [kRows] position of each row
    float* first = pos + aligned(kRows);          // [kRows] first position in its window
    float* m = first + aligned(kRows);            // [kRows] running max
    float* l = m + aligned(kRows);                // [kRows] running exp-sum

    // The tile's rows are (token, head) pairs of the kv head's group, token-major.
    const T* query = static_cast<const T*>(p.query);
    T* out = static_cast<T*>(p.out);
    const T* query_rows[kRows];
    T* out_rows[kRows];
    int64_t min_pos = INT64_MAX, max_pos = 0;
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) {
        const int64_t row = item.row_begin + r;
        const int64_t j = row / group;
        const int64_t head = item.kv_head * group + row % group;
        query_rows[r] = query + (q_start + j) * p.query_token_stride + head * D;
        out_rows[r] = out + (q_start + j) * p.out_token_stride + head * D;
        pos[r] = static_cast<float>(context + j);
        first[r] = static_cast<float>(window_begin(p, context + j));
        min_pos = min_i64(min_pos, context + j);
        max_pos = max_i64(max_pos, context + j);
      } else {  // padding lane: zero query, sees every key, never written out
        query_rows[r] = nullptr;
        pos[r] = FLT_MAX;
        first[r] = -FLT_MAX;
      }
    }
    // qT = scaled query rows, transposed kWidth x kWidth at a time.
    const VecF scale = VecF::broadcast(p.scale);
    for (int r0 = 0; r0 < kRows; r0 += kWidth) {
      for (int d0 = 0; d0 < D; d0 += kWidth) {
        VecF v[kWidth];
        for (int i = 0; i < kWidth; ++i) {
          const T* q = query_rows[r0 + i];
          v[i] = q == nullptr ? VecF::zero() : VecF::load(q + d0) * scale;
        }
        transpose(v);
        for (int i = 0; i < kWidth; ++i) v[i].store(qT + (d0 + i) * kRows + r0);
      }
    }
    for (int i = 0; i < D * kRows; i += kWidth) VecF::zero().store(oT + i);
    for (int r = 0; r < kRows; r += kWidth) {
      VecF::broadcast(-INFINITY).store(m + r);
      VecF::zero().store(l + r);
    }

    const KVRows<C, D> kv = kv_rows<C, D>(p, item.seq, item.kv_head);
    const int64_t num_positions = max_pos + 1;
    // Keys before every row's window are never read; keys before some row's window are masked.
    const int64_t first_block_pos = window_begin(p, min_pos) / block_size * block_size;
    const int64_t all_rows_first = window_begin(p, max_pos);
    const int64_t block_bytes = block_size * D * static_cast<int64_t>(sizeof(C));
    for (int64_t b0 = first_block_pos; b0 < num_positions; b0 += block_size) {
      const int num_keys = static_cast<int>(min_i64(block_size, num_positions - b0));
      if (b0 + block_size < num_positions) {  // the next block is elsewhere: request it now
        prefetch_to_l1(kv.key_block(b0 / block_size + 1), block_bytes);
        prefetch_to_l1(kv.value_block(b0 / block_size + 1), block_bytes);
      }
      const float* k = rows_as_float(kv.key_block(b0 / block_size), num_keys, kf);
      int c = 0;
      for (; c + kKeys <= num_keys; c += kKeys)
        qk_step<kRowVecs, kKeys>(qT, k + c * D, s + c * kRows);
      for (; c < num_keys; ++c) qk_step<kRowVecs, 1>(qT, k + c * D, s + c * kRows);
      if (p.logits_soft_cap > 0.0f) {  // before the masks: a capped -inf would be -cap
        const VecF cap = VecF::broadcast(p.logits_soft_cap);
        for (int i = 0; i < num_keys * kRows; i += kWidth) {
          soft_cap(VecF::load(s + i), cap).store(s + i);
        }
      }
      for (c = 0; c < num_keys; ++c) {
        const int64_t key_pos = b0 + c;
        const bool future_for_some = key_pos > min_pos;
        const bool before_some_window = key_pos < all_rows_first;
        if (!future_for_some && !before_some_window) continue;
        for (int r = 0; r < kRows; r += kWidth) {
          VecF logits = VecF::load(s + c * kRows + r);
          if (future_for_some) {
            logits = logits.mask_future(VecF::load(pos + r), static_cast<float>(key_pos));
          }
          if (before_some_window) {
            logits = logits.mask_before(VecF::load(first + r), static_cast<float>(key_pos));
          }
          logits.store(s + c * kRows + r);
        }
      }
      VecF alpha[kRowVecs];
      for (int rv = 0; rv < kRowVecs; ++rv) {
        const int r = rv * kWidth;
        VecF block_max = VecF::load(s + r);
        for (c = 1; c < num_keys; ++c) block_max = max(block_max, VecF::load(s + c * kRows + r));
        const VecF m_old = VecF::load(m + r);
        const VecF m_new = max(m_old, block_max);
        alpha[rv] = exp_nonpositive(m_old - m_new);
        VecF sum = VecF::zero();
        for (c = 0; c < num_keys; ++c) {
          const VecF e = exp_nonpositive(VecF::load(s + c * kRows + r) - m_new);
          e.store(s + c * kRows + r);
          sum = sum + e;
        }
        fma(VecF::load(l + r), alpha[rv], sum).store(l + r);
        m_new.store(m + r);
      }
      const float* v = rows_as_float(kv.value_block(b0 / block_size), num_keys, vf);
      for (int d0 = 0; d0 < D; d0 += kDims) pv_step<kRowVecs, kDims>(s, v, num_keys, alpha, oT, d0);
    }

    // l becomes each row's output factor (1 / l without sinks); padding lanes get 0.
    for (int r = 0; r < kRows; ++r) {
      l[r] = r < rows ? output_factor(m[r], l[r], p.sinks,
                                      item.kv_head * group + (item.row_begin + r) % group)
                      : 0.0f;
    }
    // out rows = O^T * factor, transposed back kWidth x kWidth at a time.
    for (int r0 = 0; r0 < rows; r0 += kWidth) {
      const VecF inv = VecF::load(l + r0);
      for (int d0 = 0; d0 < D; d0 += kWidth) {
        VecF v[kWidth];
        for (int i = 0; i < kWidth; ++i) v[i] = VecF::load(oT + (d0 + i) * kRows + r0) * inv;
        transpose(v);
        for (int i = 0; i < kWidth && r0 + i < rows; ++i) v[i].store(out_rows[r0 + i] + d0);
      }
    }
  }

  static void run(const AttentionProblem& p, const int32_t* query_start_loc,
                  const PrefillItem* items, int64_t num_items, float* workspace) {
    const int64_t per_thread = scratch_floats(p);
    const T* query = static_cast<const T*>(p.query);
    T* out = static_cast<T*>(p.out);
#pragma omp parallel num_threads(p.num_threads)
    {
      float* scratch = workspace + per_thread * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_items; ++i) {
        const PrefillItem& item = items[i];
        const int64_t q_start = query_start_loc[item.seq];
        const int64_t q_len = query_start_loc[item.seq + 1] - q_start;
        if (q_len == 1) {  // a decode: the decode kernel's layout suits it better
          Decode<T, C, D>::attend_sequence(
              p, Decode<T, C, D>::carve(p, scratch, p.max_attended_len), item.seq,
              query + q_start * p.query_token_stride, out + q_start * p.out_token_stride);
          continue;
        }
        switch (ceil_div(item.row_end - item.row_begin, kWidth)) {
          case 1:
            tile<1>(p, item, q_start, q_len, scratch);
            break;
          case 2:
            tile<2>(p, item, q_start, q_len, scratch);
            break;
          case 3:
            tile<3>(p, item, q_start, q_len, scratch);
            break;
          default:
            static_assert(kPrefillRowVecs == 4, "add the cases up to kPrefillRowVecs");
            tile<4>(p, item, q_start, q_len, scratch);
            break;
        }
      }
    }
  }
};

// Calls fn(TypeTag<T>{}, TypeTag<C>{}, std::integral_constant<int, D>{}) for the problem's
// activation dtype, cache dtype (T's own, float8 e5m2 or float8 e4m3) and head size (all validated
// by the dispatcher).
template <typename Fn>
auto dispatch(const PagedKVCache& cache, Fn&& fn) {
  auto with_types = [&](auto tag, auto cache_tag) {
    switch (cache.head_size) {
      case 64:
        return fn(tag, cache_tag, std::integral_constant<int, 64>{});
      case 80:
        return fn(tag, cache_tag, std::integral_constant<int, 80>{});
      case 96:
        return fn(tag, cache_tag, std::integral_constant<int, 96>{});
      case 128:
        return fn(tag, cache_tag, std::integral_constant<int, 128>{});
      case 192:
        return fn(tag, cache_tag, std::integral_constant<int, 192>{});
      default:
        return fn(tag, cache_tag, std::integral_constant<int, 256>{});
    }
  };
  return with_dtype(cache.dtype, [&](auto tag) {
    if (cache.cache_dtype == DType::kFloat8E5M2) return with_types(tag, TypeTag<Float8E5M2>{});
    if (cache.cache_dtype == DType::kFloat8E4M3) return with_types(tag, TypeTag<Float8E4M3>{});
    return with_types(tag, tag);
  });
}

template <typename Tag>
using type_of = typename Tag::type;

int64_t decode_workspace_floats(const AttentionProblem& p, int64_t partition_size) {
  return dispatch(p.cache, [&](auto tag, auto cache_tag, auto head_size) {
    return Decode<type_of<decltype(tag)>, type_of<decltype(cache_tag)>,
                  decltype(head_size)::value>::workspace_floats(p, partition_size);
  });
}

void decode_attention(const AttentionProblem& p, int64_t partition_size, float* workspace) {
  dispatch(p.cache, [&](auto tag, auto cache_tag, auto head_size) {
    Decode<type_of<decltype(tag)>, type_of<decltype(cache_tag)>, decltype(head_size)::value>::run(
        p, partition_size, workspace);
  });
}

int64_t prefill_workspace_floats(const AttentionProblem& p) {
  return dispatch(p.cache, [&](auto tag, auto cache_tag, auto head_size) {
    return Prefill<type_of<decltype(tag)>, type_of<decltype(cache_tag)>,
                   decltype(head_size)::value>::scratch_floats(p) *
           p.num_threads;
  });
}

void prefill_attention(const AttentionProblem& p, const int32_t* query_start_loc,
                       const PrefillItem* items, int64_t num_items, float* workspace) {
  dispatch(p.cache, [&](auto tag, auto cache_tag, auto head_size) {
    Prefill<type_of<decltype(tag)>, type_of<decltype(cache_tag)>, decltype(head_size)::value>::run(
        p, query_start_loc, items, num_items, workspace);
  });
}

}  // namespace

#define PAGEDSERVE_STR2(x) #x
#define PAGEDSERVE_STR(x) PAGEDSERVE_STR2(x)

extern const AttentionKernels kAttentionKernels = {
    PAGEDSERVE_STR(PAGEDSERVE_ISA_NS), kPrefillRowVecs * kWidth,
    decode_workspace_floats,           decode_attention,
    prefill_workspace_floats,          prefill_attention,
};

}  // namespace pagedserve::cpu::PAGEDSERVE_ISA_NS
