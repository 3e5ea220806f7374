"""Hugging Face's SmolLM3 (``SmolLM3ForCausalLM``): Llama whose every fourth layer attends
without RoPE (``no_rope_layers``). Greedy tokens identical to HF transformers (float32)
across block sizes (the parity matrix), chunked prefill with prefix hits and two
tensor-parallel ranks; with ``use_sliding_window`` its RoPE-less layers slide, as
SmolLM3Config derives them; the NoPE layers and the window are each shown to change HF's own
tokens, so the parity checks can fail; a bad ``no_rope_layers`` is refused by name.
"""

from __future__ import annotations

import pytest

from helpers.family_configs import SMOLLM3
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(SMOLLM3)


def test_every_fourth_layer_goes_without_rope(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert config.spec.rope_layers(config.hf_config) == (True, True, True, False)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_nope_layer_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    every_layer = rewritten(model_dir, tmp_path / "rope_everywhere", no_rope_layers=[1] * 4)
    assert hf_greedy(every_layer, prompts()) != hf_reference


def test_the_nope_layers_slide_with_use_sliding_window(model_dir, hf_reference, tmp_path):
    # As SmolLM3Config derives layer_types without them: the RoPE-less layers slide.
    windowed = rewritten(
        model_dir,
        tmp_path / "windowed",
        use_sliding_window=True,
        sliding_window=16,
        layer_types=None,
        no_rope_layers=[1, 0, 1, 0],
    )
    assert ModelConfig.from_dir(windowed).layer_sliding_windows == (0, 16, 0, 16)
    expected = hf_greedy(windowed, prompts())
    unwindowed = rewritten(windowed, tmp_path / "unwindowed", use_sliding_window=False)
    assert hf_greedy(unwindowed, prompts()) != expected
    llm = LLM(windowed, block_size=8, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(no_rope_layers=[1, 1, 0]), r"no_rope_layers must hold one 0 or 1 per layer \(4\)"),
        (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must hold one 0 or 1 per layer"),
        (
            dict(no_rope_layers=None, no_rope_layer_interval=0),
            "no_rope_layer_interval must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_no_rope_layers_are_refused_by_name(model_dir, tmp_path, changes, message):
    changed = rewritten(model_dir, tmp_path / "changed", **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(changed)


def test_lora_matches_hf_peft(model_dir, tmp_path):
    from helpers.lora_adapters import ALL_MODULES, make_lora_adapter, peft_greedy

    adapter = make_lora_adapter(
        model_dir, tmp_path / "lora", seed=5, target_modules=ALL_MODULES, r=8, lora_alpha=16
    )
    short_prompts = prompts()[:4]
    llm = LLM(model_dir, num_blocks=256, lora_modules={"all": str(adapter)})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = peft_greedy(model_dir, adapter, short_prompts)
    assert token_ids(llm.generate(short_prompts, params, lora_request="all")) == expected
    assert expected != peft_greedy(model_dir, None, short_prompts)
