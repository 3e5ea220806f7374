"""gRPC requests to a test server: greedy sampling, token-id requests, a request sent by both
generation RPCs, and a stream read back into what its outputs add up to."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.frontend.client import stream_request
from pagedserve.v1 import generation_pb2 as pb

# What ``greedy()`` generates by default.
NUM_TOKENS = 24


def greedy(max_tokens: int = NUM_TOKENS, **fields) -> pb.SamplingParams:
    """Greedy sampling of ``max_tokens``, EOS off (``fields``: any others)."""
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def token_request(prompt: list[int], sampling: pb.SamplingParams, **fields) -> pb.GenerateRequest:
    """A request of token ids (``fields``: the request's others)."""
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling, **fields)


def both_rpcs(stub) -> tuple[Callable, Callable]:
    """``Generate`` and ``GenerateStream`` (its messages as a list), each taking a
    ``GenerateRequest`` and the call's keywords."""
    return stub.Generate, lambda request, **kw: list(
        stub.GenerateStream(stream_request(request), **kw)
    )


def collect_stream(responses) -> tuple[list[pb.GenerateStreamResponse], dict[int, dict]]:
    """The stream's messages, and per output what they add up to."""
    messages = list(responses)
    outputs: dict[int, dict] = {}
    for message in messages:
        for completion in message.outputs:
            output = outputs.setdefault(
                completion.index,
                {"text": "", "token_ids": [], "logprobs": [], "finish_reason": 0},
            )
            output["text"] += completion.text
            output["token_ids"] += list(completion.token_ids)
            output["logprobs"] += [dict(zip(e.token_ids, e.logprobs)) for e in completion.logprobs]
            if completion.finish_reason:
                assert not output["finish_reason"], "an output finished twice"
                output["finish_reason"] = completion.finish_reason
                which = completion.WhichOneof("stop_reason")
                output["stop"] = None if which is None else getattr(completion, which)
    return messages, outputs
