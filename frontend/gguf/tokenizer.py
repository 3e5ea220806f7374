"""The converted directory's tokenizer files, made by transformers' GGUF tokenizer converter."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_tokenizer(
    gguf_path: Path, out_dir: Path, fields: dict[str, Any], context_length: int
) -> None:
    # Imported here: transformers is slow to import and only this stage needs it.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if fields.get("general.architecture") in GGUF_SUPPORTED_ARCHITECTURES:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    else:
        # transformers reads no model config from such a file (Granite's), which
        # AutoTokenizer wants for the tokenizer's class: the vocabulary alone makes the
        # generic fast tokenizer, built from the same GGUF keys.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name
        )
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template is not None and not tokenizer.chat_template:
        # Without it apply_chat_template fails after the directory is reloaded.
        tokenizer.chat_template = chat_template
    # The GGUF conversion leaves this "unlimited"; the model's context is the real limit.
    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)
