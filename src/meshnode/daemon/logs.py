"""Logging setup: text for a terminal, JSON lines for machines, journald-friendly
priorities under systemd. Secrets are never passed to a logger in the first
place; this module only shapes what is logged."""

from __future__ import annotations

import asyncio
import collections
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
    root.handlers[:] = [handler, BUFFER]
    root.setLevel(level.upper() if level.lower() != "warn" else "WARNING")
    # nats-py logs every reconnect attempt at error level; our own messages say it once.
    logging.getLogger("nats").setLevel(logging.CRITICAL)


class LogBuffer(logging.Handler):
    """Keeps the last records in memory and fans new ones out to followers
    (``meshnode logs --follow``). Bounded: a slow follower loses records
    (counted) rather than growing memory."""

    def __init__(self, capacity: int = 2000, follower_queue: int = 1000) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._followers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._follower_queue = follower_queue
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            # A handler's bug is found from `meshnode logs`: the traceback travels
            # with the record (the stderr formatters print it too).
            entry["exception"] = _FORMATTER.formatException(record.exc_info)
        self.records.append(entry)
        for queue in list(self._followers):
            try:
                queue.put_nowait(entry)
            except Exception:
                self.dropped += 1

    def follow(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=self._follower_queue)
        self._followers.add(queue)
        return queue

    def unfollow(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._followers.discard(queue)


_FORMATTER = logging.Formatter()

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}


def level_number(name: str) -> int:
    return _LEVELS.get(name.lower(), 20)


#: The process-wide buffer the admin API's Logs methods read.
BUFFER = LogBuffer()
