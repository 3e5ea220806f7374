"""How every process of an engine writes its log lines: as text (the default), or as one
JSON object per line for a log shipper (``pagedserve serve --log-format json``).

The frontend reads the choice from its flag and passes it to the scheduler and worker
processes in the environment (``PAGEDSERVE_LOG_FORMAT``), so all of an engine's lines,
written to the same stderr, read alike. A JSON line holds the time (UTC, ISO 8601), the
level, the logger, the process id and the message, plus the structured ``fields`` a call
site attaches (``logger.info(..., extra={"fields": {...}})``: the request log's ids, token
counts and times), and the traceback of an exception.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

ENVIRONMENT_VARIABLE = "PAGEDSERVE_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
# The keys every JSON line has; a call site's fields never replace them.
_BASE_KEYS = frozenset({"time", "level", "logger", "pid", "message", "exception"})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        created = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry = {
            "time": created.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update((key, value) for key, value in fields.items() if key not in _BASE_KEYS)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def log_format_from_environment() -> str:
    """The format the frontend chose for this engine ("text" when none or unknown)."""
    chosen = os.environ.get(ENVIRONMENT_VARIABLE, "text")
    return chosen if chosen in LOG_FORMATS else "text"


def configure_logging(level: int, text_format: str, log_format: str | None = None) -> None:
    """Log at ``level`` to stderr, as text in ``text_format`` or as JSON lines
    (``log_format``; None: the environment's choice)."""
    log_format = log_format or log_format_from_environment()
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(text_format)
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
