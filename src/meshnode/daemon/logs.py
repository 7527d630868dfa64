"""Logging setup: text for a terminal, JSON lines for machines, journald-friendly
priorities under systemd. Secrets are never passed to a logger in the first
place; this module only shapes what is logged."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["setup_logging"]

_SYSLOG_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class JournalFormatter(logging.Formatter):
    """``<N>`` priority prefixes, which journald turns into real priorities."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _SYSLOG_PRIORITY.get(record.levelno, 6)
        text = f"<{prio}>{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    if fmt == "auto":
        if os.environ.get("JOURNAL_STREAM"):
            fmt = "journald"
        elif sys.stderr.isatty():
            fmt = "text"
        else:
            fmt = "text"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "journald":
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level.lower() != "warn" else "WARNING")
    # nats-py logs every reconnect attempt at error level; our own messages say it once.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
