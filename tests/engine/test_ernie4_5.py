"""Baidu's ERNIE 4.5 dense models (``Ernie4_5ForCausalLM``): Llama with one bias switch for
every projection (``use_bias``) and RoPE on interleaved pairs of each head (GLM's), run as
the ops' rotate-half on query and key rows reordered on loading. Greedy tokens identical to
HF transformers (float32) across block sizes (the parity matrix), chunked prefill with
prefix hits and two tensor-parallel ranks, with and without biases; a config that leaves the
fields out takes Ernie4_5Config's (tied embeddings, heads of 128, a RoPE base of 500000);
adapters on the reordered query and key rows give peft's tokens.
"""

from __future__ import annotations

from helpers.family_configs import ERNIE
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM

model_dir, hf_reference = family_fixtures(ERNIE)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_a_bare_config_takes_ernie4_5_config_s_defaults(tmp_path):
    # Without biases, head size, tying or RoPE base in the file: 128-value heads, tied
    # embeddings, base 500000, no biases, as Ernie4_5Config makes them.
    bare = random_hf_model(
        {**ERNIE, "use_bias": False, "tie_word_embeddings": True, "head_dim": 128},
        tmp_path / "made",
    )
    bare = rewritten(
        bare,
        tmp_path / "bare",
        use_bias=None,
        tie_word_embeddings=None,
        head_dim=None,
        rope_theta=None,
        rope_parameters=None,
    )
    llm = LLM(bare, num_blocks=256)
    assert llm.model_config.head_size == 128
    assert llm.model_config.hf_config["rope_theta"] == 500000.0
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(bare, prompts())


def test_lora_on_the_reordered_rows_matches_hf_peft(model_dir, tmp_path):
    from helpers.lora_adapters import ALL_MODULES, check_adapter_matches_hf_peft

    check_adapter_matches_hf_peft(model_dir, tmp_path, ALL_MODULES, seed=6, prompt_seed=4)
