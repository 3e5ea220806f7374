"""SamplingParams' frontend fields (stop strings, special-token handling) and token-id
fields (logit_bias, allowed_token_ids), validated where the user hands them in, with the
field, the value and the limit named."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.engine_messages import AddRequest
from pagedserve.scheduler.sampling_params import SamplingParams, token_ids_outside_vocabulary
from pagedserve.scheduler.serialization import decode, encode


def test_stop_defaults_to_no_stop_strings_and_a_single_string_becomes_a_list():
    assert SamplingParams().stop == []
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_special_token_defaults_are_vllms():
    params = SamplingParams()
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True
    assert params.include_stop_str_in_output is False


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(stop=""), ValueError, r"stop\[0\] must have at least 1 character, got ''"),
        (dict(stop=["x", ""]), ValueError, r"stop\[1\] must have at least 1 character"),
        (dict(stop=["x", 3]), TypeError, r"stop\[1\] must be a string, got 3"),
        (dict(stop=b"x"), TypeError, "stop must be a string or a list of strings, got b'x'"),
        (dict(stop=7), TypeError, "stop must be a string or a list of strings, got 7"),
        (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output must be a"),
        (dict(skip_special_tokens="no"), TypeError, "skip_special_tokens must be a bool, got 'no'"),
        # Unchecked, it reached the scheduler's decoder, which stopped the whole server.
        (dict(ignore_eos={}), TypeError, "ignore_eos must be a bool, got {}"),
        (dict(spaces_between_special_tokens=None), TypeError, "spaces_between_special_tokens"),
        (dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias must be a dict of token id -> bias"),
        (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias key must be >= 0, got -1"),
        (dict(logit_bias={True: 1.0}), TypeError, "logit_bias key must be an integer, got True"),
        (dict(logit_bias={"5": 1.0}), TypeError, "logit_bias key must be an integer, got '5'"),
        (dict(logit_bias={5: "x"}), TypeError, r"logit_bias\[5\] must be a number, got 'x'"),
        (
            dict(logit_bias={5: float("inf")}),
            ValueError,
            r"logit_bias\[5\] must be >= -1000000.0 and <= 1000000.0, got inf",
        ),
        (dict(logit_bias={5: float("nan")}), ValueError, r"logit_bias\[5\] must be .*, got nan"),
        (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[3, -4]), ValueError, r"allowed_token_ids\[\] must be >= 0"),
    ],
)
def test_bad_frontend_fields_name_field_value_and_limit(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_named():
    params = SamplingParams(logit_bias={3: 1.0, 600: -1.0}, allowed_token_ids=[1, 2])
    assert token_ids_outside_vocabulary(params, 512) == (
        "logit_bias: token id 600 is outside the vocabulary [0, 512)"
    )
    params = SamplingParams(allowed_token_ids=[1, 512])
    assert token_ids_outside_vocabulary(params, 512) == (
        "allowed_token_ids: token id 512 is outside the vocabulary [0, 512)"
    )
    assert token_ids_outside_vocabulary(SamplingParams(logit_bias={}), 512) is None


def test_numpy_scalars_are_taken_as_python_numbers():
    # As vLLM: a count or a seed computed with numpy works; what crosses processes is
    # plain Python (msgpack cannot hold a numpy scalar).
    np = pytest.importorskip("numpy")
    params = SamplingParams(
        max_tokens=np.int64(5),
        min_tokens=np.int32(1),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        top_k=np.int8(3),
        seed=np.uint64(2**63 - 1),
        stop_token_ids=[np.int32(2)],
        logit_bias={np.int64(4): np.float32(1.5)},
        allowed_token_ids=list(np.arange(3, 6)),
        n=np.int16(2),
    )
    assert params.max_tokens == 5 and type(params.max_tokens) is int
    assert (
        type(params.temperature) is float and params.seed == 2**63 - 1 and type(params.seed) is int
    )
    assert params.stop_token_ids == [2] and type(params.stop_token_ids[0]) is int
    assert params.logit_bias == {4: 1.5} and type(next(iter(params.logit_bias))) is int
    assert params.allowed_token_ids == [3, 4, 5] and type(params.allowed_token_ids[0]) is int
    assert (
        decode(encode(AddRequest("r", [1], params, 0.0, eos_token_ids=[]))).sampling_params
        == params
    )
    with pytest.raises(TypeError, match="max_tokens must be an integer, got np.True_|True"):
        SamplingParams(max_tokens=np.bool_(True))
    with pytest.raises(TypeError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(2.0))
