"""Every engine option, declared once (vLLM's ``EngineArgs``).

``EngineArgs`` holds each option's type, default, bounds and help; ``LLM(**options)`` takes
exactly these (``LLM.__init__``), the command line's flags are made from them
(``add_engine_arguments``, ``engine_options_from_cli``), and docs/engine_options.md is written
from them (``python -m pagedserve.frontend.engine_args``). A new option is one field here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.frontend.engine_client import DEFAULT_STARTUP_TIMEOUT_S
from pagedserve.frontend.reasoning import REASONING_PARSERS
from pagedserve.gpu_worker.model_config import KV_CACHE_DTYPES, QUANTIZATION_NAMES
from pagedserve.scheduler.config import ALLOCATION_POLICIES
from pagedserve.scheduler.multiproc_executor import EXECUTOR_BACKENDS
from pagedserve.scheduler.sampling_params import DEFAULT_MAX_LOGPROBS
from pagedserve.scheduler.speculative_config import SpeculativeConfig

# The commands whose flags an option gets: the engine's own, and those that serve.
ALL_COMMANDS = ("chat", "generate", "serve", "run-batch")
SERVING_COMMANDS = ("serve", "run-batch")
OFFLINE_COMMANDS = ("chat", "generate")

DTYPES = ("float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32)
DEFAULT_SWAP_SPACE_BYTES = 1 << 30


def _json_object(value: str) -> dict:
    """A JSON object flag, its fields checked by the engine."""
    try:
        config = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return config


def _speculative_config(value: str) -> dict:
    """``--speculative-config``: vLLM's JSON object, checked here so a mistake is a usage
    error before the model loads."""
    config = _json_object(value)
    try:
        SpeculativeConfig.from_dict(config)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return config


def _lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules NAME=PATH``."""
    name, equals, path = value.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _chat_template(value: str) -> str:
    """``--chat-template``: a file's template, or the template given inline (as vLLM
    takes it)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # an inline template too long to be a file's name (ENAMETOOLONG)
        is_file = False
    if is_file:
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r:.200} is neither a file nor a template")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple | None = None,
    metavar: str | None = None,
    commands: tuple[str, ...] = ALL_COMMANDS,
    from_cli: Callable[[Any], Any] | None = None,
    nargs: str | None = None,
) -> Any:
    """A field of ``EngineArgs``: its default and help; how the command line spells it
    (``flag``, default ``--name-with-dashes``; a bool defaulting to True is turned off by
    its flag), parses it (``parse``, ``choices``, ``nargs``) and hands it to the engine
    (``from_cli``); on which commands (``commands``)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "flag": flag,
            "parse": parse,
            "choices": choices,
            "metavar": metavar,
            "commands": commands,
            "from_cli": from_cli,
            "nargs": nargs,
        },
    )


@dataclass(kw_only=True)
class EngineArgs:
    """The engine's options (``LLM(**options)``); docs/engine_options.md lists them with
    the flags that set them. Checks that need no model are made here; the rest (a window
    longer than the model's, a tensor-parallel size its heads cannot split) when it loads."""

    model: str | os.PathLike[str] | None = option(
        None, "local HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    dtype: str = option("float32", "the weights' and activations' dtype", choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    quantization: str | None = option(
        None,
        "quantize the linear layers' weights as the model loads (CPU only): int8 values, one "
        "scale per output feature; faster decoding, output close to the unquantized one",
        choices=QUANTIZATION_NAMES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "what the KV cache stores: auto (the --dtype), or float8 (CPU only): fp8 = fp8_e4m3 "
        "(3 mantissa bits, saturating at 448) or fp8_e5m2 (2 bits, wider range); half the "
        "bytes of a 16-bit cache, so twice the tokens; output close to auto's",
        choices=KV_CACHE_DTYPES,
    )
    cuda_graphs: bool = option(False, "replay decode steps from CUDA graphs (cuda)")
    block_size: int = option(16, "tokens per KV block", parse=int, choices=BLOCK_SIZES)
    kv_cache_bytes: int | None = option(
        None, "KV cache size, per tensor-parallel rank (default: a share of free memory)", parse=int
    )
    num_blocks: int | None = option(
        None, "KV cache blocks, instead of kv_cache_bytes (per rank)", parse=int
    )
    tensor_parallel_size: int = option(
        1, "split the model over N worker processes (heads, MLP rows, vocabulary)", parse=int
    )
    distributed_executor_backend: str = option(
        "mp",
        "where the worker processes run: mp, on this host; ray, as Ray actors placed on "
        "the nodes of a running Ray cluster (one GPU, or one CPU, a rank)",
        choices=EXECUTOR_BACKENDS,
    )
    ray_address: str = option(
        "auto",
        "the Ray cluster of distributed_executor_backend=ray: auto (the one this host's "
        "`ray start` joined, or RAY_ADDRESS), or HOST:PORT of its head",
    )
    multiprocess: bool | None = option(
        None,
        "run the scheduler and the workers in processes of their own (default: when "
        "tensor_parallel_size > 1 or the executor is ray; the servers always do)",
        commands=OFFLINE_COMMANDS,
        from_cli=lambda value: value or None,
    )
    async_scheduling: bool | None = option(
        None,
        "plan each decode step while the one before runs, so the device does not wait for "
        "the scheduler (default: on with worker processes on a CUDA device; "
        "async_scheduling=False turns it off)",
        from_cli=lambda value: value or None,
    )
    max_num_seqs: int = option(64, "sequences in one batch, at most", parse=int)
    max_model_len: int | None = option(
        None,
        "prompt + output tokens of a request, at most (default: the model's window)",
        parse=int,
    )
    max_num_batched_tokens: int | None = option(
        None,
        "tokens in one forward pass, at most (default 2048; without chunked prefill, at least "
        "max_model_len)",
        parse=int,
    )
    enable_chunked_prefill: bool = option(
        True,
        "compute a long prompt over several steps, beside other requests' decodes",
        flag="--no-chunked-prefill",
    )
    swap_space_bytes: int = option(
        DEFAULT_SWAP_SPACE_BYTES,
        "host memory for KV blocks of preempted requests (per rank)",
        parse=int,
    )
    preemption_mode: str | None = option(
        None,
        "how to preempt when blocks run out (default: recompute a single sequence, swap a group)",
        choices=("recompute", "swap"),
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: requests run in arrival order; priority: by each request's priority (lower "
        "first, then arrival; a request preempts running ones of a lower priority when it does "
        "not fit)",
        choices=("fcfs", "priority"),
    )
    enable_prefix_caching: bool = option(
        True,
        "share the KV blocks of common prompt prefixes between requests",
        flag="--no-prefix-caching",
    )
    allocation_policy: str = option(
        "paged",
        "how blocks are given out: paged (as needed), or the paper's reservation baselines: "
        "max (max_model_len for every request), pow2 (the next power of two of prompt + "
        "max_tokens), oracle (prompt + the tokens it will produce)",
        choices=ALLOCATION_POLICIES,
    )
    seed: int = option(
        0,
        "the engine's seed: requests without one draw seeds from it, so runs repeat",
        parse=int,
        commands=SERVING_COMMANDS,  # chat / generate: --seed is the request's own
    )
    cache_dir: str | None = option(
        None,
        "where converted models are kept (default: $PAGEDSERVE_CACHE_DIR, else "
        "$XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve)",
    )
    startup_timeout_s: float = option(
        DEFAULT_STARTUP_TIMEOUT_S,
        "how long the engine's processes may take to load the model",
        parse=float,
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template (a file, or the template itself) instead of the model's",
        parse=_chat_template,
        metavar="FILE_OR_TEXT",
    )
    speculative_config: dict[str, Any] | None = option(
        None,
        'speculative decoding, as vLLM takes it: by prompt lookup \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\', with a draft model of the '
        'same tokenizer \'{"model": "/models/draft", "num_speculative_tokens": 4}\' or with '
        "the model's multi-token-prediction layer (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) "
        '\'{"method": "mtp", "num_speculative_tokens": 1}\'',
        parse=_speculative_config,
        metavar="JSON",
    )
    lora_modules: dict[str, str | os.PathLike[str]] | None = option(
        None,
        "serve PEFT LoRA adapters beside the base model (the HTTP API's model NAME selects "
        "one; chat / generate: --lora NAME)",
        parse=_lora_module,
        nargs="+",
        metavar="NAME=PATH",
        from_cli=lambda pairs: dict(pairs) if pairs else None,
    )
    enable_lora: bool = option(
        False,
        "serve LoRA adapters, also with no lora_modules (they may then load at run time: "
        "serve --allow-runtime-lora-updating)",
    )
    max_loras: int | None = option(
        None,
        "the most distinct LoRA adapters one batch runs (default: no cap); a request whose "
        "adapter would pass it waits for a slot",
        parse=int,
        metavar="N",
    )
    structured_outputs_disable_any_whitespace: bool = option(
        False,
        "JSON constraints (a schema, a JSON object) allow no whitespace between JSON tokens, "
        "for every request",
    )
    reasoning_parser: str | None = option(
        None,
        "a reasoning model's thinking markers: structured output constrains the answer after "
        "the thinking only, and the servers split the thinking from the answer "
        "(reasoning_content): qwen3 (Qwen3, QwQ), deepseek_r1 (DeepSeek-R1 and distills), "
        "mistral (Magistral: [THINK] ... [/THINK]), seed_oss (<seed:think> ... "
        "</seed:think>), glm45 (GLM-4.5 / 4.6), minimax_m2 (as deepseek_r1; "
        "minimax_m2_append_think keeps it all as the answer), granite (IBM Granite 3.2+: "
        "'Here is my thought process:' ... 'Here is my response:') or openai_gptoss (gpt-oss: "
        "harmony's analysis channel)",
        choices=tuple(REASONING_PARSERS),
    )
    generation_config: str = option(
        "auto",
        "sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json: its temperature if it sets do_sample, else greedy; top_k, "
        "top_p, min_p, repetition_penalty; its max_new_tokens limits every call's max_tokens), "
        "vllm (none of it) or DIR/generation_config.json",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: dict[str, Any] | None = option(
        None,
        "sampling defaults on top of generation_config, e.g. "
        '\'{"temperature": 0.5, "max_new_tokens": 512}\'',
        parse=_json_object,
        metavar="JSON",
    )
    max_logprobs: int = option(
        DEFAULT_MAX_LOGPROBS,
        "the most logprobs (top alternatives per token) and prompt logprobs a request may ask "
        f"for (vLLM's; default {DEFAULT_MAX_LOGPROBS}; -1: the whole vocabulary)",
        parse=int,
        metavar="N",
    )
    pooler_config: dict[str, Any] | None = option(
        None,
        'how an embedding model pools (vLLM\'s): \'{"pooling_type": "MEAN"}\' (LAST, MEAN or '
        "CLS) and '\"normalize\": false'; default: the model's sentence-transformers files "
        "(modules.json), else LAST, normalized",
        parse=_json_object,
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            choices = spec.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                allowed = ", ".join(map(str, choices))
                if spec.default is None:
                    allowed += " or None"
                raise ValueError(f"{spec.name} must be one of {allowed}, got {value!r}")
            if spec.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"{spec.name} must be a bool, got {value!r}")
        for name in ("kv_cache_bytes", "num_blocks", "max_model_len", "max_loras"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        valid = isinstance(self.max_logprobs, int) and not isinstance(self.max_logprobs, bool)
        if not valid or self.max_logprobs < -1:
            raise ValueError(
                "max_logprobs must be an integer >= 0, or -1 for the whole vocabulary; got "
                f"{self.max_logprobs!r}"
            )
        swap = self.swap_space_bytes
        if isinstance(swap, bool) or not isinstance(swap, int):
            raise TypeError(f"swap_space_bytes must be an integer, got {swap!r}")
        if swap < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {swap}")
        if self.cuda_graphs and not str(self.device).startswith("cuda"):
            raise ValueError(
                f"cuda_graphs=True needs device='cuda' (or 'cuda:N'), got {self.device!r}"
            )


def engine_args(model: str | os.PathLike[str] | None, options: dict[str, Any]) -> EngineArgs:
    """``LLM(model, **options)``'s options, checked; an unknown name is a ``TypeError``
    naming it and where the options are listed."""
    unknown = sorted(set(options) - set(engine_option_names()))
    if unknown:
        raise TypeError(
            f"LLM() got unknown option {', '.join(unknown)}; the options are EngineArgs's "
            "fields, listed in docs/engine_options.md"
        )
    return EngineArgs(model=model, **options)


def engine_option_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in dataclasses.fields(EngineArgs))


def _flag(spec: dataclasses.Field) -> str:
    return spec.metadata["flag"] or "--" + spec.name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of every option ``command`` takes, each defaulting to the option's
    default (``engine_options_from_cli`` turns them back into ``LLM``'s options)."""
    for spec in dataclasses.fields(EngineArgs):
        meta = spec.metadata
        if command not in meta["commands"]:
            continue
        if spec.type == "bool" or spec.type == "bool | None":
            # Off by default: its flag turns it on; on by default: its flag turns it off.
            on = spec.default is True
            parser.add_argument(
                _flag(spec),
                dest=spec.name,
                action="store_false" if on else "store_true",
                default=spec.default,
                help=meta["help"] + (" (on by default; this flag turns it off)" if on else ""),
            )
            continue
        parser.add_argument(
            _flag(spec),
            dest=spec.name,
            type=meta["parse"],
            default=spec.default,
            choices=meta["choices"],
            metavar=meta["metavar"],
            nargs=meta["nargs"],
            help=meta["help"],
        )


def engine_options_from_cli(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """``LLM``'s options from the flags ``add_engine_arguments`` made for ``command``."""
    options = {}
    for spec in dataclasses.fields(EngineArgs):
        if command not in spec.metadata["commands"]:
            continue
        value = getattr(args, spec.name)
        convert = spec.metadata["from_cli"]
        options[spec.name] = value if convert is None else convert(value)
    return options


def options_reference() -> str:
    """The table of docs/engine_options.md: every option, its flag, default and help."""
    lines = [
        "| option | flag | default | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for spec in dataclasses.fields(EngineArgs):
        meta = spec.metadata
        flag = _flag(spec)
        if meta["commands"] != ALL_COMMANDS:
            flag += f" ({', '.join(meta['commands'])})"
        choices = meta["choices"]
        described = meta["help"].replace("|", "\\|")
        if choices:
            described += f"; one of {', '.join(f'`{choice}`' for choice in choices)}"
        default = "None" if spec.default is None else repr(spec.default)
        lines.append(f"| `{spec.name}` | `{flag}` | `{default}` | {described} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(options_reference())  # pasted into docs/engine_options.md
