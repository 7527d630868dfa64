"""Finding, reading and validating the configuration file: :func:`load_config`,
its problems as :class:`ConfigError` lines, and :func:`describe_sources`."""

from __future__ import annotations

import contextlib
import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from .model import Config
from .values import (
    CONFIG_ENV,
    DATA_DIR_ENV,
    ConfigError,
    ConfigProblem,
    _first_dir,
    _geteuid,
    _LoadContext,
    _Problems,
    _toml_key,
    _use_context,
    default_admin_socket,
    default_config_path,
    default_data_dir,
)

__all__ = [
    "describe_sources",
    "load_config",
    "resolve_config_path",
    "settings_problems",
]


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


def _model_at(loc: tuple[int | str, ...], root: type[BaseModel] = Config) -> type[BaseModel] | None:
    model: type[BaseModel] = root
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


def settings_problems(
    exc: ValidationError, file: str, prefix: tuple[str, ...], model: type[BaseModel],
    also_allowed: tuple[str, ...] = (),
) -> list[ConfigProblem]:
    """The problems of a table validated by a model of its own (a plugin's
    ``Settings`` for ``[agents.<name>]``), worded like every other config error:
    the file, the dotted key under ``prefix`` and what was expected, never
    pydantic's own dump. ``also_allowed`` are keys of the table that are not the
    model's (``plugin``, ``enabled``...), listed where an unknown key is."""
    return _problems_from(exc, file, {}, root=model, prefix=prefix, also_allowed=also_allowed)


def _problems_from(
    exc: ValidationError, file: str, env: Mapping[str, str], *,
    root: type[BaseModel] = Config, prefix: tuple[str, ...] = (), also_allowed: tuple[str, ...] = (),
) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for err in exc.errors(include_url=False):
        inner = tuple(err["loc"])
        loc = (*prefix, *inner)
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _Problems):
            problems.extend(ConfigProblem(file, key, msg) for key, msg in cause.items)
            continue
        key = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(inner[:-1], root)
            fields = [*(also_allowed if len(inner) == 1 else ()), *(parent.model_fields if parent else ())]
            allowed = ", ".join(fields)
            close = difflib.get_close_matches(str(inner[-1]), fields, n=1, cutoff=0.75) if inner else []
            hint = f"did you mean {close[0]!r}? " if close else ""
            message = f"unknown key ({hint}expected one of: {allowed})" if allowed else "unknown key"
        elif kind == "missing":
            message = "required key is missing"
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
