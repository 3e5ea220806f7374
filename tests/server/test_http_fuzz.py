"""Random request bodies against a real server: every answer is a 200 or a 4xx whose error
names what was wrong, and the server serves on with every block free. A bounded, seeded
fuzz (a few hundred small calls on the tiny model): the kind of input that once reached the
scheduler unchecked (``"ignore_eos": {}``) and took the whole server down."""

from __future__ import annotations

import json
import math
import random

import pytest
from server.test_http_api import post

# Values of every JSON type, in and out of each field's range.
VALUES = [
    None, True, False, 0, 1, -1, 2, 7, 100, 10**9, -(10**9), 0.5, -0.5, 1.5, 2.5, 1e308,
    math.nan, "", "x", "hello", " ", [], [1], [1, 2, 600], ["a"], ["a", 3], {}, {"a": 1},
    {"5": 1.0}, {"5": "x"}, [[1, 2]], "token_id:5",
]  # fmt: skip
FIELDS = [
    "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k",
    "min_p", "n", "best_of", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
    "echo", "stream", "stream_options", "logit_bias", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "use_beam_search", "length_penalty", "early_stopping",
    "prompt_logprobs", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "skip_special_tokens", "include_stop_str_in_output",
    "return_tokens_as_token_ids", "continue_final_message", "add_generation_prompt",
    "priority", "cache_salt", "request_id", "tools", "tool_choice", "parallel_tool_calls",
    "include_reasoning", "spaces_between_special_tokens", "model", "user", "suffix",
    "chat_template_kwargs", "return_token_ids", "documents", "chat_template",
]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}],
]
PROMPTS = ["hello", [5, 6, 7], ["a", "b"], [[1, 2], [3]]]


def random_body(rng: random.Random, max_fields: int) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": rng.choice([1, 3, 6])}
    if chat:
        body["messages"] = rng.choice(CHATS)
    else:
        body["prompt"] = rng.choice(PROMPTS)
    for _ in range(rng.randint(1, max_fields)):
        body[rng.choice(FIELDS)] = rng.choice(VALUES)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def post_json(server, path: str, body: dict) -> tuple[int, dict | str]:
    """As ``post``, but a streamed answer (server-sent events) comes back as its text."""
    data = json.dumps(body).encode()  # NaN goes as NaN, as Python's json writes it
    try:
        return post(server, path, data)
    except json.JSONDecodeError:
        return 200, "stream"


@pytest.mark.parametrize(("seed", "max_fields"), [(0, 1), (1, 4)])
def test_random_bodies_get_a_200_or_an_error_naming_the_field(server, seed, max_fields):
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    for _ in range(150):
        path, body = random_body(rng, max_fields)
        status, answer = post_json(server, path, body)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404), (body, status, answer)
        if status != 200:
            error = answer["error"]
            assert error["code"] == status and error["message"], (body, answer)
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses
    # The server serves on.
    status, answer = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 200, answer
