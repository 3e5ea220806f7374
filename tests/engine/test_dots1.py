"""rednote's dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention (per-head q/k norms before
RoPE) with biases on all four projections, windowed layers from ``max_window_layers`` on, a
dense first layer, then DeepSeek-V3's experts (grouped sigmoid router, a shared expert).
Greedy tokens identical to HF transformers (float32) across block sizes (the parity matrix),
chunked prefill with prefix hits and two tensor-parallel ranks; the window changes HF's own
tokens, so the check can fail; bfloat16's first tokens agree with HF's bfloat16."""

from __future__ import annotations

from helpers.family_configs import DOTS1
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
)
from pagedserve.gpu_worker.model_config import GroupedRouting, ModelConfig

model_dir, hf_reference = family_fixtures(DOTS1)


def test_layers_get_their_windows_and_experts(model_dir, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    assert config.layer_sliding_windows == (0, 0, 32)
    # Without layer_types, from max_window_layers on (as Dots1Config fills them in).
    untyped = rewritten(model_dir, tmp_path / "untyped", layer_types=None)
    assert ModelConfig.from_dir(untyped).layer_sliding_windows == (0, 0, 32)
    assert config.layer_experts[0] is None
    assert config.layer_experts[1].grouped == GroupedRouting(True, 2, 1, 1.0, correction_bias=True)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_window_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    unwindowed = rewritten(
        model_dir, tmp_path / "unwindowed", layer_types=None, max_window_layers=3
    )
    assert ModelConfig.from_dir(unwindowed).layer_sliding_windows == (0, 0, 0)
    assert hf_greedy(unwindowed, prompts()) != hf_reference


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
