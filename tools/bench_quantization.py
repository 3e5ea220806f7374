"""Weight-only int8 quantization on CPU (not a test): decode speed and agreement with the
unquantized model, all measured in one run.

Engines, in process on the same model: float32, float32 with ``quantization="int8"``,
bfloat16, and bfloat16 with int8. For each batch size, the first B chat prompts decode
``--new-tokens`` tokens greedily (EOS ignored); the figure is the generate call's output
tokens per second, its prompts' prefill included, as a user sees it.
Trials alternate engine by engine so a noisy neighbour slows all alike; the best trial
counts.

Agreement with the float32 engine, over every prompt: the fraction of greedy outputs
identical to float32's to the end, the mean position of the first differing token (the output
length where none differs), and the next-token agreement: fed float32's output as context
(prompt logprobs), how often the engine's most likely next token is float32's. A greedy output
diverges for good at its first near-tie, so the last figure is the steadier one. bfloat16 is
shown beside int8 as the everyday reference for "close to float32".

    .venv/bin/python tools/bench_quantization.py [--model DIR] [--batch-sizes 1,8,32]
        [--new-tokens 64] [--trials 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from machine import cpu_model

from pagedserve.frontend import LLM, SamplingParams

# Chat prompts of varied kinds (the embedded model is an instruct model).
PROMPTS = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea at night.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "List three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I reverse a list in Python?",
    "What are the main causes of climate change?",
    "Describe a good morning routine for a student.",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright when it moves?",
    "Write a polite email declining a meeting invitation.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is, with examples.",
    "What are the benefits of regular exercise?",
    "How do airplanes fly?",
    "Suggest a name for a friendly robot and explain why.",
    "What is the tallest mountain in the world?",
    "How do vaccines work?",
    "Give three ideas for a birthday party theme.",
    "What does a database index do?",
    "How can I improve my sleep?",
    "Explain the rules of chess briefly.",
    "What is the water cycle?",
    "Why do cats purr?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is the speed of light?",
    "Describe the taste of a lemon to someone who never had one.",
    "What is machine learning?",
]
ENGINES = [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8")]


def engine_name(dtype: str, quantization: str | None) -> str:
    return dtype if quantization is None else f"{dtype}+{quantization}"


def next_token_agreement(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Over every position of the reference outputs: how often ``llm``'s most likely token,
    given the prompt and the reference output before it, is the reference's token."""
    contexts = [prompt + list(tokens) for prompt, tokens in zip(prompts, reference)]
    scored = llm.generate(
        contexts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    )
    agree = total = 0
    for prompt, tokens, output in zip(prompts, reference, scored):
        for position, token in enumerate(tokens, start=len(prompt)):
            candidates = output.prompt_logprobs[position]
            agree += max(candidates, key=candidates.get) == token
            total += 1
    return agree / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(batch_sizes) > len(PROMPTS):
        parser.error(f"--batch-sizes: at most {len(PROMPTS)} (the prompts)")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    engines: dict[str, LLM] = {}
    prompt_ids: list[list[int]] = []
    for dtype, quantization in ENGINES:
        name = engine_name(dtype, quantization)
        print(f"loading {name}", file=sys.stderr, flush=True)
        llm = LLM(
            args.model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=max(batch_sizes),
            multiprocess=False,
        )
        engines[name] = llm
        if not prompt_ids:
            prompt_ids = [
                llm.tokenizer.encode(
                    llm.render_chat([{"role": "user", "content": text}]),
                    add_special_tokens=False,
                )
                for text in PROMPTS
            ]
        llm.generate(prompt_ids[:2], params)  # warm-up

    # Agreement with float32 over every prompt.
    outputs = {
        name: [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
        for name, llm in engines.items()
    }
    agreement = {}
    for name, tokens in outputs.items():
        firsts = [
            next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
            for mine, ref in zip(tokens, outputs["float32"])
        ]
        agreement[name] = {
            "identical_fraction": sum(f == args.new_tokens for f in firsts) / len(firsts),
            "mean_first_difference": sum(firsts) / len(firsts),
            "next_token_agreement": next_token_agreement(
                engines[name], prompt_ids, outputs["float32"]
            ),
        }

    best_s = {(name, b): float("inf") for name in engines for b in batch_sizes}
    for _ in range(args.trials):
        for b in batch_sizes:
            for name, llm in engines.items():
                started = time.perf_counter()
                llm.generate(prompt_ids[:b], params)
                best_s[name, b] = min(best_s[name, b], time.perf_counter() - started)

    print(f"{cpu_model()}, {args.new_tokens} new tokens per prompt, best of {args.trials}")
    header = "engine          " + "".join(f"  batch {b:>3} tok/s" for b in batch_sizes)
    print(header + "   identical  first diff  next token")
    records = []
    for name in engines:
        rates = [b * args.new_tokens / best_s[name, b] for b in batch_sizes]
        ratios = [
            rate / (b * args.new_tokens / best_s["float32", b])
            for rate, b in zip(rates, batch_sizes)
        ]
        cells = "".join(f"  {rate:7.1f} ({ratio:4.2f}x)" for rate, ratio in zip(rates, ratios))
        a = agreement[name]
        print(
            f"{name:16}{cells}   {a['identical_fraction']:8.0%}  "
            f"{a['mean_first_difference']:9.1f}  {a['next_token_agreement']:9.1%}"
        )
        records.append(
            {
                "engine": name,
                "tokens_per_s": dict(zip(map(str, batch_sizes), rates)),
                "vs_float32": dict(zip(map(str, batch_sizes), ratios)),
                **a,
            }
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": shlex.join([Path(sys.executable).name, *sys.argv]),
                    "cpu_model": cpu_model(),
                    "machine": platform.machine(),
                    "new_tokens": args.new_tokens,
                    "num_prompts": len(PROMPTS),
                    "results": records,
                },
                indent=2,
            )
            + "\n"
        )
    for llm in engines.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
