"""The Swiss AI Initiative's Apertus (``ApertusForCausalLM``): Llama with per-head q/k norms
before RoPE, Llama 3's RoPE scaling, and an ungated MLP, ``down(xielu(up(x)))``, whose xIELU
activation has learned scalars in every layer. Greedy tokens identical to HF transformers
(float32) across block sizes (the parity matrix), chunked prefill with prefix hits and two
tensor-parallel ranks; the xIELU scalars change HF's own tokens, so the checks can fail;
bfloat16's first tokens agree with HF's bfloat16; adapters give peft's tokens."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import APERTUS
from helpers.lora_adapters import check_adapter_matches_hf_peft
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

model_dir, hf_reference = family_fixtures(APERTUS)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_xielu_scalars_change_hf_s_tokens(model_dir, hf_reference, tmp_path):
    changed = rewritten(model_dir, tmp_path / "changed")
    tensors = load_file(changed / "model.safetensors")
    for name in tensors:
        if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
            tensors[name] = tensors[name] + 1.0
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    expected = hf_greedy(changed, prompts())
    assert expected != hf_reference
    llm = LLM(changed, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_an_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=12, prompt_seed=13)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)


def test_the_activation_is_hf_s_xielu():
    from transformers.activations import XIELUActivation

    from pagedserve.gpu_worker.layers.basic import XIELU

    reference = XIELUActivation(alpha_p_init=0.6, alpha_n_init=0.9, beta=0.4, dtype=torch.float32)
    ours = XIELU(torch.float32)
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        getattr(ours, name).data.copy_(getattr(reference, name))
    x = torch.linspace(-6, 6, 1001)
    assert torch.equal(ours(x), reference(x))
