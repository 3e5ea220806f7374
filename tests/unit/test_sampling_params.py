"""SamplingParams' frontend fields: stop strings and special-token handling, validated
where the user hands them in, with the field, the value and the limit named."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.sampling_params import SamplingParams


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
        (dict(spaces_between_special_tokens=None), TypeError, "spaces_between_special_tokens"),
    ],
)
def test_bad_frontend_fields_name_field_value_and_limit(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)
