"""vLLM's per-token pooling tasks through ``LLM.encode``: "token_embed" (every prompt token's
final-norm hidden state, each row L2-normalized) equals HF's base model at every position,
and "token_classify" (the classifier head at every token, through its softmax) equals HF's
``score`` over every position; across chunked prefill (the worker keeps a chunk's rows until
the last), with no prefix-cache hit taken, beside generation, and in the multi-process
engine. The one-vector tasks through ``encode`` equal ``embed`` and ``classify``."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.pooling_models import LABELS, classifier_config, embed_prompts
from helpers.tiny_models import TINY_CONFIGS, random_hf_model
from pagedserve.frontend import LLM, PoolingParams, SamplingParams


def hf_hidden_rows(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([prompt])).last_hidden_state[0].float() for prompt in prompts]


def hf_token_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    )
    with torch.no_grad():
        return [
            model.score(model.model(torch.tensor([prompt])).last_hidden_state[0]).float()
            for prompt in prompts
        ]


def assert_rows_close(rows: list[list[float]], expected: torch.Tensor) -> None:
    actual = torch.tensor(rows, dtype=torch.float32)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), (actual - expected).abs().max()


def chunked_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, block_size=16, num_blocks=128, max_num_batched_tokens=64, **kwargs)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    config = classifier_config(TINY_CONFIGS["llama"], id2label=LABELS)
    return random_hf_model(config, tmp_path_factory.mktemp("token_classifier"))


def test_token_embeddings_match_hf_at_every_position_across_chunks(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = embed_prompts(4)
    expected = [
        torch.nn.functional.normalize(rows, dim=1) for rows in hf_hidden_rows(model_dir, prompts)
    ]
    llm = chunked_llm(model_dir)
    for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache
        outputs = llm.encode(prompts, pooling_task="token_embed")
        for output, reference in zip(outputs, expected):
            assert output.task == "token_embed" and output.num_cached_tokens == 0
            assert_rows_close(output.outputs.data, reference)
    # A one-vector embedding of the same prompts does take the hits.
    assert llm.embed(prompts)[4].num_cached_tokens == 96
    # The last row, unnormalized and cut, is the hidden state itself.
    params = PoolingParams(task="token_embed", normalize=False, dimensions=32)
    (output,) = llm.encode([prompts[3]], params)
    assert_rows_close(output.outputs.data, hf_hidden_rows(model_dir, [prompts[3]])[0][:, :32])


def test_token_classifications_match_hf_at_every_position(classifier_dir):
    prompts = embed_prompts(5)
    expected = hf_token_logits(classifier_dir, prompts)
    llm = chunked_llm(classifier_dir)
    outputs = llm.encode(prompts, pooling_task="token_classify")
    for output, logits in zip(outputs, expected):
        assert_rows_close(output.outputs.data, logits.softmax(dim=1))
    raw = llm.encode(prompts[:2], PoolingParams(task="token_classify", use_activation=False))
    for output, logits in zip(raw, expected):
        assert_rows_close(output.outputs.data, logits)
    # encode's one-vector task is classify's.
    (one,) = llm.encode([prompts[2]])
    assert one.task == "classify"
    assert one.outputs.data == llm.classify([prompts[2]])[0].outputs.probs


def test_token_pooling_runs_beside_generation_and_in_the_multiprocess_engine(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = embed_prompts(6)
    offline = chunked_llm(model_dir)
    want = [o.outputs.data for o in offline.encode(prompts, pooling_task="token_embed")]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    generated = offline.generate(prompts[:3], greedy)
    llm = chunked_llm(model_dir, multiprocess=True)
    try:
        got = [o.outputs.data for o in llm.encode(prompts, pooling_task="token_embed")]
        for rows, reference in zip(got, want):
            assert_rows_close(rows, torch.tensor(reference))
        assert [len(o.outputs[0].token_ids) for o in generated] == [8, 8, 8]
        # One-vector embed through encode equals embed().
        (vector,) = llm.encode([prompts[1]], pooling_task="embed")
        assert vector.outputs.data == llm.embed([prompts[1]])[0].outputs.embedding
    finally:
        llm.shutdown()


def test_a_task_the_model_does_not_serve_is_refused(tiny_model_dirs, classifier_dir):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64)
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode([[1, 2]], pooling_task="token_reward")
    with pytest.raises(ValueError, match="pooling_params.task='embed' with pooling_task="):
        llm.encode([[1, 2]], PoolingParams(), pooling_task="token_embed")
    with pytest.raises(ValueError, match="not a sequence classification model"):
        llm.encode([[1, 2]], pooling_task="token_classify")
    with pytest.raises(ValueError, match="dimensions=4 is the embed task's"):
        PoolingParams(task="token_classify", dimensions=4)
    classifier = LLM(classifier_dir, num_blocks=64)
    with pytest.raises(ValueError, match="not the embed task"):
        classifier.encode([[1, 2]], pooling_task="token_embed")
