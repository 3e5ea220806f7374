"""What embedding costs: ``LLM.embed`` against HF transformers' batched forward pass on the
same prompts, model and dtype, in one run.

The peer encodes as sentence-transformers does with a decoder embedding model: the inputs
sorted by length (longest first), cut into batches of ``--hf-batch-size``, each padded to its
longest prompt with an attention mask, one forward pass of the base model (no LM head) per
batch, the last real token's final hidden state, L2-normalized. The engine gets the prompts
as one ``embed`` call: prompt-only requests, continuously batched into steps of at most
``--max-num-batched-tokens`` tokens (chunked prefill), no padding.

Prompts: random token ids with the input lengths of the ShareGPT-like trace
(tools/traces.py), ``--length-scale`` times them, capped at ``--max-len``. Both runs must
give the same vectors (largest absolute difference of any value, reported; the run fails
above ``--tolerance``). Engine and peer alternate ``--repeats`` times after a warm-up of
each; medians of prompt tokens/s are reported, and their ratio, engine over HF. Machines
are shared and noisy: read the ratio within one run.

    .venv/bin/python tools/bench_pooling.py --num-prompts 256 \\
        --json docs/bench/pooling_embedded_f32.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from machine import cpu_model
from traces import make_trace

from pagedserve.frontend import LLM
from pagedserve.frontend.model_resolver import resolve_model

# Past the special tokens of the usual vocabularies (the embedded model's are 0-16).
FIRST_ORDINARY_TOKEN_ID = 100


@dataclass
class Timing:
    seconds: float
    prompt_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.seconds


def hf_embed(model, prompts: list[list[int]], batch_size: int, pad_id: int) -> list[torch.Tensor]:
    """sentence-transformers' way: longest first, padded batches, the last real token's
    state, normalized; the vectors back in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    vectors: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            longest = len(prompts[batch[0]])
            ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, index in enumerate(batch):
                ids[row, : len(prompts[index])] = torch.tensor(prompts[index])
                mask[row, : len(prompts[index])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, index in enumerate(batch):
                state = hidden[row, len(prompts[index]) - 1].float()
                vectors[index] = torch.nn.functional.normalize(state, dim=0)
    return vectors  # type: ignore[return-value]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model_dir = resolve_model(args.model).path
    config = json.loads((model_dir / "config.json").read_text())
    trace = make_trace(
        "sharegpt",
        args.num_prompts,
        args.seed,
        args.max_len,
        config["vocab_size"],
        first_token_id=FIRST_ORDINARY_TOKEN_ID,
        length_scale=args.length_scale,
    )
    prompts = [request.prompt_token_ids for request in trace]
    prompt_tokens = sum(map(len, prompts))
    dtype = getattr(torch, args.dtype)
    hf_model = transformers.AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_len,
        enable_prefix_caching=False,  # random prompts share nothing; keep it out of the way
        multiprocess=False,
    )

    def engine_run() -> tuple[Timing, list[list[float]]]:
        started = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        seconds = time.perf_counter() - started
        return Timing(seconds, prompt_tokens), [o.outputs.embedding for o in outputs]

    def hf_run() -> tuple[Timing, list[torch.Tensor]]:
        started = time.perf_counter()
        vectors = hf_embed(hf_model, prompts, args.hf_batch_size, pad_id=0)
        return Timing(time.perf_counter() - started, prompt_tokens), vectors

    engine_run()  # warm-up: packed weights, allocator, oneDNN's kernels
    hf_run()
    engine_timings, hf_timings = [], []
    difference = 0.0
    for repeat in range(args.repeats):
        # Alternating which goes first spreads a noisy neighbour over both.
        if repeat % 2 == 0:
            engine_timing, engine_vectors = engine_run()
            hf_timing, hf_vectors = hf_run()
        else:
            hf_timing, hf_vectors = hf_run()
            engine_timing, engine_vectors = engine_run()
        engine_timings.append(engine_timing)
        hf_timings.append(hf_timing)
        for ours, theirs in zip(engine_vectors, hf_vectors):
            difference = max(difference, (torch.tensor(ours) - theirs).abs().max().item())
        print(
            f"repeat {repeat}: engine {engine_timing.tokens_per_s:.0f} tok/s, "
            f"HF {hf_timing.tokens_per_s:.0f} tok/s",
            file=sys.stderr,
        )
    stats = llm.stats()
    llm.check_integrity()
    engine_median = statistics.median(t.tokens_per_s for t in engine_timings)
    hf_median = statistics.median(t.tokens_per_s for t in hf_timings)
    return {
        "command": " ".join(sys.argv),
        "model": str(args.model or "embedded"),
        "dtype": args.dtype,
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "mean_prompt_len": prompt_tokens / len(prompts),
        "max_prompt_len": max(map(len, prompts)),
        "max_num_batched_tokens": llm.scheduler_config.max_num_batched_tokens,
        "hf_batch_size": args.hf_batch_size,
        "engine_tokens_per_s": [t.tokens_per_s for t in engine_timings],
        "hf_tokens_per_s": [t.tokens_per_s for t in hf_timings],
        "engine_median_tokens_per_s": engine_median,
        "hf_median_tokens_per_s": hf_median,
        "ratio_engine_over_hf": engine_median / hf_median,
        "max_abs_difference": difference,
        "engine_blocks_free": stats["num_free_blocks"] == stats["num_total_blocks"],
        "machine": {
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "load_average_1m": os.getloadavg()[0],
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF directory (default: embedded)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    ok = result["max_abs_difference"] <= args.tolerance and result["engine_blocks_free"]
    if not ok:
        print(
            f"FAILED: the vectors differ by {result['max_abs_difference']:.3g} (tolerance "
            f"{args.tolerance}), or blocks were left held: {result['engine_blocks_free']=}",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
