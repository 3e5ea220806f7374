"""Offline output-token throughput of pagedserve against HF transformers on the same weights.

For each (trace, dtype) the same requests (random prompt token ids, fixed output lengths, EOS
ignored) go through:

    pagedserve          LLM.generate, continuous batching on the paged KV cache
    hf_generate         model.generate on padded batches in arrival order (static batching);
                        only each request's own output length counts as useful tokens
    hf_generate_batch   transformers' continuous batching with its paged cache (the manager
                        behind model.generate_batch, given each request's own max_new_tokens)

(and with ``--torch-linear-peer``, pagedserve again with ``PAGEDSERVE_CPU_LINEAR=torch``: its
float32 linear layers on F.linear / MKL instead of its own packed kernel) and a compute
ceiling: the GEMM rate this CPU reaches in the same run (the faster of F.linear and, in
float32, pagedserve's packed kernel, at 256 rows) divided by the model's linear-layer FLOPs
per output token. Beside it, the trace's roofline: all its FLOPs
(prefill and attention included) at that GEMM rate against the memory traffic no schedule
avoids (every decoded token's read of its keys' K/V, every weight once per step, at least
as many steps as the longest output) at the memory rate measured in the same run (a 512 MiB
copy), the longer of the two, as if perfectly overlapped. On a small model with long
contexts the memory side is the larger.
Machines are shared and noisy: compare the ratios within one run, not figures across runs.

HF peers are slow on a small CPU, so by default they serve only the first `--peer-requests`
requests (64) of the trace; pagedserve then serves that same subset too, and the speedups
compare those matched runs. Model loading, cache allocation and a short warm-up (on prompts
outside the trace) are outside every timed region. Every timed run is cold: pagedserve's
prefix cache is emptied before each one, so no prompt token of a run comes from an earlier
run, as none does for the HF peers; the JSON records each run's prefix-cache hits.

Examples (from the repository root):

    # The full benchmark: both traces, both dtypes, 200 requests each (long on 2 cores).
    .venv/bin/python tools/bench_offline.py --json bench.json

    # A smoke run, end to end in a few minutes.
    .venv/bin/python tools/bench_offline.py --num-requests 8 --peer-requests 4 \\
        --trace alpaca --dtype bfloat16

    # pagedserve alone.
    .venv/bin/python tools/bench_offline.py --trace sharegpt --dtype bfloat16 --skip-peers

    # Another model: a random mixture-of-experts one, made as the tests make theirs.
    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \\
        from helpers.tiny_models import random_hf_model; from pathlib import Path; \\
        random_hf_model(dict(architectures=['MixtralForCausalLM'], hidden_size=512, \\
        intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, \\
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, \\
        vocab_size=32000, max_position_embeddings=2048), Path('/tmp/bench-mixtral'))"
    .venv/bin/python tools/bench_offline.py --model /tmp/bench-mixtral --trace sharegpt \\
        --dtype float32 --num-requests 64 --peer-requests 32
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from machine import cpu_model
from traces import TRACE_SHAPES, Request, make_trace, trace_stats
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    PreTrainedModel,
)

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.model_resolver import resolve_model
from pagedserve.gpu_worker.layers.packed_weights import (
    CPU_LINEAR_ENV,
    PanelWeight,
    packing_available,
)
from pagedserve.gpu_worker.model_config import ModelConfig

DTYPES = ("bfloat16", "float32")
# Token ids below this are special in the embedded model (unk=0, bos=1, eos=2).
FIRST_ORDINARY_TOKEN_ID = 3
DEFAULT_PEER_REQUESTS = 64
# Rows of the timed GEMM: a batch of this many tokens is what a busy decode step multiplies.
GEMM_ROWS = 256
# transformers' own default page size for its continuous batching cache (tokens).
HF_PAGE_SIZE = 256


@dataclass(frozen=True)
class EngineRun:
    """One timed generation: useful output tokens over the wall time of the generate call."""

    num_requests: int
    output_tokens: int
    seconds: float
    # Prompt tokens served from pagedserve's prefix cache during the run (it starts empty);
    # None for the HF peers, which start every run with an empty cache of their own.
    prefix_cache_hit_tokens: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass(frozen=True)
class ModelFlops:
    """Matmul FLOPs of one token through the model, from its config."""

    body_linear_flops: int  # every linear layer of the decoder blocks (experts: the top k)
    lm_head_flops: int
    attention_flops_per_context_token: int  # QK^T and PV, per key the token attends to
    kv_values_per_context_token: int  # K and V of one cached token, every layer
    # Weights of the experts a token does not run: a step of many tokens still reads them.
    idle_expert_params: int = 0

    @property
    def linear_flops_per_output_token(self) -> int:
        return self.body_linear_flops + self.lm_head_flops


# ---------------------------------------------------------------------------- model facts


def embedded_model_path() -> Path:
    return resolve_model(None).path


def model_flops(model_path: Path) -> ModelFlops:
    """Count 2 x in x out of every nn.Linear on a meta-device copy, so no weights load;
    transformers 5 keeps experts in 3-D parameters, not nn.Linear: each token runs the top k
    of them (their gate, up and down projections), counted from the engine's own reading
    of the config."""
    config = AutoConfig.from_pretrained(model_path)
    expert_flops = idle_expert_params = 0
    for spec in ModelConfig.from_dir(model_path).layer_experts:
        if spec is not None:
            params = 3 * config.hidden_size * spec.intermediate_size
            expert_flops += 2 * spec.top_k * params
            idle_expert_params += (spec.num_experts - spec.top_k) * params
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lm_head = model.get_output_embeddings()
    body_flops = sum(
        2 * module.in_features * module.out_features
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not lm_head
    )
    lm_head_flops = 2 * lm_head.in_features * lm_head.out_features
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Per layer and attended key: q.k (2 * head_dim) and p * v (2 * head_dim) for every query head.
    attention_flops = config.num_hidden_layers * config.num_attention_heads * 4 * head_dim
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_values = 2 * config.num_hidden_layers * num_kv_heads * head_dim
    if getattr(config, "kv_lora_rank", None):
        # MLA as pagedserve runs it: one latent and rotated key cached per token and layer;
        # each head scores it whole and sums the latents (kv_b_proj absorbed).
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        per_head = 2 * (latent + config.kv_lora_rank)  # scores over [c | k_pe], sums of c
        attention_flops = config.num_hidden_layers * config.num_attention_heads * per_head
        kv_values = config.num_hidden_layers * latent
    return ModelFlops(
        body_flops + expert_flops, lm_head_flops, attention_flops, kv_values, idle_expert_params
    )


def workload_flops(requests: list[Request], flops: ModelFlops) -> int:
    """FLOPs of the whole trace: prompt and fed-back tokens through the body, one LM head row
    per output token, and causal attention over every position (prefill and decode)."""
    total = 0
    for request in requests:
        # The last output token is sampled, never fed back.
        fed_tokens = len(request.prompt_token_ids) + request.output_len - 1
        attended_keys = fed_tokens * (fed_tokens + 1) // 2
        total += fed_tokens * flops.body_linear_flops
        total += request.output_len * flops.lm_head_flops
        total += attended_keys * flops.attention_flops_per_context_token
    return total


def mean_decode_context(requests: list[Request]) -> float:
    """Mean number of keys attended when producing an output token (output j of a request
    with prompt p attends p + j keys)."""
    attended = sum(
        request.output_len * len(request.prompt_token_ids)
        + request.output_len * (request.output_len - 1) // 2
        for request in requests
    )
    return attended / sum(request.output_len for request in requests)


def measure_gemm_gflop_s(dtype: torch.dtype, rows: int, inner: int, cols: int) -> float:
    """Best of five ~0.2 s trials of [rows, inner] x [inner, cols]; the best, because a ceiling
    should not be lowered by another process stealing a core for a moment."""
    left = torch.randn(rows, inner).to(dtype)
    right = torch.randn(inner, cols).to(dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    for _ in range(5):
        torch.matmul(left, right, out=out)
    best_seconds = math.inf
    for _ in range(5):
        iterations = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.2:
            torch.matmul(left, right, out=out)
            iterations += 1
        best_seconds = min(best_seconds, elapsed / iterations)
    return 2 * rows * inner * cols / best_seconds / 1e9


def measure_packed_gflop_s(rows: int, inner: int, cols: int) -> float:
    """measure_gemm_gflop_s for pagedserve's packed float32 kernel (the same best of five)."""
    left = torch.randn(rows, inner)
    packed = PanelWeight(torch.randn(cols, inner))
    for _ in range(5):
        packed.linear(left, None)
    best_seconds = math.inf
    for _ in range(5):
        iterations = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.2:
            packed.linear(left, None)
            iterations += 1
        best_seconds = min(best_seconds, elapsed / iterations)
    return 2 * rows * inner * cols / best_seconds / 1e9


def measure_memory_gb_s() -> float:
    """Best of five copies of 512 MiB (far past the caches), read + write bytes per second:
    what a kernel streaming the KV cache can approach (tools/bench_ops.py measures the same)."""
    source = torch.ones(1 << 27, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    best_seconds = math.inf
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best_seconds = min(best_seconds, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best_seconds / 1e9


# ---------------------------------------------------------------------------- engines


def load_pagedserve(
    dtype: str, args: argparse.Namespace, multiprocess: bool = False, cpu_linear: str = "packed"
) -> LLM:
    # Read when the worker packs its weights, during the constructor (in this process or a
    # worker process, which inherits the environment).
    previous = os.environ.get(CPU_LINEAR_ENV)
    os.environ[CPU_LINEAR_ENV] = cpu_linear
    try:
        llm = _construct_llm(dtype, args, multiprocess)
    finally:
        if previous is None:
            del os.environ[CPU_LINEAR_ENV]
        else:
            os.environ[CPU_LINEAR_ENV] = previous
    run_pagedserve(llm, _warmup_requests())
    return llm


def _construct_llm(dtype: str, args: argparse.Namespace, multiprocess: bool) -> LLM:
    return LLM(
        model=args.model,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        multiprocess=multiprocess,
    )


def run_pagedserve(llm: LLM, requests: list[Request]) -> EngineRun:
    """One cold run: the prefix cache is emptied first, so no prompt token comes from an
    earlier run on this engine (a warm-up, the whole trace before its peer subset), as none
    does for the HF peers. The hits counted are those among this run's own requests."""
    prompts = [request.prompt_token_ids for request in requests]
    params = [
        SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        for request in requests
    ]
    llm.reset_prefix_cache()
    hits_before = llm.stats()["prefix_cache_hits"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    hit_tokens = int(llm.stats()["prefix_cache_hits"] - hits_before)
    for index, (request, output) in enumerate(zip(requests, outputs)):
        _check_length("pagedserve", index, request, len(output.outputs[0].token_ids))
    return EngineRun(len(requests), sum(r.output_len for r in requests), seconds, hit_tokens)


def load_hf_model(model_path: Path, dtype: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    # ignore_eos: with no EOS generate runs to max_new_tokens; min_new_tokens would instead
    # mask the EOS logit and change the greedy path.
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    run_hf_generate(model, _warmup_requests(), batch_size=2)
    return model


def run_hf_generate(model: PreTrainedModel, requests: list[Request], batch_size: int) -> EngineRun:
    """Static batching: left-padded batches in arrival order, each generating the longest
    output of the batch; tokens past a request's own output length are wasted work."""
    pad_token_id = _pad_token_id(model)
    start = time.perf_counter()
    for batch in _chunks(requests, batch_size):
        width = max(len(request.prompt_token_ids) for request in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long)
            input_ids[row, width - len(prompt) :] = prompt
            attention_mask[row, width - len(prompt) :] = 1
        max_new_tokens = max(request.output_len for request in batch)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        if output.shape[1] != width + max_new_tokens:
            raise RuntimeError(
                f"hf_generate: a batch produced {output.shape[1] - width} new tokens, "
                f"expected {max_new_tokens}; EOS was not disabled"
            )
    seconds = time.perf_counter() - start
    return EngineRun(len(requests), sum(r.output_len for r in requests), seconds)


def hf_continuous_batching_config(
    model: PreTrainedModel, requests: list[Request], args: argparse.Namespace
) -> dict[str, int]:
    """The same limits as pagedserve's: at most max_num_seqs requests and
    max_num_batched_tokens tokens per step, and a cache no bigger than kv_cache_bytes. Within
    that cap the cache holds every request at once, so it never starves the scheduler."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_block = (
        2  # K and V
        * config.num_hidden_layers
        * config.num_key_value_heads
        * head_dim
        * HF_PAGE_SIZE
        * model.dtype.itemsize
    )
    blocks_needed = sum(
        math.ceil((len(request.prompt_token_ids) + request.output_len) / HF_PAGE_SIZE)
        for request in requests
    )
    return _accepted_by_continuous_batching_config(
        {
            "page_size": HF_PAGE_SIZE,
            "num_blocks": max(1, min(blocks_needed, args.kv_cache_bytes // bytes_per_block)),
            "max_batch_tokens": args.max_num_batched_tokens,
            "max_requests_per_batch": args.max_num_seqs,
        }
    )


def _accepted_by_continuous_batching_config(config: dict[str, int]) -> dict[str, int]:
    """``config`` as the installed transformers' ``ContinuousBatchingConfig`` takes it:
    older releases (5.17, the GPU image's) name the page size ``block_size``; a setting it
    does not have is left out, and said (the returned dict is what the run used)."""
    accepted = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    if "page_size" not in accepted and "block_size" in accepted:
        config = {("block_size" if k == "page_size" else k): v for k, v in config.items()}
    dropped = sorted(set(config) - set(accepted))
    if dropped:
        _log(f"ContinuousBatchingConfig has no {', '.join(dropped)}: left at its defaults")
    return {k: v for k, v in config.items() if k in accepted}


def run_hf_generate_batch(
    model: PreTrainedModel, requests: list[Request], cb_config: dict[str, int]
) -> EngineRun:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all
    requests, so this drives the manager it wraps (same scheduler, cache and model runner)
    and gives each request its own max_new_tokens, as pagedserve gets."""
    generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=None,  # the manager turns this into -1: no EOS
        max_new_tokens=max(request.output_len for request in requests),
    )
    results: dict[str, Any] = {}
    # no_grad, not inference_mode: the manager's own thread updates tensors made here in
    # place, which an inference tensor refuses outside inference mode (transformers 5.17).
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(**cb_config),
            block=True,
            timeout=10,
        ) as manager,
    ):
        start = time.perf_counter()
        for index, request in enumerate(requests):
            manager.add_request(
                request.prompt_token_ids,
                request_id=f"bench-{index}",
                max_new_tokens=request.output_len,
            )
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("hf_generate_batch: the generation thread stopped")
                continue
            if result.is_finished():
                results[result.request_id] = result
        seconds = time.perf_counter() - start
    for index, request in enumerate(requests):
        result = results[f"bench-{index}"]
        if result.error is not None:
            raise RuntimeError(f"hf_generate_batch: request {index} failed: {result.error}")
        _check_length("hf_generate_batch", index, request, len(result.generated_tokens))
    return EngineRun(len(requests), sum(r.output_len for r in requests), seconds)


def _warmup_requests() -> list[Request]:
    # First calls pay one-off costs (allocator growth, kernel selection); keep them untimed.
    return [
        Request(prompt_token_ids=list(range(10, 26)), output_len=4),
        Request(prompt_token_ids=list(range(30, 38)), output_len=6),
    ]


def _pad_token_id(model: PreTrainedModel) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def _check_length(engine: str, index: int, request: Request, produced: int) -> None:
    if produced != request.output_len:
        raise RuntimeError(
            f"{engine}: request {index} produced {produced} tokens, expected {request.output_len}"
        )


def _chunks(requests: list[Request], size: int) -> Iterator[list[Request]]:
    for start in range(0, len(requests), size):
        yield requests[start : start + size]


# ---------------------------------------------------------------------------- the run


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "cpu_count": os.cpu_count(),
        # Other processes on the cores slow every engine; a 1-minute load above cpu_count
        # when the record is made means the figures are low, the ratios less so.
        "load_average_1m": os.getloadavg()[0],
    }


@dataclass(frozen=True)
class Gemm:
    """The GEMM rate measured in this run, for one dtype, and the memory rate beside it."""

    shape: tuple[int, int, int]  # rows, inner, cols
    gflop_s: float  # the faster of the two below: the ceiling
    memory_gb_s: float  # read + write bytes of a large copy, per second
    f_linear_gflop_s: float  # torch (MKL / oneDNN)
    packed_gflop_s: float | None  # pagedserve's packed float32 kernel, where it runs


@dataclass(frozen=True)
class TraceRuns:
    """Every timed run of one (trace, dtype); peers are None under --skip-peers."""

    pagedserve: EngineRun
    pagedserve_peer_subset: EngineRun | None = None
    hf_generate: EngineRun | None = None
    hf_generate_batch: EngineRun | None = None
    hf_batch_size: int | None = None
    hf_generate_batch_config: dict[str, int] | None = None
    # --multiprocess: the same requests through LLM(multiprocess=True), right after.
    pagedserve_multiprocess: EngineRun | None = None
    # --torch-linear-peer: the same requests with PAGEDSERVE_CPU_LINEAR=torch, right after.
    pagedserve_torch_linear: EngineRun | None = None


def benchmark_dtype(
    dtype: str,
    traces: dict[str, list[Request]],
    model_path: Path,
    gemm_shape: tuple[int, int, int],
    args: argparse.Namespace,
) -> tuple[Gemm, dict[str, TraceRuns]]:
    """All traces in one dtype: the GEMM rate, then each engine on each trace."""
    f_linear = measure_gemm_gflop_s(getattr(torch, dtype), *gemm_shape)
    packed = None
    if dtype == "float32" and packing_available(torch.empty(1, 1)):
        packed = measure_packed_gflop_s(*gemm_shape)
    gemm = Gemm(gemm_shape, max(f_linear, packed or 0.0), measure_memory_gb_s(), f_linear, packed)
    _log(
        f"[{dtype}] GEMM {'x'.join(map(str, gemm_shape))}: {f_linear:.0f} GFLOP/s torch"
        + ("" if packed is None else f", {packed:.0f} packed")
        + f", memory {gemm.memory_gb_s:.1f} GB/s"
    )
    llm = load_pagedserve(dtype, args)
    split = load_pagedserve(dtype, args, multiprocess=True) if args.multiprocess else None
    torch_linear = (
        load_pagedserve(dtype, args, cpu_linear="torch") if args.torch_linear_peer else None
    )
    hf_model = None if args.skip_peers else load_hf_model(model_path, dtype)
    results = {}
    for trace_name, requests in traces.items():
        _log(f"[{dtype} {trace_name}] pagedserve on {len(requests)} requests")
        pagedserve = run_pagedserve(llm, requests)
        multiprocess_run = None
        if split is not None:
            _log(f"[{dtype} {trace_name}] pagedserve multi-process on {len(requests)} requests")
            multiprocess_run = run_pagedserve(split, requests)
        torch_linear_run = None
        if torch_linear is not None:
            _log(f"[{dtype} {trace_name}] pagedserve on F.linear on {len(requests)} requests")
            torch_linear_run = run_pagedserve(torch_linear, requests)
        if hf_model is None:
            results[trace_name] = TraceRuns(
                pagedserve,
                pagedserve_multiprocess=multiprocess_run,
                pagedserve_torch_linear=torch_linear_run,
            )
            continue
        peer_requests = requests[: args.peer_requests]
        if len(peer_requests) == len(requests):
            pagedserve_subset = pagedserve
        else:
            _log(f"[{dtype} {trace_name}] pagedserve on the {len(peer_requests)} peer requests")
            pagedserve_subset = run_pagedserve(llm, peer_requests)
        batch_size = args.hf_batch_size or args.max_num_seqs
        _log(f"[{dtype} {trace_name}] hf_generate on {len(peer_requests)}, batches of {batch_size}")
        hf_generate = run_hf_generate(hf_model, peer_requests, batch_size)
        cb_config = hf_continuous_batching_config(hf_model, peer_requests, args)
        _log(f"[{dtype} {trace_name}] hf_generate_batch on {len(peer_requests)}, {cb_config}")
        hf_generate_batch = run_hf_generate_batch(hf_model, peer_requests, cb_config)
        results[trace_name] = TraceRuns(
            pagedserve,
            pagedserve_subset,
            hf_generate,
            hf_generate_batch,
            batch_size,
            cb_config,
            multiprocess_run,
            torch_linear_run,
        )
    if split is not None:
        split.shutdown()
    return gemm, results


def make_record(
    trace_name: str,
    dtype: str,
    requests: list[Request],
    runs: TraceRuns,
    gemm: Gemm,
    flops: ModelFlops,
    args: argparse.Namespace,
) -> dict[str, Any]:
    gemm_flop_s = gemm.gflop_s * 1e9
    ceiling_tok_s = gemm_flop_s / flops.linear_flops_per_output_token
    stats = trace_stats(requests)
    flop_seconds = workload_flops(requests, flops) / gemm_flop_s
    workload_ceiling = stats.total_output_tokens / flop_seconds
    context = mean_decode_context(requests)
    subset = runs.pagedserve_peer_subset
    # The roofline of this exact trace: all its FLOPs (prompts, fed-back tokens, LM head,
    # attention) at the GEMM rate, against the memory traffic no schedule avoids at the
    # memory rate: every decoded token reads its keys' K/V, and every step reads every
    # weight once (they are far larger than the caches), with at least as many steps as
    # the longest output has tokens. Even perfectly overlapped, the run takes the longer of
    # the two. The FLOP ceiling alone ignores the memory side, which on a small model with
    # long contexts is the larger. Still optimistic: prefill's K/V reads, activations and
    # everything outside the two rates are free.
    item_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    kv_read_bytes = flops.kv_values_per_context_token * item_bytes * context
    weight_bytes = (
        flops.linear_flops_per_output_token // 2 + flops.idle_expert_params
    ) * item_bytes
    min_steps = max(request.output_len for request in requests)
    memory_seconds = (kv_read_bytes * stats.total_output_tokens + weight_bytes * min_steps) / (
        gemm.memory_gb_s * 1e9
    )
    roofline_tok_s = stats.total_output_tokens / max(flop_seconds, memory_seconds)

    def speedup(peer: EngineRun | None) -> float | None:
        if peer is None or subset is None:
            return None
        return subset.tokens_per_s / peer.tokens_per_s

    peer_hit_tokens = _prefix_cache_hits(subset) if runs.hf_generate is not None else None

    return {
        "trace": trace_name,
        "model": str(args.model) if args.model else "embedded",
        "dtype": dtype,
        "num_requests": len(requests),
        "peer_num_requests": None if subset is None else subset.num_requests,
        "pagedserve_tok_s": runs.pagedserve.tokens_per_s,
        "hf_generate_tok_s": _rate(runs.hf_generate),
        "hf_generate_batch_tok_s": _rate(runs.hf_generate_batch),
        "ceiling_tok_s": ceiling_tok_s,
        "gemm_gflop_s": gemm.gflop_s,
        # Both speedups compare pagedserve and the peer on the same peer_num_requests requests.
        "speedup_vs_hf_generate": speedup(runs.hf_generate),
        "speedup_vs_hf_generate_batch": speedup(runs.hf_generate_batch),
        "fraction_of_ceiling": runs.pagedserve.tokens_per_s / ceiling_tok_s,
        "memory_gb_s": gemm.memory_gb_s,
        "kv_read_bytes_per_output_token": kv_read_bytes,
        "roofline_flop_seconds": flop_seconds,
        "roofline_memory_seconds": memory_seconds,
        "roofline_weight_read_bytes_per_step": weight_bytes,
        "roofline_min_steps": min_steps,
        "roofline_tok_s": roofline_tok_s,
        "roofline_fraction_of_ceiling": roofline_tok_s / ceiling_tok_s,
        "fraction_of_roofline": runs.pagedserve.tokens_per_s / roofline_tok_s,
        "pagedserve_multiprocess_tok_s": _rate(runs.pagedserve_multiprocess),
        "multiprocess_fraction_of_in_process": None
        if runs.pagedserve_multiprocess is None
        else runs.pagedserve_multiprocess.tokens_per_s / runs.pagedserve.tokens_per_s,
        "pagedserve_torch_linear_tok_s": _rate(runs.pagedserve_torch_linear),
        "speedup_vs_torch_linear": None
        if runs.pagedserve_torch_linear is None
        else runs.pagedserve.tokens_per_s / runs.pagedserve_torch_linear.tokens_per_s,
        "gemm_f_linear_gflop_s": gemm.f_linear_gflop_s,
        "gemm_packed_gflop_s": gemm.packed_gflop_s,
        "pagedserve_seconds": runs.pagedserve.seconds,
        "max_num_seqs": args.max_num_seqs,
        "command": shlex.join(sys.orig_argv),
        "pagedserve_peer_subset_tok_s": _rate(subset),
        "pagedserve_peer_subset_seconds": _seconds(subset),
        "hf_generate_seconds": _seconds(runs.hf_generate),
        "hf_generate_batch_seconds": _seconds(runs.hf_generate_batch),
        "hf_batch_size": runs.hf_batch_size,
        "hf_generate_batch_config": runs.hf_generate_batch_config,
        "hf_generate_batch_max_new_tokens": None
        if runs.hf_generate_batch is None
        else "per request, through the manager that generate_batch wraps",
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_bytes": args.kv_cache_bytes,
        "seed": args.seed,
        "max_len": args.max_len,
        "trace_stats": asdict(stats),
        "gemm_shape": list(gemm.shape),
        "linear_gflop_per_output_token": flops.linear_flops_per_output_token / 1e9,
        "mean_decode_context_tokens": context,
        "attention_gflop_per_output_token": flops.attention_flops_per_context_token * context / 1e9,
        # Also charges prompt tokens and attention at the GEMM rate: a tighter, still optimistic
        # ceiling for this exact trace.
        "ceiling_workload_tok_s": workload_ceiling,
        "machine": machine_info(),
        # Prompt tokens each timed run took from the prefix cache (emptied before each run).
        "pagedserve_prefix_cache_hit_tokens": _prefix_cache_hits(runs.pagedserve),
        "pagedserve_peer_subset_prefix_cache_hit_tokens": _prefix_cache_hits(subset),
        "pagedserve_multiprocess_prefix_cache_hit_tokens": _prefix_cache_hits(
            runs.pagedserve_multiprocess
        ),
        "pagedserve_torch_linear_prefix_cache_hit_tokens": _prefix_cache_hits(
            runs.pagedserve_torch_linear
        ),
        "hf_generate_prefix_cache_hit_tokens": None,
        "hf_generate_batch_prefix_cache_hit_tokens": None,
        "hf_prefix_cache_hit_tokens_null_because": "not counted: every HF run starts with an "
        "empty cache (generate keeps none between calls; generate_batch's manager and its "
        "paged cache are made and destroyed for each run)",
        # True when pagedserve's peer-subset run took no prompt token from its prefix cache
        # (the HF runs start empty): the speedups then compare cold runs only.
        "peer_comparison_prefix_cache_hit_tokens": peer_hit_tokens,
        "peer_comparison_cold": None if peer_hit_tokens is None else peer_hit_tokens == 0,
    }


def _rate(run: EngineRun | None) -> float | None:
    return None if run is None else run.tokens_per_s


def _seconds(run: EngineRun | None) -> float | None:
    return None if run is None else run.seconds


def _prefix_cache_hits(run: EngineRun | None) -> int | None:
    return None if run is None else run.prefix_cache_hit_tokens


def format_table(records: list[dict[str, Any]]) -> str:
    columns = [
        ("trace", "trace", "{}"),
        ("dtype", "dtype", "{}"),
        ("reqs", "num_requests", "{}"),
        ("peer", "peer_num_requests", "{}"),
        ("pagedserve", "pagedserve_tok_s", "{:.1f}"),
        ("ps@peer", "pagedserve_peer_subset_tok_s", "{:.1f}"),
        ("ps_mp", "pagedserve_multiprocess_tok_s", "{:.1f}"),
        ("mp/in", "multiprocess_fraction_of_in_process", "{:.1%}"),
        ("hf_gen", "hf_generate_tok_s", "{:.1f}"),
        ("hf_gen_batch", "hf_generate_batch_tok_s", "{:.1f}"),
        ("ceiling", "ceiling_tok_s", "{:.0f}"),
        ("of_ceil", "fraction_of_ceiling", "{:.1%}"),
        ("roofline", "roofline_tok_s", "{:.0f}"),
        ("of_roof", "fraction_of_roofline", "{:.1%}"),
        ("x_gen", "speedup_vs_hf_generate", "{:.2f}"),
        ("x_gen_batch", "speedup_vs_hf_generate_batch", "{:.2f}"),
        ("x_F.linear", "speedup_vs_torch_linear", "{:.2f}"),
        ("GFLOP/s", "gemm_gflop_s", "{:.0f}"),
        ("GB/s", "memory_gb_s", "{:.1f}"),
    ]
    rows = [[title for title, _, _ in columns]]
    for record in records:
        rows.append(
            ["-" if record[key] is None else fmt.format(record[key]) for _, key, fmt in columns]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", choices=[*TRACE_SHAPES, "all"], default="all")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an HF model directory (default: the embedded model)",
    )
    parser.add_argument(
        "--dtype", choices=[*DTYPES, "all"], default="all", help="weights and KV cache dtype"
    )
    parser.add_argument("--num-requests", type=int, default=200, help="requests per trace")
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help=f"HF peers serve the first N requests (default: min(num_requests, "
        f"{DEFAULT_PEER_REQUESTS}))",
    )
    parser.add_argument("--skip-peers", action="store_true", help="run pagedserve alone")
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="also run pagedserve as separate processes (LLM(multiprocess=True)) on each trace",
    )
    parser.add_argument(
        "--torch-linear-peer",
        action="store_true",
        help="also run pagedserve with PAGEDSERVE_CPU_LINEAR=torch (F.linear, plain weights)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace")
    parser.add_argument("--max-len", type=int, default=1024, help="cap on prompt + output tokens")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="requests per step (both engines)"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (both engines)"
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=4 << 30, help="KV cache cap (both engines)"
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="hf_generate batch (default: max_num_seqs)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    for name in (
        "num_requests",
        "max_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_bytes",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        parser.error(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    if args.peer_requests is None:
        args.peer_requests = min(args.num_requests, DEFAULT_PEER_REQUESTS)
    if not 1 <= args.peer_requests <= args.num_requests:
        parser.error(
            f"--peer-requests must be in [1, --num-requests={args.num_requests}], "
            f"got {args.peer_requests}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = args.model or embedded_model_path()
    config = AutoConfig.from_pretrained(model_path)
    flops = model_flops(model_path)
    max_len = min(args.max_len, config.max_position_embeddings)
    trace_names = list(TRACE_SHAPES) if args.trace == "all" else [args.trace]
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    traces = {
        name: make_trace(
            name, args.num_requests, args.seed, max_len, config.vocab_size, FIRST_ORDINARY_TOKEN_ID
        )
        for name in trace_names
    }
    gemm_shape = (GEMM_ROWS, config.hidden_size, config.intermediate_size)
    records = []
    for dtype in dtypes:
        gemm, results = benchmark_dtype(dtype, traces, model_path, gemm_shape, args)
        for trace_name, runs in results.items():
            records.append(
                make_record(trace_name, dtype, traces[trace_name], runs, gemm, flops, args)
            )
    print(format_table(records))
    machine = machine_info()
    print(
        f"\n{machine['cpu_model']}, {machine['cpu_count']} CPUs, {machine['torch_threads']} "
        f"torch threads, 1-minute load {machine['load_average_1m']:.1f}"
    )
    if machine["load_average_1m"] > (machine["cpu_count"] or 1):
        print("NOTE: other processes compete for the cores: absolute figures are low")
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {args.json}")
    warm = [r for r in records if r["peer_comparison_cold"] is False]
    for record in warm:
        print(
            f"ERROR: [{record['dtype']} {record['trace']}] pagedserve's peer-subset run took "
            f"{record['peer_comparison_prefix_cache_hit_tokens']} prompt tokens from its prefix "
            "cache (prompts sharing a block, or preempted requests re-admitted), which the "
            "peers compute: its speedups are not cold against cold",
            file=sys.stderr,
        )
    return 1 if warm else 0


def _log(message: str) -> None:
    print(f"bench_offline: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
