"""Model families written for this engine, keyed by the family name in ModelConfig."""

from __future__ import annotations

import torch

from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import CausalLM
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


def build_model(
    config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
) -> CausalLM:
    """The model of ``config``'s family, holding rank ``parallel.rank``'s share of it; a
    sequence classification model (``config.labels``) with its classifier head."""
    model = _build_decoder(config, dtype, parallel)
    if config.labels:
        model.attach_classifier(config, dtype)
    return model


def _build_decoder(config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel) -> CausalLM:
    if config.family == "llama":
        from pagedserve.gpu_worker.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config, dtype, parallel)
    if config.family == "opt":
        from pagedserve.gpu_worker.models.opt import OPTForCausalLM

        return OPTForCausalLM(config, dtype, parallel)
    if config.family == "gemma":
        from pagedserve.gpu_worker.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM(config, dtype, parallel)
    if config.family == "glm4":
        from pagedserve.gpu_worker.models.glm4 import Glm4ForCausalLM

        return Glm4ForCausalLM(config, dtype, parallel)
    if config.family == "cohere":
        from pagedserve.gpu_worker.models.cohere import CohereForCausalLM

        return CohereForCausalLM(config, dtype, parallel)
    if config.family == "starcoder2":
        from pagedserve.gpu_worker.models.starcoder2 import Starcoder2ForCausalLM

        return Starcoder2ForCausalLM(config, dtype, parallel)
    if config.family == "olmo2":
        from pagedserve.gpu_worker.models.olmo2 import Olmo2ForCausalLM

        return Olmo2ForCausalLM(config, dtype, parallel)
    if config.family == "gpt_oss":
        from pagedserve.gpu_worker.models.gpt_oss import GptOssForCausalLM

        return GptOssForCausalLM(config, dtype, parallel)
    if config.family == "nemotron":
        from pagedserve.gpu_worker.models.nemotron import NemotronForCausalLM

        return NemotronForCausalLM(config, dtype, parallel)
    if config.family == "deepseek":
        from pagedserve.gpu_worker.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM(config, dtype, parallel)
    raise ValueError(f"model family {config.family!r} has no implementation")
