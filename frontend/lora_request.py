"""Which LoRA adapter a request runs through, as vLLM's ``LoRARequest`` names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A request's LoRA adapter, by name.

    vLLM's positional order (``lora_name, lora_int_id, lora_path``), so code written for
    it runs unchanged: on an engine started with ``enable_lora=True`` a request naming an
    adapter not yet loaded, with its ``lora_path``, loads it (``LLM.load_lora``). Later
    requests naming it must give the same path and id (for an adapter of
    ``lora_modules``: the id the engine numbered it with, 1, 2, ... in order).
    """

    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None
