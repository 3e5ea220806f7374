"""The model's generation_config.json as the sampling defaults of requests that leave a
field unset (vLLM's --generation-config / --override-generation-config): which fields,
HF's greedy-unless-do_sample temperature, the sources and the override, max_new_tokens as
the limit on output tokens, refusals by name, and the offline engine sampling with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.parity import hf_greedy
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.generation_config import load_generation_defaults

QWEN_LIKE = {  # Qwen2.5-Instruct's file
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "eos_token_id": [2, 1],
}


def _model_dir(tmp_path: Path, config: dict | None, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_models_sampling_fields_become_defaults(tmp_path):
    defaults = load_generation_defaults(_model_dir(tmp_path, QWEN_LIKE))
    assert defaults.values == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    params = defaults.sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.7, 20, 0.8, 0.0)
    assert "temperature=0.7" in defaults.describe() and "from model" in defaults.describe()


def test_without_do_sample_the_model_decodes_greedily_as_hf_does(tmp_path):
    greedy = dict(QWEN_LIKE, do_sample=False)
    assert load_generation_defaults(_model_dir(tmp_path, greedy)).values == {
        "temperature": 0.0,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    # No file at all: greedy, nothing else.
    none = load_generation_defaults(_model_dir(tmp_path, None, "bare"))
    assert none.values == {"temperature": 0.0}


def test_vllm_source_ignores_the_model_and_a_directory_replaces_it(tmp_path):
    model = _model_dir(tmp_path, QWEN_LIKE)
    vllm = load_generation_defaults(model, "vllm")
    assert vllm.values == {} and vllm.sampling_params().temperature == 1.0
    other = _model_dir(tmp_path, {"do_sample": True, "temperature": 0.3, "min_p": 0.1}, "other")
    assert load_generation_defaults(model, str(other)).values == {"temperature": 0.3, "min_p": 0.1}


def test_the_override_goes_on_top_and_its_temperature_counts(tmp_path):
    greedy = _model_dir(tmp_path, dict(QWEN_LIKE, do_sample=False))
    defaults = load_generation_defaults(greedy, "auto", {"temperature": 0.5, "top_k": -1})
    assert defaults.values == {"temperature": 0.5, "top_p": 0.8, "repetition_penalty": 1.05}
    assert load_generation_defaults(greedy, "vllm", {"top_p": 0.9}).values == {"top_p": 0.9}


@pytest.mark.parametrize(
    ("source", "override", "message"),
    [
        ("nowhere", None, "generation_config='nowhere' is not 'auto', 'vllm' or a directory"),
        ("auto", {"max_length": 5}, "'max_length' not supported; supported: temperature, "),
        ("auto", {"max_new_tokens": 0}, "override_generation_config: max_new_tokens must be an "),
        ("auto", {"max_new_tokens": 2.5}, "override_generation_config: max_new_tokens must be an"),
        ("auto", {"max_new_tokens": True}, "override_generation_config: max_new_tokens must be"),
        ("auto", {"top_p": "high"}, "override_generation_config: top_p must be a number"),
        ("auto", {"top_p": 2.0}, "override_generation_config: top_p must be"),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path, source, override, message):
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(_model_dir(tmp_path, QWEN_LIKE), source, override)


def test_a_bad_value_in_the_models_file_names_the_file(tmp_path):
    model = _model_dir(tmp_path, dict(QWEN_LIKE, top_p=5.0))
    for override in (None, {"temperature": 0.5}):
        with pytest.raises(ValueError, match="auto generation_config.json: top_p must be"):
            load_generation_defaults(model, "auto", override)
    model = _model_dir(tmp_path, dict(QWEN_LIKE, max_new_tokens=-1), "negative")
    with pytest.raises(ValueError, match=r"json: max_new_tokens must be an integer >= 1, got -1"):
        load_generation_defaults(model)


def test_max_new_tokens_is_the_limit_on_output_tokens(tmp_path):
    # SmolLM-Instruct's file names max_new_tokens; vLLM makes it the server's limit.
    model = _model_dir(tmp_path, dict(QWEN_LIKE, max_new_tokens=40))
    defaults = load_generation_defaults(model)
    assert defaults.max_tokens_limit == 40 and "max_new_tokens" not in defaults.values
    assert defaults.sampling_params().max_tokens == 40  # offline, the default max_tokens
    assert "repetition_penalty=1.05, max_tokens<=40 (max_new_tokens) (from model)" in (
        defaults.describe()
    )
    # The override's replaces the file's; the vllm source has none but may be given one.
    assert load_generation_defaults(model, "auto", {"max_new_tokens": 7}).max_tokens_limit == 7
    assert load_generation_defaults(model, "vllm").max_tokens_limit is None
    limited = load_generation_defaults(model, "vllm", {"max_new_tokens": 9})
    assert (limited.max_tokens_limit, limited.values) == (9, {})
    assert limited.describe() == "max_tokens<=9 (max_new_tokens) (from vllm + override)"
    assert limited.sampling_params().max_tokens == 9


def test_both_apis_take_the_defaults_for_the_fields_a_request_leaves_unset(tmp_path):
    from pagedserve.frontend.grpc_convert import sampling_params_from_proto
    from pagedserve.v1 import generation_pb2 as pb

    default = load_generation_defaults(_model_dir(tmp_path, QWEN_LIKE)).sampling_params()
    unset = sampling_params_from_proto(pb.SamplingParams(max_tokens=4), default)
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.7, 20, 0.8)
    assert unset.repetition_penalty == 1.05
    own = sampling_params_from_proto(pb.SamplingParams(top_k=5, temperature=0.0), default)
    assert (own.temperature, own.top_k, own.top_p) == (0.0, 5, 0.8)
    beams = sampling_params_from_proto(pb.SamplingParams(beam_width=2), default)
    assert (beams.temperature, beams.beam_width) == (0.0, 2)  # beam search stays greedy
    assert sampling_params_from_proto(pb.SamplingParams(), default).max_tokens == 16


def test_the_grpc_api_cuts_max_tokens_to_the_limit(tmp_path):
    from pagedserve.frontend.grpc_convert import sampling_params_from_proto
    from pagedserve.v1 import generation_pb2 as pb

    defaults = load_generation_defaults(_model_dir(tmp_path, dict(QWEN_LIKE, max_new_tokens=8)))
    default, limit = defaults.sampling_params(), defaults.max_tokens_limit

    def max_tokens(**fields) -> int:
        return sampling_params_from_proto(pb.SamplingParams(**fields), default, limit).max_tokens

    assert sampling_params_from_proto(None, default, limit).max_tokens == 8
    assert (max_tokens(), max_tokens(max_tokens=3), max_tokens(max_tokens=100)) == (8, 3, 8)
    assert max_tokens(max_tokens=100, min_tokens=8) == 8
    with pytest.raises(ValueError, match=r"^sampling.min_tokens=9 is more than the 8 output "):
        max_tokens(max_tokens=100, min_tokens=9)
    with pytest.raises(ValueError, match=r"^sampling.max_tokens must be >= 1"):
        max_tokens(max_tokens=0)


@pytest.fixture(scope="module")
def sampled_model_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama with a generation config that samples, but only from the most likely
    token (top_k 1): its default output is greedy's, however the draws fall; at most 10
    tokens by default (max_new_tokens)."""
    import shutil

    path = tmp_path_factory.mktemp("generation") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], path)
    config = {
        "do_sample": True,
        "temperature": 1.3,
        "top_k": 1,
        "repetition_penalty": 1.0,
        "max_new_tokens": 10,
    }
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_engine_samples_with_the_models_defaults(sampled_model_dir):
    prompts = [[5, 9, 31, 2, 77], [100, 3]]
    llm = LLM(sampled_model_dir, num_blocks=64)
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (1.3, 1, 10)
    outputs = llm.generate(prompts)  # the defaults, 10 tokens
    greedy = hf_greedy(sampled_model_dir, prompts)
    for output, reference in zip(outputs, greedy, strict=True):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)]
        assert len(tokens) == 10 or output.outputs[0].finish_reason == "stop"
    # Offline, SamplingParams given are taken as they are (vLLM's LLM): 12 tokens.
    longer = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, top_k=1))
    assert [len(output.outputs[0].token_ids) for output in longer] == [12, 12]
    # The vLLM source drops top_k: the draws at temperature 1.0 leave the greedy path.
    llm = LLM(sampled_model_dir, num_blocks=64, generation_config="vllm")
    params = SamplingParams(max_tokens=16, seed=7)
    assert llm.default_sampling_params().top_k == 0
    sampled = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert sampled != [reference[: len(tokens)] for reference, tokens in zip(greedy, sampled)]
