"""End-to-end offline throughput on one GPU: pagedserve (device="cuda") against HF transformers
on the same GPU and the same weights, on the ShareGPT-like trace of tools/traces.py, and
against the trace's decode memory roofline measured in the same run.

    pagedserve          LLM.generate on the GPU, continuous batching on the paged KV cache,
                        decode steps from CUDA graphs (and, time permitting, without them)
    hf_generate_batch   transformers' continuous batching (the manager behind generate_batch)
    hf_generate         model.generate on padded batches in arrival order (static batching)
    roofline            the trace decoded as continuous batching of --max-num-seqs would,
                        every step reading every weight once (the input embedding's table
                        aside: a step reads only its rows) and every running sequence's K/V,
                        at the device-to-device copy's bandwidth measured here: the output
                        tokens per second no engine passes on this GPU

The model is Llama-3-8B-shaped by default (32 layers, hidden 4096, 32 query heads and 8 KV
heads of 128, FFN 14336, vocab 128256; bfloat16) or Llama-2-7B-shaped (``--shape llama7b``),
with random weights: created once on the device, saved as safetensors (to /dev/shm by
default, so nothing large touches the disk) for pagedserve to load, and kept in memory as the
HF peer. EOS is ignored; every request generates exactly its trace output length. Peers serve
the first --peer-requests requests; pagedserve serves that subset too, and the whole trace.
Every timed run is cold: warm-ups run requests of another trace (seed 1), and pagedserve's
prefix cache is emptied before each timed run; the JSON records each run's prefix-cache hits.

Each stage is skipped once --deadline-s has passed, and the JSON is rewritten after every
stage, so a run cut short still reports what it measured.

    python tools/bench_gpu_e2e.py --json e2e.json
    python tools/bench_gpu_e2e.py --shape tiny --device cpu --num-requests 8 --peer-requests 4
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers
from bench_cuda import copy_gb_s
from traces import Request, make_trace, trace_stats

from pagedserve.frontend import LLM, SamplingParams

LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# A few-MB model of the same family, for smoke runs of this script (also on a CPU).
TINY = {
    **LLAMA_7B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
}
LLAMA3_8B = {
    **LLAMA_7B,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
SHAPES = {"llama3_8b": LLAMA3_8B, "llama7b": LLAMA_7B, "tiny": TINY}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The timed trace is drawn with seed 0; warm-ups draw theirs with this one, so that they run
# none of the timed prompts, at half the lengths (a few hundred decode steps suffice to touch
# the allocator and kernels).
WARMUP_SEED = 1
WARMUP_LENGTH_SCALE = 0.5
NO_PREFIX_CACHE_NOTE = (
    "prefix_cache_hit_tokens is null for the HF peers: not counted, every HF run starts with an "
    "empty cache (generate keeps none between calls; generate_batch's manager is made per run)"
)


class Report:
    """The results so far, written to --json after every stage."""

    def __init__(self, path: str | None, deadline_s: float) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.deadline_s = deadline_s
        self.data: dict[str, Any] = {"stages": {}, "skipped": {}, "errors": {}}

    def time_left(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.started)

    def stage(self, name: str, run) -> Any:
        if self.time_left() <= 0:
            self.data["skipped"][name] = f"deadline of {self.deadline_s:.0f} s passed"
            self.write()
            return None
        _log(f"{name} ...")
        started = time.perf_counter()
        try:
            result = run()
        except Exception as error:  # a failing peer must not hide the other figures
            self.data["errors"][name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            self.write()
            return None
        self.data["stages"][name] = {"wall_s": time.perf_counter() - started, **(result or {})}
        _log(f"{name}: {json.dumps(self.data['stages'][name])}")
        self.write()
        return result

    def write(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.started
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=2))


def _log(message: str) -> None:
    print(f"bench_gpu_e2e: {message}", file=sys.stderr, flush=True)


def create_model(args: argparse.Namespace) -> transformers.PreTrainedModel:
    """The random model of --shape on the device in --dtype, also saved for pagedserve."""
    config = transformers.LlamaConfig(**model_shape(args))
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(DTYPES[args.dtype]).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    return {**shape, "num_hidden_layers": args.layers or shape["num_hidden_layers"]}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy_params(requests: list[Request]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        for request in requests
    ]


def run_pagedserve(llm: LLM, requests: list[Request]) -> dict[str, Any]:
    """One cold run: the prefix cache is emptied first, so no prompt token comes from an
    earlier run on this engine, as none does for the HF peers; the hits counted are those
    among this run's own requests."""
    prompts = [request.prompt_token_ids for request in requests]
    llm.reset_prefix_cache()
    hits_before = llm.stats()["prefix_cache_hits"]
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy_params(requests))
    seconds = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    expected = sum(request.output_len for request in requests)
    if produced != expected:
        raise RuntimeError(f"pagedserve produced {produced} tokens, expected {expected}")
    result = _throughput(requests, seconds)
    result["prefix_cache_hit_tokens"] = int(llm.stats()["prefix_cache_hits"] - hits_before)
    return result


def run_hf_generate(
    model: transformers.PreTrainedModel, requests: list[Request], batch_size: int
) -> dict[str, Any]:
    """Left-padded batches in arrival order, each generating its longest output."""
    synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            width = max(len(request.prompt_token_ids) for request in batch)
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, request in enumerate(batch):
                prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long)
                input_ids[row, width - len(prompt) :] = prompt
                attention_mask[row, width - len(prompt) :] = 1
            max_new_tokens = max(request.output_len for request in batch)
            output = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            if output.shape[1] != width + max_new_tokens:
                raise RuntimeError("hf_generate stopped early: EOS was not disabled")
    synchronize()
    result = _throughput(requests, time.perf_counter() - start)
    result["batch_size"] = batch_size
    result["prefix_cache_hit_tokens"] = None  # not counted: see NO_PREFIX_CACHE_NOTE
    return result


def run_hf_generate_batch(
    model: transformers.PreTrainedModel, requests: list[Request], args: argparse.Namespace
) -> dict[str, Any]:
    """transformers' continuous batching, with pagedserve's batch limits (bench_offline.py)."""
    import bench_offline  # the HF continuous-batching driver lives there

    cb_args = argparse.Namespace(
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    cb_config = bench_offline.hf_continuous_batching_config(model, requests, cb_args)
    run = bench_offline.run_hf_generate_batch(model, requests, cb_config)
    result = _throughput(requests, run.seconds)
    result["config"] = cb_config
    result["prefix_cache_hit_tokens"] = None  # not counted: see NO_PREFIX_CACHE_NOTE
    return result


def _throughput(requests: list[Request], seconds: float) -> dict[str, Any]:
    output_tokens = sum(request.output_len for request in requests)
    return {
        "num_requests": len(requests),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
    }


def decode_roofline(
    requests: list[Request],
    max_num_seqs: int,
    weight_bytes: int,
    kv_bytes_per_token: int,
    bandwidth_bytes_s: float,
) -> dict[str, Any]:
    """The trace's decode memory roofline: its requests decoded in arrival order with at
    most ``max_num_seqs`` at once, each step producing one token of every running request,
    reading ``weight_bytes`` and each running request's K/V (its prompt and the tokens it
    has produced, ``kv_bytes_per_token`` each) at ``bandwidth_bytes_s``. Prefill and
    everything else are free: no engine's output tokens per second pass this."""
    waiting = [(len(request.prompt_token_ids), request.output_len) for request in requests]
    waiting.reverse()
    running: list[list[int]] = []  # [context tokens, tokens still to produce]
    steps = context_tokens = 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            prompt_len, output_len = waiting.pop()
            running.append([prompt_len, output_len])
        steps += 1
        for sequence in running:
            context_tokens += sequence[0]
            sequence[0] += 1
            sequence[1] -= 1
        running = [sequence for sequence in running if sequence[1] > 0]
    read_bytes = steps * weight_bytes + context_tokens * kv_bytes_per_token
    seconds = read_bytes / bandwidth_bytes_s
    output_tokens = sum(request.output_len for request in requests)
    return {
        "steps": steps,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_read_bytes": context_tokens * kv_bytes_per_token,
        "read_bytes": read_bytes,
        "bandwidth_gb_s": bandwidth_bytes_s / 1e9,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
    }


def model_read_bytes(model: transformers.PreTrainedModel) -> tuple[int, int]:
    """What a decode step reads of ``model``: every weight but the input embedding's table
    (each step gathers a row per sequence); and the K/V bytes of one token, all layers."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.get_output_embeddings().weight is not embedding:
        weights -= embedding.numel() * embedding.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return weights, kv * embedding.element_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3_8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (the shape's)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu only for smoke runs")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--peer-requests", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024, help="prompt + output cap")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    # The trace needs at most 96 x 1024 tokens (12 GiB at the 8B shape's 128 KiB a token);
    # the rest of an H100's memory holds the two copies of the weights.
    parser.add_argument("--kv-cache-bytes", type=int, default=16 << 30)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--model-dir", default="/dev/shm/pagedserve-e2e-random")
    parser.add_argument("--deadline-s", type=float, default=200.0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-eager-stage",
        dest="eager_stage",
        action="store_false",
        help="skip the last stage: pagedserve without CUDA graphs on the peer subset",
    )
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        _log("no CUDA GPU")
        return 2
    report = Report(args.json, args.deadline_s)
    report.data.update(
        device=torch.cuda.get_device_name() if on_gpu else args.device,
        torch=torch.__version__,
        transformers=transformers.__version__,
        command=" ".join(sys.argv),
        model={**model_shape(args), "dtype": args.dtype},
        prefix_cache_note=NO_PREFIX_CACHE_NOTE,
    )
    vocab_size = model_shape(args)["vocab_size"]
    requests = make_trace("sharegpt", args.num_requests, seed=0, max_len=args.max_len,
                          vocab_size=vocab_size)  # fmt: skip
    peer_requests = requests[: args.peer_requests]
    warmup_requests = make_trace(
        "sharegpt", 4, WARMUP_SEED, args.max_len, vocab_size, length_scale=WARMUP_LENGTH_SCALE
    )
    report.data["trace"] = {
        "name": "sharegpt",
        "all": trace_stats(requests).__dict__,
        "peer_subset": trace_stats(peer_requests).__dict__,
    }
    models: dict[str, Any] = {}

    def create() -> dict[str, Any]:
        models["hf"] = create_model(args)
        return {"model_dir": args.model_dir}

    def roofline() -> dict[str, Any]:
        # The bandwidth a device-to-device copy reaches (read + write), as bench_cuda.py
        # measures it; on a CPU smoke run, a host copy's, as bench_offline.py measures it.
        if on_gpu:
            bandwidth = copy_gb_s(1 << 30) * 1e9
        else:
            import bench_offline

            bandwidth = bench_offline.measure_memory_gb_s() * 1e9
        weight_bytes, kv_bytes = model_read_bytes(models["hf"])
        return decode_roofline(requests, args.max_num_seqs, weight_bytes, kv_bytes, bandwidth)

    def load(cuda_graphs: bool) -> dict[str, Any]:
        started = time.perf_counter()
        models["llm"] = LLM(
            args.model_dir,
            dtype=args.dtype,
            device=args.device,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_len,
            cuda_graphs=cuda_graphs,
        )
        load_s = time.perf_counter() - started
        run_pagedserve(models["llm"], warmup_requests)  # warm-up: allocator, kernels
        return {"num_blocks": models["llm"].worker.num_blocks, "load_s": load_s}

    def close_llm() -> None:
        models.pop("llm").shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    report.stage("create_model", create)
    if "hf" not in models:
        return 1
    report.stage("roofline", roofline)
    # pagedserve as served on a GPU: decode steps from CUDA graphs.
    report.stage("pagedserve_load", lambda: load(cuda_graphs=on_gpu))
    if "llm" in models:
        llm = models["llm"]
        report.stage("pagedserve_peer_subset", lambda: run_pagedserve(llm, peer_requests))
        report.stage("pagedserve_all", lambda: run_pagedserve(llm, requests))
        close_llm()
    hf_model = models["hf"]
    report.stage("hf_warmup", lambda: run_hf_generate(hf_model, warmup_requests[:1], 1))
    report.stage("hf_generate_batch", lambda: run_hf_generate_batch(hf_model, peer_requests, args))
    report.stage(
        "hf_generate", lambda: run_hf_generate(hf_model, peer_requests, args.hf_batch_size)
    )
    if args.eager_stage and on_gpu:
        # Last, so that it costs no other figure: the same without CUDA graphs.
        report.stage("pagedserve_eager_load", lambda: load(cuda_graphs=False))
        if "llm" in models:
            llm = models["llm"]
            report.stage("pagedserve_eager_peer_subset", lambda: run_pagedserve(llm, peer_requests))
            close_llm()
    summarize(report)
    report.write()
    return 0


def summarize(report: Report) -> None:
    """Speedups over the peers (on the peer subset), the fraction of the roofline (on the
    whole trace) and whether the peer comparison was cold."""
    stages = report.data["stages"]
    peer_stages = ("pagedserve_peer_subset", "pagedserve_eager_peer_subset")
    peer_runs = [stages[name] for name in peer_stages if name in stages]
    peer_hit_tokens = sum(run["prefix_cache_hit_tokens"] for run in peer_runs)
    # True when pagedserve's runs on the peers' requests took no prompt token from its prefix
    # cache: the speedups then compare cold runs only.
    report.data["peer_comparison_prefix_cache_hit_tokens"] = peer_hit_tokens
    report.data["peer_comparison_cold"] = peer_hit_tokens == 0 if peer_runs else None
    if peer_hit_tokens:
        _log(
            f"WARNING: pagedserve took {peer_hit_tokens} prompt tokens of the peers' requests "
            "from its prefix cache, which the peers compute: the speedups are not cold"
        )
    rate = {name: stage.get("output_tokens_per_s") for name, stage in stages.items()}
    speedups = report.data.setdefault("speedup", {})
    for ours in peer_stages:
        for peer in ("hf_generate", "hf_generate_batch"):
            if rate.get(ours) and rate.get(peer):
                label = ours.removesuffix("_peer_subset")
                speedups[f"{label}_over_{peer}"] = rate[ours] / rate[peer]
    if rate.get("pagedserve_all") and rate.get("roofline"):
        report.data["fraction_of_roofline"] = rate["pagedserve_all"] / rate["roofline"]


if __name__ == "__main__":
    sys.exit(main())
