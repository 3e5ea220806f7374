"""config.json and generation_config.json from a GGUF's metadata: the fields every llama-like
architecture shares, then what the file's architecture adds through its hooks."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value, optional_int
from pagedserve.frontend.gguf.registry import architecture_for


def hf_config(
    fields: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
    rope_factors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """config.json from the GGUF's metadata, and from its tensors where llama.cpp keeps a
    setting only in their presence or shape (biases, a tied LM head, experts) or values
    (Llama 3's RoPE divisors, LongRoPE's factors)."""
    architecture = architecture_for(fields, tensor_shapes)
    metadata = GGUFMetadata(fields, tensor_shapes, rope_freqs, rope_factors)
    hidden_size = metadata.hidden_size
    num_heads = metadata.num_heads
    head_dim = metadata.head_dim
    architecture.check_rope_dim(metadata)
    # The embedding's rows: llama.cpp may drop rows past the tokenizer's vocabulary.
    vocab_size = tensor_shapes["token_embd.weight"][0]
    config: dict[str, Any] = {
        "architectures": [architecture.hf_architecture],
        "model_type": architecture.model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata.key("feed_forward_length")),
        "num_hidden_layers": metadata.num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(metadata.key("context_length")),
        "rms_norm_eps": float32_value(metadata.key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": metadata.rope_theta,
    }
    if architecture.bias_field is not None:
        config[architecture.bias_field] = "blk.0.attn_q.bias" in tensor_shapes
    architecture.update_config(config, metadata)
    config.update(
        {
            # Without output.weight, llama.cpp reuses the embedding matrix as the LM head.
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "bos_token_id": optional_int(fields.get("tokenizer.ggml.bos_token_id")),
            "eos_token_id": optional_int(fields.get("tokenizer.ggml.eos_token_id")),
            "pad_token_id": optional_int(fields.get("tokenizer.ggml.padding_token_id")),
            # transformers 5 reads "dtype"; older readers (and other engines) read
            # "torch_dtype".
            "torch_dtype": "float32",
            "dtype": "float32",
        }
    )
    architecture.add_rope(config, metadata)
    return config


def generation_config(config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp ends a generation at EOS and at the end-of-turn / end-of-message tokens a chat
    # model closes its turn with (Gemma's <end_of_turn>, Llama 3's <|eot_id|>), as the HF
    # model's own generation_config lists them.
    stops = [config["eos_token_id"]]
    stops += [
        optional_int(fields.get(f"tokenizer.ggml.{kind}_token_id")) for kind in ("eot", "eom")
    ]
    eos = list(dict.fromkeys(token for token in stops if token is not None))
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config["pad_token_id"],
    }
