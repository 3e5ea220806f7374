"""What the offline API takes as prompts: a text, token ids, or a list of those."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

PromptType = str | Sequence[int]
Message = dict[str, Any]


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or several as a list of prompts (a list of ints is one prompt of token
    ids; a numpy array or torch tensor of ids, one prompt or one per row)."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, Sequence):
        prompts = prompts.tolist()
        prompts = [prompts] if isinstance(prompts, int) else prompts
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt")
    if all(isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in prompts):
        return [list(prompts)]
    return list(prompts)
