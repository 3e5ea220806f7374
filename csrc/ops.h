// The pagedserve op contract: one set of ops, same semantics and KV layout on every backend
// (cpu/ with OpenMP + SIMD, cuda/ with CUDA kernels). Nothing here depends on torch: callers pass
// raw pointers, shapes, strides (in elements) and a dtype code. The Python wrappers in
// gpu_worker/ops.py check every argument before calling in; the C++ side still checks what
// it has to read anyway (slots, block tables, sequence lengths) and throws
// std::invalid_argument on bad values, before writing anything.
//
// KV cache layout
// ---------------
// The worker allocates ONE tensor per pool (device pool, host swap pool):
//
//   kv_cache [num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]
//
// Block-major, so one block across all layers is one contiguous chunk: copy-on-write and
// swapping are one memcpy per block. A layer's key cache is the view kv_cache[:, layer, 0] and
// its value cache kv_cache[:, layer, 1], both
//
//   [num_blocks, num_kv_heads, block_size, head_size]
//
// with the inner three dims contiguous and an arbitrary stride between blocks
// (num_layers * 2 * num_kv_heads * block_size * head_size for the pool tensor above).
//
// A token's place in the cache is its slot: slot = block_id * block_size + offset. A negative
// slot marks a padding token, which is skipped. A sequence's logical block i lives in physical
// block block_tables[seq][i]:
//
//   positions:  0 ........ bs-1 | bs ....... 2bs-1 | 2bs ... seq_len-1
//   block_tables[seq]:   [ 7,                 2,                  9,    <padding> ... ]
//
// Entries past ceil(seq_len / block_size) are padding and never read.
//
// dtypes: float32, bfloat16, float16 (activations and cache share one dtype); accumulation is
// always float32. head_size in {64, 80, 96, 128, 192, 256}, block_size in {8, 16, 32}.
// GQA: num_heads % num_kv_heads == 0 and query head h reads kv head h / (num_heads /
// num_kv_heads), so the query heads of one kv head are adjacent.
//
// float8 caches (CPU only), PagedKVCache.cache_dtype under activations of any of the three
// dtypes; half the bytes of a 16-bit cache, a quarter of float32's:
// - kFloat8E5M2 (vLLM's kv_cache_dtype "fp8_e5m2"): reshape_and_cache rounds each K/V value as
//   torch's .to(torch.float8_e5m2) does (from float32, to nearest even, overflow to inf); the
//   attention ops read it back exactly (e5m2 is the top byte of a float16). 2 mantissa bits.
// - kFloat8E4M3 (vLLM's "fp8" / "fp8_e4m3", torch.float8_e4m3fn): rounded as torch's
//   .to(torch.float8_e4m3fn) rounds below 448, saturating to +-448 at and past it (infinities
//   too; torch gives NaN there, vLLM's CUDA conversion saturates); read back exactly. 3 mantissa
//   bits, range 2^-9 to 448. No scales: values are stored as they are (vLLM's k_scale =
//   v_scale = 1).
//
// Sliding window (Mistral, Qwen2 and Qwen3 sliding layers): every attention op takes
// sliding_window, in tokens; 0 means full causal attention. With a window W > 0 the query token
// at position i attends to the positions i - W < j <= i, that is the W positions ending at its
// own (HF transformers' sliding_window_causal_mask_function: kv_idx > q_idx - sliding_window
// and kv_idx <= q_idx):
//
//   positions:   0 ... i-W | i-W+1 .............. i | i+1 ...
//   query i:      skipped  |  attended (W tokens)   | future
//
// Positions before the window are never read, so a windowed op costs O(W) per query however
// long the context; block-table entries of blocks wholly before the window of a sequence's first
// query token are neither read nor checked: when every layer is windowed the block manager frees
// those blocks and the entries hold NULL_BLOCK (-1, scheduler/messages.py).
//
// Logit soft-capping (Gemma 2): every attention op takes logits_soft_cap, a float; 0 means off.
// With a cap c > 0 each attention logit s = scale * q . k becomes c * tanh(s / c) before the mask
// and the softmax, as HF transformers' Gemma 2 eager attention computes it (attn_weights / c,
// tanh, * c, then the mask). The cap bounds every logit to [-c, c]; masked positions stay
// masked. A negative, infinite or NaN cap is refused.
//
// Attention sinks (gpt-oss): every attention op takes sinks, null (off) or float32 [num_heads],
// one learned logit per query head that joins each softmax as one more key whose value is zero
// (HF transformers' GptOss eager attention: the logits concatenated with the head's sink,
// softmax, the sink's column dropped). A sink takes probability mass without adding to the
// output, so a row's weights sum to below one:
//
//   out[h] = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)),
//   m = max(max_j s_j, sinks[h])
//
// A sequence with seq_len 0 still gets zeros.
#pragma once

#include <cstdint>

namespace pagedserve {

// Codes shared with gpu_worker/ops.py. The float8 codes are cache types only.
enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E5M2 = 3,
  kFloat8E4M3 = 4,
};

// One layer's paged key and value caches (views into the pool tensor, see above).
struct PagedKVCache {
  void* key_cache;             // [num_blocks, num_kv_heads, block_size, head_size]
  void* value_cache;           // [num_blocks, num_kv_heads, block_size, head_size]
  int64_t key_block_stride;    // elements between key_cache[b] and key_cache[b + 1]
  int64_t value_block_stride;  // elements between value_cache[b] and value_cache[b + 1]
  int64_t num_blocks;
  int64_t num_kv_heads;
  int64_t block_size;  // tokens per block
  int64_t head_size;
  DType dtype;        // the activations: query, out, and the key / value written
  DType cache_dtype;  // the caches' elements: dtype, or a float8 code (CPU only)
};

// A batch of sequences' block tables and cache lengths.
struct BlockTables {
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], row stride below
  int64_t row_stride;           // elements between block_tables[s] and block_tables[s + 1]
  int64_t max_blocks_per_seq;
  const int32_t* seq_lens;  // [num_seqs]: tokens in the cache per sequence, incl. this step's
  int64_t num_seqs;
};

namespace cpu {

// Writes each token's key and value into its slot of the paged caches.
// Tokens with a negative slot are skipped.
void reshape_and_cache(const void* key,           // [num_tokens, num_kv_heads, head_size]
                       int64_t key_token_stride,  // elements between key[t] and key[t + 1]
                       const void* value,         // [num_tokens, num_kv_heads, head_size]
                       int64_t value_token_stride,
                       const int64_t* slot_mapping,  // [num_tokens]
                       int64_t num_tokens, const PagedKVCache& cache);

// Decode attention: one query token per sequence, at position seq_lens[s] - 1, attending to
// cache positions max(0, seq_lens[s] - sliding_window) .. seq_lens[s] - 1 (all of them when
// sliding_window is 0; the current token's K/V is already in the cache), with its logits
// soft-capped when logits_soft_cap > 0.
//   partition_size < 0: choose automatically; 0: single pass over the attended positions;
//   N > 0 (multiple of block_size): split-K, N tokens per partition, each partition keeps its
//   max / exp-sum / unnormalized output and a reduction step combines them. Partitions are
//   counted from the window's first position, so none lies outside the window.
// A sequence with seq_len 0 gets an all-zero output row.
void paged_attention_decode(void* out,  // [num_seqs, num_heads, head_size]
                            int64_t out_token_stride,
                            const void* query,  // [num_seqs, num_heads, head_size]
                            int64_t query_token_stride, int64_t num_heads, float scale,
                            int64_t sliding_window,  // tokens; 0: full attention
                            float logits_soft_cap,   // c * tanh(logit / c); 0: off
                            const float* sinks,      // [num_heads] or null: no sinks
                            const PagedKVCache& cache, const BlockTables& tables,
                            int64_t partition_size);

// Prefill / chunked-prefill / mixed attention over new query tokens of several sequences.
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1] - 1 (q_len_s rows);
// its query token j sits at position i = seq_lens[s] - q_len_s + j and attends causally to the
// cached positions <= its own (its own K/V already written by reshape_and_cache), and with a
// sliding window W > 0 only to those > i - W; logits_soft_cap > 0 caps its logits:
//
//   cache:  [ prior context (cached) | this step's q_len_s tokens ]
//            0                        seq_len - q_len            seq_len - 1
void paged_prefill_attention(void* out,  // [num_tokens, num_heads, head_size]
                             int64_t out_token_stride,
                             const void* query,  // [num_tokens, num_heads, head_size]
                             int64_t query_token_stride, int64_t num_tokens, int64_t num_heads,
                             const int32_t* query_start_loc,  // [num_seqs + 1]
                             float scale,
                             int64_t sliding_window,  // tokens; 0: full attention
                             float logits_soft_cap,   // c * tanh(logit / c); 0: off
                             const float* sinks,      // [num_heads] or null: no sinks
                             const PagedKVCache& cache, const BlockTables& tables);

// Copy-on-write: copies whole blocks (all layers, K and V) inside one pool.
// Destinations must be distinct and must not be sources of another pair.
void copy_blocks(void* kv_cache,  // [num_blocks, block_bytes] (the pool tensor, contiguous)
                 int64_t num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping,  // [num_pairs, 2]: (src_block, dst_block)
                 int64_t num_pairs);

// Swapping: copies whole blocks between two pools of the same block geometry
// (device pool <-> host pool). Destinations must be distinct.
void swap_blocks(const void* src_kv_cache,  // [src_num_blocks, block_bytes]
                 int64_t src_num_blocks,
                 void* dst_kv_cache,  // [dst_num_blocks, block_bytes]
                 int64_t dst_num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping,  // [num_pairs, 2]: (src_block, dst_block)
                 int64_t num_pairs);

// --- Fused elementwise ops of a decoder layer --------------------------------------------------
// Each replaces a chain of torch ops of HF's modeling code and reproduces its rounding: math in
// float32, rounded to the activation dtype wherever torch rounds (after every torch op). Rows may
// have any stride (views into fused qkv / gate_up outputs); within a row, elements are
// contiguous. dtype covers every tensor but positions and the cos/sin tables.

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean of the float32 squares summed in
// torch's order (HF LlamaRMSNorm, bit for bit). out may be x itself.
void rms_norm(void* out,  // [num_tokens, hidden_size]
              int64_t out_token_stride,
              const void* x,  // [num_tokens, hidden_size]
              int64_t x_token_stride,
              const void* weight,  // [hidden_size]
              int64_t num_tokens, int64_t hidden_size, float eps, DType dtype);

// In place: residual = to_dtype(x + residual), then x = rms_norm(residual).
void fused_add_rms_norm(void* x,  // [num_tokens, hidden_size]
                        int64_t x_token_stride,
                        void* residual,  // [num_tokens, hidden_size]
                        int64_t residual_token_stride,
                        const void* weight,  // [hidden_size]
                        int64_t num_tokens, int64_t hidden_size, float eps, DType dtype);

// In place, rotate-half (NeoX) RoPE of every head of query and key at each token's position:
//   c = to_dtype(cos[pos]), s = to_dtype(sin[pos]),
//   x[:half] = x1 * c - x2 * s,  x[half:] = x2 * c + x1 * s   (each product and sum rounded)
// Throws if a position is outside [0, max_positions), before writing anything.
void rotary_embedding(const int64_t* positions,  // [num_tokens]
                      void* query,               // [num_tokens, num_heads, head_size]
                      int64_t query_token_stride, int64_t num_heads,
                      void* key,  // [num_tokens, num_kv_heads, head_size]
                      int64_t key_token_stride, int64_t num_kv_heads, int64_t head_size,
                      const float* cos,  // [max_positions, head_size / 2]
                      const float* sin,  // [max_positions, head_size / 2]
                      int64_t max_positions, int64_t num_tokens, DType dtype);

// out = to_dtype(silu(gate)) * up, silu(g) = g / (1 + exp(-g)) in float32 with torch's exp.
void silu_and_mul(void* out,  // [num_tokens, intermediate_size]
                  int64_t out_token_stride,
                  const void* x,  // [num_tokens, 2 * intermediate_size]: gate | up
                  int64_t x_token_stride, int64_t num_tokens, int64_t intermediate_size,
                  DType dtype);

// --- Linear layers on packed weights ------------------------------------------------------------
// out = x W^T (+ bias) for W [out_features, in_features] stored once, after loading, in panels of
// kLinearPanelWidth output features:
//
//   packed_weight [ceil(out_features / 16), in_features, 16]
//   W[n][k] == packed_weight[n / 16][k][n % 16]; the last panel's columns past out_features are 0
//
// so the kernel reads each panel as one contiguous stream (layers/packed_weights.py packs it).
// dtype covers x, the weights, bias and out. The products are summed in float32 by FMA, in
// feature order; bias is added to the float32 sum, then out is rounded to dtype once (F.linear's
// rounding). Each output depends only on its row of x, the weights and in_features: not on
// num_rows, the other rows or the thread count (a request's results do not change with its
// batch). Not bit-equal to MKL's or oneDNN's GEMM: their sums run in another order.
constexpr int kLinearPanelWidth = 16;

void linear_packed(void* out,  // [num_rows, out_features]
                   int64_t out_row_stride,
                   const void* x,  // [num_rows, in_features]
                   int64_t x_row_stride,
                   const void* packed_weight,  // see above
                   const void* bias,           // [out_features], or nullptr
                   int64_t num_rows, int64_t in_features, int64_t out_features, DType dtype);

// The same over int8 weights, quantized per output feature (weight-only quantization):
//
//   W[n][k] == packed_weight[n / 16][k][n % 16] * weight_scales[n]
//
// in the panel layout above (int8, columns past out_features 0). dtype covers x, bias and out.
// Each output is the float32 FMA sum over the features, in order, of x times the int8 value
// (exact in float32), times weight_scales[n], plus bias, rounded to dtype once; as above it does
// not depend on the batch or the thread count.
void linear_packed_int8(void* out,  // [num_rows, out_features]
                        int64_t out_row_stride,
                        const void* x,  // [num_rows, in_features]
                        int64_t x_row_stride,
                        const int8_t* packed_weight,  // see above
                        const float* weight_scales,   // [out_features]
                        const void* bias,             // [out_features], or nullptr
                        int64_t num_rows, int64_t in_features, int64_t out_features, DType dtype);

// OpenMP threads used by every op of this library (default: omp_get_max_threads()).
void set_num_threads(int num_threads);
int get_num_threads();

// The SIMD variant the kernels run ("avx512", "avx2" or "generic"): the best the CPU
// supports, unless PAGEDSERVE_CPU_ISA names a lower one. force_isa() exists for tests.
const char* isa();
void force_isa(const char* name);

}  // namespace cpu

// --- CUDA ---------------------------------------------------------------------------------------
// The same ops on device memory (pagedserve._C_cuda, csrc/cuda/), asynchronous on a stream. What
// differs from cpu:: above:
// - Every call names the device and the stream (a cudaStream_t) it is enqueued on. Arguments are
//   checked on the host and throw std::invalid_argument before anything is enqueued; launch
//   failures throw std::runtime_error.
// - Values that live in device memory (slots, block tables, sequence lengths, query_start_loc)
//   are NOT checked: reading them on the host would cost a device-to-host synchronization per
//   call. The worker builds them from the scheduler's checked tables. A slot past the cache is
//   skipped rather than written out of bounds.
// - The caches must be 16-byte aligned (data pointer and block stride): the kernels read K/V in
//   16-byte vectors.
// - Block mappings (copy_blocks, swap_blocks) are host arrays, checked as on the CPU.
namespace cuda {

struct Stream {
  int device;    // CUDA device ordinal the pointers live on
  void* stream;  // cudaStream_t on that device (nullptr: the legacy default stream)
};

void reshape_and_cache(const void* key,           // [num_tokens, num_kv_heads, head_size]
                       int64_t key_token_stride,  // elements between key[t] and key[t + 1]
                       const void* value,         // [num_tokens, num_kv_heads, head_size]
                       int64_t value_token_stride,
                       const int64_t* slot_mapping,  // device [num_tokens]
                       int64_t num_tokens, const PagedKVCache& cache, const Stream& stream);

// How paged_attention_decode will run: the partition size it uses (0: single pass) and the
// float32 workspace it needs (0 for a single pass). requested_partition_size < 0 chooses
// (split-K when long contexts would leave the GPU's SMs short of work), 0 forces a single pass,
// N > 0 (a multiple of block_size) forces N tokens per partition. max_context_len is an upper
// bound of seq_lens known on the host: max_blocks_per_seq * block_size. A sliding window bounds
// the attended positions, hence the partitions, by min(max_context_len, sliding_window).
struct DecodePlan {
  int64_t partition_size;
  int64_t workspace_floats;  // [num_seqs, num_heads, num_partitions, head_size + 2]
};
DecodePlan plan_paged_attention_decode(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_size, int64_t max_context_len,
                                       int64_t sliding_window, int64_t requested_partition_size,
                                       int device);

// Decode attention as cpu::paged_attention_decode, with the plan's partition size (>= 0) and a
// device workspace of at least the plan's workspace_floats (may be null for a single pass).
void paged_attention_decode(void* out,  // [num_seqs, num_heads, head_size]
                            int64_t out_token_stride,
                            const void* query,  // [num_seqs, num_heads, head_size]
                            int64_t query_token_stride, int64_t num_heads, float scale,
                            int64_t sliding_window,  // tokens; 0: full attention
                            float logits_soft_cap,   // c * tanh(logit / c); 0: off
                            const float* sinks,      // device [num_heads] or null: no sinks
                            const PagedKVCache& cache, const BlockTables& tables,
                            int64_t partition_size, float* workspace, int64_t workspace_floats,
                            const Stream& stream);

// Prefill attention as cpu::paged_prefill_attention. max_query_len bounds every sequence's
// query_start_loc[s + 1] - query_start_loc[s] (num_tokens always does): the grid is sized by it.
void paged_prefill_attention(void* out,  // [num_tokens, num_heads, head_size]
                             int64_t out_token_stride,
                             const void* query,  // [num_tokens, num_heads, head_size]
                             int64_t query_token_stride, int64_t num_tokens, int64_t num_heads,
                             const int32_t* query_start_loc,  // device [num_seqs + 1]
                             int64_t max_query_len, float scale,
                             int64_t sliding_window,  // tokens; 0: full attention
                             float logits_soft_cap,   // c * tanh(logit / c); 0: off
                             const float* sinks,      // device [num_heads] or null: no sinks
                             const PagedKVCache& cache, const BlockTables& tables,
                             const Stream& stream);

// Copy-on-write inside one device pool: every pair, all layers, in one launch. block_mapping is
// the host array (checked as on the CPU); device_block_mapping the same pairs in device memory,
// which the kernel reads.
void copy_blocks(void* kv_cache,  // device [num_blocks, block_bytes]
                 int64_t num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping,         // host [num_pairs, 2]
                 const int64_t* device_block_mapping,  // device [num_pairs, 2]
                 int64_t num_pairs, const Stream& stream);

// Swapping between the device pool and a host pool (pinned for the copies to be asynchronous):
// one cudaMemcpyAsync per run of consecutive pairs, in order on the stream.
void swap_blocks(const void* src_kv_cache,  // [src_num_blocks, block_bytes]
                 int64_t src_num_blocks,
                 void* dst_kv_cache,  // [dst_num_blocks, block_bytes]
                 int64_t dst_num_blocks, int64_t block_bytes,
                 const int64_t* block_mapping,  // host [num_pairs, 2]: (src_block, dst_block)
                 int64_t num_pairs, const Stream& stream);

}  // namespace cuda
}  // namespace pagedserve
