// pybind11 bindings of the CUDA ops (pagedserve._C_cuda). Like _C_cpu, tensors arrive as raw
// addresses (tensor.data_ptr()) plus shapes and strides in elements, and gpu_worker/ops.py
// checks them first; every op also takes the device ordinal and the stream (a cudaStream_t as
// an integer, torch.cuda.Stream.cuda_stream) it is enqueued on. No torch here: the module
// builds and imports without a GPU or a CUDA build of torch.
// NOTE: gpu_worker/cuda_ops.py passes the arguments positionally (see bindings_cpu.cpp).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "ops.h"

namespace py = pybind11;
using pagedserve::BlockTables;
using pagedserve::DType;
using pagedserve::PagedKVCache;
using pagedserve::cuda::Stream;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

PagedKVCache make_cache(uintptr_t key_cache, uintptr_t value_cache, int64_t key_block_stride,
                        int64_t value_block_stride, int64_t num_blocks, int64_t num_kv_heads,
                        int64_t block_size, int64_t head_size, int dtype) {
  return PagedKVCache{ptr<void>(key_cache), ptr<void>(value_cache), key_block_stride,
                      value_block_stride, num_blocks, num_kv_heads, block_size, head_size,
                      static_cast<DType>(dtype),
                      // The CUDA kernels keep the cache in the activations' dtype (ops.h).
                      static_cast<DType>(dtype)};
}

Stream make_stream(int device, uintptr_t stream) { return Stream{device, ptr<void>(stream)}; }

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "pagedserve CUDA kernels (see csrc/ops.h for the contract; call via gpu_worker.ops)";

  m.def(
      "reshape_and_cache",
      [](uintptr_t key, int64_t key_token_stride, uintptr_t value, int64_t value_token_stride,
         uintptr_t slot_mapping, int64_t num_tokens, uintptr_t key_cache, uintptr_t value_cache,
         int64_t key_block_stride, int64_t value_block_stride, int64_t num_blocks,
         int64_t num_kv_heads, int64_t block_size, int64_t head_size, int dtype, int device,
         uintptr_t stream) {
        py::gil_scoped_release release;
        pagedserve::cuda::reshape_and_cache(
            ptr<const void>(key), key_token_stride, ptr<const void>(value), value_token_stride,
            ptr<const int64_t>(slot_mapping), num_tokens,
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype),
            make_stream(device, stream));
      },
      py::arg("key"), py::arg("key_token_stride"), py::arg("value"), py::arg("value_token_stride"),
      py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("key_block_stride"), py::arg("value_block_stride"), py::arg("num_blocks"),
      py::arg("num_kv_heads"), py::arg("block_size"), py::arg("head_size"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"));

  m.def(
      "plan_paged_attention_decode",
      [](int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
         int64_t max_context_len, int64_t sliding_window, int64_t requested_partition_size,
         int device) {
        const auto plan = pagedserve::cuda::plan_paged_attention_decode(
            num_seqs, num_heads, num_kv_heads, head_size, max_context_len, sliding_window,
            requested_partition_size, device);
        return py::make_tuple(plan.partition_size, plan.workspace_floats);
      },
      py::arg("num_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"),
      py::arg("max_context_len"), py::arg("sliding_window"), py::arg("requested_partition_size"),
      py::arg("device"),
      "(partition_size, workspace_floats) that paged_attention_decode will use.");

  m.def(
      "paged_attention_decode",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t query, int64_t query_token_stride,
         int64_t num_heads, float scale, int64_t sliding_window, float logits_soft_cap,
         uintptr_t sinks, uintptr_t key_cache, uintptr_t value_cache, int64_t key_block_stride,
         int64_t value_block_stride, int64_t num_blocks, int64_t num_kv_heads, int64_t block_size,
         int64_t head_size, int dtype, uintptr_t block_tables, int64_t block_table_stride,
         int64_t max_blocks_per_seq, uintptr_t seq_lens, int64_t num_seqs, int64_t partition_size,
         uintptr_t workspace, int64_t workspace_floats, int device, uintptr_t stream) {
        py::gil_scoped_release release;
        pagedserve::cuda::paged_attention_decode(
            ptr<void>(out), out_token_stride, ptr<const void>(query), query_token_stride, num_heads,
            scale, sliding_window, logits_soft_cap, ptr<const float>(sinks),
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype),
            BlockTables{ptr<const int32_t>(block_tables), block_table_stride, max_blocks_per_seq,
                        ptr<const int32_t>(seq_lens), num_seqs},
            partition_size, ptr<float>(workspace), workspace_floats, make_stream(device, stream));
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("query"), py::arg("query_token_stride"),
      py::arg("num_heads"), py::arg("scale"), py::arg("sliding_window"), py::arg("logits_soft_cap"),
      py::arg("sinks"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_block_stride"),
      py::arg("value_block_stride"), py::arg("num_blocks"), py::arg("num_kv_heads"),
      py::arg("block_size"), py::arg("head_size"), py::arg("dtype"), py::arg("block_tables"),
      py::arg("block_table_stride"), py::arg("max_blocks_per_seq"), py::arg("seq_lens"),
      py::arg("num_seqs"), py::arg("partition_size"), py::arg("workspace"),
      py::arg("workspace_floats"), py::arg("device"), py::arg("stream"));

  m.def(
      "paged_prefill_attention",
      [](uintptr_t out, int64_t out_token_stride, uintptr_t query, int64_t query_token_stride,
         int64_t num_tokens, int64_t num_heads, uintptr_t query_start_loc, int64_t max_query_len,
         float scale, int64_t sliding_window, float logits_soft_cap, uintptr_t sinks,
         uintptr_t key_cache, uintptr_t value_cache, int64_t key_block_stride,
         int64_t value_block_stride, int64_t num_blocks, int64_t num_kv_heads, int64_t block_size,
         int64_t head_size, int dtype, uintptr_t block_tables, int64_t block_table_stride,
         int64_t max_blocks_per_seq, uintptr_t seq_lens, int64_t num_seqs, int device,
         uintptr_t stream) {
        py::gil_scoped_release release;
        pagedserve::cuda::paged_prefill_attention(
            ptr<void>(out), out_token_stride, ptr<const void>(query), query_token_stride,
            num_tokens, num_heads, ptr<const int32_t>(query_start_loc), max_query_len, scale,
            sliding_window, logits_soft_cap, ptr<const float>(sinks),
            make_cache(key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
                       num_kv_heads, block_size, head_size, dtype),
            BlockTables{ptr<const int32_t>(block_tables), block_table_stride, max_blocks_per_seq,
                        ptr<const int32_t>(seq_lens), num_seqs},
            make_stream(device, stream));
      },
      py::arg("out"), py::arg("out_token_stride"), py::arg("query"), py::arg("query_token_stride"),
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("query_start_loc"),
      py::arg("max_query_len"), py::arg("scale"), py::arg("sliding_window"),
      py::arg("logits_soft_cap"), py::arg("sinks"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("key_block_stride"), py::arg("value_block_stride"), py::arg("num_blocks"),
      py::arg("num_kv_heads"), py::arg("block_size"), py::arg("head_size"), py::arg("dtype"),
      py::arg("block_tables"), py::arg("block_table_stride"), py::arg("max_blocks_per_seq"),
      py::arg("seq_lens"), py::arg("num_seqs"), py::arg("device"), py::arg("stream"));

  m.def(
      "copy_blocks",
      [](uintptr_t kv_cache, int64_t num_blocks, int64_t block_bytes, uintptr_t block_mapping,
         uintptr_t device_block_mapping, int64_t num_pairs, int device, uintptr_t stream) {
        py::gil_scoped_release release;
        pagedserve::cuda::copy_blocks(
            ptr<void>(kv_cache), num_blocks, block_bytes, ptr<const int64_t>(block_mapping),
            ptr<const int64_t>(device_block_mapping), num_pairs, make_stream(device, stream));
      },
      py::arg("kv_cache"), py::arg("num_blocks"), py::arg("block_bytes"), py::arg("block_mapping"),
      py::arg("device_block_mapping"), py::arg("num_pairs"), py::arg("device"), py::arg("stream"));

  m.def(
      "swap_blocks",
      [](uintptr_t src_kv_cache, int64_t src_num_blocks, uintptr_t dst_kv_cache,
         int64_t dst_num_blocks, int64_t block_bytes, uintptr_t block_mapping, int64_t num_pairs,
         int device, uintptr_t stream) {
        py::gil_scoped_release release;
        pagedserve::cuda::swap_blocks(
            ptr<const void>(src_kv_cache), src_num_blocks, ptr<void>(dst_kv_cache), dst_num_blocks,
            block_bytes, ptr<const int64_t>(block_mapping), num_pairs, make_stream(device, stream));
      },
      py::arg("src_kv_cache"), py::arg("src_num_blocks"), py::arg("dst_kv_cache"),
      py::arg("dst_num_blocks"), py::arg("block_bytes"), py::arg("block_mapping"),
      py::arg("num_pairs"), py::arg("device"), py::arg("stream"));
}
