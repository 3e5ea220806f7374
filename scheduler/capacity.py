"""Whether a request could ever run to completion on an engine's limits: the checks the
scheduler makes when a request arrives, made the same way by a frontend in another process."""

from __future__ import annotations

from pagedserve.scheduler.block_manager import blocks_for_tokens, blocks_spanned
from pagedserve.scheduler.config import SchedulerConfig


def check_request_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    config: SchedulerConfig,
    block_size: int,
    total_blocks: int,
    num_sequences: int = 1,
) -> None:
    """Raise ``ValueError`` for a request that could never run to completion: its prompt
    leaves no room to generate within ``config.max_model_len``, it needs more blocks than
    the whole cache of ``total_blocks`` blocks of ``block_size`` tokens, or it runs more
    sequences (n, best_of, beams) than a batch may hold. A function of the limits alone,
    so a frontend in another process checks exactly what the scheduler will.

    A request of several sequences must fit with every sequence holding its own blocks:
    sharing is what usually happens, but after a recompute preemption nothing is shared.
    ``max_tokens=0`` is a prompt-only (pooling) request: its prompt may fill the context.

    Under a sliding window (``config.sliding_window``) a single sequence computed in chunks
    never holds more than the blocks of one step's tokens and the window before them, so it
    may be longer than the cache. A group (recomputed all at once) and a prompt that is
    not chunked still need blocks for every token.
    """
    max_model_len = config.max_model_len
    max_num_seqs = config.max_num_seqs
    if num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least 1 token, got 0")
    if max_tokens == 0 and num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len}")
    if max_tokens > 0 and num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len} and "
            "must leave room for at least one generated token"
        )
    if max_num_seqs is not None and num_sequences > max_num_seqs:
        raise ValueError(
            f"request runs {num_sequences} sequences (n / best_of / beam_width), but "
            f"max_num_seqs is {max_num_seqs}"
        )
    max_total_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
    needed_blocks = blocks_for_tokens(max_total_tokens, block_size) * num_sequences
    if _holds_a_window(config, num_sequences):
        window_blocks = _window_blocks(config, block_size)
        if window_blocks < needed_blocks:
            if window_blocks > total_blocks:
                raise ValueError(
                    f"a step of up to {config.max_num_batched_tokens} tokens "
                    f"(max_num_batched_tokens) with the {config.sliding_window}-token "
                    f"sliding window before it spans up to {window_blocks} blocks of "
                    f"{block_size} tokens, but the whole KV cache has {total_blocks} blocks "
                    f"({total_blocks * block_size} tokens); lower max_num_batched_tokens or "
                    "raise kv_cache_bytes"
                )
            return
    if needed_blocks > total_blocks:
        per_sequence = f" x {num_sequences} sequences" if num_sequences > 1 else ""
        raise ValueError(
            f"request needs up to {max_total_tokens} tokens (prompt {num_prompt_tokens} + "
            f"max_tokens {max_tokens}){per_sequence} = {needed_blocks} blocks of "
            f"{block_size} tokens, but the whole KV cache has {total_blocks} blocks "
            f"({total_blocks * block_size} tokens); lower max_tokens or raise kv_cache_bytes"
        )


def max_sequence_tokens(
    config: SchedulerConfig, block_size: int, total_blocks: int, num_sequences: int = 1
) -> int:
    """The most tokens (prompt and output) each sequence of a request of ``num_sequences``
    can reach: ``max_model_len``, or less when the cache could not hold them (as
    ``check_request_fits`` counts: behind a sliding window, only a window's blocks)."""
    if _holds_a_window(config, num_sequences) and (
        _window_blocks(config, block_size) <= total_blocks
    ):
        return config.max_model_len
    return min(config.max_model_len, total_blocks // num_sequences * block_size)


def _holds_a_window(config: SchedulerConfig, num_sequences: int) -> bool:
    """Whether a request's blocks behind its sliding window are freed as it runs, so that it
    never holds more than ``_window_blocks``: one sequence, computed in chunks."""
    return bool(
        config.sliding_window
        and config.enable_chunked_prefill
        and config.allocation_policy == "paged"
        and num_sequences == 1
    )


def _window_blocks(config: SchedulerConfig, block_size: int) -> int:
    """The most blocks a sequence holds behind a sliding window: those spanned by the
    positions from its step's first query's window start to the step's last token."""
    return blocks_spanned(config.sliding_window - 1 + config.max_num_batched_tokens, block_size)
