"""Which LoRA adapter a request runs through, as vLLM's ``LoRARequest`` names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter served by this engine (``LLM(lora_modules={name: path})``), by name.

    vLLM's positional order (``lora_name, lora_int_id, lora_path``), so code written for
    it runs unchanged; the id and path, when given, must be those the engine numbered and
    loaded (adapters load at start-up: a request cannot bring a new one).
    """

    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None
