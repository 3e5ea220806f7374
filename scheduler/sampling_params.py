"""Per-request generation settings, validated where the user hands them in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. A request with ``temperature > 0`` and a
    ``seed`` draws the same tokens whatever else shares its batch; without a seed the
    engine assigns one from its own generator so runs stay reproducible.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        self.temperature = float(self.temperature)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, minimum=0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
