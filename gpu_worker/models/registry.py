"""Which module and class describe each HF architecture: one line per name, the module
imported on first use.

A table rather than decorators: the supported names (and the error for any other) need no
import, the list reads in one place, and a model imports only its own architecture's
module. Each module under ``architectures/`` is torch-free; the class it names builds the
model (``build_model``), importing torch only then.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedserve.gpu_worker.model_config import ModelConfig
    from pagedserve.gpu_worker.models.architecture import Architecture
    from pagedserve.gpu_worker.models.base import CausalLM
    from pagedserve.gpu_worker.parallel import TensorParallel

# HF architecture name -> (module under architectures/, class).
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "Llama"),
    "MistralForCausalLM": ("mistral", "Mistral"),
    "Ministral3ForCausalLM": ("mistral", "Ministral3"),
    "MixtralForCausalLM": ("mistral", "Mixtral"),
    "Llama4ForCausalLM": ("llama4", "Llama4"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3"),
    "Qwen2MoeForCausalLM": ("qwen", "Qwen2Moe"),
    "Qwen3MoeForCausalLM": ("qwen", "Qwen3Moe"),
    "GraniteForCausalLM": ("granite", "Granite"),
    "GraniteMoeForCausalLM": ("granite", "GraniteMoe"),
    "GraniteMoeSharedForCausalLM": ("granite", "GraniteMoeShared"),
    "Phi3ForCausalLM": ("phi3", "Phi3"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOss"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5", "Ernie4_5Moe"),
    "InternLM3ForCausalLM": ("internlm3", "InternLM3"),
    "ArceeForCausalLM": ("arcee", "Arcee"),
    "ApertusForCausalLM": ("apertus", "Apertus"),
    "ExaoneForCausalLM": ("exaone", "Exaone"),
    "HeliumForCausalLM": ("helium", "Helium"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan", "HunYuanDense"),
    "HunYuanMoEV1ForCausalLM": ("hunyuan", "HunYuanMoe"),
    "OlmoeForCausalLM": ("olmoe", "Olmoe"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4Moe"),
    "Dots1ForCausalLM": ("dots1", "Dots1"),
    "NemotronForCausalLM": ("nemotron", "Nemotron"),
    "OPTForCausalLM": ("opt", "OPT"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2"),
    "CohereForCausalLM": ("cohere", "Cohere"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2"),
    "Glm4ForCausalLM": ("glm4", "Glm4"),
    "GemmaForCausalLM": ("gemma", "Gemma"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3"),
    "GptOssForCausalLM": ("gpt_oss", "GptOss"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3"),
    "Glm4MoeLiteForCausalLM": ("deepseek", "Glm4MoeLite"),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


@functools.cache
def architecture(name: str) -> Architecture:
    """The architecture registered under HF's ``name`` (a KeyError for any other)."""
    module_name, class_name = _ARCHITECTURES[name]
    module = importlib.import_module(f"{__package__}.architectures.{module_name}")
    return getattr(module, class_name)(name)


def architectures_with(flag: str) -> list[str]:
    """The names whose architecture sets ``flag``, for a message that lists them."""
    return [name for name in _ARCHITECTURES if getattr(architecture(name), flag)]


@functools.cache
def classifier_architectures() -> dict[str, str]:
    """HF's sequence classifier names -> the decoder they are read as (with a ``score``
    head in place of the LM head)."""
    return {
        classifier: name
        for name in _ARCHITECTURES
        if (classifier := architecture(name).classifier_name) is not None
    }


def build_model(
    config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel | None = None
) -> CausalLM:
    """The model of ``config``'s architecture, holding rank ``parallel.rank``'s share of it
    (None: the whole model); a sequence classification model (``config.labels``) with its
    classifier head."""
    from pagedserve.gpu_worker.parallel import SINGLE

    parallel = SINGLE if parallel is None else parallel
    spec = architecture(config.architecture)
    module = importlib.import_module(f"{__package__}.{spec.model_module}")
    model = getattr(module, spec.model_class)(config, dtype, parallel)
    if config.labels:
        model.attach_classifier(config, dtype)
    return model
