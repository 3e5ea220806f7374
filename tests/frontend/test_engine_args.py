"""Every engine option is declared once (``frontend/engine_args.py``): ``LLM(...)`` takes
exactly the declared options, each command's flags are made from them with the same
defaults, and docs/engine_options.md lists them as declared."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from pagedserve.frontend.cli import build_parser
from pagedserve.frontend.engine_args import (
    ALL_COMMANDS,
    EngineArgs,
    engine_args,
    engine_option_names,
    engine_options_from_cli,
    options_reference,
)
from pagedserve.frontend.llm import LLM

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "engine_options.md"
# The arguments each command needs besides its flags.
POSITIONAL = {
    "chat": ["hi"],
    "generate": ["hi"],
    "serve": [],
    "run-batch": ["-i", "in.jsonl", "-o", "out.jsonl"],
}


def test_llm_takes_exactly_the_declared_options():
    signature = inspect.signature(LLM.__init__)
    assert list(signature.parameters) == ["self", "model", "options"]
    defaults = {spec.name: spec.default for spec in dataclasses.fields(EngineArgs)}
    assert engine_args(None, {k: v for k, v in defaults.items() if k != "model"}) == EngineArgs()
    with pytest.raises(TypeError, match="unknown option max_num_sequences.*engine_options.md"):
        engine_args(None, {"max_num_sequences": 8})


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_each_command_has_the_options_flags_with_their_defaults(command):
    args = build_parser().parse_args([command, *POSITIONAL[command]])
    options = engine_options_from_cli(args, command)
    defaults = EngineArgs()
    for name, value in options.items():
        assert value == getattr(defaults, name), name


def test_every_option_has_a_flag_and_serve_has_all_but_the_offline_ones():
    parser = build_parser()
    on_serve = engine_options_from_cli(parser.parse_args(["serve"]), "serve")
    on_chat = engine_options_from_cli(parser.parse_args(["chat", "hi"]), "chat")
    assert set(on_serve) | set(on_chat) == set(engine_option_names())
    assert set(engine_option_names()) - set(on_serve) == {"multiprocess"}


def test_flags_reach_the_options():
    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "8", "--no-prefix-caching", "--lora-modules", "a=/x",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
         "--seed", "7", "--num-blocks", "32", "--no-chunked-prefill"]
    )  # fmt: skip
    options = engine_options_from_cli(args, "serve")
    assert options["max_num_seqs"] == 8 and options["seed"] == 7 and options["num_blocks"] == 32
    assert options["enable_prefix_caching"] is False
    assert options["enable_chunked_prefill"] is False
    assert options["lora_modules"] == {"a": "/x"}
    assert options["speculative_config"]["num_speculative_tokens"] == 2
    assert EngineArgs(**options).max_num_seqs == 8


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 12}, "block_size must be one of 8, 16, 32, got 12"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer, got 0"),
        ({"cuda_graphs": True}, "cuda_graphs=True needs device='cuda'"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
        ({"max_logprobs": -2}, "max_logprobs must be an integer >= 0, or -1"),
    ],
)
def test_bad_options_are_named_before_anything_loads(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_the_reference_page_is_current():
    text = REFERENCE.read_text()
    assert options_reference() in text, "run: python -m pagedserve.frontend.engine_args"
