"""Constants, errors, the load context, durations and sizes, value checks and
platform defaults of the configuration (see :mod:`meshnode.config`)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    WithJsonSchema,
)
from pydantic.functional_validators import BeforeValidator

__all__ = [
    "CONFIG_ENV",
    "ConfigError",
    "ConfigProblem",
    "DATA_DIR_ENV",
    "EX_CONFIG",
    "UDS_PATH_MAX",
    "default_admin_socket",
    "default_config_path",
    "default_data_dir",
    "format_duration",
    "format_size",
    "is_system_service",
    "parse_duration",
    "parse_size",
]


#: sysexits.h EX_CONFIG: exit status for a configuration error. systemd units use
#: ``RestartPreventExitStatus=78`` so a bad config does not become a restart loop.
EX_CONFIG = 78

#: Environment variable naming the config file (below ``--config``).
CONFIG_ENV = "MESHNODE_CONFIG"
#: Environment variable overriding ``node.data_dir``.
DATA_DIR_ENV = "MESHNODE_DATA_DIR"

#: Longest admin socket path accepted, in bytes. ``sun_path`` holds 108 bytes on
#: Linux and 104 on macOS/BSD including the NUL; the margin leaves room for the
#: admin server to bind a slightly longer temporary name and rename it into place.
UDS_PATH_MAX = 100

SYSTEM_CONFIG_PATH = Path("/etc/meshnode/meshnode.toml")
SYSTEM_DATA_DIR = Path("/var/lib/meshnode")

_AGENT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_PLUGIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_BARE_TOML_KEY = re.compile(r"[A-Za-z0-9_-]+")


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem in a configuration: where it is and what was expected.

    ``key`` is the dotted key (``protections.live_max_age``) or None for a
    problem with the file as a whole (unreadable, TOML syntax).
    """

    file: str
    key: str | None
    message: str

    def __str__(self) -> str:
        if self.key is None:
            return f"{self.file}: {self.message}"
        return f"{self.file}: {self.key}: {self.message}"


class ConfigError(Exception):
    """The configuration cannot be used; fix the file and start again.

    Not retryable: the daemon exits with :data:`EX_CONFIG`. ``str()`` is one
    line per problem, each naming the file, the key and what was expected.
    """

    def __init__(self, problems: list[ConfigProblem], path: Path | None = None) -> None:
        self.problems = problems
        self.path = path
        super().__init__("\n".join(str(p) for p in problems))


class _Problems(ValueError):
    """Raised from validators to report problems at explicit dotted keys.

    Pydantic places a model-level ValueError at the model's own location; this
    carries the keys the user must edit so the message can name them.
    """

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self.items = items
        super().__init__("; ".join(f"{k}: {m}" for k, m in items))


# --------------------------------------------------------------------------- load context


@dataclass(frozen=True, slots=True)
class _LoadContext:
    env: Mapping[str, str]
    euid: int
    base_dir: Path | None  # relative paths in the file resolve against this
    toml_file: Path | None


_CONTEXT: ContextVar[_LoadContext | None] = ContextVar("meshnode_config_context", default=None)


def _context() -> _LoadContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        return _LoadContext(os.environ, _geteuid(), None, None)
    return ctx


def _geteuid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 1


@contextlib.contextmanager
def _use_context(ctx: _LoadContext) -> Iterator[None]:
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


# --------------------------------------------------------------------------- durations and sizes

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_HINT = 'a duration like "500ms", "30s", "10m", "72h", "7d" or a number of seconds'

_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
_SIZE_HINT = 'a size like "25MiB", "1GiB", "1MB" or a number of bytes'


def parse_duration(value: object) -> timedelta:
    """Parse ``"500ms"``/``"30s"``/``"10m"``/``"72h"``/``"7d"`` (combinable) or seconds.

    Raises ValueError (naming the accepted forms) for anything else, including
    zero and negative durations: every duration in the config is a window or an
    interval that may be tuned but never disabled.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"expected {_DURATION_HINT}, got {value!r}")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        pos, seconds, seen = 0, 0.0, False
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos, seen = m.end(), True
        if not seen or pos != len(text):
            raise ValueError(f"expected {_DURATION_HINT}, got {value!r}")
    else:
        raise ValueError(f"expected {_DURATION_HINT}, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected a duration greater than zero, got {value!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"duration {value!r} is too large") from None


def format_duration(value: timedelta) -> str:
    """The shortest config spelling of a duration (``"72h"`` -> ``"3d"``, ``"1h30m"``)."""
    total_ms = round(value.total_seconds() * 1000)
    if total_ms <= 0:
        return "0s"
    parts: list[str] = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, total_ms = divmod(total_ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def parse_size(value: object) -> int:
    """Parse ``"25MiB"``/``"1GiB"``/``"1MB"``/``"512KiB"``/``"100B"`` or bytes to ``int`` bytes.

    Unit letters are case-insensitive and always mean bytes (``"1mb"`` is a
    megabyte, not a megabit). Zero and negative sizes are rejected.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {_SIZE_HINT}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected a whole number of bytes, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value.strip())
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"expected {_SIZE_HINT}, got {value!r}")
        if not unit and "." in m.group(1):
            raise ValueError(f"expected a whole number of bytes, got {value!r}")
        size = round(float(m.group(1)) * _SIZE_UNITS[unit or "b"])
    else:
        raise ValueError(f"expected {_SIZE_HINT}, got {value!r}")
    if size <= 0:
        raise ValueError(f"expected a size greater than zero, got {value!r}")
    return size


def format_size(value: int) -> str:
    """The config spelling of a byte count: the largest binary unit that divides it."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value % size == 0 and value >= size:
            return f"{value // size}{unit}"
    return f"{value}B"


class _SizeMarker:
    """Annotation metadata marking an ``int`` field as a byte size (for TOML export)."""


_SIZE = _SizeMarker()

_DURATION_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|s|m|h|d))+$"},
        {"type": "number", "exclusiveMinimum": 0},
    ],
    "description": _DURATION_HINT,
}
_SIZE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": r"^\d+(\.\d+)?\s*(([KkMmGgTt][Ii]?)?[Bb])?$"},
        {"type": "integer", "exclusiveMinimum": 0},
    ],
    "description": _SIZE_HINT,
}

Duration = Annotated[timedelta, BeforeValidator(parse_duration), WithJsonSchema(_DURATION_SCHEMA)]
ByteSize = Annotated[int, BeforeValidator(parse_size), WithJsonSchema(_SIZE_SCHEMA), _SIZE]


def _optional_duration(value: object) -> timedelta | None:
    if value is None or value == "":
        return None
    return parse_duration(value)


OptionalDuration = Annotated[
    timedelta | None,
    BeforeValidator(_optional_duration),
    WithJsonSchema({"anyOf": [_DURATION_SCHEMA, {"type": "string", "const": ""}]}),
]


# --------------------------------------------------------------------------- value helpers


def _choice(*options: str, optional: bool = False, fold_case: bool = False) -> BeforeValidator:
    """Validate one of ``options`` with our own message; ``""`` means unset when optional."""
    listed = ", ".join(options)

    def check(value: object) -> object:
        if optional and (value is None or value == ""):
            return None
        if isinstance(value, str):
            text = value.lower() if fold_case else value
            if text in options:
                return text
        raise ValueError(f"expected one of {listed}, got {value!r}")

    return BeforeValidator(check)


def _choice_schema(*options: str, optional: bool = False) -> WithJsonSchema:
    values = list(options) + ([""] if optional else [])
    return WithJsonSchema({"type": "string", "enum": values})


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME")
    if home and os.path.isabs(home):
        return Path(home)
    return Path(os.path.expanduser("~"))


def _resolve_path(value: object, *, what: str) -> Path:
    if isinstance(value, Path):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise ValueError(f"expected a {what} path (a string), got {value!r}")
    if not text:
        raise ValueError(f"expected a {what} path, got an empty string")
    if "\0" in text:
        raise ValueError(f"{what} path contains a NUL byte")
    ctx = _context()
    if text == "~" or text.startswith("~/"):
        text = str(_home(ctx.env)) + text[1:]
    path = Path(text)
    if not path.is_absolute():
        # Relative to the config file, so the meaning does not depend on the cwd.
        path = (ctx.base_dir or Path.cwd()) / path
    return Path(os.path.normpath(path))


def _dir_path(value: object) -> Path:
    return _resolve_path(value, what="directory")


def _optional_file_path(value: object) -> Path | None:
    if value is None or value == "":
        return None
    return _resolve_path(value, what="file")


def _optional_dir_path(value: object) -> Path | None:
    if value is None or value == "":
        return None
    return _resolve_path(value, what="directory")


_PATH_SCHEMA = WithJsonSchema({"type": "string"})

DirPath = Annotated[Path, BeforeValidator(_dir_path), _PATH_SCHEMA]
OptionalFilePath = Annotated[Path | None, BeforeValidator(_optional_file_path), _PATH_SCHEMA]


def _url(schemes: tuple[str, ...], what: str) -> Callable[[object], str]:
    pattern = re.compile(rf"(?:{'|'.join(schemes)})://[^\s/?#]+(?:[/?#]\S*)?", re.IGNORECASE)
    listed = ", ".join(f"{s}://" for s in schemes)

    def check(value: object) -> str:
        if isinstance(value, str) and pattern.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(f"expected a {what} URL starting with {listed}, got {value!r}")

    return check


def _optional_url(schemes: tuple[str, ...], what: str) -> Callable[[object], str | None]:
    check = _url(schemes, what)

    def optional(value: object) -> str | None:
        if value is None or value == "":
            return None
        return check(value)

    return optional


NatsUrl = Annotated[str, BeforeValidator(_url(("nats", "tls", "ws", "wss"), "NATS server"))]
OptionalHttpUrl = Annotated[
    str | None,
    BeforeValidator(_optional_url(("http", "https"), "control-plane")),
    WithJsonSchema({"type": "string"}),
]


def _socket_mode(value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f'expected an octal mode string like "0600" or "0660", got {value!r}')
    if isinstance(value, int):  # TOML 0o660 arrives as an int
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value.strip()):
        mode = int(value.strip(), 8)
    else:
        raise ValueError(f'expected an octal mode string like "0600" or "0660", got {value!r}')
    if mode & ~0o777:
        raise ValueError(f"expected permission bits only (0000-0777), got {oct(mode)}")
    if mode & 0o007:
        raise ValueError(
            f"the admin socket must never be accessible to others; got {mode:04o}, "
            'use "0600" or "0660"'
        )
    if mode & 0o600 != 0o600:
        raise ValueError(f"the owner needs read and write on the admin socket; got {mode:04o}")
    return mode


SocketMode = Annotated[
    int | None,
    BeforeValidator(_socket_mode),
    WithJsonSchema({"type": "string", "pattern": r"^0?[0-7][0-7]0$"}),
]


def _optional_socket_path(value: object) -> Path:
    if value is None or value == "":
        return Path()  # derived in Config once data_dir is known
    return _resolve_path(value, what="socket")


def _optional_group(value: object) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?", value.strip()):
        return value.strip()
    raise ValueError(f"expected a group name or numeric gid, got {value!r}")


# --------------------------------------------------------------------------- platform defaults


def is_system_service(env: Mapping[str, str] | None = None, euid: int | None = None) -> bool:
    """True when running as root or as a systemd *system* service.

    systemd sets ``INVOCATION_ID`` for every unit; a user-manager unit also has
    the session's ``XDG_RUNTIME_DIR`` while a system unit (even with ``User=``)
    does not. Root without systemd counts too: it owns the system-wide paths.
    """
    env = os.environ if env is None else env
    euid = _geteuid() if euid is None else euid
    if euid == 0:
        return True
    return "INVOCATION_ID" in env and not env.get("XDG_RUNTIME_DIR")


def _first_dir(env: Mapping[str, str], name: str) -> Path | None:
    # systemd joins several directories of one kind with ':'; ours is the first.
    value = env.get(name, "")
    first = value.split(":", 1)[0]
    return Path(first) if first and os.path.isabs(first) else None


def _xdg(env: Mapping[str, str], name: str, fallback: str) -> Path:
    value = env.get(name, "")
    # The XDG spec says relative values are invalid and must be ignored.
    return Path(value) if value and os.path.isabs(value) else _home(env) / fallback


def default_config_path(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """Where the config file lives when neither ``--config`` nor ``$MESHNODE_CONFIG`` says."""
    env = os.environ if env is None else env
    conf_dir = _first_dir(env, "CONFIGURATION_DIRECTORY")
    if conf_dir is not None:
        return conf_dir / "meshnode.toml"
    if is_system_service(env, euid):
        return SYSTEM_CONFIG_PATH
    return _xdg(env, "XDG_CONFIG_HOME", ".config") / "meshnode" / "meshnode.toml"


def default_data_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """``$STATE_DIRECTORY`` under systemd, ``/var/lib/meshnode`` for root, else XDG data home."""
    env = os.environ if env is None else env
    euid = _geteuid() if euid is None else euid
    state = _first_dir(env, "STATE_DIRECTORY")
    if state is not None:
        return state
    if euid == 0:
        return SYSTEM_DATA_DIR
    return _xdg(env, "XDG_DATA_HOME", ".local/share") / "meshnode"


def default_admin_socket(data_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """``$RUNTIME_DIRECTORY/admin.sock``, else ``$XDG_RUNTIME_DIR/meshnode/admin.sock``,
    else ``<data_dir>/admin.sock``."""
    env = os.environ if env is None else env
    runtime = _first_dir(env, "RUNTIME_DIRECTORY")
    if runtime is not None:
        return runtime / "admin.sock"
    xdg_runtime = env.get("XDG_RUNTIME_DIR", "")
    if xdg_runtime and os.path.isabs(xdg_runtime):
        return Path(xdg_runtime) / "meshnode" / "admin.sock"
    return data_dir / "admin.sock"


def _default_data_dir_factory() -> Path:
    ctx = _context()
    return Path(os.path.normpath(default_data_dir(ctx.env, ctx.euid)))


def _hostname() -> str:
    return socket.gethostname() or "meshnode"




def _toml_key(part: str) -> str:
    if _BARE_TOML_KEY.fullmatch(part):
        return part
    escaped = part.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


