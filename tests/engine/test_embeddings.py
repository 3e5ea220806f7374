"""Embeddings (vLLM's embed task) equal HF transformers' base model on the same weights:
the final-norm hidden state of each prompt's last token, L2-normalized (float32)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from helpers.parity import NEW_TOKENS, hf_greedy
from helpers.pooling_models import embed_prompts
from pagedserve.frontend import LLM, PoolingParams, SamplingParams
from pagedserve.frontend.request_tracker import EmbeddingTracker, RequestTracker
from pagedserve.scheduler.pooling_params import PROMPT_ONLY_SAMPLING_PARAMS

FAMILIES = ["llama", "qwen2", "qwen3"]


def hf_last_hidden(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The base model's (no LM head) last hidden state at each prompt's last token,
    one prompt at a time: no padding effects."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [
            model(torch.tensor([prompt])).last_hidden_state[0, -1].float() for prompt in prompts
        ]


def assert_close(embedding: list[float], expected: torch.Tensor) -> None:
    actual = torch.tensor(embedding, dtype=torch.float32)
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), (actual - expected).abs().max()


def normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.fixture(scope="module")
def hf_hidden(tiny_model_dirs):
    return {
        family: hf_last_hidden(tiny_model_dirs[family], embed_prompts(3)) for family in FAMILIES
    }


def chunked_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, block_size=16, num_blocks=128, max_num_batched_tokens=64, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_match_hf_with_chunked_prefill_and_prefix_hits(
    tiny_model_dirs, hf_hidden, family
):
    llm = chunked_llm(tiny_model_dirs[family])
    prompts = embed_prompts(3)
    expected = [normalized(hidden) for hidden in hf_hidden[family]]
    first = llm.embed(prompts)
    # The same prompts again: their full blocks now come from the prefix cache.
    second = llm.embed(prompts)
    for outputs in (first, second):
        assert [o.prompt_token_ids for o in outputs] == prompts
        assert all(o.finished and o.finish_reason == "stop" for o in outputs)
        for output, reference in zip(outputs, expected):
            assert_close(output.outputs.embedding, reference)
    # Full blocks only, never the last token (a 16-token prompt computes its one block).
    assert [o.num_cached_tokens for o in second] == [0, 0, 0, 16, 96, 144, 64]
    assert llm.stats()["num_sampled_tokens"] == 0  # pooling requests never sample


def test_unnormalized_and_matryoshka_dimensions(tiny_model_dirs, hf_hidden):
    llm = chunked_llm(tiny_model_dirs["qwen3"])
    prompts = embed_prompts(3)
    raw = llm.embed(prompts, PoolingParams(normalize=False))
    cut = llm.embed(prompts, [PoolingParams(dimensions=32)] * len(prompts))
    cut_raw = llm.embed(prompts[:1], PoolingParams(normalize=False, dimensions=7))
    for output, cut_output, hidden in zip(raw, cut, hf_hidden["qwen3"]):
        assert_close(output.outputs.embedding, hidden)
        assert_close(cut_output.outputs.embedding, normalized(hidden[:32]))
        assert cut_output.outputs.hidden_size == 32
    assert_close(cut_raw[0].outputs.embedding, hf_hidden["qwen3"][0][:7])


def test_embedding_and_generation_requests_share_steps(tiny_model_dirs, hf_hidden):
    """One engine run of greedy generation requests and embedding requests together:
    the tokens still equal HF generate, the vectors HF's hidden states."""
    model_dir = tiny_model_dirs["llama"]
    llm = chunked_llm(model_dir)
    embed = embed_prompts(3)
    rng = random.Random(9)
    generate = [[rng.randrange(512) for _ in range(n)] for n in (3, 40, 90)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    trackers: dict[str, RequestTracker | EmbeddingTracker] = {}
    for index, (gen_prompt, embed_prompt) in enumerate(zip(generate, embed)):
        trackers[f"g{index}"] = RequestTracker(f"g{index}", None, gen_prompt, greedy, None, set())
        llm.engine.add_request(f"g{index}", gen_prompt, greedy, frozenset())
        trackers[f"e{index}"] = EmbeddingTracker(f"e{index}", None, embed_prompt)
        llm.engine.add_request(
            f"e{index}",
            embed_prompt,
            PROMPT_ONLY_SAMPLING_PARAMS,
            frozenset(),
            pooling_params=PoolingParams(),
        )
    mixed_steps = 0
    while llm.engine.has_unfinished_requests():
        deltas = llm.engine.step()
        kinds = {delta.request_id[0] for delta in deltas}
        mixed_steps += kinds == {"g", "e"}
        for delta in deltas:
            trackers[delta.request_id].apply(delta)
    assert mixed_steps > 0
    tokens = [trackers[f"g{index}"].output.outputs[0].token_ids for index in range(3)]
    assert tokens == hf_greedy(model_dir, generate)
    for index in range(3):
        output = trackers[f"e{index}"].output
        assert output.finished and output.finish_reason == "stop"
        assert_close(output.outputs.embedding, normalized(hf_hidden["llama"][index]))


def test_refusals_name_the_field(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen2"], num_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match=r"dimensions=257 exceeds the model's embedding size"):
        llm.embed([[1, 2]], PoolingParams(dimensions=257))
    with pytest.raises(ValueError, match=r"dimensions must be an integer >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is 33 tokens; max_model_len is 32"):
        llm.embed([[1], [1] * 33])
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="pooling_params: got"):
        llm.embed([[1], [2]], [PoolingParams()])
    # An embedding needs no room to generate: a prompt may fill the whole window.
    (full,) = llm.embed([[5] * 32], PoolingParams(dimensions=256))
    assert len(full.outputs.embedding) == 256


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_multiprocess_embeddings_match_hf(tiny_model_dirs, hf_hidden, tensor_parallel_size):
    """Across processes the vector travels as bytes; with two ranks, rank 0's hidden state
    is already whole (row-parallel layers all-reduce), so it pools alone."""
    llm = chunked_llm(
        tiny_model_dirs["qwen2"], multiprocess=True, tensor_parallel_size=tensor_parallel_size
    )
    try:
        outputs = llm.embed(embed_prompts(3), PoolingParams(normalize=False))
        for output, hidden in zip(outputs, hf_hidden["qwen2"]):
            assert_close(output.outputs.embedding, hidden)
    finally:
        llm.shutdown()


def test_score_is_the_cosine_of_hf_hidden_states(tiny_model_dirs, hf_hidden):
    """vLLM's score for an embedding model: 1:N and pairwise, each prompt embedded once."""
    llm = chunked_llm(tiny_model_dirs["llama"])
    prompts = embed_prompts(3)
    hidden = hf_hidden["llama"]

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(a, b, dim=0).item()

    one_to_many = llm.score(prompts[0], prompts[1:4])
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [cosine(hidden[0], hidden[j]) for j in (1, 2, 3)], abs=1e-5
    )
    assert [o.prompt_token_ids for o in one_to_many] == [prompts[0] + p for p in prompts[1:4]]
    pairwise = llm.score(prompts[1:3], prompts[3:5])
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [cosine(hidden[1], hidden[3]), cosine(hidden[2], hidden[4])], abs=1e-5
    )
    assert llm.score(prompts[2], [prompts[2]])[0].outputs.score == pytest.approx(1.0)
    # The last 5 tokens of each: the 100-token prompt and its last 5 tokens score 1.
    (cut,) = llm.score([prompts[4]], [prompts[4][-5:]], truncate_prompt_tokens=5)
    assert cut.outputs.score == pytest.approx(1.0) and len(cut.prompt_token_ids) == 10
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3: give one data_1"):
        llm.score(prompts[:2], prompts[:3])
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 or in \[1, "):
        llm.score(prompts[0], prompts[1], truncate_prompt_tokens=0)
