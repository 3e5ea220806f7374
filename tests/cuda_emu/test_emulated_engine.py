"""The engine end to end with csrc/cuda's kernels, run on the CPU by the CUDA emulator.

Every paged op of a step (reshape_and_cache, decode and prefill attention, copy_blocks,
swap_blocks) goes through gpu_worker/cuda_ops.py into the emulated ``_C_cuda``, with the
arguments the model runner gives on a GPU: views into fused qkv outputs, padded block tables,
chunked prefills over cached context, copy-on-write pairs and swaps. Greedy tokens must equal
HF transformers' (float32), as tests/engine requires of the CPU kernels; sampling and beam search
must give what the engine gives with the CPU kernels (which tests/engine checks against HF).

Prefill runs the paged prefill kernel unless a test asks for torch SDPA over gathered blocks
(a GPU's default). What stays the CPU's here: the model's torch ops, CUDA graphs and streams;
tests/cuda covers those on a GPU.
"""

from __future__ import annotations

import collections

import pytest

from cuda_emu.build import emulated_kernels
from helpers.parity import (
    GREEDY,
    check_bfloat16_first_tokens_agree_with_hf,
    hf_greedy,
    prompts_for,
    random_prompts,
)
from helpers.windowed_models import make_windowed_model, windowed_prompts
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker import cuda_ops, ops
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV

pytestmark = pytest.mark.slow  # compiles the kernels on first use; each run takes ~10 s


class _CountingKernels:
    """The emulated module, counting the calls of each kernel (so a test can tell that the
    engine reached the CUDA kernels and not the CPU ones)."""

    def __init__(self, module) -> None:
        self._module = module
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        function = getattr(self._module, name)

        def counted(*args):
            self.calls[name] += 1
            return function(*args)

        return counted


@pytest.fixture(scope="module")
def kernels():
    """The paged ops on CPU tensors run the emulated CUDA kernels, for this module's tests."""
    counting = _CountingKernels(emulated_kernels())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_ops, "_module", counting)
        patch.setattr(cuda_ops, "_stream", lambda device: (0, 0))  # the emulator's device 0
        patch.setattr(ops, "_runs_cuda_kernels", lambda tensor: True)
        yield counting


@pytest.fixture
def calls(kernels, monkeypatch):
    """This test's kernel calls; prefill through the paged kernel (not torch SDPA)."""
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    kernels.calls.clear()
    return kernels.calls


@pytest.fixture(scope="module")
def hf_references(tiny_model_dirs):
    families = ("llama", "qwen2", "opt")
    return {
        family: hf_greedy(tiny_model_dirs[family], random_prompts(1, 512)) for family in families
    }


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


@pytest.mark.parametrize(
    ("family", "block_size", "prefill"),
    [("llama", 8, "kernel"), ("qwen2", 16, "kernel"), ("opt", 32, "kernel"), ("llama", 16, "sdpa")],
)
def test_greedy_tokens_match_hf(
    tiny_model_dirs, hf_references, calls, monkeypatch, family, block_size, prefill
):
    # "sdpa" is a GPU's default prefill (gathered_prefill.py): torch SDPA over K/V gathered
    # from blocks the CUDA reshape_and_cache wrote.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill)
    llm = LLM(tiny_model_dirs[family], block_size=block_size, num_blocks=256)
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert _token_ids(outputs) == [[tokens] for tokens in hf_references[family]]
    # Per layer (2) and step: one write of the step's new K/V, decode attention when a
    # sequence decodes (from the first step on: a 1-token prompt is a decode) and prefill
    # attention when one prefills.
    assert calls["reshape_and_cache"] == calls["paged_attention_decode"] == 2 * GREEDY.max_tokens
    assert calls["paged_prefill_attention"] == (2 if prefill == "kernel" else 0)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_and_preemption_match_hf(tiny_model_dirs, hf_references, calls, mode):
    # 16 blocks of 16 for prompts that need 52 together, 64 tokens a step: prompts prefill in
    # chunks over their cached context, and running requests are preempted.
    llm = LLM(
        tiny_model_dirs["llama"],
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode=mode,
    )
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert _token_ids(outputs) == [[tokens] for tokens in hf_references["llama"]]
    assert llm.stats()[f"num_{mode}_preemptions"] > 0
    if mode == "swap":
        assert calls["swap_blocks"] > 0


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed_models")
    return {family: make_windowed_model(family, root / family) for family in ("mistral", "qwen2")}


@pytest.mark.parametrize(("family", "block_size"), [("mistral", 8), ("qwen2", 16)])
def test_sliding_window_models_match_hf(windowed_dirs, calls, family, block_size):
    # Windows of 16 (Mistral, every layer) and 12 (Qwen2, layers 1-2; layer 0 full) under
    # prompts of up to 130 tokens and 48 generated, prefilled in chunks over cached context.
    llm = LLM(
        windowed_dirs[family], block_size=block_size, num_blocks=256, max_num_batched_tokens=64
    )
    outputs = llm.generate(windowed_prompts(), GREEDY)
    expected = hf_greedy(windowed_dirs[family], windowed_prompts())
    assert _token_ids(outputs) == [[tokens] for tokens in expected]
    assert calls["paged_prefill_attention"] > 0 and calls["paged_attention_decode"] > 0


def _engine_outputs(model_dir, prompts, params, **engine_args):
    return _token_ids(LLM(model_dir, **engine_args).generate(prompts, params))


def test_parallel_samples_with_copy_on_write_and_swaps(tiny_model_dirs, kernels, calls):
    # Four samples share each prompt's partly filled last block: the first decode step copies
    # it (copy_blocks); 28 blocks of 8 make the groups swap out and back in.
    model_dir = tiny_model_dirs["llama"]
    prompts = prompts_for(3)
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    emulated = _engine_outputs(model_dir, prompts, params, block_size=8, num_blocks=28)
    assert calls["copy_blocks"] > 0 and calls["swap_blocks"] > 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "_runs_cuda_kernels", lambda tensor: tensor.is_cuda)
        on_cpu_kernels = _engine_outputs(model_dir, prompts, params, block_size=8, num_blocks=28)
    assert emulated == on_cpu_kernels


def test_beam_search_matches_the_cpu_kernels(tiny_model_dirs, kernels, calls):
    model_dir = tiny_model_dirs["llama"]
    prompts = prompts_for(0)
    params = SamplingParams(beam_width=4, n=4, temperature=0.0, max_tokens=12, ignore_eos=True)
    emulated = _engine_outputs(model_dir, prompts, params, block_size=8, num_blocks=256)
    assert calls["copy_blocks"] > 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "_runs_cuda_kernels", lambda tensor: tensor.is_cuda)
        on_cpu_kernels = _engine_outputs(model_dir, prompts, params, block_size=8, num_blocks=256)
    assert emulated == on_cpu_kernels


def test_bfloat16_first_tokens_agree_with_hf(tiny_model_dirs, calls):
    check_bfloat16_first_tokens_agree_with_hf(tiny_model_dirs["llama"])
    assert calls["paged_prefill_attention"] > 0 and calls["paged_attention_decode"] > 0
