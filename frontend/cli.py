"""``pagedserve``: the command line. ``chat`` answers a message, ``generate`` continues
a prompt, both on the embedded model unless ``--model`` names another."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedserve.scheduler.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument(
        "--model",
        default=None,
        help="local HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    engine.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    engine.add_argument(
        "--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (cuda)"
    )
    engine.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    engine.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="KV cache size (per tensor-parallel rank)"
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N worker processes (heads, MLP rows, vocabulary)",
    )
    engine.add_argument("--max-tokens", type=int, default=128)
    engine.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    engine.add_argument("--seed", type=int, default=None)
    engine.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the output where TEXT first appears (left out of it); repeatable",
    )
    engine.add_argument(
        "--multiprocess",
        action="store_true",
        help="run the scheduler and the worker in processes of their own",
    )
    engine.add_argument("--verbose", action="store_true", help="log engine events to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", parents=[engine], help="answer one user message")
    chat.add_argument("message", nargs="+", help="one or more user messages, answered in a batch")
    generate = commands.add_parser("generate", parents=[engine], help="continue raw prompts")
    generate.add_argument("prompt", nargs="+", help="one or more prompts, run as one batch")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from pagedserve.frontend.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop,
        )
        started = time.monotonic()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            tensor_parallel_size=args.tensor_parallel_size,
            multiprocess=args.multiprocess or None,  # None: chosen by tensor_parallel_size
        )
        ranks = (
            f" on each of {llm.tensor_parallel_size} ranks" if llm.tensor_parallel_size > 1 else ""
        )
        try:
            print(
                f"pagedserve: engine ready in {time.monotonic() - started:.1f} s; KV cache "
                f"{llm.num_blocks} blocks x {args.block_size} tokens "
                f"({llm.bytes_per_block} bytes each{ranks}, at most "
                f"{llm.num_blocks * args.block_size} cached tokens), "
                f"{llm.num_host_blocks} host swap blocks",
                file=sys.stderr,
            )
            if args.command == "chat":
                conversations = [[{"role": "user", "content": text}] for text in args.message]
                outputs = llm.chat(conversations, params)
            else:
                outputs = llm.generate(args.prompt, params)
        finally:
            llm.shutdown()
    except (ValueError, TypeError) as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    for output in outputs:
        if len(outputs) > 1:
            print(f"--- {output.request_id} ({output.outputs[0].finish_reason})")
        print(output.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
