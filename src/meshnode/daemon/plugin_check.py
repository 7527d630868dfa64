"""The ``[agents.<name>]`` tables checked against the installed plugins.

The configuration model alone cannot know whether ``plugin = "gretter"`` names
an installed agent kind, or whether ``greeting = 3`` suits the plugin's
``Settings``: only the loaded plugins can say. :func:`agent_problems` asks
them and words each problem like every other configuration error (the file,
the dotted key, what was expected; :class:`meshnode.config.ConfigProblem`),
so ``meshnode check-config`` (like Caddy's ``validate``), the daemon's start
and ``meshnode reload`` report the same lines, never pydantic's raw dump.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from meshnode.agent import Agent
from meshnode.config import AgentConfig, Config, ConfigError, ConfigProblem, settings_problems
from meshnode.plugins import AgentCatalog, module_entry_points

__all__ = [
    "agent_problems",
    "config_file_label",
    "installed_kinds",
    "module_problems",
    "raise_if_problems",
    "settings_error",
    "unknown_kind_message",
    "unused_failures",
]

#: The keys of an ``[agents.<name>]`` table that are meshnode's, not the plugin's.
_OWN_KEYS = tuple(k for k in AgentConfig.model_fields if k != "settings")


def config_file_label(config: Config) -> str:
    """How problems name the file: its path, or what stood in for one."""
    return str(config.source_file) if config.source_file is not None else "(built-in defaults)"


def installed_kinds(catalog: AgentCatalog) -> list[str]:
    """The agent kinds a configuration may name (the built-in identities are not among them)."""
    return sorted(k for k in catalog.kinds if not k.startswith("builtin:"))


def unknown_kind_message(kind: str, catalog: AgentCatalog) -> str:
    """Why ``plugin = kind`` cannot be hosted: it failed to load, or nothing
    installed provides it (with a did-you-mean and the kinds that are)."""
    failure = catalog.failures.get(kind)
    if failure is not None:
        return f"plugin {kind!r} is installed but failed to load: {failure} (the daemon's log has the traceback)"
    installed = installed_kinds(catalog)
    message = f"no installed plugin provides agent kind {kind!r}"
    close = difflib.get_close_matches(kind, installed, n=1, cutoff=0.6)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    message += f"; installed: {', '.join(installed) if installed else 'none'}"
    message += (
        ": install the plugin's distribution into meshnode's environment (it declares the entry point"
        ' group "meshnode.agents"), or name a module in [node] plugin_modules'
    )
    return message


def settings_error(
    file: str, name: str, agent_class: type[Agent], settings: Mapping[str, Any]
) -> list[ConfigProblem]:
    """The problems of ``[agents.<name>]``'s plugin keys under ``agent_class.Settings``."""
    try:
        agent_class.Settings.model_validate(dict(settings))
    except ValidationError as exc:
        return settings_problems(exc, file, ("agents", name), agent_class.Settings, also_allowed=_OWN_KEYS)
    return []


def agent_problems(config: Config, catalog: AgentCatalog) -> dict[str, list[ConfigProblem]]:
    """Every enabled agent's problems, by agent name (absent when it has none)."""
    file = config_file_label(config)
    found: dict[str, list[ConfigProblem]] = {}
    for name, agent_cfg in config.agents.items():
        if not agent_cfg.enabled:
            continue
        agent_class = catalog.kinds.get(agent_cfg.plugin)
        if agent_class is None:
            found[name] = [ConfigProblem(file, f"agents.{name}.plugin", unknown_kind_message(agent_cfg.plugin, catalog))]
            continue
        problems = settings_error(file, name, agent_class, agent_cfg.settings)
        if problems:
            found[name] = problems
    return found


def module_problems(config: Config, catalog: AgentCatalog) -> list[ConfigProblem]:
    """``[node] plugin_modules`` entries that failed to load, at their keys: named
    in the file, so a failure is the file's problem even when no table uses it."""
    file = config_file_label(config)
    problems = []
    for index, ep in enumerate(module_entry_points(config.node.plugin_modules)):
        failure = catalog.failures.get(ep.name)
        if failure is not None:
            problems.append(ConfigProblem(file, f"node.plugin_modules[{index}]", f"cannot load {ep.value!r}: {failure}"))
    return problems


def unused_failures(config: Config, catalog: AgentCatalog) -> dict[str, str]:
    """Installed plugins that failed to load although no table names them (a
    warning, not an error: a broken package elsewhere in the environment)."""
    named = {a.plugin for a in config.agents.values() if a.enabled}
    modules = {ep.name for ep in module_entry_points(config.node.plugin_modules)}
    return {k: v for k, v in catalog.failures.items() if k not in named and k not in modules}


def raise_if_problems(
    config: Config, found: Mapping[str, list[ConfigProblem]], first: list[ConfigProblem] | None = None
) -> None:
    """A :class:`ConfigError` of every problem found (``first``, then each
    agent's; nothing when there is none)."""
    problems = [*(first or ()), *(p for name in found for p in found[name])]
    if problems:
        raise ConfigError(problems, config.source_file)
