"""``pagedserve.frontend.client``: the offline API's types over gRPC, against the offline
engine on the same weights."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import AsyncClient, Client
from pagedserve.frontend.grpc_convert import sampling_params_from_proto, sampling_params_to_proto

PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402, 403], "hello world"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


def same_output(got, want) -> None:
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.finished
    assert len(got.outputs) == len(want.outputs)
    for mine, theirs in zip(got.outputs, want.outputs):
        assert mine.token_ids == theirs.token_ids
        assert mine.text == theirs.text
        assert mine.finish_reason == theirs.finish_reason
        assert mine.stop_reason == theirs.stop_reason
        if theirs.logprobs is not None:
            assert [list(e) for e in mine.logprobs] == [list(e) for e in theirs.logprobs]
            for entry, expected in zip(mine.logprobs, theirs.logprobs):
                # (Prefix-cache hits and batch shapes move float32 sums in the last bits.)
                assert list(entry.values()) == pytest.approx(list(expected.values()), abs=1e-5)
            assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(max_tokens=10, temperature=0.7, seed=3, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(max_tokens=8, temperature=0.0, beam_width=3, n=2, early_stopping="never"),
        SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=2, best_of=4, stop=["a", "b"]),
        SamplingParams(logit_bias={5: -100.0, 70000: 0.25}, allowed_token_ids=[5, 9, 70000]),
        SamplingParams(bad_words=["no", " way"], truncate_prompt_tokens=-1),
        SamplingParams(max_tokens=3, detokenize=False),
    ],
)
def test_sampling_params_survive_the_wire(params):
    assert sampling_params_from_proto(sampling_params_to_proto(params), GREEDY) == params


def test_generate_stream_and_chat_match_the_offline_engine(server, offline):
    with Client(f"127.0.0.1:{server.port}") as client:
        for prompt in PROMPTS:
            want = offline.generate(prompt, GREEDY)[0]
            same_output(client.generate(prompt, GREEDY), want)
            seen = []
            for output in client.stream(prompt, GREEDY):
                seen.append(len(output.outputs[0].token_ids))
            # Growing outputs; on a busy machine the server coalesces the steps a slow reader
            # has not taken yet (seen once: [5, 16], and [16]), so only order is certain here.
            assert seen == sorted(seen) and seen[-1] == 16
            same_output(output, want)
        # A stream long enough that it cannot all be made before its first message is read.
        long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        seen = [len(output.outputs[0].token_ids) for output in client.stream(PROMPTS[0], long)]
        assert seen == sorted(seen) and seen[-1] == 300 and len(seen) >= 2, seen
        seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=3, ignore_eos=True)
        same_output(client.generate(PROMPTS[0], seeded), offline.generate(PROMPTS[0], seeded)[0])
        steered = SamplingParams(
            max_tokens=12, temperature=0.0, logit_bias={300: 5.0}, allowed_token_ids=[7, 300, 301]
        )
        want = offline.generate(PROMPTS[0], steered)[0]
        assert set(want.outputs[0].token_ids) <= {7, 300, 301}
        same_output(client.generate(PROMPTS[0], steered), want)
        # bad_words go as words; the server tokenizes them as the offline engine does.
        plain = offline.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
        letter = next(t for t in map(offline.tokenizer.decode, ([i] for i in plain)) if t.isalpha())
        unsaid = SamplingParams(temperature=0.0, bad_words=[letter])
        want = offline.generate(PROMPTS[0], unsaid)[0]
        assert letter in offline.tokenizer.decode(plain) and letter not in want.outputs[0].text
        same_output(client.generate(PROMPTS[0], unsaid), want)
        messages = [{"role": "user", "content": "hi there"}]
        chat_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        same_output(client.chat(messages, chat_params), offline.chat(messages, chat_params)[0])
        started = [*messages, {"role": "assistant", "content": "well"}]
        flags = dict(add_generation_prompt=False, continue_final_message=True)
        want = offline.chat(started, chat_params, **flags)[0]
        assert want.prompt.endswith("well")
        same_output(client.chat(started, chat_params, **flags), want)
        no_thinking = {"enable_thinking": False}
        want = offline.chat(messages, chat_params, chat_template_kwargs=no_thinking)[0]
        assert want.prompt.endswith("</think>\n\n")
        same_output(client.chat(messages, chat_params, chat_template_kwargs=no_thinking), want)
        sources = [{"text": "plums are fruit"}]
        want = offline.chat(messages, chat_params, documents=sources)[0]
        assert want.prompt.startswith("<|im_start|>document\nplums")
        same_output(client.chat(messages, chat_params, documents=sources), want)
        assert client.tokenize("hello") == offline.tokenizer.encode("hello")
        assert client.generate(PROMPTS[0], GREEDY).queue_time_s is not None
        assert client.embed("hello").queue_time_s is not None
        assert client.model_info().vocab_size == 512
        # Leaving a stream early cancels the call (the fixture then finds every block free).
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        for output in client.stream(PROMPTS[0], long):
            if len(output.outputs[0].token_ids) >= 3:
                break
        with pytest.raises(grpc.RpcError) as caught:
            client.generate([1, 2, 999], GREEDY)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids.ids[2]: token id 999" in caught.value.details()


def test_async_client_streams_concurrently(server, offline):
    wants = offline.generate(PROMPTS, GREEDY)

    async def run():
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:

            async def last(prompt):
                outputs = [output async for output in client.stream(prompt, GREEDY)]
                return outputs[-1]

            streamed = await asyncio.gather(*(last(p) for p in PROMPTS))
            whole = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
            return streamed, whole

    streamed, whole = asyncio.run(run())
    for got_stream, got_whole, want in zip(streamed, whole, wants):
        same_output(got_stream, want)
        same_output(got_whole, want)


def test_chat_calls_send_reasoning_effort_to_the_template(start_server, offline):
    """Each chat call of both clients hands ``reasoning_effort`` to the chat template as its
    variable (as the offline engine's ``chat_template_kwargs`` would); a value that is not
    OpenAI's is refused naming the field, by the client (the proto's enum cannot carry it)."""
    server = start_server("--kv-cache-bytes", str(4 << 20), "--trust-request-chat-template")
    messages = [{"role": "user", "content": "hi"}]
    template = "Reasoning: {{ reasoning_effort | default('unset') }}>"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {
        effort: offline.chat(
            messages, params, chat_template=template,
            chat_template_kwargs=None if effort is None else {"reasoning_effort": effort},
        )[0].prompt_token_ids
        for effort in (None, "low", "high")
    }  # fmt: skip
    assert len({tuple(prompt) for prompt in prompts.values()}) == 3
    target = f"127.0.0.1:{server.port}"
    with Client(target) as client:
        for effort, prompt in prompts.items():
            got = client.chat(messages, params, chat_template=template, reasoning_effort=effort)
            assert got.prompt_token_ids == prompt
            streamed = list(
                client.chat_stream(
                    messages, params, chat_template=template, reasoning_effort=effort
                )
            )
            assert streamed[-1].prompt_token_ids == prompt
        for call in (
            client.chat,
            lambda *args, **kwargs: list(client.chat_stream(*args, **kwargs)),
        ):
            # The enum has no such value: the client refuses it before sending.
            with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, "
                               "high; got 'max'"):  # fmt: skip
                call(messages, params, chat_template=template, reasoning_effort="max")

    async def run():
        async with AsyncClient(target) as client:
            whole = await client.chat(
                messages, params, chat_template=template, reasoning_effort="low"
            )
            streamed = [
                output
                async for output in client.chat_stream(
                    messages, params, chat_template=template, reasoning_effort="high"
                )
            ]
            return whole, streamed[-1]

    whole, streamed = asyncio.run(run())
    assert whole.prompt_token_ids == prompts["low"]
    assert streamed.prompt_token_ids == prompts["high"]
