"""The int8 engine's reference: an HF model whose linear weights are their int8
quantization, dequantized."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pagedserve.gpu_worker.layers.packed_weights import Int8PanelWeight


def save_dequantized(model_dir: Path, path: Path) -> Path:
    """The HF model in ``model_dir`` with each decoder layer's linear weights replaced by
    their int8 quantization, dequantized (per output feature, as ``Int8PanelWeight``
    quantizes; the engine's fused q/k/v and gate/up matrices keep one scale per row, so the
    same), saved to ``path``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for module in model.get_decoder().modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(Int8PanelWeight(module.weight).dequantized())
    model.save_pretrained(path)
    return path
