// The interface between the ISA-independent dispatcher (dispatch.cpp) and the attention
// kernels, which are compiled once per ISA variant (attention_kernels.cpp) into the namespaces
// pagedserve::cpu::{generic, avx2, avx512}.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops.h"

namespace pagedserve::cpu {

// Everything both attention ops share; shapes as in ops.h.
struct AttentionProblem {
  void* out;  // [num_tokens, num_heads, head_size]
  int64_t out_token_stride;
  const void* query;  // [num_tokens, num_heads, head_size]
  int64_t query_token_stride;
  int64_t num_heads;
  float scale;
  int64_t sliding_window;  // tokens; 0: full attention (see ops.h)
  float logits_soft_cap;   // logits become cap * tanh(logit / cap); 0: off (see ops.h)
  const float* sinks;      // [num_heads] sink logits (see ops.h); null: none
  PagedKVCache cache;
  BlockTables tables;
  // The most cache positions one query token attends to: max over tables.seq_lens of
  // min(seq_len, sliding_window) (of seq_len when there is no window).
  int64_t max_attended_len;
  int num_threads;
};

// The first cache position a query token at `position` attends to.
inline int64_t window_begin(const AttentionProblem& p, int64_t position) {
  if (p.sliding_window <= 0 || position < p.sliding_window) return 0;
  return position - p.sliding_window + 1;
}

// The factor that turns a row's unnormalized output into its attention output: the row's running
// max m, its exp-sum l relative to m, and head's sink logit joining the softmax (ops.h). The
// output accumulator is relative to m too; when the sink is the larger the factor rescales it.
inline float output_factor(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.0f / l;
  const float sink = sinks[head];
  if (sink <= m) return 1.0f / (l + std::exp(sink - m));
  const float rescale = std::exp(m - sink);
  return rescale / (l * rescale + 1.0f);
}

// Prefill work item: query rows [row_begin, row_end) of one (sequence, kv head), where the
// sequence's rows are its query tokens x the kv head's query heads, token-major:
// row = token * (num_heads / num_kv_heads) + head_in_group. A sequence with one query token
// is one item (kv_head 0, rows [0, num_heads)) that the decode kernel runs over all heads.
struct PrefillItem {
  int32_t seq;
  int32_t kv_head;
  int32_t row_begin;
  int32_t row_end;
};

struct AttentionKernels {
  const char* isa;
  // Query rows (lanes) one prefill tile holds.
  int64_t prefill_rows_per_tile;
  // Floats of workspace decode_attention needs (per-thread scratch + partition results).
  int64_t (*decode_workspace_floats)(const AttentionProblem&, int64_t partition_size);
  // partition_size 0: single pass; > 0: split-K with a reduction step.
  void (*decode_attention)(const AttentionProblem&, int64_t partition_size, float* workspace);
  int64_t (*prefill_workspace_floats)(const AttentionProblem&);
  void (*prefill_attention)(const AttentionProblem&, const int32_t* query_start_loc,
                            const PrefillItem* items, int64_t num_items, float* workspace);
};

namespace generic {
extern const AttentionKernels kAttentionKernels;
}
#if defined(PAGEDSERVE_HAVE_AVX2)
namespace avx2 {
extern const AttentionKernels kAttentionKernels;
}
#endif
#if defined(PAGEDSERVE_HAVE_AVX512)
namespace avx512 {
extern const AttentionKernels kAttentionKernels;
}
#endif

}  // namespace pagedserve::cpu
