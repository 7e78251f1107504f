"""Logging set-up for the ``fedloom`` command: readable text, or JSON lines.

``--log-format json`` writes one JSON object per line, for log shippers (Loki,
Elasticsearch, CloudWatch) that index fields instead of parsing text::

    {"ts": "2026-01-05T10:31:02.114Z", "level": "INFO", "logger": "fedloom.server",
     "message": "client 3f2a... (site-7) joined; 12 connected", "client": "3f2a...",
     "client_name": "site-7", "connected": 12}

Fields beyond ``ts``, ``level``, ``logger`` and ``message`` come from the ``extra=``
mapping of the logging call (``client``, ``round``, ``rpc``, ``reason``, ...); an
exception adds ``exception`` (the formatted traceback). Values JSON cannot hold are
written as their ``str``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry: dict[str, Any] = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, default=str, ensure_ascii=False)


class _Handler(logging.StreamHandler[TextIO]):
    """The handler `configure_logging` installs (so a second call can replace it).

    Without a stream of its own it writes to whatever ``sys.stderr`` is when a record
    arrives, as logging's last-resort handler does, not to the one it was made with:
    an application (or a test runner) that swaps or closes stderr later keeps its logs.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._own: TextIO | None = stream
        super().__init__(stream)

    @property
    def stream(self) -> TextIO:
        return self._own if self._own is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        if value is not sys.stderr:  # the base class stores sys.stderr for None
            self._own = value


def configure_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Set the root logger's level and its one handler's format (``text`` or ``json``).

    Raises:
        ValueError: ``fmt`` is not one of `FORMATS`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = _Handler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)  # a second call replaces the first, leaves others alone
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
