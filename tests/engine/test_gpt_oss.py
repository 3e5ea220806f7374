"""OpenAI's gpt-oss (``GptOssForCausalLM``): attention with biases and a sink logit per
head, a window on every other layer, YaRN RoPE, experts under a biased router, each a
clamped SwiGLU with biases. Greedy tokens identical to HF transformers (float32) across
block sizes (the parity matrix), chunked prefill with prefix hits, two tensor-parallel ranks
and the gathered (SDPA-shaped) prefill; a checkpoint whose experts are MXFP4 (as OpenAI
publishes them) runs as HF runs its dequantized weights, and the dequantization equals
transformers' own. The sinks, the clamp and the window each change HF's own tokens here, so
the parity checks can fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from helpers.family_configs import GPT_OSS
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.gpt_oss import dequantize_mxfp4

model_dir, hf_reference = family_fixtures(GPT_OSS)


def test_the_first_layer_slides_and_the_second_attends_to_all(model_dir):
    llm = LLM(model_dir, num_blocks=16)
    windows = [layer.self_attn.attention.sliding_window for layer in llm.worker.runner.model.layers]
    assert windows == [32, 0]


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_gathered_prefill_with_sinks_matches_hf(model_dir, hf_reference, monkeypatch):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    llm = LLM(model_dir, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_sinks_clamp_and_window_each_change_hf_s_tokens(model_dir, hf_reference, tmp_path):
    # Sinks of -1e4 weigh nothing: HF's attention without sinks.
    no_sinks = Path(shutil.copytree(model_dir, tmp_path / "no_sinks"))
    tensors = load_file(no_sinks / "model.safetensors")
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, no_sinks / "model.safetensors", metadata={"format": "pt"})
    unclamped = rewritten(model_dir, tmp_path / "unclamped", swiglu_limit=7.0)
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", sliding_window=4096)
    for variant in (no_sinks, unclamped, unwindowed):
        assert hf_greedy(variant, prompts()) != hf_reference, variant.name


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)


# --- MXFP4 experts ---------------------------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, columns] -> MXFP4 (blocks [..., rows, columns / 32, 16], scales): each group
    of 32 scaled by the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest e2m1 magnitude with its sign (code 8 + i for -E2M1[i])."""
    groups = weight.float().unflatten(-1, (-1, 32))
    largest = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    nearest = (scaled.abs()[..., None] - _E2M1).abs().argmin(-1)
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)


def test_dequantize_mxfp4_equals_transformers():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=generator)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254  # the exponents' extremes, 2^-127 and 2^127
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected.transpose(1, 2))


def test_an_mxfp4_checkpoint_runs_as_hf_runs_its_dequantized_weights(model_dir, tmp_path):
    quantized = Path(shutil.copytree(model_dir, tmp_path / "mxfp4"))
    dequantized = Path(shutil.copytree(model_dir, tmp_path / "dequantized"))
    tensors = load_file(model_dir / "model.safetensors")
    packed, plain = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # HF's [experts, in, out]; MXFP4 groups each output row's inputs.
            blocks, scales = _quantize_mxfp4(tensor.transpose(1, 2))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = plain[name] = tensor
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (quantized / "config.json").write_text(json.dumps(config))
    expected = hf_greedy(dequantized, prompts())
    assert expected != hf_greedy(model_dir, prompts())  # the rounding shows in the tokens
    llm = LLM(quantized, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_a_checkpoint_quantized_otherwise_is_refused_naming_its_method(model_dir, tmp_path, method):
    quantized = rewritten(
        model_dir, tmp_path / method, quantization_config={"quant_method": method}
    )
    with pytest.raises(ValueError, match=f"quant_method '{method}' is not supported .* mxfp4"):
        ModelConfig.from_dir(quantized)
