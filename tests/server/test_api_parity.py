"""The gRPC and HTTP APIs give the same verdict on the fields they share: each value in the
table is accepted by both, or refused by both with the same message (the field named as
each API names it: ``sampling.top_k`` and ``top_k``). Both go through one check path
(``SamplingParams``, ``frontend/request_contract.py``), and this table holds them to it."""

from __future__ import annotations

import math
import re

import grpc
import pytest

from helpers.http_calls import post
from pagedserve.v1 import generation_pb2 as pb

PROMPT = [5, 6]
BASE = {"max_tokens": 4, "temperature": 0.0}
NAN = math.nan
INF = math.inf

# (field, value): fields of both HTTP's completions body and gRPC's SamplingParams, in
# range, at its edges and past them (values each API's wire can carry).
CASES = [
    ("max_tokens", 0), ("max_tokens", 1), ("max_tokens", 510), ("max_tokens", 511),
    ("max_tokens", 2**31 - 1), ("max_tokens", 2**32 - 1),
    ("min_tokens", 4), ("min_tokens", 5), ("min_tokens", 2**32 - 1),
    ("temperature", 0.0), ("temperature", 1e-9), ("temperature", 100.0), ("temperature", 100.5),
    ("temperature", -1.0), ("temperature", INF), ("temperature", NAN),
    ("top_k", -1), ("top_k", 0), ("top_k", 2**31 - 1), ("top_k", -2),
    ("top_p", 0.0), ("top_p", 1.0), ("top_p", 1.5), ("top_p", NAN),
    ("min_p", -0.1), ("min_p", 1.0), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", 0.01), ("repetition_penalty", 100.0),
    ("repetition_penalty", 101.0), ("repetition_penalty", INF),
    ("presence_penalty", 2.0), ("presence_penalty", 2.5), ("presence_penalty", -INF),
    ("frequency_penalty", -2.5),
    ("seed", 0), ("seed", 2**63 - 1), ("seed", 2**63), ("seed", 2**64 - 1),
    ("logprobs", 20), ("logprobs", 21), ("logprobs", 2**32 - 1),
    ("prompt_logprobs", 20), ("prompt_logprobs", 21),
    ("n", 2), ("n", 65), ("n", 1025), ("best_of", 3), ("best_of", 2**32 - 1),
    ("stop_token_ids", [511]), ("stop_token_ids", [512]), ("stop_token_ids", [2**32 - 1]),
    ("stop_token_ids", list(range(1025))),
    ("stop", ["a"]), ("stop", ["x" * 4097]), ("stop", [""]), ("stop", ["a"] * 257),
    ("logit_bias", {5: 200.0}), ("logit_bias", {5: NAN}), ("logit_bias", {5: INF}),
    ("logit_bias", {512: 1.0}),
    ("allowed_token_ids", [5, 6]), ("allowed_token_ids", [512]),
    ("bad_words", ["ok"]), ("bad_words", [" "]), ("bad_words", ["x" * 1025]),
    ("bad_words", ["ok"] * 257),
    ("truncate_prompt_tokens", -1), ("truncate_prompt_tokens", 1), ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", 513), ("truncate_prompt_tokens", -2),
]  # fmt: skip


def http_verdict(server, field: str, value) -> tuple[bool, str]:
    body = {"prompt": PROMPT, **BASE, field: value}
    if field == "logit_bias":
        body[field] = {str(token_id): bias for token_id, bias in value.items()}
    status, answer = post(server, "/v1/completions", body)
    assert status in (200, 400), answer
    return status == 200, "" if status == 200 else answer["error"]["message"]


def grpc_verdict(server, field: str, value) -> tuple[bool, str]:
    sampling = pb.SamplingParams(**{**BASE, field: value})
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling)
    try:
        server.stub.Generate(request, timeout=30)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        # The same message, each API naming its own fields.
        details = error.details().replace("sampling.", "")
        return False, re.sub(r"\btoken_ids(\.ids)?\b", "prompt", details)
    return True, ""


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r:.30}" for f, v in CASES])
def test_both_apis_give_the_same_verdict(server, field, value):
    assert http_verdict(server, field, value) == grpc_verdict(server, field, value)
