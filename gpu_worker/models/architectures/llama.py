"""Meta's Llama (``LlamaForCausalLM``): GQA, RoPE, RMSNorm, a gated SiLU MLP; the defaults
of ``Architecture``, which the other members of its family adjust."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture
from pagedserve.gpu_worker.models.architectures import exaone


class Llama(Architecture):
    lora = True

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        """transformers saves an EXAONE 3.x model as LlamaForCausalLM of model_type "exaone",
        under EXAONE's own tensor names."""
        if hf_config.get("model_type") == "exaone":
            return exaone.llama_name(name)
        return name
