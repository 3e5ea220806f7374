"""Meta's OPT (``OPTForCausalLM``): learned positions, LayerNorm, a ReLU MLP of ``ffn_dim``,
optional projections in and out of the embeddings (models/opt.py)."""

from __future__ import annotations

from pagedserve.gpu_worker.models.architecture import Architecture


class OPT(Architecture):
    model_module = "opt"
    model_class = "OPTForCausalLM"
    dense_width_field = "ffn_dim"
