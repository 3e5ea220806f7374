"""Shanghai AI Lab's InternLM3 (``InternLM3ForCausalLM``, which transformers implements as
Llama): its configs switch biases as ``qkv_bias`` and ``bias`` (InternLM3Config's names for
attention_bias and mlp_bias) and scale RoPE with dynamic NTK, which rotates with the plain
frequencies up to ``max_position_embeddings`` (past it HF re-bases each pass: refused,
naming why). Greedy tokens identical to HF transformers (float32) across block sizes (the
parity matrix), chunked prefill with prefix hits and two tensor-parallel ranks, with the
biases on; without them they are HF's too, and the biases move HF's own tokens.
"""

from __future__ import annotations

import pytest

from helpers.family_configs import INTERNLM3
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

model_dir, hf_reference = family_fixtures(INTERNLM3)


def test_internlm3_s_bias_fields_are_read(model_dir):
    hf_config = ModelConfig.from_dir(model_dir).hf_config
    assert (hf_config["attention_bias"], hf_config["mlp_bias"]) == (True, True)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_without_biases_and_past_the_window(model_dir, hf_reference, tmp_path):
    plain = rewritten(model_dir, tmp_path / "plain", qkv_bias=False, bias=False)
    # transformers 5 saves the switches under their own names: drop those, keep the aliases.
    plain = rewritten(plain, tmp_path / "aliased", attention_bias=None, mlp_bias=None)
    expected = hf_greedy(plain, prompts())
    assert expected != hf_reference
    from safetensors.torch import load_file, save_file

    tensors = load_file(plain / "model.safetensors")
    save_file(
        {name: t for name, t in tensors.items() if not name.endswith("bias")},
        plain / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert token_ids(LLM(plain, num_blocks=256).generate(prompts(), GREEDY)) == expected
    config = ModelConfig.from_dir(plain)
    assert config.max_position_embeddings == 256
    with pytest.raises(ValueError, match=r"exceeds .* 256 \(dynamic: positions past"):
        LLM(plain, num_blocks=256, max_model_len=512)
