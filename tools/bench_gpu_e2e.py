"""End-to-end offline throughput on one GPU: pagedserve (device="cuda") against HF transformers
on the same GPU and the same weights, float16, on the ShareGPT-like trace of tools/traces.py.

    pagedserve          LLM.generate on the GPU, continuous batching on the paged KV cache
    hf_generate         model.generate on padded batches in arrival order (static batching)
    hf_generate_batch   transformers' continuous batching (the manager behind generate_batch)

The model is Llama-2-7B-shaped (32 layers, hidden 4096, 32 heads of 128, FFN 11008, vocab
32000) with random weights: created once on the GPU, saved as safetensors (to /dev/shm by
default, so nothing large touches the disk) for pagedserve to load, and kept in memory as the
HF peer. EOS is ignored; every request generates exactly its trace output length. Peers serve
the first --peer-requests requests; pagedserve serves that subset too, and the whole trace.
Every timed run is cold: warm-ups run requests of another trace (seed 1), and pagedserve's
prefix cache is emptied before each timed run; the JSON records each run's prefix-cache hits.

Each stage is skipped once --deadline-s has passed, and the JSON is rewritten after every
stage, so a run cut short still reports what it measured.

    python tools/bench_gpu_e2e.py --json e2e.json
    python tools/bench_gpu_e2e.py --layers 4 --num-requests 32 --peer-requests 8   # smoke
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
SHAPES = {"llama7b": LLAMA_7B, "tiny": TINY}
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
    """The random Llama-7B-shaped model on the GPU in float16, also saved for pagedserve."""
    config = transformers.LlamaConfig(**model_shape(args))
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.float16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    return {**SHAPES[args.shape], "num_hidden_layers": args.layers}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-7B)")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama7b")
    parser.add_argument("--device", default="cuda", help="cpu only for smoke runs")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--peer-requests", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024, help="prompt + output cap")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=40 << 30)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--model-dir", default="/dev/shm/pagedserve-llama7b-random")
    parser.add_argument("--deadline-s", type=float, default=200.0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-cuda-graphs-stage",
        dest="cuda_graphs_stage",
        action="store_false",
        help="skip the last stage: pagedserve with cuda_graphs=True on the peer subset",
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        _log("no CUDA GPU")
        return 2
    report = Report(args.json, args.deadline_s)
    report.data.update(
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        torch=torch.__version__,
        transformers=transformers.__version__,
        command=" ".join(sys.argv),
        model={**model_shape(args), "dtype": "float16"},
        prefix_cache_note=NO_PREFIX_CACHE_NOTE,
    )
    requests = make_trace("sharegpt", args.num_requests, seed=0, max_len=args.max_len,
                          vocab_size=model_shape(args)["vocab_size"])  # fmt: skip
    peer_requests = requests[: args.peer_requests]
    warmup_requests = make_trace(
        "sharegpt",
        4,
        WARMUP_SEED,
        args.max_len,
        model_shape(args)["vocab_size"],
        length_scale=WARMUP_LENGTH_SCALE,
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

    def load(cuda_graphs: bool = False) -> dict[str, Any]:
        started = time.perf_counter()
        models["llm"] = LLM(
            args.model_dir,
            dtype="float16",
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

    report.stage("create_model", create)
    if "hf" not in models:
        return 1
    report.stage("pagedserve_load", load)
    if "llm" in models:
        llm = models.pop("llm")
        report.stage("pagedserve_peer_subset", lambda: run_pagedserve(llm, peer_requests))
        report.stage("pagedserve_all", lambda: run_pagedserve(llm, requests))
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    hf_model = models["hf"]
    report.stage("hf_warmup", lambda: run_hf_generate(hf_model, warmup_requests[:2], 2))
    report.stage(
        "hf_generate", lambda: run_hf_generate(hf_model, peer_requests, args.hf_batch_size)
    )
    report.stage("hf_generate_batch", lambda: run_hf_generate_batch(hf_model, peer_requests, args))
    if args.cuda_graphs_stage and args.device == "cuda":
        # Last, so that a failure here costs no other figure: decode steps from CUDA graphs.
        report.stage("pagedserve_graphs_load", lambda: load(cuda_graphs=True))
        if "llm" in models:
            llm = models.pop("llm")
            report.stage(
                "pagedserve_graphs_peer_subset", lambda: run_pagedserve(llm, peer_requests)
            )
            llm.shutdown()
    stages = report.data["stages"]
    peer_stages = ("pagedserve_peer_subset", "pagedserve_graphs_peer_subset")
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
    ours = stages.get("pagedserve_peer_subset", {}).get("output_tokens_per_s")
    ours_graphs = stages.get("pagedserve_graphs_peer_subset", {}).get("output_tokens_per_s")
    for peer in ("hf_generate", "hf_generate_batch"):
        theirs = stages.get(peer, {}).get("output_tokens_per_s")
        if ours and theirs:
            report.data.setdefault("speedup", {})[f"pagedserve_over_{peer}"] = ours / theirs
        if ours_graphs and theirs:
            speedups = report.data.setdefault("speedup", {})
            speedups[f"pagedserve_graphs_over_{peer}"] = ours_graphs / theirs
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
