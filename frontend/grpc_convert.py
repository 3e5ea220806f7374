"""Between the gRPC API's messages (protos/pagedserve/v1/generation.proto) and the
engine's: sampling settings in, outputs out (whole, or what is new since the last
streamed message)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.frontend.outputs import CompletionOutput, RequestOutput
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.structured_output import grammar_text
from pagedserve.v1 import generation_pb2 as pb

# Proto3 `optional` fields copied as they are when set (unset: SamplingParams' default).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "min_tokens",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
    "beam_width",
    "length_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
_EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}
# uint64 on the wire; the engine's generators take seeds below 2**63.
MAX_SEED = (1 << 63) - 1

# StructuredOutputs' constraint (the proto's oneof) -> StructuredOutputsParams' field.
_STRUCTURED_KINDS = {
    "json_schema": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(
    message: pb.SamplingParams | None, default: SamplingParams
) -> SamplingParams:
    """The request's ``SamplingParams``. ``default`` is the model's (its generation config):
    all of it when the request sets none, its temperature when the request leaves that
    unset. Raises ``ValueError`` naming ``sampling.<field>``, the value and the limit."""
    if message is None:
        return default
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)
    }
    kwargs["temperature"] = (
        message.temperature if message.HasField("temperature") else default.temperature
    )
    if message.HasField("seed") and message.seed > MAX_SEED:
        raise ValueError(f"sampling.seed must be <= {MAX_SEED}, got {message.seed}")
    early_stopping = message.early_stopping.strip().lower()
    if early_stopping not in _EARLY_STOPPING:
        raise ValueError(
            f"sampling.early_stopping must be one of 'true', 'false', 'never' (or unset), "
            f"got {message.early_stopping!r}"
        )
    kwargs.update(
        ignore_eos=message.ignore_eos,
        stop_token_ids=list(message.stop_token_ids),
        stop=list(message.stop) or None,
        include_stop_str_in_output=message.include_stop_str_in_output,
        early_stopping=_EARLY_STOPPING[early_stopping],
    )
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_outputs_from_proto(message.structured_outputs)
    if message.logit_bias:
        kwargs["logit_bias"] = dict(message.logit_bias)
    if message.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(message.allowed_token_ids)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        raise ValueError(f"sampling.{error}") from None


def _structured_outputs_from_proto(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    """The constraint, compiled here so that an error names the proto's field
    (``sampling.structured_outputs.json_schema``, not the engine's ``json``)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise ValueError(
            "sampling.structured_outputs is set but names no constraint; set one of "
            + ", ".join(_STRUCTURED_KINDS)
        )
    if kind == "json_object" and not message.json_object:
        raise ValueError(
            "sampling.structured_outputs.json_object must be true (any JSON object); leave "
            "structured_outputs unset for unconstrained output"
        )
    engine_kind = _STRUCTURED_KINDS[kind]
    value = getattr(message, kind)
    if kind == "choice":
        value = list(value.choices)
    try:
        params = StructuredOutputsParams(
            **{engine_kind: value}, disable_any_whitespace=message.disable_any_whitespace
        )
        grammar_text(params)
    except (ValueError, TypeError) as error:
        text = str(error)
        prefix = f"structured_outputs.{engine_kind}"
        raise ValueError(f"sampling.structured_outputs.{kind}{text.removeprefix(prefix)}") from None
    return params


def _structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    message = pb.StructuredOutputs(disable_any_whitespace=params.disable_any_whitespace)
    kind = params.kind
    if kind == "choice":
        message.choice.choices.extend(params.choice)
    elif kind == "json":
        message.json_schema = params.json  # JSON text once constructed
    else:
        setattr(message, kind, getattr(params, kind))
    return message


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The request's settings as the server reads them: every field set explicitly, so
    the server applies exactly ``params`` (the client's side of the conversion above)."""
    message = pb.SamplingParams(
        temperature=params.temperature,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop or [],
        include_stop_str_in_output=params.include_stop_str_in_output,
        early_stopping={True: "true", False: "false"}.get(
            params.early_stopping, str(params.early_stopping)
        ),
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(_structured_outputs_to_proto(params.structured_outputs))
    if params.logit_bias:
        message.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids:
        message.allowed_token_ids.extend(params.allowed_token_ids)
    return message


def _token_logprobs(entry: dict[int, float]) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def _set_stop_reason(message: pb.Completion, completion: CompletionOutput) -> None:
    if isinstance(completion.stop_reason, str):
        message.stop_string = completion.stop_reason
    elif completion.stop_reason is not None:
        message.stop_token_id = completion.stop_reason


def _usage(output: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in output.outputs),
        cached_prompt_tokens=output.num_cached_tokens,
    )


def whole_response(client_request_id: str, output: RequestOutput) -> pb.GenerateResponse:
    """``Generate``'s answer: every output in full."""
    response = pb.GenerateResponse(
        request_id=client_request_id,
        prompt_token_ids=output.prompt_token_ids,
        finished=output.finished,
        usage=_usage(output),
    )
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.extend(
            _token_logprobs(entry) for entry in output.prompt_logprobs if entry is not None
        )
    for completion in output.outputs:
        message = response.outputs.add(
            index=completion.index,
            text=completion.text,
            token_ids=completion.token_ids,
            finish_reason=FINISH_REASONS.get(completion.finish_reason),
        )
        if completion.logprobs is not None:
            message.logprobs.extend(_token_logprobs(entry) for entry in completion.logprobs)
        if completion.cumulative_logprob is not None:
            message.cumulative_logprob = completion.cumulative_logprob
        _set_stop_reason(message, completion)
    return response


@dataclass
class _Sent:
    """How much of one output a stream has sent."""

    text_chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass
class StreamState:
    """What ``GenerateStream`` has sent of a request, so each message carries only what
    is new. The text only grows: the detokenizer holds back what a stop string may cut."""

    client_request_id: str
    outputs: dict[int, _Sent] = field(default_factory=dict)
    prompt_sent: bool = False
    prompt_logprobs_sent: int = 0

    def due(self, output: RequestOutput, interval_tokens: int) -> bool:
        """Whether to send now: the first message (time to first token), at least
        ``interval_tokens`` new tokens over the outputs, or an output or the request
        ended. Fewer, larger messages cost the frontend less per token."""
        if output.finished or not self.prompt_sent or interval_tokens <= 1:
            return True
        new_tokens = 0
        for completion in output.outputs:
            sent = self.outputs.get(completion.index)
            sent_tokens = 0 if sent is None else sent.tokens
            if completion.finish_reason is not None and (sent is None or not sent.finished):
                return True
            new_tokens += len(completion.token_ids) - sent_tokens
        return new_tokens >= interval_tokens

    def next_response(self, output: RequestOutput) -> pb.GenerateResponse | None:
        """The message for what changed since the last one; None when nothing did."""
        response = pb.GenerateResponse(request_id=self.client_request_id)
        changed = False
        if not self.prompt_sent:
            response.prompt_token_ids.extend(output.prompt_token_ids)
            self.prompt_sent = changed = True
        if output.prompt_logprobs is not None:
            new = [e for e in output.prompt_logprobs[1:][self.prompt_logprobs_sent :]]
            if new:
                response.prompt_logprobs.extend(_token_logprobs(entry) for entry in new)
                self.prompt_logprobs_sent += len(new)
                changed = True
        for completion in output.outputs:
            sent = self.outputs.setdefault(completion.index, _Sent())
            new_text = completion.text[sent.text_chars :]
            new_tokens = completion.token_ids[sent.tokens :]
            new_logprobs = (
                [] if completion.logprobs is None else completion.logprobs[sent.logprobs :]
            )
            newly_finished = completion.finish_reason is not None and not sent.finished
            if not (new_text or new_tokens or new_logprobs or newly_finished):
                continue
            message = response.outputs.add(
                index=completion.index, text=new_text, token_ids=new_tokens
            )
            message.logprobs.extend(_token_logprobs(entry) for entry in new_logprobs)
            if newly_finished:
                message.finish_reason = FINISH_REASONS.get(completion.finish_reason)
                _set_stop_reason(message, completion)
                if completion.cumulative_logprob is not None:
                    message.cumulative_logprob = completion.cumulative_logprob
                sent.finished = True
            sent.text_chars = len(completion.text)
            sent.tokens = len(completion.token_ids)
            sent.logprobs += len(new_logprobs)
            changed = True
        if output.finished:
            response.finished = True
            response.usage.CopyFrom(_usage(output))
            changed = True
        return response if changed else None
