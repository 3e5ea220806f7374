"""What freeing the blocks behind a sliding window gives a windowed model on a small KV cache
(not a test): throughput and preemptions, with the peer measured in the same run.

The model is a randomly initialised Mistral-shaped model (every layer windowed, ``--window``
tokens), made here with transformers and saved to a temporary directory (nothing is
downloaded). Two in-process engines load it with the same KV cache (``--num-blocks`` blocks
of 16 tokens):

- ``window freeing``: this engine as it runs (blocks wholly behind a sequence's window go
  back to the pool as it grows);
- ``blocks kept``: the same engine with its block manager's freeing switched off, so every
  sequence keeps all its blocks to the end, as before the change (the peer).

Both attend over the same windows (the attention ops read only the window either way), so
the difference is what the cache can hold at once: kept blocks fill it with a few long
sequences and preempt (recompute) the rest. ``--requests`` prompts of ``--prompt-tokens``
random tokens each generate ``--max-tokens`` tokens greedily (EOS ignored), submitted at
once; the figure is output tokens per second of the whole ``generate`` call. The outputs of
the two engines must be identical (freeing must change no token): a mismatch makes the run
invalid (exit status 1). Trials alternate the engines; the best trial counts.
Machines are shared and noisy: compare the engines within one run, not across runs.

    .venv/bin/python tools/bench_window_freeing.py [--window 256] [--num-blocks 64]
        [--requests 12] [--prompt-tokens 128] [--max-tokens 512] [--trials 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model

from pagedserve.frontend import LLM, SamplingParams

BLOCK_SIZE = 16
VOCAB_SIZE = 2048


def make_model(path: Path, window: int, max_positions: int) -> Path:
    """A random Mistral-shaped model (4 layers, 512 hidden, GQA 8/2 heads of 64) at ``path``."""
    import torch
    import transformers

    config = transformers.MistralConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_positions,
        sliding_window=window,
    )
    config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.05)  # wider than HF's default: fewer near-ties
    model.save_pretrained(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256, help="tokens")
    parser.add_argument("--num-blocks", type=int, default=64, help=f"of {BLOCK_SIZE} tokens")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    total_tokens = args.prompt_tokens + args.max_tokens
    if -(-total_tokens // BLOCK_SIZE) > args.num_blocks:
        parser.error(
            f"a request reaches {total_tokens} tokens, more than the {args.num_blocks} blocks "
            "hold: the peer (blocks kept) could not run it"
        )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(VOCAB_SIZE) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    with tempfile.TemporaryDirectory() as model_dir:
        make_model(Path(model_dir), args.window, max(4096, total_tokens))
        engines: dict[str, LLM] = {}
        for name in ("window freeing", "blocks kept"):
            llm = LLM(
                model_dir,
                block_size=BLOCK_SIZE,
                num_blocks=args.num_blocks,
                max_num_seqs=args.requests,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=False,
                multiprocess=False,
            )
            assert llm.scheduler_config.sliding_window == args.window
            if name == "blocks kept":
                llm.engine.block_manager.sliding_window = 0
            llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
            engines[name] = llm

        best_s = dict.fromkeys(engines, float("inf"))
        outputs: dict[str, list[list[int]]] = {}
        counters: dict[str, dict[str, int]] = {}
        for _ in range(args.trials):
            for name, llm in engines.items():
                before = llm.stats()
                started = time.perf_counter()
                results = llm.generate(prompts, params)
                elapsed_s = time.perf_counter() - started
                after = llm.stats()
                if elapsed_s < best_s[name]:
                    best_s[name] = elapsed_s
                    counters[name] = {
                        key: int(after[key] - before[key])
                        for key in (
                            "num_preemptions",
                            "num_recompute_preemptions",
                            "num_window_freed_blocks",
                        )
                    }
                outputs[name] = [r.outputs[0].token_ids for r in results]
        for llm in engines.values():
            llm.shutdown()

    identical = outputs["window freeing"] == outputs["blocks kept"]
    num_output_tokens = args.requests * args.max_tokens
    print(
        f"{cpu_model()}; window {args.window} tokens, KV cache {args.num_blocks} blocks x "
        f"{BLOCK_SIZE} tokens; {args.requests} requests of {args.prompt_tokens} + "
        f"{args.max_tokens} tokens; best of {args.trials}"
    )
    print("engine            tok/s   vs peer   preemptions   blocks freed")
    records = []
    peer_rate = num_output_tokens / best_s["blocks kept"]
    for name, elapsed_s in best_s.items():
        rate = num_output_tokens / elapsed_s
        c = counters[name]
        print(
            f"{name:15} {rate:7.1f}   {rate / peer_rate:5.2f}x   {c['num_preemptions']:11d}"
            f"   {c['num_window_freed_blocks']:12d}"
        )
        records.append(
            {
                "engine": name,
                "seconds": elapsed_s,
                "output_tokens_per_s": rate,
                "vs_peer": rate / peer_rate,
                **c,
            }
        )
    print("outputs identical" if identical else "OUTPUTS DIFFER: the run is invalid")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": shlex.join([Path(sys.executable).name, *sys.argv]),
                    "cpu_model": cpu_model(),
                    "machine": platform.machine(),
                    "window": args.window,
                    "num_blocks": args.num_blocks,
                    "block_size": BLOCK_SIZE,
                    "requests": args.requests,
                    "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "trials": args.trials,
                    "outputs_identical": identical,
                    "results": records,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
