"""The daemon's TOML configuration.

One file, found in this order: the ``--config`` argument, ``$MESHNODE_CONFIG``,
then the default location (``$CONFIGURATION_DIRECTORY/meshnode.toml`` when
systemd provides one, ``/etc/meshnode/meshnode.toml`` for root or a systemd
system service, else ``$XDG_CONFIG_HOME/meshnode/meshnode.toml``). A missing
default file means "all defaults"; a missing file that was asked for by name is
an error. Every key is optional; unknown keys are rejected, except inside an
``[agents.<name>]`` table, whose extra keys belong to the agent's plugin and are
kept in :attr:`AgentConfig.settings` for the plugin's own model to validate.

Durations are written ``"500ms"``, ``"30s"``, ``"10m"``, ``"72h"``, ``"7d"``
(units may be combined: ``"1h30m"``) or as a number of seconds, and load as
:class:`datetime.timedelta`. Sizes are written ``"25MiB"``, ``"1GiB"``,
``"1MB"`` or as a number of bytes, and load as ``int`` bytes.

Every problem becomes one line of a :class:`ConfigError` naming the file, the
dotted key and what was expected, so ``meshnode check-config`` can print it and
exit :data:`EX_CONFIG` (systemd's ``RestartPreventExitStatus=78``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.functional_validators import BeforeValidator
from pydantic.json_schema import GenerateJsonSchema
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

# The extension's pure core (no SDK): config checks a key's form when it is read.
from meshnode.protocol.a2a_extension import parse_verify_key

__all__ = [
    "A2AConfig",
    "A2APeerConfig",
    "CONFIG_ENV",
    "DATA_DIR_ENV",
    "EX_CONFIG",
    "UDS_PATH_MAX",
    "AdminConfig",
    "AgentConfig",
    "ArtifactsConfig",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "EmbeddedMeshConfig",
    "EventsConfig",
    "InboxConfig",
    "KeystoreConfig",
    "LoggingConfig",
    "MeshConfig",
    "NodeConfig",
    "ObservabilityConfig",
    "ProtectionsConfig",
    "RegistryConfig",
    "ServicesConfig",
    "default_config_path",
    "default_data_dir",
    "default_admin_socket",
    "describe_sources",
    "format_duration",
    "format_size",
    "is_system_service",
    "load_config",
    "parse_duration",
    "parse_size",
    "resolve_config_path",
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


# --------------------------------------------------------------------------- the schema

_FORBID = ConfigDict(extra="forbid")


class NodeConfig(BaseModel):
    """``[node]``: this host's identity and timing."""

    model_config = _FORBID

    name: Annotated[str, Field(min_length=1, max_length=253)] = Field(default_factory=_hostname)
    """Display name; defaults to the host name."""
    data_dir: DirPath = Field(default_factory=_default_data_dir_factory)
    """State directory (inbox, keys). ``$MESHNODE_DATA_DIR`` overrides the file."""
    availability_class: Annotated[
        Literal["always_on", "intermittent", "on_demand"] | None,
        _choice("always_on", "intermittent", "on_demand", optional=True),
        _choice_schema("always_on", "intermittent", "on_demand", optional=True),
    ] = None
    """Declared availability; None (absent) means undeclared."""
    vouch_ttl: OptionalDuration = None
    """Explicit vouch lifetime; None lets the runtime choose."""
    heartbeat_interval: Duration = timedelta(seconds=30)
    strict_plugins: bool = False
    """Fail fast on a broken plugin instead of logging and skipping it (development)."""
    plugin_modules: list[
        Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")]
    ] = Field(default_factory=list)
    """Extra plugins to load as if installed (``"package.module"`` or
    ``"package.module:AgentClass"``): for developing a plugin without packaging it."""


class TenantExportConfig(BaseModel):
    """``[[mesh.embedded.exports]]``: what one tenant makes reachable from another (§15.2).

    ``from`` and ``to`` name tenants (``mesh`` is the mesh's own account).
    ``agents`` lists agent ids whose inboxes ``to``'s nodes may send to;
    ``discover`` lets ``to`` query ``from``'s registry on
    ``mesh.external.<from>.discover``. Nothing else crosses.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_: Annotated[str, Field(alias="from", pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    to: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    agents: list[Annotated[str, Field(pattern=r"^U[A-Z2-7]{55}$")]] = Field(default_factory=list)
    discover: bool = False

    @model_validator(mode="after")
    def _two_tenants(self) -> TenantExportConfig:
        if self.from_ == self.to:
            raise ValueError(f"tenant {self.to!r} cannot export to itself")
        if not self.agents and not self.discover:
            raise ValueError("an export names agents, discover = true, or both")
        return self


class EmbeddedMeshConfig(BaseModel):
    """``[mesh.embedded]``: the local nats-server started when no servers are given."""

    model_config = _FORBID

    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 4222
    """0 picks a free port."""
    control_host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    control_port: Annotated[int, Field(ge=0, le=65535)] = 7422
    """HTTP control plane that issues node credentials; 0 picks a free port."""
    max_payload: ByteSize = 1024**2
    jetstream_max_store: ByteSize = 1024**3
    credential_ttl: Duration = timedelta(hours=24)
    monitor_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    """nats-server's HTTP monitoring (/varz, /jsz) on ``host``; off unless set (it is
    unauthenticated and shows every connection); 0 picks a free port."""
    tenants: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]] = Field(
        default_factory=list
    )
    """Tenants beyond the mesh's own account (``mesh``): each a NATS account with its
    own registry; nodes join one with ``meshnode mesh invite NAME --tenant T`` (§15)."""
    exports: list[TenantExportConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _known_tenants(self) -> EmbeddedMeshConfig:
        if "mesh" in self.tenants or len(set(self.tenants)) != len(self.tenants):
            raise ValueError("tenants must be unique and not 'mesh' (the mesh's own account)")
        known = {"mesh", *self.tenants}
        for i, export in enumerate(self.exports):
            for name in (export.from_, export.to):
                if name not in known:
                    raise ValueError(f"exports[{i}] names tenant {name!r}, not in tenants")
        return self

    @field_validator("max_payload")
    @classmethod
    def _nats_payload_limit(cls, value: int) -> int:
        # nats-server refuses to start with max_payload above 64 MiB.
        if value > 64 * 1024**2:
            raise ValueError(f"nats-server allows at most 64MiB, got {format_size(value)}")
        return value


def _server_list(value: object) -> object:
    # One URL, or a comma-separated string of them, reads as a list: a
    # single-server config keeps working when the mesh grows into a cluster.
    if isinstance(value, str):
        return [part for part in (p.strip() for p in value.split(",")) if part]
    return value


class MeshConfig(BaseModel):
    """``[mesh]``: which NATS to use. No servers means the embedded mesh."""

    model_config = _FORBID

    servers: Annotated[list[NatsUrl], BeforeValidator(_server_list)] = Field(default_factory=list)
    """The mesh's NATS servers (one URL, or every server of a cluster); the
    connection fails over across them and any the cluster announces."""
    replicas: Annotated[int, Field(ge=1, le=5)] | None = None
    """JetStream replicas of the streams and buckets this node's services create;
    None (absent) means ``min(3, servers in the cluster)`` (1 on the embedded mesh)."""
    credentials: OptionalFilePath = None
    """NATS ``.creds`` file of a joining node; None when unset."""
    control_plane: OptionalHttpUrl = None
    """Control-plane URL for credential renewal (joining node); None when unset."""
    embedded: EmbeddedMeshConfig = Field(default_factory=EmbeddedMeshConfig)

    @property
    def is_embedded(self) -> bool:
        return not self.servers


class RegistryConfig(BaseModel):
    """``[registry]``."""

    model_config = _FORBID

    require_connection_bound: bool = True
    rate_limit: Annotated[int, Field(ge=1)] = 60
    """Requests per sender per window across every platform-service subject (§16.1)."""
    rate_window: Duration = timedelta(seconds=60)


class ServicesConfig(BaseModel):
    """``[services]``: the platform services (registry, presence, task manager,
    artifacts, feeds) this node runs."""

    model_config = _FORBID

    run: bool | None = None
    """Run them on this node. None (absent) means: only with the embedded mesh.
    ``true`` on a node joined to an external mesh (a cluster's service node)
    needs a credential with the service role."""
    key_dir: Annotated[Path | None, BeforeValidator(_optional_dir_path), _PATH_SCHEMA] = None
    """Directory of the services' shared signing keys (``registry.nk``,
    ``presence.nk``, ...). Every service node of one mesh must sign with the
    same keys, because callers pin a service's key on first use; None keeps
    per-node keys in the keystore (fine for a single service node)."""


class AdminConfig(BaseModel):
    """``[admin]``: the Unix-socket admin API."""

    model_config = _FORBID

    socket: Annotated[
        Path, BeforeValidator(_optional_socket_path), WithJsonSchema({"type": "string"})
    ] = Path()
    """Socket path; always resolved to an absolute path after loading."""
    group: Annotated[
        str | None, BeforeValidator(_optional_group), WithJsonSchema({"type": "string"})
    ] = None
    """Group granted operator level; None when unset."""
    mode: SocketMode = None
    """Explicit socket mode; None means 0660 with a group, else 0600."""

    @property
    def effective_mode(self) -> int:
        """The mode to give the socket."""
        if self.mode is not None:
            return self.mode
        return 0o660 if self.group else 0o600


class ProtectionsConfig(BaseModel):
    """``[protections]``: the inbound limits of §22 (tunable, never disabled)."""

    model_config = _FORBID

    max_inbound_chars: Annotated[int, Field(ge=0)] = 65536
    """0 means no cap; only ever by explicit choice."""
    clock_skew_ahead: Duration = timedelta(minutes=5)
    live_max_age: Duration = timedelta(minutes=10)
    mailbox_max_age: Duration = timedelta(days=7)
    """Must not exceed ``inbox.buffer_max_age``."""
    dedup_entries: Annotated[int, Field(ge=1)] = 5000
    check_sender_vouch: bool = True
    """Refuse requests from senders no node vouches for (§5.3 step 2), asking the registry."""


class InboxConfig(BaseModel):
    """``[inbox]``: the node inbox and the broker's redelivery buffer."""

    model_config = _FORBID

    drain_interval: Duration = timedelta(seconds=60)
    buffer_max_age: Duration = timedelta(days=7)
    buffer_max_bytes: ByteSize = 25 * 1024**2


class ArtifactsConfig(BaseModel):
    """``[artifacts]``: the artifact store an embedded-mesh node serves (§7.5.2, §18.5)."""

    model_config = _FORBID

    quota_bytes: ByteSize = 1024**3
    """Per-owner total of stored bytes."""
    quota_objects: Annotated[int, Field(ge=1)] = 10_000
    """Per-owner number of stored objects."""
    max_object_size: ByteSize = 256 * 1024**2
    """One object's limit (larger is PAYLOAD_TOO_LARGE, however empty the quota)."""
    default_retention: Duration = timedelta(days=14)
    """Task retention (7d) plus the 7-day grace window of §7.5.2."""
    max_retention: Duration = timedelta(days=365)
    """The longest lifetime a writer may declare."""
    sweep_interval: Duration = timedelta(minutes=5)
    """How often expired objects are reclaimed (their refs keep answering ARTIFACT_GONE)."""
    upload_idle: Duration = timedelta(hours=1)
    """A chunked upload idle this long is discarded."""


class KeystoreConfig(BaseModel):
    """``[keystore]``: where private keys are kept at rest (see :mod:`meshnode.keystore`)."""

    model_config = _FORBID

    backend: Annotated[
        Literal["auto", "keyring", "systemd-credentials", "file"],
        _choice("auto", "keyring", "systemd-credentials", "file"),
        _choice_schema("auto", "keyring", "systemd-credentials", "file"),
    ] = "auto"


class LoggingConfig(BaseModel):
    """``[logging]``."""

    model_config = _FORBID

    level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"],
        _choice("debug", "info", "warning", "error", "critical", fold_case=True),
        _choice_schema("debug", "info", "warning", "error", "critical"),
    ] = "info"
    format: Annotated[
        Literal["auto", "json", "text", "journald"],
        _choice("auto", "json", "text", "journald"),
        _choice_schema("auto", "json", "text", "journald"),
    ] = "auto"


class EventsConfig(BaseModel):
    """``[events]``: emitting events and feeds (§6.6, §6.6a)."""

    model_config = _FORBID

    emit_limit: Annotated[int, Field(ge=1)] = 600
    """Emits one agent may make on one subject per ``emit_window`` (sender-side)."""
    emit_window: Duration = timedelta(seconds=60)


class ObservabilityConfig(BaseModel):
    """``[observability]``: publishing spans, logs and metrics (§13). All off by default."""

    model_config = _FORBID

    spans: bool = False
    """Publish a span_completed event per hop on ``mesh.trace.{agent}`` (§13.1.1)."""
    logs: bool = False
    """Publish agent log records on ``mesh.log.{agent}.{level}`` (§13.3)."""
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"],
        _choice("debug", "info", "warning", "error", fold_case=True),
        _choice_schema("debug", "info", "warning", "error"),
    ] = "info"
    """The lowest level published when ``logs`` is on."""
    metrics: bool = False
    """Publish §13.2 metrics per agent on ``mesh.metrics.{agent}`` every ``metrics_interval``."""
    metrics_interval: Duration = timedelta(seconds=60)


_USD_DECIMAL = re.compile(r"\d+(?:\.\d+)?")


def _usd_decimal(value: object) -> str:
    # Money is a decimal string in the mesh extension, never a float: a TOML
    # float (0.1) would already have lost the amount it was meant to be.
    if isinstance(value, str) and _USD_DECIMAL.fullmatch(value.strip()):
        return value.strip()
    raise ValueError(f'expected a USD amount as a decimal string like "0.05", got {value!r}')


def _optional_verify_key(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected an Ed25519 public key string, got {value!r}")
    parse_verify_key(value)  # raises ValueError naming the accepted forms
    return value.strip()


class A2APeerConfig(BaseModel):
    """``[a2a.peers.<name>]``: an external A2A agent hosted agents may call as ``a2a:<name>``."""

    model_config = _FORBID

    url: Annotated[str, BeforeValidator(_url(("http", "https"), "A2A agent card or base")),
                   WithJsonSchema({"type": "string"})]
    """The peer's Agent Card URL (``…/agent-card.json``) or its base URL (the card is
    then read from ``/.well-known/agent-card.json`` below it)."""
    contract_price: Annotated[str, BeforeValidator(_usd_decimal), WithJsonSchema({"type": "string"})]
    """What one completed call costs at least, in USD (``"0.05"``): the charge is
    max(verified reported spend, contract_price)."""
    audience: str | None = None
    """The peer's application name for the envelope's ``audience``; default from its
    card (the extension's ``params.application``, else the card's name)."""
    issuer_key: Annotated[str | None, BeforeValidator(_optional_verify_key),
                          WithJsonSchema({"type": "string"})] = None
    """The Ed25519 key that signs the peer's run reports (``U…`` nkey or base64url);
    default from its card (the extension's ``params.issuerKey``)."""
    timeout: Duration = timedelta(seconds=30)
    """How long one HTTP attempt may take before it counts as ambiguous."""
    card_ttl: Duration = timedelta(minutes=10)
    """How long a fetched Agent Card is reused before it is read again."""



_AGENT_KEYS = ("plugin", "enabled", "interaction")


def _plugin_name(value: object) -> str:
    if isinstance(value, str) and _PLUGIN_NAME.fullmatch(value):
        return value
    raise ValueError(
        f"expected an entry point name in group meshnode.agents "
        f"(letters, digits, '_', '.', '-'), got {value!r}"
    )


class AgentConfig(BaseModel):
    """``[agents.<name>]``: one hosted agent.

    Keys other than ``plugin``, ``enabled`` and ``interaction`` belong to the
    plugin: they are collected into :attr:`settings` unvalidated, for the
    plugin's own model.
    """

    model_config = _FORBID

    plugin: Annotated[str, BeforeValidator(_plugin_name), WithJsonSchema({"type": "string"})]
    """Entry point name in group ``meshnode.agents``; defaults to the table name."""
    enabled: bool = True
    interaction: Annotated[
        Literal["service", "interactive"] | None,
        _choice("service", "interactive", optional=True),
        _choice_schema("service", "interactive", optional=True),
    ] = None
    """None lets the plugin decide."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """The plugin's own keys from the table, unvalidated."""

    @model_validator(mode="before")
    @classmethod
    def _collect_plugin_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = {k: v for k, v in data.items() if k in _AGENT_KEYS}
        own["settings"] = {k: v for k, v in data.items() if k not in _AGENT_KEYS}
        return own


_LISTEN = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")


def _listen_address(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        m = _LISTEN.fullmatch(value.strip())
        if m is not None and int(m.group("port")) <= 65535:
            return value.strip()
    raise ValueError(f'expected "host:port" (e.g. "127.0.0.1:8700" or "[::1]:8700"), got {value!r}')


def _verify_key_text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("expected an Ed25519 public key as a string")
    parse_verify_key(value)  # raises ValueError naming the accepted forms
    return value.strip()


class A2AIssuerConfig(BaseModel):
    """``[a2a.issuers.<name>]``: a caller application whose signed envelopes are
    trusted (its budget and deadline bind the work, its origin is the execution's)."""

    model_config = _FORBID

    key: Annotated[str, BeforeValidator(_verify_key_text), WithJsonSchema({"type": "string"})]
    """The issuer's Ed25519 public key: a user nkey (``U...``) or 32 bytes in base64url."""


class A2AConfig(BaseModel):
    """``[a2a]``: the A2A bridge. Inbound serving is off unless ``listen`` is set."""

    model_config = _FORBID

    listen: Annotated[
        str | None, BeforeValidator(_listen_address), WithJsonSchema({"type": "string"})
    ] = None
    """Address the A2A HTTP server binds (``"127.0.0.1:8700"``); unset = not served."""
    public_url: OptionalHttpUrl = None
    """Base URL the Agent Cards advertise; defaults to ``http://<listen>``."""
    application: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """This application's name: the audience envelopes must name and the issuer
    of run reports. Defaults to ``[node] name``."""
    expose: list[str] = Field(default_factory=list)
    """Hosted agents (names of ``[agents.<name>]`` tables) served over A2A."""
    max_mesh_hops: Annotated[int, Field(ge=1, le=64)] = 8
    """A call chain this long is refused (REJECTED, ``limit.hops``)."""
    idempotency_retention: Duration = timedelta(hours=24)
    """How long a caller's messageId maps to its task (card ``idempotencyRetention``)."""
    clock_skew: Duration = timedelta(seconds=30)
    """How far two applications' clocks may disagree: an envelope issued this
    far in the future counts, and an ``expiresIn`` may exceed the seed's PT60S
    replay window by as much, never more."""
    send_wait: Duration = timedelta(seconds=30)
    """How long a blocking SendMessage waits for a terminal state before it
    answers with the task as it stands (GetTask follows it up)."""
    task_timeout: Duration = timedelta(minutes=10)
    """The longest a bridged task is followed when the caller set no deadline."""
    allow_issuers: list[str] | None = None
    """Issuers whose signatures are trusted. Unset: exactly the configured
    ``[a2a.issuers]``. A list: the names or nkey ids listed; ``"*"`` admits
    every configured issuer and every mesh agent id (nkey) issuer."""
    issuers: dict[str, A2AIssuerConfig] = Field(default_factory=dict)
    signing: Annotated[
        Literal["agent", "node", "none"],
        _choice("agent", "node", "none", fold_case=True),
        _choice_schema("agent", "node", "none"),
    ] = "agent"
    """Who signs outbound envelopes: ``agent`` — the calling agent's key, issuer its id
    (verifiable from the id itself); ``node`` — the node key, issuer ``application``
    (the peer configures the node's public key for it); ``none`` — an unsecured claim."""
    peers: dict[str, A2APeerConfig] = Field(default_factory=dict)
    """External A2A agents by local name (``[a-z0-9][a-z0-9_-]{0,63}``)."""

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_names(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        problems = [
            (f"a2a.peers.{_toml_key(str(name))}",
             "peer name must match [a-z0-9][a-z0-9_-]{0,63} (lower-case letters, digits, '_' and '-')")
            for name in value
            if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name)
        ]
        if problems:
            raise _Problems(problems)
        return value


class _EnvSource(PydanticBaseSettingsSource):
    """The environment overrides, read from the mapping given to :func:`load_config`.

    The stock env source is not used: it would map variables such as ``NODE``
    or ``LOGGING`` onto whole tables and cannot read an injected mapping.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        ctx = _context()
        value = ctx.env.get(DATA_DIR_ENV, "")
        if not value:
            return {}
        if os.path.isabs(value) or value.startswith("~"):
            return {"node": {"data_dir": value}}
        # A relative value from the environment means the caller's cwd, not the file's dir.
        return {"node": {"data_dir": os.path.abspath(value)}}


class Config(BaseSettings):
    """The whole daemon configuration. Load it with :func:`load_config`."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=False)

    node: NodeConfig = Field(default_factory=NodeConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    protections: ProtectionsConfig = Field(default_factory=ProtectionsConfig)
    inbox: InboxConfig = Field(default_factory=InboxConfig)
    artifacts: ArtifactsConfig = Field(default_factory=ArtifactsConfig)
    keystore: KeystoreConfig = Field(default_factory=KeystoreConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    a2a: A2AConfig = Field(default_factory=A2AConfig)
    agents: dict[str, AgentConfig] = Field(default_factory=dict)
    """Hosted agents by local name (``[a-z0-9][a-z0-9_-]{0,63}``)."""

    _source_file: Path | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        ctx = _context()
        return (
            init_settings,
            _EnvSource(settings_cls),
            TomlConfigSettingsSource(settings_cls, toml_file=ctx.toml_file),
        )

    @property
    def source_file(self) -> Path | None:
        """The file this config was read from (None: defaults only)."""
        return self._source_file

    @field_validator("agents", mode="before")
    @classmethod
    def _agent_tables(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        problems: list[tuple[str, str]] = []
        tables: dict[str, Any] = {}
        for name, table in value.items():
            if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
                problems.append(
                    (
                        f"agents.{_toml_key(str(name))}",
                        "agent name must match [a-z0-9][a-z0-9_-]{0,63} "
                        "(lower-case letters, digits, '_' and '-', up to 64 characters)",
                    )
                )
                continue
            if isinstance(table, dict) and "plugin" not in table:
                table = {"plugin": name, **table}
            tables[name] = table
        if problems:
            raise _Problems(problems)
        return tables

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        problems: list[tuple[str, str]] = []
        p, inbox = self.protections, self.inbox
        if p.mailbox_max_age > inbox.buffer_max_age:
            problems.append(
                (
                    "protections.mailbox_max_age",
                    f"must not exceed inbox.buffer_max_age ({format_duration(inbox.buffer_max_age)}), "
                    f"got {format_duration(p.mailbox_max_age)}",
                )
            )
        emb = self.mesh.embedded
        if emb.port and emb.port == emb.control_port:
            problems.append(
                ("mesh.embedded.control_port", f"must differ from mesh.embedded.port ({emb.port})")
            )
        admin = self.admin
        if admin.group and admin.mode is not None and not admin.mode & 0o060:
            problems.append(
                (
                    "admin.mode",
                    f"{admin.mode:04o} gives admin.group {admin.group!r} no access; "
                    'use "0660" or leave admin.group empty',
                )
            )
        derived = admin.socket == Path()
        if derived:
            ctx = _context()
            admin.socket = Path(os.path.normpath(default_admin_socket(self.node.data_dir, ctx.env)))
        length = len(os.fsencode(admin.socket))
        if length > UDS_PATH_MAX:
            origin = "the default path" if derived else "the path"
            problems.append(
                (
                    "admin.socket",
                    f"{origin} {str(admin.socket)!r} is {length} bytes; Unix socket paths must "
                    f"stay within {UDS_PATH_MAX} bytes: set [admin] socket to a shorter path",
                )
            )
        for i, name in enumerate(self.a2a.expose):
            agent = self.agents.get(name)
            if agent is None or not agent.enabled:
                problems.append(
                    (
                        f"a2a.expose[{i}]",
                        f"{name!r} is not an enabled [agents.<name>] table of this node",
                    )
                )
        if self.a2a.listen is not None and "a2a-bridge" in self.agents:
            problems.append(
                ("agents.a2a-bridge", "the name is reserved for the A2A bridge's identity when [a2a] listen is set")
            )
        if self.a2a.listen is None and self.a2a.expose:
            problems.append(("a2a.listen", "a2a.expose lists agents but no listen address is set"))
        if problems:
            raise _Problems(problems)
        return self

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """JSON Schema of the TOML file, for editors and ``meshnode config schema``.

        Unlike :meth:`model_json_schema`, defaults are shown in config spelling
        (``"30s"``, not ISO 8601) and unset optional keys carry no default.
        """
        schema: dict[str, Any] = _drop_null_defaults(
            cls.model_json_schema(schema_generator=_TomlSchema)
        )
        return schema

    def to_toml_dict(self) -> dict[str, Any]:
        """The configuration as TOML-ready data: durations and sizes in config spelling,
        paths as strings, unset optional keys omitted, agent settings flattened."""
        return _model_to_toml(self)


class _TomlSchema(GenerateJsonSchema):
    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, timedelta):
            return format_duration(dft)
        if isinstance(dft, Path):
            return "" if dft == Path() else str(dft)
        return super().encode_default(dft)


def _drop_null_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _drop_null_defaults(v) for k, v in node.items() if not (k == "default" and v is None)
        }
    if isinstance(node, list):
        return [_drop_null_defaults(v) for v in node]
    return node


def _model_to_toml(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(model, AgentConfig) and name == "settings":
            out.update(value)
            continue
        if isinstance(model, AdminConfig) and name == "mode" and value is not None:
            out[name] = f"{value:04o}"
            continue
        converted = _value_to_toml(value, info)
        if converted is not None:
            out[info.alias or name] = converted
    return out


def _value_to_toml(value: Any, info: FieldInfo | None) -> Any:
    if value is None:
        return None
    if isinstance(value, BaseModel):
        return _model_to_toml(value)
    if isinstance(value, dict):
        return {k: _value_to_toml(v, None) for k, v in value.items()}
    if isinstance(value, list):
        return [_value_to_toml(v, None) for v in value]
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, Path):
        return str(value)
    if (
        info is not None
        and isinstance(value, int)
        and not isinstance(value, bool)
        and any(isinstance(m, _SizeMarker) for m in info.metadata)
    ):
        return format_size(value)
    return value


# --------------------------------------------------------------------------- loading


def resolve_config_path(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    euid: int | None = None,
) -> tuple[Path, str, bool]:
    """Which config file to read: ``(path, origin, explicit)``.

    ``origin`` is a short human phrase for messages; ``explicit`` is True when
    the file was named (``--config`` or ``$MESHNODE_CONFIG``) and so must exist.
    """
    env = os.environ if env is None else env
    if path is not None and str(path) != "":
        return Path(os.path.abspath(os.fspath(path))), "--config", True
    from_env = env.get(CONFIG_ENV, "")
    if from_env:
        return Path(os.path.abspath(from_env)), f"${CONFIG_ENV}", True
    return default_config_path(env, euid), "default location", False


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    euid: int | None = None,
) -> Config:
    """Read, validate and resolve the configuration.

    ``path`` is the ``--config`` argument; ``env`` defaults to ``os.environ``
    (tests pass a plain dict); ``euid`` defaults to the process's effective uid
    and only affects the default locations.

    Raises :class:`ConfigError` listing every problem found.
    """
    env = os.environ if env is None else env
    euid = _geteuid() if euid is None else euid
    file, origin, explicit = resolve_config_path(path, env=env, euid=euid)
    shown = str(file)
    if not file.exists():
        if explicit:
            raise ConfigError(
                [ConfigProblem(shown, None, f"config file not found (named by {origin})")], file
            )
        toml_file: Path | None = None
    elif not file.is_file():
        raise ConfigError([ConfigProblem(shown, None, "is not a regular file")], file)
    else:
        toml_file = file

    ctx = _LoadContext(env, euid, file.parent if toml_file else None, toml_file)
    try:
        with _use_context(ctx):
            config = Config()
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigProblem(shown, None, f"TOML syntax error: {exc}")], file) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [ConfigProblem(shown, None, f"is not valid UTF-8 (byte {exc.start})")], file
        ) from None
    except OSError as exc:
        raise ConfigError(
            [ConfigProblem(shown, None, f"cannot read: {exc.strerror or exc}")], file
        ) from None
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, shown, env), file) from None
    config._source_file = toml_file
    return config


def _toml_key(part: str) -> str:
    if _BARE_TOML_KEY.fullmatch(part):
        return part
    escaped = part.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            continue
        else:
            out += ("." if out else "") + _toml_key(part)
    return out


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        info = model.model_fields.get(str(part))
        ann = info.annotation if info is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problems_from(exc: ValidationError, file: str, env: Mapping[str, str]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _Problems):
            problems.extend(ConfigProblem(file, key, msg) for key, msg in cause.items)
            continue
        key = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent is not None else ""
            message = f"unknown key (expected one of: {allowed})" if allowed else "unknown key"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            message = f"expected a table, got {_short(err['input'])}"
        elif kind == "value_error" and cause is not None:
            message = str(cause)
        else:
            msg = err["msg"]
            if msg.startswith("Input should be "):
                msg = "expected " + msg[len("Input should be ") :]
            elif msg.startswith("String should "):
                msg = "expected to " + msg[len("String should ") :]
            message = f"{msg}, got {_short(err['input'])}"
        if key == "node.data_dir" and env.get(DATA_DIR_ENV):
            message += f" (from ${DATA_DIR_ENV})"
        problems.append(ConfigProblem(file, key or None, message))
    return problems


def describe_sources(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    euid: int | None = None,
) -> list[str]:
    """Where the configuration comes from, one line each, for ``check-config``/status.

    Works without validating the file (so it helps when the file is broken):
    names the config file and why it was chosen, and the origin of the values
    that have environment-dependent defaults.
    """
    env = os.environ if env is None else env
    euid = _geteuid() if euid is None else euid
    file, origin, explicit = resolve_config_path(path, env=env, euid=euid)
    raw: dict[str, Any] = {}
    if file.is_file():
        lines = [f"config file: {file} (from {origin})"]
        with contextlib.suppress(OSError, ValueError), file.open("rb") as fh:
            raw = tomllib.load(fh)
    elif explicit:
        lines = [f"config file: {file} (from {origin}; MISSING)"]
    else:
        lines = [f"config file: {file} ({origin}; not present, built-in defaults)"]

    def in_file(table: str, key: str) -> Any:
        section = raw.get(table)
        return section.get(key) if isinstance(section, dict) else None

    data_dir: Path
    if env.get(DATA_DIR_ENV):
        data_dir = Path(os.path.abspath(env[DATA_DIR_ENV]))
        lines.append(f"node.data_dir: {data_dir} (from ${DATA_DIR_ENV})")
    elif in_file("node", "data_dir"):
        data_dir = Path(str(in_file("node", "data_dir")))
        lines.append(f"node.data_dir: {data_dir} (from the config file)")
    else:
        data_dir = default_data_dir(env, euid)
        why = (
            "$STATE_DIRECTORY"
            if _first_dir(env, "STATE_DIRECTORY")
            else "root default"
            if euid == 0
            else "XDG data home"
        )
        lines.append(f"node.data_dir: {data_dir} (default: {why})")

    if in_file("admin", "socket"):
        lines.append(f"admin.socket: {in_file('admin', 'socket')} (from the config file)")
    else:
        sock = default_admin_socket(data_dir, env)
        why = (
            "$RUNTIME_DIRECTORY"
            if _first_dir(env, "RUNTIME_DIRECTORY")
            else "$XDG_RUNTIME_DIR"
            if env.get("XDG_RUNTIME_DIR")
            else "data directory"
        )
        lines.append(f"admin.socket: {sock} (default: {why})")
    return lines
