"""Every message that crosses a process boundary round-trips through msgpack exactly, and
a frame that is not a message is rejected with a message naming what is wrong."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    EngineStats,
    GetStats,
    LoadLoRA,
    OutputBatch,
    Progress,
    Ready,
    ResetPrefixCache,
    Shutdown,
    StartEngine,
    StartStructuredOutput,
    StartWorker,
    StopSample,
    UnloadLoRA,
    WorkerSpec,
)
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    PromptLogprobsChunk,
    RequestOutputDelta,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.serialization import (
    MESSAGE_TAGS,
    WIRE_FIELDS,
    DecodeError,
    decode,
    decode_as,
    encode,
)
from pagedserve.scheduler.structured_output import GrammarVocabulary

ALL_SET_PARAMS = SamplingParams(
    max_tokens=77,
    min_tokens=3,
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    seed=2**63 - 1,
    ignore_eos=True,
    stop_token_ids=[7, 8],
    logprobs=5,
    prompt_logprobs=2,
    n=3,
    best_of=5,
    stop=["\n\n", "終わり"],
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    structured_outputs=StructuredOutputsParams(json={"type": "object", "title": "é"}),
    logit_bias={5: -100.0, 2**31 - 1: 0.125},
    allowed_token_ids=[1, 5, 2**31 - 1],
    bad_words=["nein", " 終"],
    bad_words_token_ids=[[9], [4, 2**31 - 1]],
    truncate_prompt_tokens=-1,
)
BEAM_PARAMS = SamplingParams(
    temperature=0.0, beam_width=4, n=2, length_penalty=0.5, early_stopping="never",
    detokenize=False,
)  # fmt: skip
TOP = TokenLogprobs(token_ids=[11, 3, 9], logprobs=[-0.125, -1.0e-9, float("-inf")])
OTHER = TokenLogprobs(token_ids=[4], logprobs=[-2.5])


def new_request(params: SamplingParams, eos: list[int]) -> NewRequestData:
    return NewRequestData(
        request_id="req-é-0",  # non-ASCII survives
        token_ids=[1, 2, 3, 4, 5],
        num_prompt_tokens=4,
        block_ids=[10, 11],
        num_computed_tokens=0,
        num_scheduled_tokens=5,
        sampling_params=params,
        eos_token_ids=eos,
        lora_id=2,
    )


FULL_PLAN = StepPlan(
    step_id=2**40,
    new_requests=[new_request(ALL_SET_PARAMS, [2, 32000]), new_request(SamplingParams(), [])],
    cached_requests=[
        CachedRequestData("req-1", [12], 31, 1),
        CachedRequestData("req-2", [], 64, 16),
    ],
    finished_request_ids=["req-9", "req-10"],
    swap_out=[(5, 0), (6, 1)],
    swap_in=[(2, 7)],
    copy_blocks=[(3, 9), (4, 11)],
    token_bitmasks={"req-1": b"\x00\xff\x10\x00", "req-é-0": b"\xff" * 8},
    spec_token_ids={"req-2": [7, 8, 2**31 + 5], "req-1": [0]},
    load_loras=[(3, "sql-é", "/adapters/sql-é"), (4, "chat", "/adapters/chat")],
    unload_lora_ids=[1, 2],
    window_freed_blocks={"req-2": 3, "req-1": 1},
    draft_guesses=False,
)

FULL_DELTA = RequestOutputDelta(
    request_id="a",
    new_token_ids=[5, 6],
    finished=True,
    finish_reason="stop",
    logprobs=[TOP, OTHER],
    prompt_logprobs=[OTHER],
    num_cached_tokens=48,
    index=3,
    cumulative_logprob=-1.25,
    queue_time_s=0.125,
)
WORKER_SPEC = WorkerSpec(
    model_path="/models/tiny-é",
    dtype="bfloat16",
    block_size=16,
    num_blocks=None,
    kv_cache_bytes=1 << 30,
    device="cpu",
    swap_space_bytes=0,
    cuda_graph_max_batch=64,
    cuda_graph_max_len=4096,
    lora_modules=[["sql", "/adapters/sql-é"], ["chat", "/adapters/chat"]],
    enable_lora=True,
    quantization="int8",
    kv_cache_dtype="fp8_e5m2",
    speculative_model="/models/draft-é",
    num_speculative_tokens=3,
)
SCHEDULER_CONFIG = SchedulerConfig(
    max_num_seqs=8,
    max_num_batched_tokens=4096,
    max_model_len=4096,
    enable_chunked_prefill=False,
    watermark_fraction=0.25,
    preemption_mode="swap",
    allocation_policy="paged",
    num_speculative_tokens=5,
    prompt_lookup_max=6,
    prompt_lookup_min=3,
    scheduling_policy="priority",
    max_loras=3,
    sliding_window=4096,
    async_scheduling=True,
)

# Every encodable type, with optional fields set and unset.
ROUND_TRIP_CASES = {
    "plan-full": FULL_PLAN,
    "plan-empty": StepPlan(step_id=0),
    "result-full": StepResult(
        step_id=3,
        request_ids=["a", "b", "c"],
        sampled_token_ids=[5, 6, 7],
        logprobs=[TOP, None, OTHER],
        prompt_logprobs={
            "a": PromptLogprobsChunk(1, [TOP, OTHER]),
            "c": PromptLogprobsChunk(9, []),
        },
    ),
    "result-empty": StepResult(step_id=4),
    "result-embeddings": StepResult(
        step_id=5,
        request_ids=["a"],
        sampled_token_ids=[5],
        embeddings={"emb-é": b"\x00\x00\x80\x3f" * 3, "emb-2": b""},
    ),
    "result-drafts": StepResult(
        step_id=6,
        request_ids=["a", "b"],
        sampled_token_ids=[5, 6],
        draft_token_ids={"a": [7, 8, 9], "b": []},
    ),
    "result-failed": StepResult(
        step_id=7,
        request_ids=["a"],
        sampled_token_ids=[5],
        failed_requests={"b": "its sampling settings cannot be set up: OverflowError"},
        launched_ahead=True,
    ),
    "delta-full": FULL_DELTA,
    "delta-unset": RequestOutputDelta(request_id="a", new_token_ids=[], finished=False),
    "delta-embedding": RequestOutputDelta(
        "e", [], True, "stop", num_cached_tokens=16, embedding=b"\xff\x00\x80\x3f"
    ),
    "add-full": AddRequest(
        "r",
        [1, 2, 3],
        ALL_SET_PARAMS,
        1234.5,
        eos_token_ids=[2, 32000],
        cache_namespace="t-1",
        lora_id=3,
        priority=-7,
    ),
    "add-defaults": AddRequest("r", [1], SamplingParams(), 0.25, eos_token_ids=[]),
    "add-pooling": AddRequest(
        "e", [1, 2], SamplingParams(), 0.5, [2], pooling_params=PoolingParams(False, 64)
    ),
    "abort": AbortRequest("r"),
    "stop-sample": StopSample("r", 2),
    "error-request": EngineError(request_id="r", message="prompt too long: 9000 > 4096"),
    "failed-request": EngineError(request_id="r", message="worker refused it", code="INTERNAL"),
    "progress-step": Progress(waiting_on="", waiting_s=0.0),
    "progress-waiting": Progress(waiting_on="worker rank 0 (pid 7)", waiting_s=2.5),
    "error-engine": EngineError(request_id=None, message="worker 1 died"),
    "shutdown": Shutdown(),
    "ready-full": Ready(
        component="worker",
        pid=4242,
        info={
            "rank": 0,
            "num_blocks": 4096,
            "ok": True,
            "none": None,
            "blob": b"\x00\xff",
            "nested": {"shape": [2, 3], "dtype": "float32"},
            "ratio": 0.5,
        },
    ),
    "ready-empty": Ready(component="scheduler", pid=1, info={}),
    "output-batch": OutputBatch(
        [
            FULL_DELTA,
            RequestOutputDelta("b", [9], finished=True, finish_reason="error"),
            RequestOutputDelta("c", [], True, "stop", embedding=b"\x00\x00\x80\x3f"),
        ]
    ),
    "output-batch-empty": OutputBatch([]),
    "get-stats": GetStats(),
    "engine-stats-ok": EngineStats({"num_free_blocks": 64, "num_running": 0}, None),
    "engine-stats-broken": EngineStats({}, "block 3 is free but in a table"),
    "reset-prefix-cache": ResetPrefixCache(),
    "load-lora": LoadLoRA(7, "sql-é", "/adapters/sql-é"),
    "unload-lora": UnloadLoRA(7),
    "scheduler-config": SCHEDULER_CONFIG,
    "scheduler-config-defaults": SchedulerConfig(),
    "worker-spec": WORKER_SPEC,
    "worker-spec-blocks": WorkerSpec("/m", "float32", 8, 64, None, "cpu", 1 << 30),
    "start-engine": StartEngine(
        frontend_pid=77,
        input_endpoint="ipc:///tmp/ps-x/input.sock",
        output_endpoint="ipc:///tmp/ps-x/output.sock",
        ipc_dir="/tmp/ps-x",
        scheduler_config=SCHEDULER_CONFIG,
        seed=2**63 - 1,
        enable_prefix_caching=True,
        world_size=1,
        worker=WORKER_SPEC,
        executor_backend="ray",
        ray_address="10.0.0.1:6379",
    ),
    "start-structured-output": StartStructuredOutput(
        GrammarVocabulary('{"model": {"vocab": {"é": 0}}}', 49152, [0, 2], 7, [8, 9]), True
    ),
    "start-structured-output-none": StartStructuredOutput(None, False),
    "start-worker": StartWorker(
        rank=0,
        world_size=1,
        scheduler_pid=78,
        broadcast={"ring_name": None, "local_endpoint": "ipc:///x", "num_local_readers": 1},
        result_endpoint="ipc:///tmp/ps-x/results.sock",
        worker=WORKER_SPEC,
    ),
    "start-worker-tensor-parallel": StartWorker(
        rank=1,
        world_size=2,
        scheduler_pid=78,
        broadcast={"ring_name": "r", "local_endpoint": "ipc:///x", "num_local_readers": 2},
        result_endpoint="ipc:///tmp/ps-x/results.sock",
        worker=WORKER_SPEC,
        distributed_init_method="file:///tmp/ps-x/tensor_parallel.store",
    ),
    "start-worker-ray-remote": StartWorker(
        rank=1,
        world_size=2,
        scheduler_pid=0,
        broadcast={"ring_name": None, "remote_endpoint": "tcp://10.0.0.1:5555"},
        result_endpoint="tcp://10.0.0.1:5556",
        worker=WORKER_SPEC,
        distributed_init_method="tcp://10.0.0.2:29500",
        remote_reader=True,
        reader_index=0,
        device="cuda:0",
        ranks_on_host=1,
    ),
    "new-request": new_request(ALL_SET_PARAMS, [2]),
    "new-request-pooling": dataclasses.replace(
        new_request(SamplingParams(), [2]), pooling_params=PoolingParams(dimensions=8)
    ),
    "pooling-params": PoolingParams(normalize=False, dimensions=3),
    "pooling-params-defaults": PoolingParams(),
    "pooling-params-classify": PoolingParams(task="classify", use_activation=False),
    "pooling-params-mean": PoolingParams(normalize=False, pooling_type="MEAN"),
    "scheduler-config-classifier": SchedulerConfig(model_task="classify"),
    "cached-request": CachedRequestData("req-1", [12, 13], 31, 1),
    "token-logprobs": TOP,
    "prompt-logprobs-chunk": PromptLogprobsChunk(first_position=1, entries=[TOP, OTHER]),
    "params-all-set": ALL_SET_PARAMS,
    "params-beam": BEAM_PARAMS,
    "params-defaults": SamplingParams(),
    "params-regex": SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\d+")),
    "params-choice": SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "peut-être"])
    ),
    "params-grammar": SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar='start: "a"+')
    ),
    "params-json-object": SamplingParams(
        structured_outputs=StructuredOutputsParams(json_object=True)
    ),
    "params-json-compact": SamplingParams(
        structured_outputs=StructuredOutputsParams(
            json={"type": "array"}, disable_any_whitespace=True
        )
    ),
}


@pytest.mark.parametrize("message", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_round_trip_is_exact(message):
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_every_encodable_type_has_a_round_trip_case_and_encodes_all_its_fields():
    assert {type(message) for message in ROUND_TRIP_CASES.values()} == set(MESSAGE_TAGS)
    for message_type, wire_fields in WIRE_FIELDS.items():
        declared = tuple(field.name for field in dataclasses.fields(message_type))
        assert wire_fields == declared, message_type.__name__
    assert len(set(MESSAGE_TAGS.values())) == len(MESSAGE_TAGS)


def test_swap_pairs_come_back_as_tuples():
    decoded = decode(encode(FULL_PLAN))
    assert decoded.swap_out == [(5, 0), (6, 1)]
    assert all(type(pair) is tuple for pair in decoded.swap_out + decoded.swap_in)


def test_decoded_plan_keeps_derived_properties():
    decoded = decode_as(encode(FULL_PLAN), StepPlan)
    assert decoded.num_scheduled_tokens == FULL_PLAN.num_scheduled_tokens == 5 + 5 + 1 + 16
    assert decoded.new_requests[0].sampling_params.seed == 2**63 - 1
    assert decoded.new_requests[0].sampling_params.top_p == 0.9


def test_int_arrival_time_arrives_as_float():
    decoded = decode(encode(AddRequest("r", [1], SamplingParams(), 3, eos_token_ids=[])))
    assert decoded.arrival_time_s == 3.0 and type(decoded.arrival_time_s) is float


def test_eos_ids_given_as_a_frozenset_arrive_as_a_list():
    # The in-process engine passes the model's EOS ids as a frozenset.
    request = AddRequest("r", [1], SamplingParams(), 0.0, eos_token_ids=frozenset({7}))
    assert decode(encode(request)).eos_token_ids == [7]


def test_ready_info_tuples_arrive_as_lists():
    decoded = decode(encode(Ready("worker", 1, {"shape": (2, 3)})))
    assert decoded.info == {"shape": [2, 3]}


def _pack_params(**wire_values) -> list:
    """The default params' wire fields, some replaced by (possibly malformed) values."""
    fields = msgpack.unpackb(encode(SamplingParams()))[1:]
    for name, value in wire_values.items():
        fields[WIRE_FIELDS[SamplingParams].index(name)] = value
    return fields


def _frame(message_type: type, *fields) -> bytes:
    return msgpack.packb([MESSAGE_TAGS[message_type], *fields])


def _plan_fields(**overrides) -> list:
    fields = {
        "step_id": 1,
        "new_requests": [],
        "cached": [["a"], [[]], [3], [1]],
        "finished": [],
        "swap_out": [],
        "swap_in": [],
        "copy_blocks": [],
        "token_bitmasks": {},
        "spec_token_ids": {},
        "load_loras": [],
        "unload_lora_ids": [],
        "window_freed_blocks": {},
        "draft_guesses": True,
    }
    fields.update(overrides)
    return list(fields.values())


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"\xc1", "not a msgpack frame"),  # 0xc1 is never used by msgpack
        (encode(FULL_PLAN)[:-3], "not a msgpack frame"),  # truncated
        (encode(Shutdown()) + b"\x00", "not a msgpack frame"),  # trailing bytes
        (msgpack.packb({"tag": 1}), r"expected an array \[tag, fields...\], got dict"),
        (msgpack.packb([]), r"expected an array \[tag, fields...\]"),
        (msgpack.packb(["StepPlan"]), r"expected an array \[tag, fields...\]"),
        (msgpack.packb([99, 1]), "unknown message tag 99 .*1=StepPlan"),
        (_frame(StepPlan, 1, [], []), "StepPlan: expected an array of 13 fields"),
        (
            _frame(StepPlan, *_plan_fields(draft_guesses=1)),
            "StepPlan.draft_guesses: expected bool, got int",
        ),
        (_frame(StepPlan, *_plan_fields(step_id="1")), "StepPlan.step_id: expected int, got str"),
        (_frame(StepPlan, *_plan_fields(step_id=True)), "StepPlan.step_id: expected int, got bool"),
        (
            _frame(StepPlan, *_plan_fields(cached=[["a", "b"], [[]], [3], [1]])),
            "new_block_ids: expected 2 entries, got 1",
        ),
        (
            _frame(StepPlan, *_plan_fields(cached=[["a"], [[]], [3.0], [1]])),
            r"num_computed_tokens: expected only int, found \['float'\]",
        ),
        (
            _frame(StepPlan, *_plan_fields(cached=[["a"], [[]], [3]])),
            "cached_requests: expected 4 columns",
        ),
        (_frame(StepPlan, *_plan_fields(swap_out=[1, 2, 3])), r"swap_out: expected \(src, dst\)"),
        (_frame(StepPlan, *_plan_fields(new_requests=[["r"]])), "NewRequestData: expected an"),
        (
            _frame(StepPlan, *_plan_fields(token_bitmasks={"a": "ff"})),
            r"StepPlan.token_bitmasks: expected only bytes, found \['str'\]",
        ),
        (
            _frame(StepPlan, *_plan_fields(token_bitmasks=[b"\xff"])),
            "StepPlan.token_bitmasks: expected dict, got list",
        ),
        (
            _frame(StepPlan, *_plan_fields(spec_token_ids={"a": 3})),
            r"StepPlan.spec_token_ids: expected only list, found \['int'\]",
        ),
        (
            _frame(StepPlan, *_plan_fields(load_loras=[[3, "sql"]])),
            r"StepPlan.load_loras: expected \[id, name, path\]",
        ),
        (
            _frame(StepPlan, *_plan_fields(unload_lora_ids=["sql"])),
            r"StepPlan.unload_lora_ids: expected only int, found \['str'\]",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(structured_outputs=[None, "a+", ["x"], None, False, False]),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "StructuredOutputsParams: structured_outputs must set exactly one of .*regex, choice",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(structured_outputs=[None, 5, None, None, False, False]),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "StructuredOutputsParams.regex: expected str or None, got int",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(structured_outputs=[None, "a+", None, None, False, 1]),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "StructuredOutputsParams.disable_any_whitespace: expected bool, got int",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(logit_bias=[[1, 2], [0.5]]),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            r"SamplingParams.logit_bias: expected \[token ids, biases\] of one length",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(logit_bias={"1": 0.5}),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "SamplingParams.logit_bias: expected list, got dict",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(temperature=-1.0),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "SamplingParams: temperature must be >= 0.0 and <= 100.0, got -1.0",
        ),
        (
            _frame(AddRequest, "r", [1], [16], 0.0, [2], None, 0, 0, None),
            "SamplingParams: expected an array of 30",
        ),
        (
            _frame(AddRequest, "r", [1], _pack_params(stop="\n"), 0.0, [2], None, 0, 0, None),
            "SamplingParams.stop: expected list, got str",
        ),
        (
            _frame(AddRequest, "r", [1], _pack_params(stop=["a", ""]), 0.0, [2], None, 0, 0, None),
            r"SamplingParams: stop\[1\] must have at least 1 character, got ''",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(skip_special_tokens=1),
                0.0,
                [2],
                None,
                0,
                0,
                None,
            ),
            "SamplingParams: skip_special_tokens must be a bool, got 1",
        ),
        (
            _frame(AddRequest, "r", [1], _pack_params(), 0.0),
            "AddRequest: expected an array of 9 fields",
        ),
        (
            _frame(AddRequest, "r", [1], _pack_params(), 0.0, [2, "3"], None, 0, 0, None),
            r"AddRequest.eos_token_ids: expected only int, found \['str'\]",
        ),
        (
            _frame(AddRequest, "r", [1], _pack_params(), 0.0, [2], None, 0, "high", None),
            "AddRequest.priority: expected int, got str",
        ),
        (
            _frame(
                OutputBatch,
                [["a"], [[]], ["yes"], [None], [None], [None], [None], [0], [None], [None], [None]],
            ),
            r"OutputBatch.deltas.finished: expected only bool, found \['str'\]",
        ),
        (
            _frame(OutputBatch, [["a", "b"], [[], []], [True, False], [None], [None], [None]]),
            "OutputBatch.deltas: expected 11 columns",
        ),
        (
            _frame(
                OutputBatch,
                [["a", "b"], [[], []], [True, False], [None], [None], [None], [], [], [], [], []],
            ),
            "OutputBatch.deltas.finish_reason: expected 2 entries, got 1",
        ),
        (
            _frame(
                OutputBatch,
                [["a"], [[]], [True], [7], [None], [None], [None], [0], [None], [None], [None]],
            ),
            r"OutputBatch.deltas.finish_reason: unexpected \['int'\]",
        ),
        (
            _frame(
                OutputBatch,
                [
                    ["a"],
                    [[5]],
                    [True],
                    [None],
                    [[[[1, 2], [-0.5]]]],
                    [None],
                    [3],
                    [0],
                    [None],
                    [None],
                    [None],
                ],
            ),
            "TokenLogprobs: 2 token_ids but 1 logprobs",
        ),
        (_frame(EngineStats, [], None), "EngineStats.stats: expected dict, got list"),
        (
            _frame(
                SchedulerConfig,
                0,
                2048,
                2048,
                True,
                0.01,
                None,
                "paged",
                0,
                4,
                2,
                "ngram",
                0,
                "fcfs",
                0,
                0,
                "generate",
                0,
                False,
            ),
            "SchedulerConfig: max_num_seqs must be a positive integer, got 0",
        ),
        (
            _frame(
                WorkerSpec,
                "/m",
                "float32",
                16,
                1.5,
                None,
                "cpu",
                0,
                0,
                0,
                [],
                False,
                None,
                "auto",
                None,
                0,
                "draft_model",
            ),
            r"WorkerSpec.num_blocks: expected int or None, got float",
        ),
        (
            _frame(StartWorker, 0, 1, 2, {}, "ipc:///r", [], None, False, None, None, None),
            "WorkerSpec: expected an array of 16 fields",
        ),
        (
            _frame(StartWorker, 1, 2, 2, {}, "ipc:///r", [], 5, False, None, None, None),
            "StartWorker.distributed_init_method: expected str or None, got int",
        ),
        (_frame(StopSample, "r", True), "StopSample.index: expected int, got bool"),
        (
            _frame(EngineError, 7, "boom", "INTERNAL"),
            "EngineError.request_id: expected str or None, got int",
        ),
        (
            _frame(StepResult, 1, ["a"], [5], [[[1, 2], [-0.5]]], {}, {}, {}, {}, False),
            "TokenLogprobs: 2 token_ids but 1 logprobs",
        ),
        (
            _frame(StepResult, 1, [], [], [], {}, {"e": [1.0]}, {}, {}, False),
            r"StepResult.embeddings: expected only bytes, found \['list'\]",
        ),
        (
            _frame(StepResult, 1, [], [], [], {}, {}, {"a": 5}, {}, False),
            r"StepResult.draft_token_ids: expected only list, found \['int'\]",
        ),
        (
            _frame(StepResult, 1, [], [], [], {}, {}, {}, {"a": 5}, False),
            r"StepResult.failed_requests: expected only str, found \['int'\]",
        ),
        (
            _frame(StepResult, 1, [], [], [], {}, {}, {}, {}, 1),
            "StepResult.launched_ahead: expected bool, got int",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(),
                0.0,
                [2],
                None,
                0,
                0,
                [True, 0, "embed", True, "LAST"],
            ),
            "PoolingParams: dimensions must be an integer >= 1, got 0",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(),
                0.0,
                [2],
                None,
                0,
                0,
                [1, None, "embed", True, "LAST"],
            ),
            "PoolingParams.normalize: expected bool, got int",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(),
                0.0,
                [2],
                None,
                0,
                0,
                [True, 3, "classify", True, "LAST"],
            ),
            "PoolingParams: dimensions=3 is the embed task's",
        ),
        (
            _frame(
                AddRequest,
                "r",
                [1],
                _pack_params(),
                0.0,
                [2],
                None,
                0,
                0,
                [True, None, "rank", True, "LAST"],
            ),
            "PoolingParams: task must be one of 'embed', 'classify', 'token_embed', "
            "'token_classify', got 'rank'",
        ),
        (
            _frame(
                OutputBatch,
                [["a"], [[]], [True], [None], [None], [None], [None], [0], [None], [[]], [None]],
            ),
            r"OutputBatch.deltas.embedding: unexpected \['list'\]",
        ),
        (
            _frame(
                OutputBatch,
                [["a"], [[]], [True], [None], [None], [None], [None], [0], [None], [None], [1]],
            ),
            r"OutputBatch.deltas.queue_time_s: unexpected \['int'\]",
        ),
        (_frame(Shutdown, 1), "Shutdown: expected an array of 0 fields"),
        (_frame(Ready, "w", 1, {1: "x"}), "not a msgpack frame.*map key"),
    ],
)
def test_malformed_frame_is_rejected_with_a_clear_error(frame, match):
    with pytest.raises(DecodeError, match=match):
        decode(frame)


def test_decode_as_rejects_a_frame_of_another_type():
    with pytest.raises(DecodeError, match="expected a StepPlan frame, got a StepResult"):
        decode_as(encode(StepResult(step_id=1)), StepPlan)


def test_encode_rejects_what_is_not_a_message():
    class PlanSubclass(StepPlan):
        pass

    with pytest.raises(TypeError, match="cannot encode dict: not a message type"):
        encode({"step_id": 1})
    with pytest.raises(TypeError, match="cannot encode PlanSubclass"):
        encode(PlanSubclass(step_id=1))
    # A numpy scalar leaking out of the sampler is caught at the sender, not the receiver.
    with pytest.raises(TypeError, match="cannot encode StepResult"):
        encode(StepResult(step_id=1, request_ids=["a"], sampled_token_ids=[np.int64(5)]))


@pytest.mark.parametrize(
    "frame, request_id",
    [
        # The id is readable: the receiver can refuse this one request.
        (
            _frame(AddRequest, "r7", [1], _pack_params(ignore_eos={}), 0.0, [2], None, 0, 0, None),
            "r7",
        ),
        (_frame(AddRequest, "r7", [1], _pack_params(), 0.0, [2], None, 0, "high", None), "r7"),
        (_frame(AddRequest, "r7", [1], [16], 0.0, [2], None, 0, 0, None), "r7"),
        # It is not: nothing to name but the frame.
        (_frame(AddRequest, 7, [1], _pack_params(), 0.0, [2], None, 0, 0, None), None),
        (_frame(AddRequest, "r7", [1], _pack_params(), 0.0), None),
        (_frame(StopSample, "r7", True), None),
    ],
)
def test_a_bad_add_request_names_its_request_when_it_can(frame, request_id):
    with pytest.raises(DecodeError) as raised:
        decode(frame)
    assert raised.value.request_id == request_id
