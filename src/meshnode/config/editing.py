"""Careful edits of a configuration file a person wrote.

The standard library reads TOML (``tomllib``) but does not write it, and a
round trip through a writer would drop the user's comments, order and
spacing. meshnode makes two edits, both by lines: ``meshnode agents add
--save`` appends a new ``[agents.<name>]`` table (the file's text stays byte
for byte), and ``meshnode agents remove --save`` comments out the lines of
one (nothing deleted: uncommenting restores it). Either result is parsed
before it replaces the file (atomically, keeping its mode), and a removal must
parse to exactly the old configuration without that agent, so a file that
would no longer load, or would change in any other way, is never written.
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

__all__ = ["SaveRefused", "agent_table_text", "append_agent_table", "comment_out_agent_table", "toml_value"]

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
    current, parsed = _read(path, target)
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
    _replace(path, target, text)
    return added


def comment_out_agent_table(path: Path, name: str) -> None:
    """Comment out ``[agents.<name>]`` (and its sub-tables) in the file at ``path``.

    Refused (:class:`SaveRefused`, nothing written) when the file does not
    parse, has no such table, or defines the agent some other way (inline, by
    dotted keys): the edited text must parse to the old configuration minus
    exactly that agent.
    """
    target = path.resolve()
    current, parsed = _read(path, target)
    agents = parsed.get("agents")
    if not isinstance(agents, dict) or name not in agents:
        raise SaveRefused(f"{path} has no [agents.{name}]")
    lines = current.splitlines(keepends=True)
    headers = [(i, _header_path(line)) for i, line in enumerate(lines)]
    starts = [i for i, key in headers if key is not None]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = list(lines)
    found = False
    for index, key in headers:
        if key is None or key[:2] != ("agents", name):
            continue
        found = True
        end = next((i for i in starts if i > index), len(lines))
        while end > index + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1  # blank lines and comments just before the next table stay: they may describe it
        for i in range(index, end):
            out[i] = "# " + lines[i] if lines[i].strip() else lines[i]
        out[index] = f"# Removed by `meshnode agents remove --save` at {stamp} (uncomment to restore):\n" + out[index]
    expected = {**parsed, "agents": {k: v for k, v in agents.items() if k != name}}
    text = "".join(out)
    try:
        edited = tomllib.loads(text) if found else None
    except tomllib.TOMLDecodeError:
        edited = None
    if _without_empty_agents(edited) != _without_empty_agents(expected):
        raise SaveRefused(f"{path} defines agent {name} other than as an [agents.{name}] table; "
                          "remove it by hand")
    _replace(path, target, text)


def _header_path(line: str) -> tuple[str, ...] | None:
    """The key path of a ``[table]`` header line (quoted keys read as TOML
    reads them), else None. Array-of-tables headers count as headers too."""
    stripped = line.strip()
    if not stripped.startswith("["):
        return None
    try:
        parsed: Any = tomllib.loads(stripped + "\n")
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    while isinstance(parsed, (dict, list)) and parsed:
        if isinstance(parsed, list):
            parsed = parsed[-1]
            continue
        if len(parsed) != 1:
            return None
        [(key, parsed)] = parsed.items()
        path.append(key)
    return tuple(path) or None


def _without_empty_agents(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if config is None or config.get("agents"):
        return config
    return {k: v for k, v in config.items() if k != "agents"}


def _read(path: Path, target: Path) -> tuple[str, dict[str, Any]]:
    try:
        current = target.read_text(encoding="utf-8")
    except OSError as exc:
        raise SaveRefused(f"cannot read {path}: {exc.strerror}") from None
    try:
        return current, tomllib.loads(current)
    except tomllib.TOMLDecodeError as exc:
        raise SaveRefused(f"{path} does not parse as TOML ({exc}); not editing it") from None


def _replace(path: Path, target: Path, text: str) -> None:
    """Write ``text`` over ``target`` atomically, keeping its mode."""
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
