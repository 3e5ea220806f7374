"""The language model of a vision-language checkpoint served for text
(``Gemma3ForConditionalGeneration``: Gemma 3 4B and up; ``Mistral3ForConditionalGeneration``:
Mistral Small 3.1 / 3.2, Ministral 3, Devstral Small 2; Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE,
whose M-RoPE is
plain RoPE for text; GLM-4.1V and GLM-4.5V; LLaVA, LLaVA-NeXT and LLaVA-OneVision; InternVL;
Llama 4):
its ``text_config`` read
as the text
model's, its ``language_model`` tensors loaded under a text checkpoint's names, the vision
encoder and projector left unread. Greedy tokens identical to HF transformers' vision-language
model given the same text alone (float32), chunked prefill and two tensor-parallel ranks too;
the outer config's ``tie_word_embeddings`` decides the LM head, as in HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from helpers.family_configs import MINISTRAL3_ROPE
from helpers.tiny_family import GREEDY, TINY_SHAPE, prompts, token_ids
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig

NEW_TOKENS = GREEDY.max_tokens
_TEXT = {k: v for k, v in TINY_SHAPE.items()}
_VISION_SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    image_size=32, patch_size=16,
)  # fmt: skip
_VISION_PIXTRAL = dict(_VISION_SIGLIP, head_dim=16)
_VISION_QWEN = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256
)  # out_hidden_size: the text model's hidden size
_MROPE = [8, 12, 12]  # M-RoPE's sections of the 32 rotary frequencies of a 64-value head

MODELS_GLM4V_TEXT = dict(
    **_TEXT,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [4, 6, 6],  # of the 16 frequencies of half a head
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
)
MODELS = {
    "gemma3": (
        transformers.Gemma3Config,
        dict(
            text_config=dict(
                model_type="gemma3_text",
                **_TEXT,
                head_dim=64,
                sliding_window=24,
                query_pre_attn_scalar=64,
                layer_types=["sliding_attention", "full_attention"],
            ),
            vision_config=_VISION_SIGLIP,
            tie_word_embeddings=True,
        ),
        "Gemma3ForCausalLM",
    ),
    "ministral3": (
        transformers.Mistral3Config,
        dict(
            text_config=dict(
                model_type="ministral3", **_TEXT, head_dim=64, rope_parameters=MINISTRAL3_ROPE
            ),
            vision_config=_VISION_PIXTRAL,
            tie_word_embeddings=False,
        ),
        "Ministral3ForCausalLM",
    ),
    "qwen2_5_vl": (
        transformers.Qwen2_5_VLConfig,
        dict(
            text_config=dict(
                **_TEXT,
                rope_scaling={"type": "mrope", "mrope_section": _MROPE, "rope_theta": 10000.0},
            ),
            vision_config=_VISION_QWEN,
            tie_word_embeddings=True,
        ),
        "Qwen2ForCausalLM",
    ),
    "qwen3_vl": (
        transformers.Qwen3VLConfig,
        dict(
            text_config=dict(
                **_TEXT,
                head_dim=64,
                rope_scaling={
                    "rope_type": "default",
                    "mrope_section": _MROPE,
                    "mrope_interleaved": True,
                    "rope_theta": 10000.0,
                },
            ),
            vision_config=dict(_VISION_QWEN, deepstack_visual_indexes=[]),
        ),
        "Qwen3ForCausalLM",
    ),
    "qwen3_vl_moe": (
        transformers.Qwen3VLMoeConfig,
        dict(
            text_config=dict(
                **_TEXT,
                head_dim=64,
                moe_intermediate_size=96,
                num_experts=8,
                num_experts_per_tok=3,
                rope_scaling={
                    "rope_type": "default",
                    "mrope_section": _MROPE,
                    "mrope_interleaved": True,
                    "rope_theta": 10000.0,
                },
            ),
            vision_config=dict(_VISION_QWEN, deepstack_visual_indexes=[]),
        ),
        "Qwen3MoeForCausalLM",
    ),
    "glm4v": (
        transformers.Glm4vConfig,
        dict(
            text_config=MODELS_GLM4V_TEXT,
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256
            ),
        ),
        "Glm4ForCausalLM",
    ),
    "glm4v_moe": (
        transformers.Glm4vMoeConfig,
        dict(
            text_config=dict(
                **{**_TEXT, "num_hidden_layers": 3},
                head_dim=64,
                moe_intermediate_size=64,
                n_routed_experts=8,
                num_experts_per_tok=3,
                n_group=4,
                topk_group=2,
                first_k_dense_replace=1,
                routed_scaling_factor=2.5,
                attention_bias=True,
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": [4, 6, 6],
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
            ),
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256
            ),
        ),
        "Glm4MoeForCausalLM",
    ),
    "glm46v": (
        transformers.Glm46VConfig,
        {
            "text_config": {"model_type": "glm4v_text", **MODELS_GLM4V_TEXT},
            "vision_config": dict(
                model_type="glm4v_vision",
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=256,
            ),
        },
        "Glm4ForCausalLM",
    ),
    "llava": (
        transformers.LlavaConfig,
        dict(
            text_config=dict(model_type="llama", **_TEXT, head_dim=64),
            vision_config=dict(_VISION_SIGLIP, model_type="clip_vision_model"),
        ),
        "LlamaForCausalLM",
    ),
    "llava_next": (
        transformers.LlavaNextConfig,
        dict(
            text_config=dict(model_type="mistral", **_TEXT, head_dim=64),
            vision_config=dict(_VISION_SIGLIP, model_type="clip_vision_model"),
            image_grid_pinpoints=[[32, 32]],
        ),
        "MistralForCausalLM",
    ),
    "llava_onevision": (
        transformers.LlavaOnevisionConfig,
        dict(
            text_config=dict(model_type="qwen2", **_TEXT),
            vision_config=dict(_VISION_SIGLIP, model_type="siglip_vision_model"),
        ),
        "Qwen2ForCausalLM",
    ),
    "internvl": (
        transformers.InternVLConfig,
        dict(
            text_config=dict(model_type="qwen3", **_TEXT, head_dim=64),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=[32, 32],
                patch_size=[16, 16],
            ),
        ),
        "Qwen3ForCausalLM",
    ),
    "llama4": (
        transformers.Llama4Config,
        dict(
            text_config=dict(
                model_type="llama4_text",
                **{**_TEXT, "intermediate_size": 96},
                head_dim=64,
                intermediate_size_mlp=384,
                no_rope_layer_interval=2,
                moe_layers=[0],
                num_local_experts=4,
                attention_chunk_size=32,
                floor_scale=16,
                attn_scale=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            vision_config=dict(
                _VISION_SIGLIP,
                intermediate_size=128,
                vision_output_dim=64,
                projector_input_dim=64,
                projector_output_dim=64,
            ),
        ),
        "Llama4ForCausalLM",
    ),
    "mistral_small": (
        transformers.Mistral3Config,
        dict(
            text_config=dict(model_type="mistral", **_TEXT, head_dim=64, rope_theta=10000.0),
            vision_config=_VISION_PIXTRAL,
            tie_word_embeddings=False,
        ),
        "MistralForCausalLM",
    ),
}


def vlm_dir(name: str, path: Path) -> Path:
    """A random vision-language model saved as transformers saves it, weights drawn wide
    (``tiny_models.random_hf_model``'s reason: tie-free greedy paths)."""
    config_class, fields, _ = MODELS[name]
    config = config_class(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.uniform_(0.8, 1.2)
            else:
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def hf_text_greedy(model_dir: Path) -> list[list[int]]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for prompt in prompts():
            input_ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {name: vlm_dir(name, root / name) for name in MODELS}


@pytest.fixture(scope="module")
def hf_references(vlm_dirs) -> dict[str, list[list[int]]]:
    return {name: hf_text_greedy(path) for name, path in vlm_dirs.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_text_model_of_a_vision_language_checkpoint_matches_hf(vlm_dirs, hf_references, name):
    config = ModelConfig.from_dir(vlm_dirs[name])
    assert config.architecture == MODELS[name][2]
    assert config.declared_architecture.endswith("ForConditionalGeneration")
    llm = LLM(vlm_dirs[name], num_blocks=256, max_num_batched_tokens=64)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[name]


@pytest.mark.slow
def test_two_ranks_match_hf(vlm_dirs, hf_references):
    llm = LLM(vlm_dirs["ministral3"], num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["ministral3"]
    finally:
        llm.shutdown()


def test_qwen2_5_vl_s_older_flat_config_reads_the_same(vlm_dirs, hf_references, tmp_path):
    """Qwen2.5-VL's published checkpoints keep the text fields at the top level, with
    ``rope_scaling`` {"type": "mrope"}, as transformers 4 wrote them."""
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    for file in vlm_dirs["qwen2_5_vl"].iterdir():
        (flat_dir / file.name).symlink_to(file)
    (flat_dir / "config.json").unlink()
    config = json.loads((vlm_dirs["qwen2_5_vl"] / "config.json").read_text())
    text = config.pop("text_config")
    text.pop("model_type")
    text["rope_scaling"] = {"type": "mrope", "mrope_section": _MROPE}
    text["rope_theta"] = 10000.0
    text.pop("rope_parameters", None)
    (flat_dir / "config.json").write_text(json.dumps({**config, **text}))
    assert ModelConfig.from_dir(flat_dir).architecture == "Qwen2ForCausalLM"
    llm = LLM(flat_dir, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["qwen2_5_vl"]


def test_qwen3_vl_moe_s_published_expert_orientation_reads_the_same(
    vlm_dirs, hf_references, tmp_path
):
    """Qwen3-VL-MoE's published checkpoints stack each layer's experts transposed
    ([experts, hidden, 2 x intermediate]); transformers 5 saves them the other way round."""
    source = vlm_dirs["qwen3_vl_moe"]
    published = tmp_path / "published"
    published.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (published / file.name).symlink_to(file)
    tensors = load_file(source / "model.safetensors")
    stacked = [name for name in tensors if name.endswith(("experts.gate_up_proj", "down_proj"))]
    stacked = [name for name in stacked if ".experts." in name]
    assert stacked
    for name in stacked:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(published, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["qwen3_vl_moe"]


def test_an_unknown_text_model_is_refused_by_its_model_type(vlm_dirs, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((vlm_dirs["mistral_small"] / "config.json").read_text())
    config["text_config"]["model_type"] = "qwen2"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_config.model_type 'qwen2' is not supported"):
        ModelConfig.from_dir(bad)
