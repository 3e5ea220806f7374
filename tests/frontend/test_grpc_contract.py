"""The proto's promises that no server is needed to check: GenerateStream's messages are
Generate's field for field, and each enum of a closed vocabulary names exactly the words the
engine and the HTTP API take."""

from __future__ import annotations

import pytest

from pagedserve.frontend import grpc_enums
from pagedserve.frontend.chat_template import REASONING_EFFORTS
from pagedserve.frontend.client import stream_request
from pagedserve.frontend.engine_args import DTYPES
from pagedserve.frontend.grpc_convert import queue_time_s, usage
from pagedserve.frontend.request_contract import CHAT_ROLES
from pagedserve.frontend.tool_calls import TOOL_CHOICE_MODES
from pagedserve.gpu_worker.model_config import KV_CACHE_DTYPES, QUANTIZATION_NAMES
from pagedserve.v1 import generation_pb2 as pb


def _fields(message_type) -> list[tuple]:
    return [
        (
            field.name,
            field.number,
            field.type,
            field.is_repeated,
            field.message_type and field.message_type.full_name,
            field.containing_oneof and field.containing_oneof.name,
        )
        for field in message_type.DESCRIPTOR.fields
    ]


@pytest.mark.parametrize(
    ("whole", "streamed"),
    [
        (pb.GenerateRequest, pb.GenerateStreamRequest),
        (pb.GenerateResponse, pb.GenerateStreamResponse),
    ],
)
def test_stream_messages_are_the_whole_calls_field_for_field(whole, streamed):
    assert _fields(streamed) == _fields(whole)


def test_a_generate_request_reads_as_a_stream_request():
    request = pb.GenerateRequest(
        request_id="r",
        chat=pb.Chat(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi")]),
        sampling=pb.SamplingParams(max_tokens=3, early_stopping=pb.EARLY_STOPPING_NEVER),
        cache_namespace="n",
        lora_adapter="a",
        priority=-2,
    )
    assert stream_request(request).SerializeToString() == request.SerializeToString()
    assert stream_request(request).chat.messages[0].content == "hi"


@pytest.mark.parametrize(
    ("enum", "engine_words"),
    [
        (pb.ChatRole, set(CHAT_ROLES)),
        (pb.ToolChoiceMode, set(TOOL_CHOICE_MODES)),
        (pb.ReasoningEffort, set(REASONING_EFFORTS)),
        (pb.Dtype, set(DTYPES)),
        (pb.KvCacheDtype, (set(KV_CACHE_DTYPES) - {"fp8"})),  # "fp8" is e4m3's other name
        (pb.Quantization, {"none", *QUANTIZATION_NAMES}),
    ],
)
def test_each_enum_names_the_engines_words(enum, engine_words):
    assert set(grpc_enums.words(enum)) == engine_words
    assert enum.Name(0).endswith("_UNSPECIFIED")
    for word in engine_words:
        code = grpc_enums.value(enum, word, "field")
        assert code != 0 and grpc_enums.word(enum, code, "field") == word
    assert grpc_enums.word(enum, 0, "field") is None
    with pytest.raises(ValueError, match=f"field is {enum.Name(0)}; set one of "):
        grpc_enums.required_word(enum, 0, "field")
    with pytest.raises(ValueError, match="field is 99, which is no"):
        grpc_enums.word(enum, 99, "field")
    with pytest.raises(ValueError, match="field must be one of"):
        grpc_enums.value(enum, "no such word", "field")


def test_the_cache_and_weights_report_their_own_words():
    assert grpc_enums.kv_cache_dtype_value("fp8") == pb.KV_CACHE_DTYPE_FP8_E4M3
    assert grpc_enums.kv_cache_dtype_value("fp8_e5m2") == pb.KV_CACHE_DTYPE_FP8_E5M2
    assert grpc_enums.quantization_value(None) == pb.QUANTIZATION_NONE
    assert grpc_enums.quantization_value("int8") == pb.QUANTIZATION_INT8


def test_early_stopping_keeps_hf_transformers_values():
    for value, code in grpc_enums.EARLY_STOPPING_TO_PROTO.items():
        assert grpc_enums.EARLY_STOPPING_FROM_PROTO[code] is value
    assert grpc_enums.EARLY_STOPPING_FROM_PROTO[pb.EARLY_STOPPING_UNSPECIFIED] is False


def test_queue_time_travels_as_a_duration():
    message = usage(3, queue_time_s=1.25)
    assert (message.queue_time.seconds, message.queue_time.nanos) == (1, 250_000_000)
    assert queue_time_s(message) == 1.25
    assert queue_time_s(usage(3)) is None and not usage(3).HasField("queue_time")
