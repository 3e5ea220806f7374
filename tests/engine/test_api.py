"""The offline API as a user meets it: chat, sampling, bad input, freed blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.cuda_graphs import graph_batch_sizes


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def embedded_llm():
    return LLM(kv_cache_bytes=128 << 20)


@pytest.mark.slow
def test_chat_on_the_embedded_model_knows_paris(embedded_llm):
    outputs = embedded_llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in outputs[0].outputs[0].text
    assert outputs[0].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_text_prompts_and_eos_on_the_embedded_model(embedded_llm):
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outputs = embedded_llm.chat(
        [[{"role": "user", "content": "Say hello."}], [{"role": "user", "content": "Say bye."}]],
        params,
    )
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"  # the model ends its turn with EOS
        assert completion.token_ids[-1] in embedded_llm.eos_token_ids
        assert completion.text and "<|im_end|>" not in completion.text


def test_seeded_sampling_is_independent_of_the_batch(tiny_llm):
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([prompt], params)[0].outputs[0].token_ids
    others = [[i % 500 + 1] * (i + 3) for i in range(6)]
    mixed = tiny_llm.generate(
        [others[0], prompt, *others[1:]],
        [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(1)]
        + [params]
        + [SamplingParams(max_tokens=30, temperature=0.7) for _ in others[1:]],
    )
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(max_tokens=24, temperature=0.9, seed=4321, ignore_eos=True)
    assert tiny_llm.generate([prompt], different_seed)[0].outputs[0].token_ids != alone


def test_sampling_is_not_greedy_at_high_temperature(tiny_llm):
    prompt = [9, 10, 11]
    greedy = tiny_llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))
    hot = tiny_llm.generate(prompt, SamplingParams(max_tokens=32, temperature=5.0, seed=3))
    assert hot[0].outputs[0].token_ids != greedy[0].outputs[0].token_ids
    assert len(set(hot[0].outputs[0].token_ids)) > 8  # near-uniform draws over 512 ids


def test_one_result_per_prompt_in_order(tiny_llm):
    prompts = [[1, 2, 3], [4] * 40, [7]]
    outputs = tiny_llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(len(o.outputs[0].token_ids) == 3 and o.finished for o in outputs)
    single = tiny_llm.generate([4] * 40, SamplingParams(max_tokens=3, temperature=0.0))
    assert single[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_each_output_reports_how_long_it_queued(tiny_model_dirs):
    # One sequence at a time: each request waits for those before it to end, so the
    # scheduler's time queued grows along the batch; sampled outputs (n > 1, ranked at the
    # end) and embeddings report it too.
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, max_num_seqs=1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5], [6]], greedy)
    queued = [output.queue_time_s for output in outputs]
    assert None not in queued and queued[0] >= 0.0, queued
    assert queued[0] < queued[1] < queued[2], queued
    assert llm.embed([1, 2, 3])[0].queue_time_s is not None
    ranked = SamplingParams(n=2, best_of=3, max_tokens=4, temperature=1.0, seed=1)
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64)
    assert llm.generate([1, 2, 3], ranked)[0].queue_time_s is not None


def test_max_model_len_caps_generation(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, max_model_len=40)
    output = llm.generate([1] * 30, SamplingParams(max_tokens=100, temperature=0.0))[0]
    assert len(output.outputs[0].token_ids) == 10
    assert output.outputs[0].finish_reason == "length"


# ------------------------------------------------------------------- bad input


def test_unknown_model_path_names_the_value(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"model={str(missing)!r} does not exist"):
        LLM(missing)


def test_unknown_dtype_lists_the_allowed(tiny_model_dirs):
    with pytest.raises(
        ValueError, match="dtype must be one of float32, bfloat16, float16, got 'float8'"
    ):
        LLM(tiny_model_dirs["llama"], dtype="float8")


def test_unknown_device_names_the_allowed(tiny_model_dirs):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        LLM(tiny_model_dirs["llama"], device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_device_without_a_gpu_says_so(tiny_model_dirs):
    with pytest.raises(ValueError, match="device='cuda': torch sees no CUDA GPU here"):
        LLM(tiny_model_dirs["llama"], device="cuda")


def test_cuda_graphs_need_a_cuda_device(tiny_model_dirs):
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'.*got 'cpu'"):
        LLM(tiny_model_dirs["llama"], cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got 'yes'"):
        LLM(tiny_model_dirs["llama"], cuda_graphs="yes")


def test_cuda_graph_batch_sizes_cover_every_batch():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = graph_batch_sizes(30)
    assert all(min(s for s in sizes if s >= n) - n < 8 for n in range(1, 31))


def test_unsupported_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(tmp_path)


@pytest.mark.parametrize("block_size", [0, 12, 64])
def test_unsupported_block_size(tiny_model_dirs, block_size):
    with pytest.raises(ValueError, match=f"block_size must be one of 8, 16, 32, got {block_size}"):
        LLM(tiny_model_dirs["llama"], block_size=block_size)


def test_negative_max_tokens_names_the_field():
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got -1"):
        SamplingParams(max_tokens=-1)


def test_empty_prompts_name_their_index(tiny_llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        tiny_llm.generate([[1, 2], []])
    with pytest.raises(ValueError, match="prompts is empty"):
        tiny_llm.generate([])


def test_text_prompt_without_tokenizer_asks_for_token_ids(tiny_llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: text needs a tokenizer"):
        tiny_llm.generate("hello")


def test_out_of_vocabulary_token_names_position_and_limit(tiny_llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]\[2\]: token id 512 .* \[0, 512\)"):
        tiny_llm.generate([[1, 2, 512]])


def test_numpy_and_torch_prompts_and_settings_are_taken_as_python_values(tiny_llm):
    # As vLLM: token ids and settings computed with numpy (or a tensor of ids) work, and
    # give what the same Python values give.
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    want = [o.outputs[0].token_ids for o in tiny_llm.generate([[1, 2, 3], [4, 5]], greedy)]
    from_numpy = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.0))
    for prompts in ([np.int64(1), np.int64(2), np.int64(3)], np.array([1, 2, 3])):
        outputs = tiny_llm.generate(prompts, from_numpy)
        assert [o.outputs[0].token_ids for o in outputs] == want[:1]
        assert type(outputs[0].prompt_token_ids[0]) is int
    outputs = tiny_llm.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), greedy)
    assert [o.outputs[0].token_ids for o in outputs] == [want[0], want[0]]
    outputs = tiny_llm.generate([np.array([1, 2, 3]), [np.int32(4), np.int32(5)]], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == want
    with pytest.raises(TypeError, match=r"prompts\[0\]: a prompt is a string or a list"):
        tiny_llm.generate([np.True_])


def test_use_tqdm_is_taken_as_vllm_takes_it_and_draws_only_on_a_terminal(tiny_llm, capfd):
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    quiet = tiny_llm.generate([1, 2, 3], greedy, use_tqdm=False)
    drawn = tiny_llm.generate([1, 2, 3], greedy, use_tqdm=True)
    assert quiet[0].outputs[0].token_ids == drawn[0].outputs[0].token_ids
    assert tiny_llm.embed([1, 2, 3], use_tqdm=False)[0].outputs.embedding
    assert "Processed prompts" not in capfd.readouterr().err  # stderr is no terminal here


def test_vllm_accessors_get_tokenizer_and_get_default_sampling_params(
    byte_level_llama_dir, tiny_llm
):
    llm = LLM(byte_level_llama_dir, num_blocks=16)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("Paris") == llm.tokenizer.encode("Paris")
    assert tokenizer.decode(tokenizer.encode("Paris", add_special_tokens=False)) == "Paris"
    assert llm.get_default_sampling_params() == llm.default_sampling_params()
    with pytest.raises(ValueError, match="get_tokenizer: text needs a tokenizer"):
        tiny_llm.get_tokenizer()


def test_too_long_prompt_and_too_big_request_are_rejected_up_front(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=8, block_size=16)
    with pytest.raises(
        ValueError, match=r"prompts\[0\]: prompt is 512 tokens; max_model_len is 512"
    ):
        llm.generate([[1] * 512])
    with pytest.raises(ValueError, match=r"prompts\[1\]: .* whole KV cache has 8 blocks"):
        llm.generate([[1], [1] * 100], SamplingParams(max_tokens=50))
    # Nothing was queued by the rejected calls, and a request that fits still runs.
    assert llm.stats()["num_waiting"] == 0
    output = llm.generate([1] * 100, SamplingParams(max_tokens=28, temperature=0.0))[0]
    assert len(output.outputs[0].token_ids) == 28


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_each_prompt(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, block_size=16, max_model_len=64)
    long, short = [(7 * i) % 500 + 3 for i in range(100)], [9, 8, 7]
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    with pytest.raises(
        ValueError, match=r"prompts\[0\]: prompt is 100 tokens; max_model_len is 64"
    ):
        llm.generate([long], SamplingParams(**greedy))
    kept = llm.generate([long, short], SamplingParams(**greedy, truncate_prompt_tokens=20))
    direct = llm.generate([long[-20:], short], SamplingParams(**greedy))
    assert [o.prompt_token_ids for o in kept] == [long[-20:], short]
    assert [o.outputs[0].token_ids for o in kept] == [o.outputs[0].token_ids for o in direct]
    # -1 keeps what the window holds: here all of a shorter prompt.
    whole = llm.generate([short], SamplingParams(**greedy, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == short
    with pytest.raises(
        ValueError,
        match=r"^sampling_params.truncate_prompt_tokens must be -1 or in \[1, 64\] \(the "
        r"model's context window\), got 65$",
    ):
        llm.generate([long], SamplingParams(**greedy, truncate_prompt_tokens=65))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or >= 1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= -1, got -2"):
        SamplingParams(truncate_prompt_tokens=-2)


def test_mismatched_params_count(tiny_llm):
    with pytest.raises(ValueError, match="sampling_params: got 2 for 3 prompts"):
        tiny_llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_kv_cache_bytes_too_small_names_the_block_size(tiny_model_dirs):
    with pytest.raises(ValueError, match="kv_cache_bytes=100 holds no block"):
        LLM(tiny_model_dirs["llama"], kv_cache_bytes=100)
