"""Microbenchmark of the CPU ops (not a test).

Decode: batch 64 and 256, context 512, on the embedded model's attention shape (9 query heads,
3 kv heads, head size 64), bf16 and fp32; prints us/call and GB/s of K/V read. Each call reads
another layer of a pool larger than the caches, so the K/V comes from memory, as in a real
decode step. Also a memory-bandwidth reference (a large tensor copy) and prefill figures.

Elementwise: one decoder layer's elementwise work on the embedded model's shapes (hidden 576,
FFN 1536), HF's torch code against the fused ops, at 1, 64 and 256 tokens, and the sum over a
layer (2 add + RMSNorm, RoPE, SiLU * up).

    .venv/bin/python tools/bench_ops.py [--threads N] [--isa avx512,avx2,generic]
        [--only attention|elementwise] [--json results.json]

``--isa`` lists the kernel variants to run, one after another in the same process (default:
the best this CPU runs), so their figures compare within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import time
from typing import Any

import torch
from machine import cpu_model

from pagedserve import _C_cpu
from pagedserve.gpu_worker import fused_ops, ops

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
HIDDEN_SIZE, INTERMEDIATE_SIZE, RMS_NORM_EPS, MAX_POSITIONS = 576, 1536, 1e-5, 8192
POOL_BYTES = 1 << 30  # >> last-level cache, so every call reads K/V from memory

# Every figure printed, as a record for --json (each with the kernel variant that ran).
RESULTS: list[dict[str, Any]] = []


# gpt-oss's attention sinks for the attention ops (--sinks), one logit per query head.
SINKS: torch.Tensor | None = None


def record(kind: str, **fields: Any) -> None:
    RESULTS.append({"kind": kind, "isa": _C_cpu.isa(), **fields})


def timed(fn, iters: int) -> float:
    """Median seconds per call after a warm-up."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def memory_bandwidth_gbps() -> float:
    """Read + write GB/s of a 512 MiB copy: the ceiling a memory-bound kernel can approach."""
    src = torch.empty(1 << 27, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds / 1e9


def advise_hugepages(tensor: torch.Tensor) -> None:
    """Asks for transparent huge pages under ``tensor`` (before it is first touched): fewer TLB
    misses when blocks are scattered over a large pool."""
    page = 1 << 21
    start = (tensor.data_ptr() + page - 1) // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    if end > start:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        madv_hugepage = 14
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_hugepage)


def scrambled_block_tables(num_seqs: int, blocks_per_seq: int, num_blocks: int) -> torch.Tensor:
    perm = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq]
    return perm.view(num_seqs, blocks_per_seq).to(torch.int32)


def bench_decode(
    num_seqs: int, context: int, dtype: torch.dtype, iters: int, hugepages: bool
) -> None:
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    elem = torch.empty((), dtype=dtype).element_size()
    layer_bytes = num_blocks * 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_SIZE * elem
    num_layers = max(2, POOL_BYTES // layer_bytes)
    pool = torch.empty(num_blocks, num_layers, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=dtype)
    if hugepages:
        advise_hugepages(pool)
    pool.normal_()
    block_tables = scrambled_block_tables(num_seqs, blocks_per_seq, num_blocks)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_SIZE).to(dtype)
    out = torch.empty_like(query)
    scale = HEAD_SIZE**-0.5
    layer_caches = [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(num_layers)]
    # With --sinks, the automatic partitioning once more with gpt-oss's attention sinks.
    runs = [(None, None), (0, None), (128, None)] + [(None, SINKS)] * (SINKS is not None)
    for partition_size, sinks in runs:
        layers = itertools.cycle(layer_caches)

        def call(partition_size: int | None = partition_size, layers=layers, sinks=sinks) -> None:
            key_cache, value_cache = next(layers)
            ops.paged_attention_decode(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                scale,
                out=out,
                partition_size=partition_size,
                sinks=sinks,
            )

        seconds = timed(call, iters)
        record(
            "decode",
            batch=num_seqs,
            context=context,
            dtype=str(dtype),
            hugepages=hugepages,
            partition_size=partition_size,
            sinks=sinks is not None,
            us_per_call=seconds * 1e6,
            kv_read_gbps=layer_bytes / seconds / 1e9,
        )
        print(
            f"decode  batch {num_seqs:4d} ctx {context} {str(dtype):15s} "
            f"{'huge pages ' if hugepages else ''}{'sinks ' if sinks is not None else ''}"
            f"partition {str(partition_size):4s}: {seconds * 1e6:8.1f} us/call  "
            f"{layer_bytes / seconds / 1e9:6.1f} GB/s KV read"
        )


def bench_prefill(q_lens: list[int], dtype: torch.dtype, iters: int) -> None:
    num_seqs = len(q_lens)
    blocks_per_seq = -(-max(q_lens) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE).to(dtype)
    value_cache = torch.randn_like(key_cache)
    block_tables = scrambled_block_tables(num_seqs, blocks_per_seq, num_blocks)
    seq_lens = torch.tensor(q_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(seq_lens, 0)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_SIZE).to(dtype)
    out = torch.empty_like(query)
    scale = HEAD_SIZE**-0.5

    def call(sinks: torch.Tensor | None = None) -> None:
        ops.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            out=out,
            sinks=sinks,
        )

    seconds = timed(call, iters)
    sinks_seconds = None if SINKS is None else timed(lambda: call(SINKS), iters)
    # QK^T and PV over the causal half, 2 flops per multiply-add.
    flops = sum(4 * NUM_HEADS * HEAD_SIZE * n * (n + 1) / 2 for n in q_lens)

    # Peer: torch SDPA on contiguous K/V (no paging), same dtype.
    contiguous = [
        (
            query[start : start + n].transpose(0, 1),
            torch.randn(NUM_KV_HEADS, n, HEAD_SIZE).to(dtype),
            torch.randn(NUM_KV_HEADS, n, HEAD_SIZE).to(dtype),
        )
        for n, start in zip(q_lens, query_start_loc.tolist())
    ]

    def sdpa() -> None:
        for q, k, v in contiguous:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )

    sdpa_seconds = timed(sdpa, iters)
    record(
        "prefill",
        q_lens=q_lens,
        dtype=str(dtype),
        us_per_call=seconds * 1e6,
        gflops=flops / seconds / 1e9,
        torch_sdpa_contiguous_us=sdpa_seconds * 1e6,
        us_per_call_with_sinks=None if sinks_seconds is None else sinks_seconds * 1e6,
    )
    print(
        f"prefill q_lens {q_lens} {str(dtype):15s}: {seconds * 1e6:8.1f} us/call  "
        f"{flops / seconds / 1e9:6.1f} GFLOP/s  (torch SDPA on contiguous K/V: "
        f"{sdpa_seconds * 1e6:.1f} us)"
        + ("" if sinks_seconds is None else f"; with sinks {sinks_seconds * 1e6:.1f} us")
    )


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)
    return weight * h.to(x.dtype)


def torch_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].to(query.dtype).unsqueeze(1)
    s = sin[positions].to(query.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, HEAD_SIZE)
        x1, x2 = x[..., : HEAD_SIZE // 2], x[..., HEAD_SIZE // 2 :]
        return torch.cat((x1 * c + (-x2) * s, x2 * c + x1 * s), dim=-1).flatten(1)

    return rotate(query), rotate(key)


def bench_elementwise(num_tokens: int, dtype: torch.dtype, iters: int) -> None:
    """Each of a layer's elementwise steps: HF's torch code against the fused op."""
    q_width, kv_width = NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE
    weight = (1 + torch.randn(HIDDEN_SIZE) / 4).to(dtype)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, HEAD_SIZE, 2).float() / HEAD_SIZE))
    freqs = torch.arange(MAX_POSITIONS).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    hidden = torch.randn(num_tokens, HIDDEN_SIZE).to(dtype)
    residual = torch.randn(num_tokens, HIDDEN_SIZE).to(dtype)
    normed = torch.empty_like(hidden)
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width).to(dtype)
    query, key = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,))
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE_SIZE).to(dtype)
    activated = torch.empty(num_tokens, INTERMEDIATE_SIZE, dtype=dtype)

    def torch_silu_and_mul() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    steps = [
        # (name, times per layer, torch, fused)
        (
            "rms_norm",
            0,
            lambda: torch_rms_norm(hidden, weight),
            lambda: fused_ops.rms_norm(normed, hidden, weight, RMS_NORM_EPS),
        ),
        (
            "add + rms_norm",
            2,
            lambda: torch_rms_norm(residual + hidden, weight),
            lambda: fused_ops.fused_add_rms_norm(hidden, residual, weight, RMS_NORM_EPS),
        ),
        (
            "rotary_embedding",
            1,
            lambda: torch_rotary(positions, query, key, cos, sin),
            lambda: fused_ops.rotary_embedding(positions, query, key, cos, sin),
        ),
        ("silu * up", 1, torch_silu_and_mul, lambda: fused_ops.silu_and_mul(activated, gate_up)),
    ]
    layer_torch = layer_fused = 0.0
    for name, per_layer, torch_fn, fused_fn in steps:
        torch_seconds, fused_seconds = timed(torch_fn, iters), timed(fused_fn, iters)
        layer_torch += per_layer * torch_seconds
        layer_fused += per_layer * fused_seconds
        record(
            "elementwise",
            step=name,
            tokens=num_tokens,
            dtype=str(dtype),
            torch_us=torch_seconds * 1e6,
            fused_us=fused_seconds * 1e6,
        )
        print(
            f"  {name:16s} tokens {num_tokens:4d} {str(dtype):15s}: torch "
            f"{torch_seconds * 1e6:7.1f} us  fused {fused_seconds * 1e6:7.1f} us  "
            f"({torch_seconds / fused_seconds:4.1f}x)"
        )
    record(
        "elementwise",
        step="per layer",
        tokens=num_tokens,
        dtype=str(dtype),
        torch_us=layer_torch * 1e6,
        fused_us=layer_fused * 1e6,
    )
    print(
        f"  per layer        tokens {num_tokens:4d} {str(dtype):15s}: torch "
        f"{layer_torch * 1e6:7.1f} us  fused {layer_fused * 1e6:7.1f} us  "
        f"({layer_torch / layer_fused:4.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--isa", default=None, help="kernel variants to run, comma-separated (avx512,avx2,generic)"
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--hugepages", action="store_true", help="also run decode on a pool with huge pages"
    )
    parser.add_argument("--only", choices=("attention", "elementwise"), default=None)
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument(
        "--sinks", action="store_true", help="also time the attention ops with attention sinks"
    )
    args = parser.parse_args()
    global SINKS
    SINKS = torch.randn(NUM_HEADS) * 3.0 if args.sinks else None
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    isas = args.isa.split(",") if args.isa else [_C_cpu.isa()]
    print(f"{cpu_model()}: threads {args.threads}, kernel variants {', '.join(isas)}")
    bandwidth_gbps = None
    if args.only != "elementwise":
        bandwidth_gbps = memory_bandwidth_gbps()
        print(f"memory bandwidth (512 MiB copy): {bandwidth_gbps:.1f} GB/s")
    for isa in isas:
        _C_cpu.force_isa(isa)
        torch.manual_seed(0)  # the same data for every variant
        print(f"kernels {isa}")
        if args.only != "elementwise":
            for hugepages in (False, True) if args.hugepages else (False,):
                for dtype in (torch.bfloat16, torch.float32):
                    for num_seqs in (64, 256):
                        bench_decode(num_seqs, 512, dtype, args.iters, hugepages)
            for dtype in (torch.bfloat16, torch.float32):
                bench_prefill([512], dtype, max(5, args.iters // 5))
                bench_prefill([128, 256, 64], dtype, max(5, args.iters // 5))
        if args.only != "attention":
            print("elementwise steps of one layer (per layer: 2 add + norm, RoPE, SiLU * up)")
            for dtype in (torch.bfloat16, torch.float32):
                for num_tokens in (1, 64, 256):
                    bench_elementwise(num_tokens, dtype, 4 * args.iters)
    if args.json:
        summary = {
            "cpu": cpu_model(),
            "threads": args.threads,
            "isas": isas,
            "memory_bandwidth_gbps": bandwidth_gbps,
            "results": RESULTS,
        }
        with open(args.json, "w") as file:
            json.dump(summary, file, indent=1)


if __name__ == "__main__":
    main()
