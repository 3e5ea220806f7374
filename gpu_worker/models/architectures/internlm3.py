"""Shanghai AI Lab's InternLM3 (``InternLM3ForCausalLM``): Llama's implementation (HF's too),
its own names for the bias switches. HF has no InternLM3 classifier."""

from __future__ import annotations

from pagedserve.gpu_worker.models.architecture import Architecture


class InternLM3(Architecture):
    has_classifier = False
    lora = True
    # InternLM3Config's: heads of 128, no biases.
    config_defaults = dict(head_dim=128, attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5)
    field_aliases = {"qkv_bias": "attention_bias", "bias": "mlp_bias"}
