"""Stop strings end a request in the engine, in one process and across processes.

The tiny random Llama gets a byte-level tokenizer of its 512-token vocabulary (bytes
and filler words), so its greedy output decodes to text. A first run without stop
strings shows the text; a string that straddles two of its tokens then stops a second
run there: text cut before it (or kept with ``include_stop_str_in_output``), token ids
up to the token that completed it, ``finish_reason="stop"``, ``stop_reason`` the
string, and every block free again (asserted here and by conftest after each test).
"""

from __future__ import annotations

import pytest

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.detokenizer import REPLACEMENT_CHAR

PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402, 403, 404, 405, 406]]
NUM_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def in_process_llm(byte_level_llama_dir) -> LLM:
    return LLM(byte_level_llama_dir, num_blocks=64, block_size=16)


def stop_string_across_a_boundary(llm: LLM, token_ids: list[int]) -> tuple[str, int]:
    """A 4-character string made of the last 2 characters of one token's text and the
    first 2 of the next one's, first found in the text at that boundary; and how many
    tokens it takes to complete it."""
    texts = [llm.tokenizer.decode(token_ids[:n]) for n in range(len(token_ids) + 1)]
    full_text = texts[-1]
    for num_tokens in range(2, len(token_ids)):
        before, upto, after = texts[num_tokens - 1], texts[num_tokens], texts[num_tokens + 1]
        if len(upto) - len(before) < 2 or len(after) - len(upto) < 2:
            continue
        stop = after[len(upto) - 2 : len(upto) + 2]
        if REPLACEMENT_CHAR not in stop and full_text.find(stop) == len(upto) - 2:
            return stop, num_tokens + 1
    raise AssertionError(f"no token boundary to put a stop string on in {full_text!r}")


def record_engine_steps(llm: LLM, monkeypatch, per_output: bool = False) -> list[dict]:
    """From now on, per ``engine.step()`` call: the tokens it handed over, per request (or
    per output: keys ``(request_id, index)``)."""
    calls: list[dict] = []
    step = llm.engine.step

    def recording_step():
        deltas = step()
        counts: dict = {}
        for delta in deltas:
            key = (delta.request_id, delta.index) if per_output else delta.request_id
            counts[key] = counts.get(key, 0) + len(delta.new_token_ids)
        calls.append(counts)
        return deltas

    monkeypatch.setattr(llm.engine, "step", recording_step)
    return calls


def assert_engine_ended_it(calls: list[dict], request_id, num_tokens: int, exact: bool) -> None:
    """No step after the one that brought the stop string's last token hands over more
    of the request. In one process the abort is immediate, so that step brought
    exactly ``num_tokens``; across processes it may carry a few more, already made."""
    received = 0
    for index, counts in enumerate(calls):
        received += counts.get(request_id, 0)
        if received >= num_tokens:
            assert not any(request_id in later for later in calls[index + 1 :])
            assert received == num_tokens or not exact
            return
    raise AssertionError(f"{request_id} got {received} tokens, not {num_tokens}")


def check_stops_there(llm: LLM, monkeypatch, exact: bool) -> None:
    full = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert all(len(c.token_ids) == NUM_TOKENS and c.stop_reason is None for c in full)
    stops = [stop_string_across_a_boundary(llm, c.token_ids) for c in full]
    engine_calls = record_engine_steps(llm, monkeypatch)

    for include in (False, True):
        params = [
            SamplingParams(
                max_tokens=NUM_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                stop=["never in this text", stop],
                include_stop_str_in_output=include,
            )
            for stop, _ in stops
        ]
        outputs = llm.generate(PROMPTS, params)
        for output, reference, (stop, num_tokens) in zip(outputs, full, stops):
            completion = output.outputs[0]
            assert num_tokens < NUM_TOKENS  # the engine would have gone on
            assert_engine_ended_it(engine_calls, output.request_id, num_tokens, exact)
            assert completion.token_ids == reference.token_ids[:num_tokens]
            end = reference.text.find(stop) + (len(stop) if include else 0)
            assert completion.text == reference.text[:end]
            assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        stats = llm.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0, stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_stop_string_ends_the_request_in_process(in_process_llm, monkeypatch):
    check_stops_there(in_process_llm, monkeypatch, exact=True)


def test_stop_string_ends_the_request_across_processes(byte_level_llama_dir, monkeypatch):
    llm = LLM(byte_level_llama_dir, num_blocks=64, block_size=16, multiprocess=True)
    try:
        check_stops_there(llm, monkeypatch, exact=False)
    finally:
        llm.shutdown()


def test_final_text_is_the_decode_of_the_output_tokens(in_process_llm):
    for skip in (True, False):
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, skip_special_tokens=skip)
        for output in in_process_llm.generate(PROMPTS, params):
            completion = output.outputs[0]
            assert completion.text
            assert completion.text == in_process_llm.tokenizer.decode(
                completion.token_ids, skip_special_tokens=skip
            )


def test_a_stopped_request_still_reports_its_prefix_cache_hit(in_process_llm):
    prompt = list(range(100, 140))  # two full blocks of 16 to share
    reference = in_process_llm.generate(prompt, GREEDY)[0].outputs[0]
    stop, num_tokens = stop_string_across_a_boundary(in_process_llm, reference.token_ids)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    output = in_process_llm.generate(prompt, params)[0]
    assert len(output.outputs[0].token_ids) == num_tokens < NUM_TOKENS
    assert output.num_cached_tokens == 32


def test_stop_token_is_reported_as_the_stop_reason(in_process_llm):
    reference = in_process_llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    stop_token = reference[5]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop_token_ids=[stop_token])
    completion = in_process_llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert completion.token_ids == reference[: reference.index(stop_token) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)


def test_stop_strings_without_a_tokenizer_are_refused(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match=r"sampling_params.stop=\['x'\]: stop strings need a"):
        llm.generate([1, 2, 3], SamplingParams(stop="x"))


def test_command_line_stop_across_processes(byte_level_llama_dir, in_process_llm, capsys):
    from pagedserve.frontend.cli import main

    prompt = "Once upon"
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0)
    reference = in_process_llm.generate(prompt, params)[0].outputs[0]
    stop, _ = stop_string_across_a_boundary(in_process_llm, reference.token_ids)
    arguments = ["generate", "--model", str(byte_level_llama_dir), "--kv-cache-bytes", str(1 << 20)]
    arguments += ["--max-tokens", str(NUM_TOKENS), "--multiprocess", "--stop", "never"]
    assert main([*arguments, "--stop", stop, prompt]) == 0
    assert capsys.readouterr().out == reference.text[: reference.text.find(stop)] + "\n"
    assert main([*arguments, "--stop", "", prompt]) == 2
    assert "stop[1] must have at least 1 character" in capsys.readouterr().err


def check_each_sample_stops_on_its_own(llm: LLM, monkeypatch, exact: bool) -> None:
    """n=3 samples: a stop string that one sample's text contains ends that output there,
    and its sequence in the engine (which samples no more of it, and no later step hands
    over more); the others run on, and the request ends when all have."""
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=NUM_TOKENS, ignore_eos=True)
    free = llm.generate(PROMPTS[0], params)[0].outputs
    target = free[1]
    stop, num_tokens = stop_string_across_a_boundary(llm, target.token_ids)
    per_sample = record_engine_steps(llm, monkeypatch, per_output=True)
    sampled_before = llm.stats()["num_sampled_tokens"]
    stopped = llm.generate(PROMPTS[0], SamplingParams(**{**vars(params), "stop": [stop]}))
    outputs = stopped[0].outputs
    # The engine sampled each output's tokens, no more (a stopped one's up to its stop); in
    # one process exactly, across processes maybe a few made before it heard of a stop.
    sampled = llm.stats()["num_sampled_tokens"] - sampled_before
    returned = sum(len(output.token_ids) for output in outputs)
    assert sampled == returned or (not exact and returned < sampled < 3 * NUM_TOKENS)
    assert outputs[1].token_ids == target.token_ids[:num_tokens]
    assert outputs[1].stop_reason == stop and outputs[1].finish_reason == "stop"
    assert stop not in outputs[1].text
    assert num_tokens < NUM_TOKENS  # the engine would have gone on
    assert_engine_ended_it(per_sample, (stopped[0].request_id, 1), num_tokens, exact)
    for free_output, output in zip(free, outputs):
        if stop not in free_output.text:
            assert output.token_ids == free_output.token_ids
            assert output.finish_reason == "length"
    assert stopped[0].finished
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_each_sample_of_a_request_stops_on_its_own(in_process_llm, monkeypatch):
    check_each_sample_stops_on_its_own(in_process_llm, monkeypatch, exact=True)


def test_each_sample_stops_on_its_own_across_processes(byte_level_llama_dir, monkeypatch):
    llm = LLM(byte_level_llama_dir, num_blocks=64, block_size=16, multiprocess=True)
    try:
        check_each_sample_stops_on_its_own(llm, monkeypatch, exact=False)
    finally:
        llm.shutdown()
