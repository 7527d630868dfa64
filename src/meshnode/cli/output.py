"""How every ``meshnode`` command prints: one JSON style, one time format each
for JSON and for people, sizes and rates in one set of units.

* ``--json``: :func:`emit_json` (a document) or :func:`emit_json_line` (one per
  line, for streams). Instants in JSON are RFC 3339 UTC (``2026-12-01T23:38:15.000Z``):
  :func:`rfc3339_fields` converts the admin API's unix-second fields (``*_at``,
  ``expires_at``...) on the way out.
* people: :func:`human_time` (``2026-12-01 23:38:15Z``), :func:`human_size`
  (binary units, one decimal: ``12.5 MiB``), :func:`human_rate` (``3.2 MiB/s``),
  :func:`human_duration` (``1m05s``); :func:`render` prints any result as an
  indented ``key  value`` listing when a command has no table of its own.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339

from .exitcodes import EX_DATAERR, EX_NOINPUT, EX_OK

__all__ = [
    "emit_json",
    "emit_json_line",
    "human_duration",
    "human_rate",
    "human_size",
    "human_time",
    "render",
    "rfc3339_fields",
]

#: Result members that hold an instant as unix seconds in the admin API.
_EPOCH_SUFFIXES = ("_at",)
_EPOCH_NAMES = frozenset({"expires_at", "renew_at", "enrolled_at", "retired_at", "last_issued_at",
                          "credential_expires_at", "vouch_expires_at"})
# Unix seconds this side of 2000-01-01 are not plausible instants (counts, sizes).
_EPOCH_FLOOR = 946_684_800


def _is_epoch_key(key: str) -> bool:
    return key in _EPOCH_NAMES or key.endswith(_EPOCH_SUFFIXES)


def rfc3339_fields(value: Any) -> Any:
    """``value`` with every unix-seconds instant (a ``*_at`` member) as RFC 3339 UTC."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if (
                isinstance(key, str) and _is_epoch_key(key) and isinstance(item, int | float)
                and not isinstance(item, bool) and item >= _EPOCH_FLOOR
            ):
                # Unix seconds or milliseconds (a *_ms member is left alone by name).
                out[key] = format_ts(int(item * 1000) if item < 1e11 else int(item))
            else:
                out[key] = rfc3339_fields(item)
        return out
    if isinstance(value, list):
        return [rfc3339_fields(item) for item in value]
    return value


def emit_json(value: Any, *, indent: int | None = 2) -> None:
    """One JSON document on stdout, instants in RFC 3339."""
    print(json.dumps(rfc3339_fields(value), indent=indent, ensure_ascii=False, default=str))


def read_json_document(path: Path, what: str, *, object_only: bool = False) -> tuple[int, Any]:
    """A signed document handed to the CLI as a file: ``(EX_OK, value)``, or the
    exit code after a message naming the file (66 missing, 65 unreadable or not
    JSON; with ``object_only`` also 65 for JSON that is not an object)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(f"meshnode: {path}: no such file", file=sys.stderr)
        return EX_NOINPUT, None
    except (OSError, ValueError) as exc:
        print(f"meshnode: {path}: not a readable JSON {what} ({exc})", file=sys.stderr)
        return EX_DATAERR, None
    if object_only and not isinstance(document, dict):
        print(f"meshnode: {path}: an {what} is a JSON object", file=sys.stderr)
        return EX_DATAERR, None
    return EX_OK, document


def emit_json_line(value: Any) -> None:
    """One JSON value on one line, flushed (a stream's item, for ``jq`` and friends)."""
    print(json.dumps(rfc3339_fields(value), ensure_ascii=False, default=str), flush=True)


def human_time(value: Any) -> str:
    """An instant for people: ``YYYY-MM-DD HH:MM:SSZ`` (UTC), from unix seconds,
    milliseconds or RFC 3339 text; ``-`` for none; anything else as given."""
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) / 1000 if value > 1e11 else float(value)
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(seconds))
    us = try_parse_rfc3339(value)
    if us is not None:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(us / 1_000_000))
    return str(value)


def human_size(count: float) -> str:
    """Bytes in binary units with one decimal (``512 B``, ``1.5 KiB``, ``12.0 MiB``)."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}"
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    """A transfer rate in the units of :func:`human_size`, per second."""
    return f"{human_size(bytes_per_s)}/s"


def human_duration(seconds: float) -> str:
    """``42s``, ``1m05s``, ``2h03m``."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if _is_epoch_key(key) or key == "ts":
        return human_time(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def render(value: Any, *, indent: int = 0, file: Any = None) -> None:
    """Print ``value`` for people: mappings as aligned ``key  value`` lines
    (nested ones indented), lists of scalars on one line, other lists item by item."""
    out = file or sys.stdout
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            print(f"{pad}(none)", file=out)
            return
        width = min(24, max(len(str(k)) for k in value))
        for key, item in value.items():
            if isinstance(item, Mapping) and item:
                print(f"{pad}{key}", file=out)
                render(item, indent=indent + 2, file=out)
            elif isinstance(item, list) and any(isinstance(x, Mapping | list) for x in item):
                print(f"{pad}{key}", file=out)
                for element in item:
                    if isinstance(element, Mapping):
                        render(element, indent=indent + 2, file=out)
                        print(file=out)
                    else:
                        print(f"{pad}  {_scalar(str(key), element)}", file=out)
            elif isinstance(item, list):
                print(f"{pad}{key:<{width}}  {', '.join(_scalar(str(key), x) for x in item) or '-'}", file=out)
            else:
                print(f"{pad}{key:<{width}}  {_scalar(str(key), item)}", file=out)
    elif isinstance(value, list):
        for element in value:
            render(element, indent=indent, file=out)
    else:
        print(f"{pad}{_scalar('', value)}", file=out)
