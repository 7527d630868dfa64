"""The plugin contract: hook specifications and the loader.

A distribution provides agents through the entry-point group
``meshnode.agents``. An entry point may name either

* an :class:`meshnode.agent.Agent` subclass — registered under the entry
  point's name (the simple case), or
* a module or object implementing the hooks below (for plugins that provide
  several agents, CLI commands or admin methods).

``pyproject.toml`` of a plugin::

    [project.entry-points."meshnode.agents"]
    echo = "meshnode_echo:EchoAgent"

Each entry point is loaded on its own: a broken plugin is logged and skipped
(``strict`` mode re-raises, for development). Hooks are synchronous; pluggy
calls them in registration order.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import site
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from meshnode.agent import Agent

__all__ = [
    "ENTRY_POINT_GROUP",
    "AgentCatalog",
    "PluginLoadError",
    "PluginManager",
    "hookimpl",
    "hookspec",
    "installed_versions",
    "load_plugins",
    "rescan_installed",
]

ENTRY_POINT_GROUP = "meshnode.agents"
PROJECT = "meshnode"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

log = logging.getLogger("meshnode.plugins")


class PluginLoadError(Exception):
    """A plugin could not be loaded (raised only in strict mode)."""


class MeshnodeHookSpec:
    """The hooks a plugin may implement. This class is documentation with code
    attached: every hook here is a stable contract."""

    @hookspec
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        """Register the agent classes this plugin provides.

        Call ``register(name, AgentSubclass)`` once per agent kind. ``name`` is
        what a node's configuration selects with ``plugin = "<name>"``.

        .. versionadded:: 0.1
        """

    @hookspec
    def meshnode_add_cli_commands(self, commands: Any) -> None:
        """Add subcommands to the ``meshnode`` CLI.

        ``commands`` is the argparse subparsers object of the top-level parser;
        set ``handler=callable(args) -> int`` on each parser you add.

        .. versionadded:: 0.1
        """


    @hookspec
    def meshnode_admin_methods(self, register: Callable[..., Any], daemon: Any) -> None:
        """Add methods to the admin API.

        Call ``register(name, async_fn, level="operator", streaming=False, doc="...")``
        with a CamelCase dotted name (``MyPlugin.DoThing``); ``async_fn(params,
        call)`` returns the result. ``daemon`` is the running
        :class:`meshnode.daemon.main.Daemon`.

        .. versionadded:: 0.1
        """


@dataclass
class AgentCatalog:
    """What the loaded plugins provide: agent kinds by name, and what failed."""

    kinds: dict[str, type[Agent]] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    #: ``entry-point name -> "distribution version"`` as scanned (:func:`installed_versions`).
    versions: dict[str, str] = field(default_factory=dict)

    def register(self, name: str, agent_class: type[Agent], origin: str) -> None:
        if not (isinstance(agent_class, type) and issubclass(agent_class, Agent)):
            raise TypeError(f"{origin}: {name!r} is not an Agent subclass")
        if name in self.kinds and self.kinds[name] is not agent_class:
            raise ValueError(
                f"agent kind {name!r} from {origin} clashes with the one from {self.origins[name]}"
            )
        self.kinds[name] = agent_class
        self.origins[name] = origin


class PluginManager:
    """A typed facade over pluggy so every hook call is checked by mypy."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(MeshnodeHookSpec)

    def register(self, plugin: object, name: str) -> None:
        self._pm.register(plugin, name=name)

    def check_pending(self) -> None:
        self._pm.check_pending()

    def register_agents(self, catalog: AgentCatalog, *, strict: bool = False) -> None:
        """Ask every plugin for its agent kinds, one plugin at a time so that one
        bad registration is isolated (logged, recorded in ``catalog.failures``)."""
        for impl in self._pm.hook.meshnode_register_agents.get_hookimpls():
            origin = impl.plugin_name

            def register(name: str, cls: type[Agent], _origin: str = origin) -> None:
                catalog.register(name, cls, _origin)

            try:
                impl.function(register=register)
            except Exception as exc:
                catalog.failures[origin] = f"{type(exc).__name__}: {exc}"
                log.error("plugin %s failed to register its agents: %s", origin, exc)
                if strict:
                    raise PluginLoadError(f"plugin {origin}: {exc}") from exc

    def add_cli_commands(self, commands: Any) -> None:
        self._pm.hook.meshnode_add_cli_commands(commands=commands)

    def add_admin_methods(self, methods: Any, daemon: Any) -> None:
        """Let plugins add admin methods; one plugin failing is logged, not fatal."""
        for impl in self._pm.hook.meshnode_admin_methods.get_hookimpls():
            try:
                impl.function(register=methods.add, daemon=daemon)
            except Exception as exc:
                log.error("plugin %s failed to add admin methods: %s", impl.plugin_name, exc)


class _SingleAgentPlugin:
    """Adapts an entry point that names an Agent subclass directly."""

    def __init__(self, name: str, agent_class: type[Agent]) -> None:
        self._name = name
        self._agent_class = agent_class

    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register(self._name, self._agent_class)


def module_entry_points(specs: Iterable[str]) -> list[importlib.metadata.EntryPoint]:
    """Entry points for ``[node] plugin_modules`` ("pkg.mod" or "pkg.mod:Attr")."""
    eps = []
    for spec in specs:
        name = spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1].lower() if ":" in spec else spec.rsplit(".", 1)[-1]
        eps.append(importlib.metadata.EntryPoint(name=name, value=spec, group=ENTRY_POINT_GROUP))
    return eps


def rescan_installed(site_dirs: Iterable[str] | None = None) -> list[str]:
    """Forget what the import system remembers of the installed distributions, so
    the next :func:`load_plugins` sees one pip-installed since the process started.

    ``importlib.metadata`` memoizes each ``sys.path`` directory's listing (keyed by
    its mtime, which a coarse clock or an in-place install may leave unchanged), and
    the path finders cache ``sys.path`` entries, including a directory that did not
    exist yet; :func:`importlib.invalidate_caches` drops both.

    An editable install (``pip install -e``) puts no module in site-packages: it
    writes a ``.pth`` file there, a path to add or an import that installs a
    finder, and the interpreter reads ``.pth`` files only as it starts. Its entry
    point was found, and importing it failed (``No module named ...``). So the
    ``.pth`` files that appeared in the site directories (``site_dirs``, default
    the interpreter's) since this process first looked are read now, as
    :mod:`site` reads them at start; each file once. Returns the ones read.
    """
    importlib.invalidate_caches()  # a .pth's import line may name a module installed with it
    added = _read_new_path_files(_site_dirs() if site_dirs is None else site_dirs)
    if added:
        importlib.invalidate_caches()  # the paths they added
    return added


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def _path_files(site_dirs: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for directory in site_dirs:
        try:
            names = os.listdir(directory)
        except OSError:  # a site directory that does not exist (yet)
            continue
        found.update(os.path.join(directory, name) for name in names if name.endswith(".pth"))
    return found


#: The ``.pth`` files read already: those present when this module was first
#: imported (the interpreter read them as it started), and those read since.
_PATH_FILES_READ: set[str] = _path_files(_site_dirs())


def _read_new_path_files(site_dirs: Iterable[str]) -> list[str]:
    added = sorted(_path_files(site_dirs) - _PATH_FILES_READ)
    for path in added:
        _PATH_FILES_READ.add(path)
        directory, name = os.path.split(path)
        # What site does at start for each .pth: add its paths, run its import lines.
        site.addpackage(directory, name, None)
        log.info("read %s (an editable install since the daemon started)", path)
    return added


def installed_versions() -> dict[str, str]:
    """``entry-point name -> "distribution version"`` of the installed plugins, to
    tell an upgraded plugin (whose old module stays imported) from an unchanged one."""
    found: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found[ep.name] = f"{dist.name} {dist.version}" if dist is not None else ep.value
    return found


def load_plugins(
    *,
    strict: bool = False,
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
    builtins: Iterable[tuple[str, object]] = (),
    extra_modules: Iterable[str] = (),
) -> tuple[PluginManager, AgentCatalog]:
    """Load every installed plugin and collect the agent kinds they provide.

    ``builtins`` are (name, plugin) pairs registered first — built-in features
    take the same path as third-party plugins. ``extra_modules`` are loaded
    like entry points (see :func:`module_entry_points`).
    """
    pm = PluginManager()
    catalog = AgentCatalog()
    for name, plugin in builtins:
        pm.register(plugin, name=name)
    if entry_points is None:
        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        catalog.versions = installed_versions()
    else:
        eps = list(entry_points)
    eps.extend(module_entry_points(extra_modules))
    for ep in eps:
        origin = f"{ep.name} ({ep.value})"
        try:
            obj = ep.load()
            if isinstance(obj, type) and issubclass(obj, Agent):
                pm.register(_SingleAgentPlugin(ep.name, obj), name=f"ep:{ep.name}")
            else:
                pm.register(obj, name=f"ep:{ep.name}")
        except Exception as exc:  # one broken plugin must not stop the others
            catalog.failures[ep.name] = f"{type(exc).__name__}: {exc}"
            log.error("plugin %s failed to load: %s", origin, exc)
            if strict:
                raise PluginLoadError(f"plugin {origin} failed to load: {exc}") from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        if strict:
            raise PluginLoadError(str(exc)) from exc
        log.error("plugin hook validation failed: %s", exc)
    pm.register_agents(catalog, strict=strict)
    return pm, catalog
