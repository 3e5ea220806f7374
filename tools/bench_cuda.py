"""Microbenchmarks of the CUDA kernels (pagedserve._C_cuda) on one GPU, with their peers
measured in the same run:

    decode    paged decode attention: achieved GB/s of K/V read against a device-to-device
              copy's GB/s (read + write), and time against torch SDPA decode over the same
              K/V laid out contiguously ([batch, kv_heads, context, head_size])
    prefill   prefill attention over the paged cache (the paged kernel; the engine's CUDA
              default, flash attention's variable-length kernel over K/V gathered from the
              blocks and packed; and the padded SDPA layout) against causal torch SDPA (flash)
              on contiguous K/V
    cache     reshape_and_cache, copy_blocks and swap_blocks (device <-> pinned host) GB/s

Every timing is the median of CUDA-event-timed calls after a warm-up. The default decode
configuration is the target's: batch 64 x 4096-token contexts, Llama-7B heads (32 x 128),
float16, block size 16.

    python tools/bench_cuda.py --json bench_cuda.json            # everything
    python tools/bench_cuda.py --only decode --batch 64 --context 4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.gathered_prefill import (
    flash_varlen_available,
    gathered_prefill_attention,
    packed_prefill_attention,
    plan_gathered_prefill,
    plan_packed_prefill,
)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def time_ms(fn: Callable[[], object], iterations: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one call, each call timed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_gb_s(num_bytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    milliseconds = time_ms(lambda: target.copy_(source))
    return 2 * num_bytes / milliseconds / 1e6


def paged_pool(batch: int, context: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype, generator: torch.Generator):  # fmt: skip
    """A one-layer pool with every sequence's blocks scattered at random."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    pool = torch.empty(
        num_blocks, 1, 2, num_kv_heads, block_size, head_size, dtype=dtype, device="cuda"
    )
    pool.normal_(generator=generator)
    order = torch.randperm(num_blocks, device="cuda", generator=generator)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return pool, block_tables, seq_lens


def contiguous(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """[num_blocks, kv_heads, block_size, head] gathered to [batch, kv_heads, context, head]."""
    blocks = cache[block_tables.long()]  # [batch, blocks, kv_heads, block_size, head]
    batch, num_blocks, kv_heads, block_size, head = blocks.shape
    gathered = blocks.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, num_blocks * block_size, head)
    return gathered[:, :, :context].contiguous()


def bench_decode(args: argparse.Namespace, copy_bandwidth: float) -> list[dict[str, Any]]:
    configs = [(args.batch, args.context, args.num_heads, args.num_kv_heads)]
    if not args.quick:
        configs += [
            (64, 4096, 32, 8),  # Llama 3's grouped-query heads (issue 37's target)
            (1, 32768, 32, 8),  # one long sequence: split-K
            (64, 4096, 48, 1),  # multi-query (StarCoder): the wide kernel
            (8, 4096, 32, 32),
            (64, 512, 32, 32),
        ]
    results = []
    for batch, context, num_heads, num_kv_heads in configs:
        result = decode_case(args, batch, context, num_heads, num_kv_heads)
        result["copy_gb_s"] = copy_bandwidth
        result["fraction_of_copy_bandwidth"] = result["paged_gb_s"] / copy_bandwidth
        torch.cuda.empty_cache()
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def decode_case(
    args: argparse.Namespace, batch: int, context: int, num_heads: int, num_kv_heads: int
) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    generator = torch.Generator(device="cuda").manual_seed(0)
    pool, block_tables, seq_lens = paged_pool(
        batch, context, num_kv_heads, args.head_size, args.block_size, dtype, generator
    )
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    query = torch.randn(batch, num_heads, args.head_size, dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    scale = args.head_size**-0.5
    kv_bytes = 2 * batch * context * num_kv_heads * args.head_size * pool.element_size()

    def paged(partition_size: int | None) -> float:
        return time_ms(
            lambda: ops.paged_attention_decode(
                query, key_cache, value_cache, block_tables, seq_lens, scale, out=out,
                partition_size=partition_size,
            )
        )  # fmt: skip

    automatic_ms, single_ms, split_ms = paged(None), paged(0), paged(512)
    # Smaller partitions: more thread blocks in flight for few long sequences.
    split_small_ms = {size: paged(size) for size in (128, 256)} if batch <= 8 else {}
    ops.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                               out=out)  # fmt: skip
    keys = contiguous(key_cache, block_tables, context)
    values = contiguous(value_cache, block_tables, context)
    query_4d = query.view(batch, num_heads, 1, args.head_size)
    gqa = num_heads != num_kv_heads

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(query_4d, keys, values, scale=scale, enable_gqa=gqa)

    sdpa_ms = time_ms(sdpa)
    max_error = (sdpa().view_as(out).float() - out.float()).abs().max().item()
    best_ms = min(automatic_ms, single_ms, split_ms, *split_small_ms.values())
    return {
        "batch": batch,
        "context": context,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": args.head_size,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "kv_bytes": kv_bytes,
        "paged_ms": automatic_ms,
        "paged_single_pass_ms": single_ms,
        "paged_split_k_512_ms": split_ms,
        **{f"paged_split_k_{size}_ms": ms for size, ms in split_small_ms.items()},
        "best_variant_gb_s": kv_bytes / best_ms / 1e6,
        "paged_gb_s": kv_bytes / automatic_ms / 1e6,
        "sdpa_contiguous_ms": sdpa_ms,
        "paged_over_sdpa": automatic_ms / sdpa_ms,
        "best_variant_over_sdpa": best_ms / sdpa_ms,
        "max_abs_diff_vs_sdpa": max_error,
    }


def bench_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    shapes = [(8, 1024), (32, 161)]  # issue 37's prefill targets
    for (batch, prompt_len), (num_heads, num_kv_heads) in itertools.product(
        shapes, [(32, 8), (32, 32)]
    ):
        result = prefill_case(args, batch, prompt_len, num_heads, num_kv_heads)
        torch.cuda.empty_cache()
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def prefill_case(
    args: argparse.Namespace, batch: int, prompt_len: int, num_heads: int, num_kv_heads: int
) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    generator = torch.Generator(device="cuda").manual_seed(1)
    pool, block_tables, seq_lens = paged_pool(
        batch, prompt_len, num_kv_heads, args.head_size, args.block_size, dtype, generator
    )
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    num_tokens = batch * prompt_len
    query = torch.randn(num_tokens, num_heads, args.head_size, dtype=dtype, device="cuda")
    loc = torch.arange(0, num_tokens + 1, prompt_len, dtype=torch.int32, device="cuda")
    scale = args.head_size**-0.5
    paged_ms = time_ms(
        lambda: ops.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, loc, seq_lens, scale,
            max_query_len=prompt_len,
        ),
        iterations=10,
    )  # fmt: skip
    # The step's sequences as the engine plans them (once per step, shared by its layers).
    host = (
        block_tables.cpu().numpy(),
        np.full(batch, prompt_len, dtype=np.int32),
        seq_lens.cpu().numpy(),
        args.block_size,
        query.device,
    )
    plan = plan_gathered_prefill(*host)
    out = torch.empty_like(query)
    gathered_ms = time_ms(
        lambda: gathered_prefill_attention(query, key_cache, value_cache, plan, scale, out),
        iterations=10,
    )
    varlen_ms = None
    if flash_varlen_available() and dtype != torch.float32:
        packed = plan_packed_prefill(*host)
        varlen_ms = time_ms(
            lambda: packed_prefill_attention(query, key_cache, value_cache, packed, scale, out),
            iterations=10,
        )
        varlen_out = out.clone()
    keys = contiguous(key_cache, block_tables, prompt_len)
    values = contiguous(value_cache, block_tables, prompt_len)
    query_4d = query.view(batch, prompt_len, num_heads, args.head_size).transpose(1, 2)
    gqa = num_heads != num_kv_heads
    sdpa_ms = time_ms(
        lambda: F.scaled_dot_product_attention(
            query_4d, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
        ),
        iterations=10,
    )
    flops = 4 * batch * num_heads * args.head_size * prompt_len * (prompt_len + 1) / 2
    max_error = None
    if varlen_ms is not None:
        expected = F.scaled_dot_product_attention(
            query_4d, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
        )
        flat = expected.transpose(1, 2).reshape_as(varlen_out)
        max_error = (flat.float() - varlen_out.float()).abs().max().item()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "dtype": args.dtype,
        "paged_ms": paged_ms,
        "paged_tflop_s": flops / paged_ms / 1e9,
        "gathered_sdpa_ms": gathered_ms,
        "sdpa_causal_ms": sdpa_ms,
        "paged_over_sdpa": paged_ms / sdpa_ms,
        "gathered_over_sdpa": gathered_ms / sdpa_ms,
        "varlen_ms": varlen_ms,
        "varlen_over_sdpa": None if varlen_ms is None else varlen_ms / sdpa_ms,
        "varlen_max_abs_diff_vs_sdpa": max_error,
    }


def bench_cache_ops(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    # Llama-7B's geometry: one block (16 tokens, 32 layers, K and V) is 8 MiB in float16.
    num_layers, kv_heads, head, block_size = 32, 32, 128, 16
    num_blocks = 512
    pool = torch.empty(
        num_blocks, num_layers, 2, kv_heads, block_size, head, dtype=dtype, device="cuda"
    )
    pool.normal_()
    block_bytes = pool[0].numel() * pool.element_size()
    host = torch.empty((128, *pool.shape[1:]), dtype=dtype).pin_memory()
    tokens = 256
    key = torch.randn(tokens, kv_heads, head, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    write_ms = time_ms(
        lambda: ops.reshape_and_cache(key, value, pool[:, 0, 0], pool[:, 0, 1], slots)
    )
    pairs = torch.stack([torch.arange(0, 64), torch.arange(256, 320)], dim=1)
    copy_ms = time_ms(lambda: ops.copy_blocks(pool, pairs), iterations=10)
    out_pairs = torch.stack([torch.randperm(num_blocks)[:128], torch.arange(128)], dim=1)
    swap_out_ms = time_ms(lambda: ops.swap_blocks(pool, host, out_pairs), iterations=5)
    in_pairs = torch.stack([torch.arange(128), torch.arange(128, 256)], dim=1)
    swap_in_ms = time_ms(lambda: ops.swap_blocks(host, pool, in_pairs), iterations=5)
    result = {
        "reshape_and_cache_tokens": tokens,
        "reshape_and_cache_us": write_ms * 1e3,
        "copy_blocks_pairs": 64,
        "copy_blocks_gb_s": 2 * 64 * block_bytes / copy_ms / 1e6,
        "swap_out_gb_s": 128 * block_bytes / swap_out_ms / 1e6,
        "swap_in_gb_s": 128 * block_bytes / swap_in_ms / 1e6,
        "block_bytes": block_bytes,
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["decode", "prefill", "cache"], default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=32)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16")
    parser.add_argument("--quick", action="store_true", help="the target configuration only")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(sys.argv),
    }
    report["copy_gb_s"] = copy_gb_s(1 << 30)
    print(json.dumps({"copy_gb_s": report["copy_gb_s"]}), flush=True)
    if args.only in (None, "decode"):
        report["decode"] = bench_decode(args, report["copy_gb_s"])
    if args.only in (None, "prefill"):
        report["prefill"] = bench_prefill(args)
    if args.only in (None, "cache"):
        report["cache"] = bench_cache_ops(args)
        torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
