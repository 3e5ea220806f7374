"""An embedding model pools as its sentence-transformers files say (vLLM reads them too):
mean or first-token pooling equal sentence-transformers' own arithmetic over HF's hidden
states (float32), with or without its Normalize module; ``pooler_config`` replaces the
files; what the engine cannot reproduce is refused at load, naming the file and field;
``sentence_bert_config.json`` caps the context window and lowercases texts."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers

from pagedserve.frontend import LLM, PoolingParams
from pagedserve.frontend.pooler_config import (
    PoolerConfig,
    read_pooler_config,
    read_sentence_transformer_config,
)
from pagedserve.scheduler.pooling_params import PROMPT_ONLY_SAMPLING_PARAMS

ST = "sentence_transformers.models."
# Past one block and past the 64-token budget a chunking engine would cut them at.
LENGTHS = [1, 5, 17, 100, 150]


def prompts(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]
    return [*ids, ids[3][:64] + [rng.randrange(512) for _ in range(10)]]


def sentence_transformer(tmp_path, model_dir, mode: str, normalize: bool, **pooling):
    """A copy of ``model_dir`` with sentence-transformers' files: Transformer, Pooling in
    ``mode`` (and ``pooling``'s other fields), and Normalize when ``normalize``."""
    path = tmp_path / f"st_{mode}_{normalize}"
    shutil.copytree(model_dir, path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    fields = {f"pooling_mode_{name}": name == mode for name in modes}
    fields.update({"word_embedding_dimension": 128, "include_prompt": True, **pooling})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def hf_states(tiny_model_dirs) -> list[torch.Tensor]:
    """The tiny Qwen3's final hidden states of every token, one prompt at a time."""
    model = transformers.AutoModel.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0].float() for ids in prompts()]


def assert_close(values: list[float], expected: torch.Tensor) -> None:
    actual = torch.tensor(values, dtype=torch.float32)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), (actual - expected).abs().max()


@pytest.mark.parametrize(
    ("mode", "normalize", "pool"),
    [
        ("mean_tokens", True, lambda states: states.mean(dim=0)),
        ("cls_token", False, lambda states: states[0]),
        ("lasttoken", True, lambda states: states[-1]),
    ],
)
def test_sentence_transformers_pooling_matches_its_arithmetic(
    tmp_path, tiny_model_dirs, hf_states, mode, normalize, pool
):
    model_dir = sentence_transformer(tmp_path, tiny_model_dirs["qwen3"], mode, normalize)
    # A small budget: a LAST model chunks its long prompts, MEAN and CLS turn chunking off.
    llm = LLM(model_dir, block_size=16, num_blocks=128, max_model_len=256)
    expected = [pool(states) for states in hf_states]
    if normalize:
        expected = [torch.nn.functional.normalize(vector, dim=0) for vector in expected]
    for _ in range(2):  # again: MEAN and CLS take no prefix-cache hits, LAST does
        outputs = llm.embed(prompts())
        for output, vector in zip(outputs, expected):
            assert_close(output.outputs.embedding, vector)
    cached = [output.num_cached_tokens for output in outputs]
    if mode == "lasttoken":
        assert cached == [0, 0, 16, 96, 144, 64]
    else:
        assert cached == [0] * len(LENGTHS + [0])
        assert llm.scheduler_config.enable_chunked_prefill is False
    # A request's own normalize wins over the model's default; the pooling stays the model's.
    raw = llm.embed(prompts()[:2], PoolingParams(normalize=False))
    for output, states in zip(raw, hf_states):
        assert_close(output.outputs.embedding, pool(states))


def test_pooler_config_replaces_the_files_across_processes(tmp_path, tiny_model_dirs, hf_states):
    model_dir = sentence_transformer(tmp_path, tiny_model_dirs["qwen3"], "lasttoken", True)
    with LLM(
        model_dir,
        num_blocks=128,
        multiprocess=True,
        pooler_config={"pooling_type": "MEAN", "normalize": False},
    ) as llm:
        assert llm.pooler_config == PoolerConfig("MEAN", False, "pooler_config")
        for output, states in zip(llm.embed(prompts()), hf_states):
            assert_close(output.outputs.embedding, states.mean(dim=0))
        # The scores of a MEAN model are the cosines of its mean vectors.
        (score,) = llm.score(prompts()[3], [prompts()[4]])
        want = torch.nn.functional.cosine_similarity(
            hf_states[3].mean(dim=0), hf_states[4].mean(dim=0), dim=0
        )
        assert score.outputs.score == pytest.approx(float(want), abs=1e-5)
        llm.check_integrity()


def test_the_scheduler_refuses_whole_prompt_pooling_on_a_chunking_engine(tiny_model_dirs):
    """A client of the engine cannot get a mean over tokens it never computed."""
    llm = LLM(tiny_model_dirs["qwen3"], num_blocks=64)
    with pytest.raises(ValueError, match="pooling_type 'MEAN' pools every prompt token"):
        llm.engine.add_request(
            "m",
            [1, 2, 3],
            PROMPT_ONLY_SAMPLING_PARAMS,
            frozenset(),
            pooling_params=PoolingParams(pooling_type="MEAN"),
        )
    with pytest.raises(ValueError, match="a classifier's head reads the last token"):
        PoolingParams(task="classify", pooling_type="CLS")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(mode="max_tokens"), "pooling_mode_max_tokens is not supported"),
        (dict(include_prompt=False), "include_prompt=false"),
        (dict(pooling_mode_lasttoken=True), "must set exactly one of"),
        (dict(dense=True), "lists sentence_transformers.models.Dense, which this engine"),
    ],
)
def test_what_the_engine_cannot_reproduce_is_refused_at_load(
    tmp_path, tiny_model_dirs, change, message
):
    change = dict(change)
    mode = change.pop("mode", "mean_tokens")
    dense = change.pop("dense", False)
    model_dir = sentence_transformer(tmp_path, tiny_model_dirs["qwen3"], mode, True, **change)
    if dense:
        modules = json.loads((model_dir / "modules.json").read_text())
        modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"})
        (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=message):
        read_pooler_config(model_dir)
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, num_blocks=16)
    # pooler_config sets it explicitly, the files aside.
    assert read_pooler_config(model_dir, {"pooling_type": "LAST"}).pooling_type == "LAST"


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"pooling_type": "MAX"}, ValueError, "pooling_type must be one of LAST, MEAN, CLS"),
        ({"normalize": "yes"}, ValueError, "normalize must be true or false"),
        ({"softmax": True}, ValueError, "'softmax' not supported"),
        ("MEAN", TypeError, "pooler_config must be a dict"),
    ],
)
def test_pooler_config_is_checked_by_name(tiny_model_dirs, override, error, message):
    with pytest.raises(error, match=message):
        read_pooler_config(tiny_model_dirs["qwen3"], override)


def test_sentence_bert_config_caps_the_window_and_lowercases(tmp_path, byte_level_llama_dir):
    """vLLM reads a sentence-transformers model's sentence_bert_config.json: max_seq_length
    is the context window (a longer max_model_len refused, naming the file), do_lower_case
    lowercases every text before it is tokenized."""
    model_dir = sentence_transformer(tmp_path, byte_level_llama_dir, "lasttoken", True)
    config_file = model_dir / "sentence_bert_config.json"
    config_file.write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    llm = LLM(model_dir, block_size=16, num_blocks=64)
    assert llm.scheduler_config.max_model_len == 64
    (upper,) = llm.embed("Paged ATTENTION")
    (lower,) = llm.embed("paged attention")
    assert upper.prompt_token_ids == lower.prompt_token_ids
    assert upper.outputs.embedding == lower.outputs.embedding
    assert llm.tokenizer.encode_pair("A", "B") == llm.tokenizer.encode_pair("a", "b")
    with pytest.raises(ValueError, match="65 tokens"):
        llm.embed([[5] * 65])
    assert len(llm.embed([[5] * 64])[0].outputs.embedding) == 128
    message = (
        r"max_model_len=128 exceeds the model's context window 64 \(max_seq_length in "
        r".*sentence_bert_config.json\)"
    )
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, num_blocks=64, max_model_len=128)
    # Without the file: the model's own window and its casing.
    config_file.unlink()
    plain = LLM(model_dir, block_size=16, num_blocks=64)
    assert plain.scheduler_config.max_model_len == 512
    assert plain.embed("Paged ATTENTION")[0].prompt_token_ids != lower.prompt_token_ids


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_seq_length": 0}, "max_seq_length must be a positive integer, got 0"),
        ({"max_seq_length": "64"}, "max_seq_length must be a positive integer, got '64'"),
        ({"do_lower_case": 1}, "do_lower_case must be true or false, got 1"),
    ],
)
def test_sentence_bert_config_is_checked_by_field(tmp_path, tiny_model_dirs, fields, message):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["qwen3"], model_dir)
    (model_dir / "sentence_bert_config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=message):
        read_sentence_transformer_config(model_dir)
    with pytest.raises(ValueError, match="sentence_bert_config.json"):
        LLM(model_dir, num_blocks=16)
