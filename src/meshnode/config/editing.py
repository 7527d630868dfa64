"""Careful edits of a configuration file a person wrote.

The standard library reads TOML (``tomllib``) but does not write it, and a
round trip through a writer would drop the user's comments, order and
spacing. The one edit meshnode makes (``meshnode agents add --save``) is an
addition, so it is done as an append: the file's text stays byte for byte,
a new ``[agents.<name>]`` table goes at its end, and the result is parsed
before it replaces the file (atomically, keeping its mode), so a file that
would no longer load is never written.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["SaveRefused", "agent_table_text", "append_agent_table", "toml_value"]

_BARE_KEY = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class SaveRefused(Exception):
    """The table was not written; the message says why and names the file."""


def _key(name: str) -> str:
    return name if name and set(name) <= _BARE_KEY else json.dumps(name)


def toml_value(value: Any) -> str:
    """``value`` (from JSON: str, int, float, bool, list, object) as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise SaveRefused("TOML has no null: leave the key out instead")
    raise SaveRefused(f"cannot write a {type(value).__name__} to TOML")


def agent_table_text(name: str, table: dict[str, Any]) -> str:
    """The ``[agents.<name>]`` table, ``plugin`` first."""
    lines = [f"[agents.{_key(name)}]"]
    ordered = sorted(table.items(), key=lambda kv: (kv[0] != "plugin", 0))
    lines += [f"{_key(k)} = {toml_value(v)}" for k, v in ordered]
    return "\n".join(lines) + "\n"


def append_agent_table(path: Path, name: str, table: dict[str, Any]) -> str:
    """Append ``[agents.<name>]`` to the file at ``path``; returns the text added.

    Refused (:class:`SaveRefused`, nothing written) when the file already has
    that agent (an edit is a person's job), when it does not parse now, or when
    it would not parse after the append.
    """
    target = path.resolve()  # a symlinked config: edit the file it points at
    try:
        current = target.read_text(encoding="utf-8")
    except OSError as exc:
        raise SaveRefused(f"cannot read {path}: {exc.strerror}") from None
    try:
        parsed = tomllib.loads(current)
    except tomllib.TOMLDecodeError as exc:
        raise SaveRefused(f"{path} does not parse as TOML ({exc}); not editing it") from None
    agents = parsed.get("agents")
    if isinstance(agents, dict) and name in agents:
        raise SaveRefused(f"{path} already has [agents.{name}]; edit that table by hand")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    added = f"# Added by `meshnode agents add --save` at {stamp}.\n" + agent_table_text(name, table)
    separator = "" if not current or current.endswith("\n\n") else ("\n" if current.endswith("\n") else "\n\n")
    text = current + separator + added
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SaveRefused(f"[agents.{name}] would not fit in {path} ({exc}); add it by hand") from None
    mode = target.stat().st_mode & 0o7777
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise SaveRefused(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SaveRefused(f"cannot write {path}: {exc.strerror}") from None
    return added
