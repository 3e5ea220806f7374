"""Pooling models and their prompts: sequence classifiers and a cross-encoder made from
the tiny configs, and the prompts the embedding tests pool."""

from __future__ import annotations

import random

from tokenizers.processors import TemplateProcessing

from helpers.tiny_models import TINY_CONFIGS, random_hf_model
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_tokenizer, save_for_transformers

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
# With 16-token blocks and a 64-token budget: one token, part of a block, a block exactly,
# a block and one, and prompts that take two and three chunks.
EMBED_LENGTHS = [1, 5, 16, 17, 100, 150]


def classifier_config(causal: dict, **fields) -> dict:
    """The sequence classifier of a causal LM's config (``fields`` added: labels)."""
    architecture = causal["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    return {**causal, "architectures": [architecture], **fields}


def make_cross_encoder(path):
    """A one-label Qwen3 classifier whose byte-level tokenizer joins a pair as
    ``<|im_start|> A <|im_end|> B``, as rerankers' tokenizers mark the boundary."""
    random_hf_model(classifier_config(TINY_CONFIGS["qwen3"], num_labels=1), path)
    tokenizer = byte_level_tokenizer([], vocab_size=512)
    start, end = BYTE_LEVEL_SPECIALS[1], BYTE_LEVEL_SPECIALS[2]
    tokenizer.post_processor = TemplateProcessing(
        single=f"{start} $A",
        pair=f"{start} $A {end} $B:1",
        special_tokens=[(start, tokenizer.token_to_id(start)), (end, tokenizer.token_to_id(end))],
    )
    return save_for_transformers(tokenizer, path, BYTE_LEVEL_SPECIALS)


def make_text_classifier(path):
    """A three-label Llama classifier with a byte-level tokenizer (texts to classify)."""
    random_hf_model(classifier_config(TINY_CONFIGS["llama"], id2label=LABELS), path)
    return save_for_transformers(
        byte_level_tokenizer([], vocab_size=512), path, BYTE_LEVEL_SPECIALS
    )


def embed_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in EMBED_LENGTHS]
    # Shares its first 48 tokens (three full blocks) with the 100-token prompt.
    prompts.append(prompts[4][:48] + [rng.randrange(512) for _ in range(20)])
    return prompts
