"""The README's server examples on the real embedded model (SmolLM2-135M-Instruct): one
`pagedserve serve` with both APIs, OpenAI's client over HTTP and our client over gRPC,
both answering what the offline engine answers."""

from __future__ import annotations

import openai
import pytest

from helpers.server_process import ServerProcess
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import Client

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_the_embedded_model_answers_over_both_apis_as_offline(tmp_path):
    offline = LLM()
    try:
        want = offline.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0.0))[0]
        completion_want = offline.generate(
            "The capital of France is", SamplingParams(max_tokens=12, temperature=0.0)
        )[0]
    finally:
        offline.shutdown()
    assert "Paris" in want.outputs[0].text
    server = ServerProcess(None, tmp_path, "--http-port", "0").wait_serving()
    try:
        with openai.OpenAI(
            base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            assert [m.id for m in client.models.list().data] == [EMBEDDED_NAME]
            answer = client.chat.completions.create(
                model=EMBEDDED_NAME, messages=QUESTION, max_tokens=24, temperature=0.0
            )
            assert answer.choices[0].message.content == want.outputs[0].text
            streamed = client.completions.create(
                model=EMBEDDED_NAME, prompt="The capital of France is", max_tokens=12,
                temperature=0.0, stream=True,
            )  # fmt: skip
            text = "".join(chunk.choices[0].text for chunk in streamed)
            assert text == completion_want.outputs[0].text
        with Client(f"127.0.0.1:{server.port}") as grpc_client:
            output = grpc_client.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0.0))
            assert output.outputs[0].text == want.outputs[0].text
        server.assert_blocks_all_free()
        assert server.terminate() == 0
    finally:
        server.close()
