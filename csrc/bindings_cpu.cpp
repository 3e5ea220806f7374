// pybind11 bindings of the CPU ops (pagedserve._C_cpu). Tensors arrive as raw addresses
// (tensor.data_ptr()) plus shapes and strides in elements; gpu_worker/ops.py checks them
// first. Every op releases the GIL while it runs.
// NOTE: gpu_worker/ops.py passes the arguments positionally: pybind11 matches keyword
// arguments at about 0.3 us each, which adds up over 20 arguments x 3 ops x every layer.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "ops.h"

namespace py = pybind11;
using pagedserve::BlockTables;
using pagedserve::DType;
using pagedserve::PagedKVCache;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

PagedKVCache make_cache(uintptr_t key_cache, uintptr_t value_cache, int64_t key_block_stride,
                        int64_t value_block_stride, int64_t num_blocks, int64_t num_kv_heads,
                        int64_t block_size, int64_t head_size, int dtype, int cache_dtype) {
  return PagedKVCache{ptr<void>(key_cache),
                      ptr<void>(value_cache),
                      key_block_stride,
                      value_block_stride,
                      num_blocks,
                      num_kv_heads,
                      block_size,
                      head_size,
                      static_cast<DType>(dtype),
                      static_cast<DType>(cache_dtype)};
}

}  // namespace

PYBIND11_MODULE(_C_cpu, m) {
  m.doc() = "pagedserve CPU kernels (see csrc/ops.h for the contract; call via gpu_worker.ops)";

  m.def(
      "reshape_and_cache",
      [](uintptr_t key, int64_t key_token_stride, uintptr_t value, int64_t value_token_stride,
         uintptr_t slot_mapping, int64_t num_tokens, uintptr_t key_cache, uintptr_t value_cache,
         int64_t key_block_stride, int64_t value_block_stride, int64_t num_blocks,
         int64_t num_kv_heads, int64_t block_size, int64_t head_size, int dtype, int cache_dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::reshape_and_cache(
            ptr<const void>(key), key_token_stride, ptr<const void>(value), value_token_stride,
            ptr<const int64_t>(slot_mapping), num_tokens,
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype, cache_dtype));
      },
      py::arg("key"), py::arg("key_token_stride"), py::arg("value"), py::arg("value_token_stride"),
      py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("key_block_stride"), py::arg("value_block_stride"), py::arg("num_blocks"),
      py::arg("num_kv_heads"), py::arg("block_size"), py::arg("head_size"), py::arg("dtype"),
      py::arg("cache_dtype"));

  m.def(
      "paged_attention_decode",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t query, int64_t query_token_stride,
         int64_t num_heads, float scale, int64_t sliding_window, float logits_soft_cap,
         uintptr_t sinks, uintptr_t key_cache, uintptr_t value_cache, int64_t key_block_stride,
         int64_t value_block_stride, int64_t num_blocks, int64_t num_kv_heads, int64_t block_size,
         int64_t head_size, int dtype, int cache_dtype, uintptr_t block_tables,
         int64_t block_table_stride, int64_t max_blocks_per_seq, uintptr_t seq_lens,
         int64_t num_seqs, int64_t partition_size) {
        py::gil_scoped_release release;
        pagedserve::cpu::paged_attention_decode(
            ptr<void>(out), out_token_stride, ptr<const void>(query), query_token_stride, num_heads,
            scale, sliding_window, logits_soft_cap, ptr<const float>(sinks),
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype, cache_dtype),
            BlockTables{ptr<const int32_t>(block_tables), block_table_stride, max_blocks_per_seq,
                        ptr<const int32_t>(seq_lens), num_seqs},
            partition_size);
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("query"), py::arg("query_token_stride"),
      py::arg("num_heads"), py::arg("scale"), py::arg("sliding_window"), py::arg("logits_soft_cap"),
      py::arg("sinks"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_block_stride"),
      py::arg("value_block_stride"), py::arg("num_blocks"), py::arg("num_kv_heads"),
      py::arg("block_size"), py::arg("head_size"), py::arg("dtype"), py::arg("cache_dtype"),
      py::arg("block_tables"), py::arg("block_table_stride"), py::arg("max_blocks_per_seq"),
      py::arg("seq_lens"), py::arg("num_seqs"), py::arg("partition_size"));

  m.def(
      "paged_prefill_attention",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t query, int64_t query_token_stride,
         int64_t num_tokens, int64_t num_heads, uintptr_t query_start_loc, float scale,
         int64_t sliding_window, float logits_soft_cap, uintptr_t sinks, uintptr_t key_cache,
         uintptr_t value_cache, int64_t key_block_stride, int64_t value_block_stride,
         int64_t num_blocks, int64_t num_kv_heads, int64_t block_size, int64_t head_size, int dtype,
         int cache_dtype, uintptr_t block_tables, int64_t block_table_stride,
         int64_t max_blocks_per_seq, uintptr_t seq_lens, int64_t num_seqs) {
        py::gil_scoped_release release;
        pagedserve::cpu::paged_prefill_attention(
            ptr<void>(out), out_token_stride, ptr<const void>(query), query_token_stride,
            num_tokens, num_heads, ptr<const int32_t>(query_start_loc), scale, sliding_window,
            logits_soft_cap, ptr<const float>(sinks),
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype, cache_dtype),
            BlockTables{ptr<const int32_t>(block_tables), block_table_stride, max_blocks_per_seq,
                        ptr<const int32_t>(seq_lens), num_seqs});
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("query"), py::arg("query_token_stride"),
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("query_start_loc"), py::arg("scale"),
      py::arg("sliding_window"), py::arg("logits_soft_cap"), py::arg("sinks"), py::arg("key_cache"),
      py::arg("value_cache"), py::arg("key_block_stride"), py::arg("value_block_stride"),
      py::arg("num_blocks"), py::arg("num_kv_heads"), py::arg("block_size"), py::arg("head_size"),
      py::arg("dtype"), py::arg("cache_dtype"), py::arg("block_tables"),
      py::arg("block_table_stride"), py::arg("max_blocks_per_seq"), py::arg("seq_lens"),
      py::arg("num_seqs"));

  m.def(
      "copy_blocks",
      [](uintptr_t kv_cache, int64_t num_blocks, int64_t block_bytes, uintptr_t block_mapping,
         int64_t num_pairs) {
        py::gil_scoped_release release;
        pagedserve::cpu::copy_blocks(ptr<void>(kv_cache), num_blocks, block_bytes,
                                     ptr<const int64_t>(block_mapping), num_pairs);
      },
      py::arg("kv_cache"), py::arg("num_blocks"), py::arg("block_bytes"), py::arg("block_mapping"),
      py::arg("num_pairs"));

  m.def(
      "swap_blocks",
      [](uintptr_t src_kv_cache, int64_t src_num_blocks, uintptr_t dst_kv_cache,
         int64_t dst_num_blocks, int64_t block_bytes, uintptr_t block_mapping, int64_t num_pairs) {
        py::gil_scoped_release release;
        pagedserve::cpu::swap_blocks(ptr<const void>(src_kv_cache), src_num_blocks,
                                     ptr<void>(dst_kv_cache), dst_num_blocks, block_bytes,
                                     ptr<const int64_t>(block_mapping), num_pairs);
      },
      py::arg("src_kv_cache"), py::arg("src_num_blocks"), py::arg("dst_kv_cache"),
      py::arg("dst_num_blocks"), py::arg("block_bytes"), py::arg("block_mapping"),
      py::arg("num_pairs"));

  m.def(
      "rms_norm",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t x, int64_t x_token_stride,
         uintptr_t weight, int64_t num_tokens, int64_t hidden_size, float eps, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::rms_norm(ptr<void>(out), out_token_stride, ptr<const void>(x),
                                  x_token_stride, ptr<const void>(weight), num_tokens, hidden_size,
                                  eps, static_cast<DType>(dtype));
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("x"), py::arg("x_token_stride"),
      py::arg("weight"), py::arg("num_tokens"), py::arg("hidden_size"), py::arg("eps"),
      py::arg("dtype"));

  m.def(
      "fused_add_rms_norm",
      [](uintptr_t x, int64_t x_token_stride, uintptr_t residual, int64_t residual_token_stride,
         uintptr_t weight, int64_t num_tokens, int64_t hidden_size, float eps, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::fused_add_rms_norm(
            ptr<void>(x), x_token_stride, ptr<void>(residual), residual_token_stride,
            ptr<const void>(weight), num_tokens, hidden_size, eps, static_cast<DType>(dtype));
      },
      py::arg("x"), py::arg("x_token_stride"), py::arg("residual"),
      py::arg("residual_token_stride"), py::arg("weight"), py::arg("num_tokens"),
      py::arg("hidden_size"), py::arg("eps"), py::arg("dtype"));

  m.def(
      "rotary_embedding",
      [](uintptr_t positions, uintptr_t query, int64_t query_token_stride, int64_t num_heads,
         uintptr_t key, int64_t key_token_stride, int64_t num_kv_heads, int64_t head_size,
         uintptr_t cos, uintptr_t sin, int64_t max_positions, int64_t num_tokens, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::rotary_embedding(
            ptr<const int64_t>(positions), ptr<void>(query), query_token_stride, num_heads,
            ptr<void>(key), key_token_stride, num_kv_heads, head_size, ptr<const float>(cos),
            ptr<const float>(sin), max_positions, num_tokens, static_cast<DType>(dtype));
      },
      py::arg("positions"), py::arg("query"), py::arg("query_token_stride"), py::arg("num_heads"),
      py::arg("key"), py::arg("key_token_stride"), py::arg("num_kv_heads"), py::arg("head_size"),
      py::arg("cos"), py::arg("sin"), py::arg("max_positions"), py::arg("num_tokens"),
      py::arg("dtype"));

  m.def(
      "silu_and_mul",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t x, int64_t x_token_stride,
         int64_t num_tokens, int64_t intermediate_size, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::silu_and_mul(ptr<void>(out), out_token_stride, ptr<const void>(x),
                                      x_token_stride, num_tokens, intermediate_size,
                                      static_cast<DType>(dtype));
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("x"), py::arg("x_token_stride"),
      py::arg("num_tokens"), py::arg("intermediate_size"), py::arg("dtype"));

  m.def(
      "linear_packed",
      [](uintptr_t out, int64_t out_row_stride, uintptr_t x, int64_t x_row_stride,
         uintptr_t packed_weight, uintptr_t bias, int64_t num_rows, int64_t in_features,
         int64_t out_features, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::linear_packed(ptr<void>(out), out_row_stride, ptr<const void>(x),
                                       x_row_stride, ptr<const void>(packed_weight),
                                       ptr<const void>(bias), num_rows, in_features, out_features,
                                       static_cast<DType>(dtype));
      },
      py::arg("out"), py::arg("out_row_stride"), py::arg("x"), py::arg("x_row_stride"),
      py::arg("packed_weight"), py::arg("bias"), py::arg("num_rows"), py::arg("in_features"),
      py::arg("out_features"), py::arg("dtype"));
  m.def(
      "linear_packed_int8",
      [](uintptr_t out, int64_t out_row_stride, uintptr_t x, int64_t x_row_stride,
         uintptr_t packed_weight, uintptr_t weight_scales, uintptr_t bias, int64_t num_rows,
         int64_t in_features, int64_t out_features, int dtype) {
        py::gil_scoped_release release;
        pagedserve::cpu::linear_packed_int8(
            ptr<void>(out), out_row_stride, ptr<const void>(x), x_row_stride,
            ptr<const int8_t>(packed_weight), ptr<const float>(weight_scales),
            ptr<const void>(bias), num_rows, in_features, out_features, static_cast<DType>(dtype));
      },
      py::arg("out"), py::arg("out_row_stride"), py::arg("x"), py::arg("x_row_stride"),
      py::arg("packed_weight"), py::arg("weight_scales"), py::arg("bias"), py::arg("num_rows"),
      py::arg("in_features"), py::arg("out_features"), py::arg("dtype"));
  m.attr("LINEAR_PANEL_WIDTH") = pagedserve::cpu::kLinearPanelWidth;

  m.def("set_num_threads", &pagedserve::cpu::set_num_threads, py::arg("num_threads"),
        "OpenMP threads used by every op of this module.");
  m.def("get_num_threads", &pagedserve::cpu::get_num_threads);
  m.def("isa", &pagedserve::cpu::isa, "The SIMD variant the kernels run: avx512, avx2 or generic.");
  m.def("force_isa", &pagedserve::cpu::force_isa, py::arg("name"),
        "Run the kernels' `name` variant from now on (for tests and benchmarks).");
}
