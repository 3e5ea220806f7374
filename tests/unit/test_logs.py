"""The JSON log format (scheduler/logs.py): one object per line, a call's fields beside the
base keys (never over them), a traceback as text."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from pagedserve.scheduler.logs import JsonFormatter, configure_logging


def record(message: str, *args, fields=None, exc_info=None) -> logging.LogRecord:
    made = logging.LogRecord(
        "pagedserve.server", logging.INFO, __file__, 1, message, args, exc_info
    )
    if fields is not None:
        made.fields = fields
    return made


def test_a_line_holds_the_base_keys_and_the_fields_without_overwriting_them():
    line = JsonFormatter().format(
        record("call %s: %d tokens", "r1", 5, fields={"prompt_tokens": 5, "message": "x", "é": "ü"})
    )
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "call r1: 5 tokens"  # not the field's "x"
    assert entry["level"] == "INFO" and entry["logger"] == "pagedserve.server"
    assert entry["prompt_tokens"] == 5 and entry["é"] == "ü"
    assert entry["time"].endswith("+00:00") and isinstance(entry["pid"], int)


def test_an_exception_travels_as_its_traceback():
    try:
        raise KeyError("block 7")
    except KeyError:
        entry = json.loads(JsonFormatter().format(record("failed", exc_info=sys.exc_info())))
    assert (
        entry["exception"].startswith("Traceback") and "KeyError: 'block 7'" in entry["exception"]
    )


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="log_format must be one of text, json, got 'xml'"):
        configure_logging(logging.INFO, "%(message)s", "xml")
