"""ByteDance's Seed-OSS (``SeedOssForCausalLM``): Llama with q/k/v biases and its own switch
for the output projection's (``attention_out_bias``), heads of 128 by default. Greedy tokens
identical to HF transformers (float32) across block sizes (the parity matrix), chunked
prefill with prefix hits and two tensor-parallel ranks, with and without the output bias
(each shown to change HF's own tokens, so the checks can fail); a config that leaves the
head size out takes SeedOssConfig's 128, not hidden / heads; adapters give peft's tokens.
"""

from __future__ import annotations

from safetensors.torch import load_file, save_file

from helpers.family_configs import SEED_OSS
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(SEED_OSS)


def test_heads_are_seed_oss_s_128_values(model_dir):
    assert ModelConfig.from_dir(model_dir).head_size == 128


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_without_the_output_bias_and_head_size_as_seed_oss_config_says(
    model_dir, hf_reference, tmp_path
):
    # The same weights less the output projection's bias, and a config without head_dim:
    # 128 still.
    plain = rewritten(model_dir, tmp_path / "plain", attention_out_bias=False, head_dim=None)
    tensors = load_file(plain / "model.safetensors")
    tensors = {name: t for name, t in tensors.items() if not name.endswith("o_proj.bias")}
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    expected = hf_greedy(plain, prompts())
    assert expected != hf_reference
    llm = LLM(plain, num_blocks=256)
    assert llm.model_config.head_size == 128
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_lora_matches_hf_peft(model_dir, tmp_path):
    from helpers.lora_adapters import ALL_MODULES, check_adapter_matches_hf_peft

    check_adapter_matches_hf_peft(model_dir, tmp_path, ALL_MODULES, seed=4, prompt_seed=2)
