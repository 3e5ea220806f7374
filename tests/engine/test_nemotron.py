"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron): RoPE over half of each
head, LayerNorm1P (a biased LayerNorm scaled by ``1 + w``) and an ungated squared-ReLU MLP.
Greedy tokens identical to HF transformers (float32) across block sizes (the parity matrix),
chunked prefill with prefix hits and two tensor-parallel ranks, also with biases; bfloat16's
first tokens agree with HF's bfloat16; adapters give peft's tokens."""

from __future__ import annotations

from helpers.family_configs import NEMOTRON
from helpers.lora_adapters import check_adapter_matches_hf_peft
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    token_ids,
)
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM

model_dir, hf_reference = family_fixtures(NEMOTRON)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_with_biases_matches_hf(tmp_path):
    biased = random_hf_model({**NEMOTRON, "attention_bias": True, "mlp_bias": True}, tmp_path)
    llm = LLM(biased, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(biased, prompts())
    finally:
        llm.shutdown()


def test_an_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=14, prompt_seed=15)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
