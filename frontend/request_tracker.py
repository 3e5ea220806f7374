"""One request's output as the frontend builds it from the engine's deltas.

Shared by the offline ``LLM`` and the gRPC server: tokens are decoded as they arrive
(through one ``IncrementalDetokenizer`` per output when there is a tokenizer), stop strings
end an output where they appear, and the tracker says when the engine must hear of it.
"""

from __future__ import annotations

import enum

from pagedserve.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.frontend.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from pagedserve.frontend.tokenizer import Tokenizer
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.pooling_params import decode_embedding
from pagedserve.scheduler.sampling_params import SamplingParams


class EngineAction(enum.Enum):
    """What the engine must be told after a delta (it does not see stop strings)."""

    NONE = "none"
    # A stop string ended the last of the request's running outputs: abort the request.
    ABORT_REQUEST = "abort_request"
    # A stop string ended this output while others run: stop that sample alone.
    STOP_SAMPLE = "stop_sample"


class RequestTracker:
    """``output`` is the request's ``RequestOutput``, updated in place by ``apply``."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index,
                    "",
                    [],
                    None,
                    logprobs=None if params.logprobs is None else [],
                    cumulative_logprob=None if params.logprobs is None else 0.0,
                )
                for index in range(params.n)
            ],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        self._detokenizers = (
            None
            if tokenizer is None or not params.detokenize
            else [IncrementalDetokenizer(tokenizer, params) for _ in range(params.n)]
        )

    @property
    def finished(self) -> bool:
        return self.output.finished

    def apply(self, delta: RequestOutputDelta) -> EngineAction:
        """Add one delta of this request. Deltas that arrive after a stop string ended
        their output (the engine made them before it heard) are dropped."""
        output = self.output
        if output.finished:
            return EngineAction.NONE  # stop strings ended it; the engine ran on meanwhile
        if isinstance(output.outputs[delta.index].stop_reason, str):
            output.finished = delta.finished
            return EngineAction.NONE
        detokenizer = None if self._detokenizers is None else self._detokenizers[delta.index]
        if not _apply_delta(output, delta, detokenizer, self.params, self.eos_token_ids):
            return EngineAction.NONE
        if output.finished:
            return EngineAction.NONE
        if all(completion.finish_reason is not None for completion in output.outputs):
            output.finished = True
            return EngineAction.ABORT_REQUEST
        return EngineAction.STOP_SAMPLE


class EmbeddingTracker:
    """An embedding request's ``EmbeddingRequestOutput``: its one delta carries the
    vector (or, aborted or failed, the reason it has none)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.output = EmbeddingRequestOutput(request_id, prompt, prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.output.finished

    def apply(self, delta: RequestOutputDelta) -> EngineAction:
        output = self.output
        if delta.embedding is not None:
            output.outputs = EmbeddingOutput(decode_embedding(delta.embedding))
        if delta.num_cached_tokens is not None:
            output.num_cached_tokens = delta.num_cached_tokens
        if delta.queue_time_s is not None:
            output.queue_time_s = delta.queue_time_s
        output.finish_reason = delta.finish_reason or output.finish_reason
        output.finished = output.finished or delta.finished
        return EngineAction.NONE


def _apply_delta(
    output: RequestOutput,
    delta: RequestOutputDelta,
    detokenizer: IncrementalDetokenizer | None,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
) -> bool:
    """Add one step's tokens to ``output`` and decode them. Returns True when a stop
    string ended the output (``delta.index``) with them: the engine does not know, the
    caller ends that output's sequence there, or the request once all its outputs have
    ended."""
    completion = output.outputs[delta.index]
    new_token_ids = delta.new_token_ids
    num_kept = len(new_token_ids)
    if detokenizer is not None:
        num_kept = detokenizer.append(new_token_ids, delta.finish_reason is not None)
        completion.text = detokenizer.text
        if num_kept < len(new_token_ids):
            new_token_ids = new_token_ids[:num_kept]
    completion.token_ids.extend(new_token_ids)
    if delta.logprobs is not None and completion.logprobs is not None:
        for entry in delta.logprobs[:num_kept]:
            completion.logprobs.append(dict(zip(entry.token_ids, entry.logprobs)))
            completion.cumulative_logprob += entry.logprobs[0]
    if delta.cumulative_logprob is not None:
        # Ranked outputs (best_of, beams) report their score as a whole.
        completion.cumulative_logprob = delta.cumulative_logprob
    if delta.prompt_logprobs is not None and output.prompt_logprobs is not None:
        output.prompt_logprobs.extend(
            dict(zip(entry.token_ids, entry.logprobs)) for entry in delta.prompt_logprobs
        )
    if delta.num_cached_tokens is not None:
        output.num_cached_tokens = delta.num_cached_tokens
    if delta.queue_time_s is not None:
        output.queue_time_s = delta.queue_time_s
    stop_string = None if detokenizer is None else detokenizer.stop_string
    if stop_string is not None:
        completion.finish_reason = "stop"
        completion.stop_reason = stop_string
    elif delta.finish_reason is not None:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = _stop_token(completion, params, eos_token_ids)
    if delta.finished:
        output.finished = True
        if delta.finish_reason == "abort":
            for other in output.outputs:
                other.finish_reason = other.finish_reason or "abort"
    return stop_string is not None


def _stop_token(
    completion: CompletionOutput, params: SamplingParams, eos_token_ids: frozenset[int]
) -> int | None:
    """The stop token that ended a finished output, if one did (``Request``'s order:
    EOS first, then ``stop_token_ids``)."""
    if completion.finish_reason != "stop" or not completion.token_ids:
        return None
    last = completion.token_ids[-1]
    if last in params.stop_token_ids and (params.ignore_eos or last not in eos_token_ids):
        return last
    return None
