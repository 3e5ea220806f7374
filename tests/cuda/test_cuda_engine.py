"""The engine on a GPU (device="cuda") against HF transformers on the same GPU and weights:
greedy tokens identical in float32 (also through swap preemption), logprobs close in float16.
Skipped without a GPU or without pagedserve._C_cuda."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from helpers.family_configs import DEEPSEEK_CONFIGS, GEMMA_CONFIGS, LLAMA4, MOE_CONFIGS
from helpers.multi_token_prediction import CONFIGS as MTP_CONFIGS
from helpers.multi_token_prediction import predictable_copy, with_mtp_layer
from helpers.tiny_models import random_hf_model
from helpers.windowed_models import make_windowed_model, windowed_prompts
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker import cuda_ops
from pagedserve.gpu_worker.layers import gathered_prefill
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
    pytest.mark.skipif(
        not cuda_ops.is_built(), reason="pagedserve._C_cuda is not built (no nvcc at install)"
    ),
]

NEW_TOKENS = 40
PROMPT_LENGTHS = [1, 5, 16, 17, 31, 64, 100, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(seed: int, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_model(model_dir, dtype: torch.dtype) -> transformers.PreTrainedModel:
    # Eager attention: the reference must soft-cap Gemma 2's logits, which HF's SDPA path
    # leaves out. transformers 5.25 refuses SDPA for Gemma 2 ("sdpa does not support
    # softcapping"); the GPU image's 5.17 took it, and its tokens parted from the engine's
    # (which agreed across both prefill paths) after a few decode steps.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    ).to("cuda")
    model.generation_config.eos_token_id = None  # exactly NEW_TOKENS, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt at a time on the GPU, in float32, so the reference carries no padding."""
    model = hf_model(model_dir, torch.float32)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], device="cuda")
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def hf_references(tiny_model_dirs):
    families = ("llama", "qwen2", "mistral", "opt")
    return {family: hf_greedy(tiny_model_dirs[family], random_prompts(1)) for family in families}


@pytest.mark.parametrize(
    ("family", "block_size"),
    [("llama", 8), ("llama", 16), ("llama", 32), ("qwen2", 16), ("mistral", 16), ("opt", 16)],
)
def test_greedy_tokens_match_hf_on_the_gpu(tiny_model_dirs, hf_references, family, block_size):
    llm = LLM(tiny_model_dirs[family], device="cuda", block_size=block_size, num_blocks=256)
    assert llm.worker.kv_cache.is_cuda
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references[family]


def test_chunked_prefill_on_the_gpu_matches_hf(tiny_model_dirs, hf_references):
    llm = LLM(tiny_model_dirs["qwen2"], device="cuda", num_blocks=128, max_num_batched_tokens=40)
    assert llm.worker.runner.gathered_prefill  # the CUDA default
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["qwen2"]


def test_prefill_kernel_on_the_gpu_matches_hf(tiny_model_dirs, hf_references, monkeypatch):
    # The default CUDA prefill is one SDPA call over gathered K/V; the paged prefill kernel
    # stays selectable, and both must give HF's tokens (chunks put context under most steps).
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    llm = LLM(tiny_model_dirs["llama"], device="cuda", num_blocks=128, max_num_batched_tokens=40)
    assert not llm.worker.runner.gathered_prefill
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]


def test_cuda_graphs_match_hf(tiny_model_dirs, hf_references):
    llm = LLM(
        tiny_model_dirs["llama"], device="cuda", num_blocks=256, max_num_seqs=12, cuda_graphs=True
    )
    graphs = llm.worker.runner.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 12]
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]
    # 8 prompts of different lengths: decode batches of 8 down to 1, all replayed.
    assert graphs.num_replays >= NEW_TOKENS - 1


def test_cuda_graphs_in_the_multiprocess_engine(tiny_model_dirs, hf_references):
    llm = LLM(
        tiny_model_dirs["llama"], device="cuda", num_blocks=256, cuda_graphs=True, multiprocess=True
    )
    try:
        outputs = llm.generate(random_prompts(1), GREEDY)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_the_gpu_keeps_tokens(tiny_model_dirs, hf_references, mode):
    # 16 blocks of 16 tokens hold far less than the eight requests need: running requests
    # are preempted; swaps go through the pinned host pool on the worker's swap stream.
    llm = LLM(
        tiny_model_dirs["llama"],
        device="cuda",
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode=mode,
    )
    if mode == "swap":
        assert all(cache.is_pinned() for cache in llm.worker.host_kv_caches)
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]
    assert llm.stats()[f"num_{mode}_preemptions"] > 0


@pytest.mark.parametrize("prefill", ["auto", "sdpa"])
def test_float16_logprobs_close_to_hf(tiny_model_dirs, monkeypatch, prefill):
    # auto: prefills (chunks of a 100-token prompt over their cached context) through flash
    # attention's variable-length kernel over packed K/V; sdpa: the padded layout.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill)
    flash_calls = []
    real_flash = gathered_prefill.flash_varlen
    monkeypatch.setattr(
        gathered_prefill,
        "flash_varlen",
        lambda *args: flash_calls.append(1) or real_flash(*args),
    )
    path = tiny_model_dirs["llama"]
    llm = LLM(path, device="cuda", dtype="float16", num_blocks=128, max_num_batched_tokens=32)
    params = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    prompt = random_prompts(2)[6]  # 100 tokens: prefilled in chunks
    output = llm.generate([prompt], params)[0]
    completion = output.outputs[0]
    # HF scores the same sequence (teacher-forced) in float16 on the GPU.
    model = hf_model(path, torch.float16)
    with torch.no_grad():
        sequence = torch.tensor([prompt + completion.token_ids], device="cuda")
        reference = torch.log_softmax(model(sequence).logits[0].float(), dim=-1).cpu()
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert entry[token_id] == pytest.approx(row[token_id].item(), abs=3e-2)
        assert row[token_id] >= row.max() - 3e-2  # greedy picked HF's top token, or a near-tie
    for position in range(1, len(prompt)):
        token_id = prompt[position]
        expected = reference[position - 1, token_id].item()
        assert output.prompt_logprobs[position][token_id] == pytest.approx(expected, abs=3e-2)
    assert bool(flash_calls) == (prefill == "auto")


def test_bfloat16_first_tokens_match_hf(tiny_model_dirs):
    path = tiny_model_dirs["mistral"]
    prompts = random_prompts(3)
    llm = LLM(path, device="cuda", dtype="bfloat16", num_blocks=128)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model = hf_model(path, torch.bfloat16)
    agreeing = 0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours):
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            agreeing += int(logits.argmax().item() == tokens[0])
    # bfloat16 rounding may flip a near-tie; most first tokens must agree.
    assert agreeing >= len(prompts) - 1


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_speculative_decoding_on_the_gpu_matches_hf(tiny_model_dirs, hf_references, cuda_graphs):
    # Verification steps run the prefill path beside graph-replayed plain decodes.
    llm = LLM(
        tiny_model_dirs["llama"],
        device="cuda",
        num_blocks=256,
        max_num_seqs=12,
        cuda_graphs=cuda_graphs,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]
    assert llm.stats()["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed_models")
    return {family: make_windowed_model(family, root / family) for family in ("mistral", "qwen2")}


@pytest.fixture(scope="module")
def windowed_references(windowed_dirs):
    return {family: hf_greedy(path, windowed_prompts()) for family, path in windowed_dirs.items()}


@pytest.mark.parametrize(
    ("family", "prefill", "cuda_graphs"),
    [
        ("mistral", "sdpa", False),
        ("mistral", "kernel", True),
        ("qwen2", "sdpa", True),
        ("qwen2", "kernel", False),
        ("qwen2", "varlen", False),  # float32: varlen's plans fall back to the padded layout
    ],
)
def test_sliding_window_models_match_hf_on_the_gpu(
    windowed_dirs, windowed_references, monkeypatch, family, prefill, cuda_graphs
):
    # Windows of 12-16 tokens (Qwen2: layer 0 full, layers 1-2 windowed) under prompts of up to
    # 130 tokens and 40 generated, prefilled in chunks; graph replays carry each layer's window.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill)
    llm = LLM(
        windowed_dirs[family],
        device="cuda",
        block_size=16,
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        cuda_graphs=cuda_graphs,
    )
    outputs = llm.generate(windowed_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == windowed_references[family]
    if cuda_graphs:
        assert llm.worker.runner.decode_graphs.num_replays > 0


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gemma3"])
def test_mixture_of_experts_and_gemma_models_match_hf_on_the_gpu(tmp_path, family):
    # MoE: routing, the per-expert GEMMs and index_add on the device (no CUDA graphs:
    # refused). Gemma 3: the 1 + w norms, two RoPE tables, sliding layers, logit soft-cap.
    configs = {**MOE_CONFIGS, "gemma3": GEMMA_CONFIGS["gemma3"]}
    model_dir = random_hf_model(configs[family], tmp_path / family)
    expected = hf_greedy(model_dir, random_prompts(1))
    llm = LLM(model_dir, device="cuda", block_size=16, num_blocks=256)
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_deepseek_latent_attention_matches_hf_on_the_gpu(tmp_path):
    # MLA over the latent cache on the device (V3's layout; the CPU tests cover V2's too):
    # latents written by index, the step's latent plans copied over, the absorbed einsums;
    # swaps move the latent pool.
    model_dir = random_hf_model(DEEPSEEK_CONFIGS["v3"], tmp_path / "v3")
    expected = hf_greedy(model_dir, random_prompts(1))
    llm = LLM(
        model_dir,
        device="cuda",
        block_size=16,
        num_blocks=24,
        preemption_mode="swap",
        swap_space_bytes=64 << 20,
    )
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("prefill", ["sdpa", "kernel"])
def test_llama4_matches_hf_on_the_gpu(tmp_path, monkeypatch, prefill):
    # Llama 4's chunked layers (chunks of 32: the step's chunked view of the block tables,
    # copied to the device each step) in the CUDA decode kernel and either prefill path, its
    # NoPE layers' temperature, L2 q/k norms and input-scaled experts on the device.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill)
    model_dir = random_hf_model(LLAMA4, tmp_path / "llama4")
    expected = hf_greedy(model_dir, random_prompts(1))
    llm = LLM(model_dir, device="cuda", block_size=16, num_blocks=256)
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("prefill", ["sdpa", "kernel"])
def test_gemma2_matches_hf_on_the_gpu(tmp_path, monkeypatch, prefill):
    # Gemma 2's attention logit soft-cap in the CUDA decode kernel and in either prefill path
    # (explicit capped scores over gathered K/V, or the paged prefill kernel), with its
    # sliding layers and final logit cap.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill)
    model_dir = random_hf_model(GEMMA_CONFIGS["gemma2"], tmp_path / "gemma2")
    expected = hf_greedy(model_dir, random_prompts(1))
    llm = LLM(model_dir, device="cuda", block_size=16, num_blocks=256)
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize(("cuda_graphs", "preemption_mode"), [(False, "swap"), (True, None)])
def test_a_draft_model_on_the_gpu_matches_hf(
    tiny_model_dirs, hf_references, cuda_graphs, preemption_mode
):
    """A copy of the target as its draft model, in a pool of its own on the GPU (swapped
    through the pinned host pools beside the target's): HF's tokens, every guess accepted."""
    llama = tiny_model_dirs["llama"]
    tight = dict(num_blocks=24, max_num_batched_tokens=64) if preemption_mode else {}
    llm = LLM(
        llama,
        device="cuda",
        max_num_seqs=12,
        cuda_graphs=cuda_graphs,
        preemption_mode=preemption_mode,
        speculative_config={"model": str(llama), "num_speculative_tokens": 3},
        **({"num_blocks": 256} | tight),
    )
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] == stats["num_draft_tokens"], stats
    if preemption_mode:
        assert stats["num_swap_preemptions"] > 0, stats


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_the_mtp_layer_on_the_gpu_keeps_hf_s_tokens(tmp_path, name):
    """The multi-token-prediction layer drafting on the device from the step's hidden states
    (its own latent or KV pool, swapped beside the target's): HF's tokens with a random
    layer, and every guess but a one-token prompt's first accepted with a predictable one."""
    model_dir = with_mtp_layer(
        random_hf_model(MTP_CONFIGS[name], tmp_path / "base"), tmp_path / "m"
    )
    expected = hf_greedy(model_dir, random_prompts(1))
    speculative = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(
        model_dir,
        device="cuda",
        block_size=16,
        num_blocks=24,
        preemption_mode="swap",
        swap_space_bytes=64 << 20,
        speculative_config=speculative,
    )
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_swap_preemptions"] > 0
    predictable = predictable_copy(model_dir, tmp_path / "predictable")
    plain = LLM(predictable, device="cuda", num_blocks=256).generate(random_prompts(1), GREEDY)
    llm = LLM(predictable, device="cuda", num_blocks=256, speculative_config=speculative)
    outputs = llm.generate(random_prompts(1), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.stats()
    assert stats["num_draft_tokens"] - stats["num_accepted_tokens"] <= 2, stats
