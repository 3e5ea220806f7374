"""Random PEFT LoRA adapters of tiny models, and HF + peft's greedy tokens under them:
the reference of every LoRA check, in the engine's tests and the server's."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

from helpers.parity import prompts_for
from helpers.tiny_family import token_ids
from pagedserve.frontend import LLM, SamplingParams

# The LoRA comparisons' length: 24 greedy tokens, EOS off.
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Wide enough that every prompt's greedy tokens change (the product adds about as much
# as the base projection on these tiny models), yet no overflow in float32.
LORA_STD = 0.1
# The server tests' adapters (name -> PEFT config): two ranks, one with rsLoRA.
SERVER_ADAPTERS = {
    "tiny-all-r8": dict(target_modules=ALL_MODULES, r=8, lora_alpha=16),
    "tiny-qv-r4": dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, use_rslora=True),
}


def make_lora_adapter(model_dir: Path, path: Path, seed: int, **config) -> Path:
    """Save a PEFT LoRA adapter (``peft.LoraConfig(**config)``) for the HF model in
    ``model_dir`` to ``path``, its A and B drawn with std ``LORA_STD``."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * LORA_STD)
    model.save_pretrained(path)
    return path


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompts) -> list[list[int]]:
    """HF transformers (+ peft when ``adapter_dir``), one prompt at a time, EOS off."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # exactly NEW_TOKENS, like ignore_eos
    model.generation_config.pad_token_id = 0
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    outputs = []
    # One thread: on a shared machine, tiny models' ops run several times faster so.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            with torch.no_grad():
                generated = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )
            outputs.append(generated[0, len(prompt) :].tolist())
    finally:
        torch.set_num_threads(num_threads)
    return outputs


def assert_adapter_changes_every_prompt(adapter_tokens, base_tokens) -> None:
    """Without this an adapter the engine ignored would pass."""
    assert all(a != b for a, b in zip(adapter_tokens, base_tokens, strict=True)), (
        adapter_tokens,
        base_tokens,
    )


def check_adapter_matches_hf_peft(
    model_dir: Path, tmp_path: Path, targets: list[str], seed: int, prompt_seed: int
) -> Path:
    """An adapter on ``targets`` (r 8) gives HF peft's tokens on three prompts (1, 17 and 40
    tokens) batched with the base model's, and changes each; returns the adapter."""
    prompts = prompts_for(prompt_seed, [1, 17, 40])
    adapter = make_lora_adapter(
        model_dir, tmp_path / "adapter", seed=seed, target_modules=targets, r=8, lora_alpha=16
    )
    llm = LLM(model_dir, num_blocks=128, lora_modules={"a": str(adapter)})
    expected = peft_greedy(model_dir, adapter, prompts)
    both = llm.generate(prompts * 2, GREEDY, lora_request=["a"] * 3 + [None] * 3)
    assert token_ids(both[:3]) == expected
    assert token_ids(both[3:]) == peft_greedy(model_dir, None, prompts)
    assert_adapter_changes_every_prompt(expected, token_ids(both[3:]))
    return adapter
