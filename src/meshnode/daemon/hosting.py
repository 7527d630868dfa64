"""The node and its agents, as the daemon runs them: keys, plugins, the
:class:`~meshnode.node.runtime.Node` built from the configuration with its
collaborators, and agents hosted, added, removed and restarted.

One agent failing never takes the node down: its failure is recorded in
``failed_agents`` (shown by ``Status``) and the others go on, unless
``[node] strict_plugins`` asks for the opposite. What an admin call asked
wrongly raises the admin API's own errors (``InvalidParameter``, ``NotFound``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from meshnode.admin.protocol import Conflict, InvalidParameter, NotFound, NotReady
from meshnode.config import AgentConfig, Config, ConfigError
from meshnode.daemon.credentials import CredentialUnavailable
from meshnode.daemon.plugin_check import (
    agent_problems,
    config_file_label,
    raise_if_problems,
    settings_error,
    unknown_kind_message,
)
from meshnode.keystore import KeyStore, KeyStoreError, get_or_create_all
from meshnode.node.builtin import BRIDGE_AGENT_NAME, CLI_AGENT_NAME, BuiltinAgents
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.supervise import StartTimeout
from meshnode.plugins import AgentCatalog, PluginManager, load_plugins, rescan_installed
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.protections import FreshnessWindow
from meshnode.services.identity import SERVICE_NAMES, load_service_keys

__all__ = ["AgentHost", "load_plugin_catalog", "ms", "node_settings", "rescan_catalog", "scan_plugins"]

log = logging.getLogger("meshnode.daemon")

#: What an agent's name must look like (its key, subjects and config table use it).
_AGENT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def ms(td: timedelta) -> int:
    return int(td.total_seconds() * 1000)


def node_settings(config: Config) -> NodeSettings:
    """The runtime's settings from ``[node]``, ``[protections]``, ``[events]``, ``[inbox]``."""
    p = config.protections
    return NodeSettings(
        name=config.node.name,
        heartbeat_interval_s=config.node.heartbeat_interval.total_seconds(),
        availability_class=config.node.availability_class,
        vouch_ttl_ms=ms(config.node.vouch_ttl) if config.node.vouch_ttl else None,
        freshness=FreshnessWindow(
            max_clock_skew_ahead_ms=ms(p.clock_skew_ahead),
            max_age_live_ms=ms(p.live_max_age),
            max_age_mailbox_ms=ms(p.mailbox_max_age),
        ),
        max_inbound_chars=p.max_inbound_chars,
        dedup_entries=p.dedup_entries,
        emit_limit=config.events.emit_limit,
        emit_window_ms=ms(config.events.emit_window),
        drain_interval_s=config.inbox.drain_interval.total_seconds(),
        agent_start_warn_s=config.node.agent_start_warn.total_seconds(),
        agent_start_timeout_s=config.node.agent_start_timeout.total_seconds(),
        agent_max_concurrency=config.node.agent_max_concurrency,
        loop_block_threshold_s=config.node.loop_block_threshold.total_seconds(),
        registrations_at_once=config.node.host_concurrency,
    )


def scan_plugins(config: Config, *, strict: bool | None = None) -> tuple[PluginManager, AgentCatalog]:
    """Load every installed plugin afresh (entry points re-read: a distribution
    pip-installed since the last scan is found; see :func:`meshnode.plugins.rescan`)."""
    return load_plugins(
        strict=config.node.strict_plugins if strict is None else strict,
        builtins=[("meshnode.builtin", BuiltinAgents())],
        extra_modules=config.node.plugin_modules,
    )


def rescan_catalog(config: Config, running: AgentCatalog) -> tuple[AgentCatalog, dict[str, str]]:
    """The plugins installed now (entry points re-read), merged over the running
    catalog: a kind already loaded keeps its class (its module is imported and
    agents run it). Returns the catalog and, for each kind whose distribution
    changed version since, ``"old -> new"``."""
    rescan_installed()
    _, fresh = scan_plugins(config, strict=False)
    merged = AgentCatalog(
        kinds={**fresh.kinds, **running.kinds},
        origins={**fresh.origins, **running.origins},
        failures={k: v for k, v in fresh.failures.items() if k not in running.kinds},
        versions={**fresh.versions, **{k: v for k, v in running.versions.items() if k in running.kinds}},
    )
    upgraded = {
        kind: f"{running.versions[kind]} -> {fresh.versions[kind]} installed"
        for kind in running.kinds
        if kind in running.versions and kind in fresh.versions and running.versions[kind] != fresh.versions[kind]
    }
    return merged, upgraded


def load_plugin_catalog(config: Config, failed: dict[str, str]) -> tuple[PluginManager, AgentCatalog]:
    """The ``plugins`` stage: load every plugin and check each ``[agents.<name>]``
    table against it (:mod:`meshnode.daemon.plugin_check`). An agent whose kind
    no plugin provides, or whose settings its plugin refuses, is recorded in
    ``failed`` and not hosted; with ``strict_plugins`` the problems raise as a
    :class:`~meshnode.config.ConfigError` (the daemon exits 78)."""
    manager, catalog = scan_plugins(config)
    found = agent_problems(config, catalog)
    if config.node.strict_plugins:
        raise_if_problems(config, found)
    for name, problems in found.items():
        failed[name] = "; ".join(f"{p.key}: {p.message}" for p in problems)
        log.error("agent %s not hosted:\n%s", name, "\n".join(str(p) for p in problems))
    return manager, catalog


@dataclass
class AgentHost:
    """The keys of everything the node hosts, and the agents it runs.

    ``agent_keys`` holds ``name -> key`` for the hosted agents and, on a
    service node, ``service.<name> -> key`` for the platform services.
    """

    keystore: KeyStore
    node_key: KeyPair
    agent_keys: dict[str, KeyPair] = field(default_factory=dict)
    failed_agents: dict[str, str] = field(default_factory=dict)
    catalog: AgentCatalog = field(default_factory=AgentCatalog)
    node: Node | None = None
    #: How configuration problems name the file (:func:`plugin_check.config_file_label`).
    config_file: str = "(built-in defaults)"
    #: Agents an :meth:`add_many` under way is adding (a second add of one is refused).
    adding: set[str] = field(default_factory=set)
    #: Agents ``agents remove`` stopped whose tables the file still has: a reload
    #: leaves them removed (it applies what changed in the file) until they are
    #: added again or their table changes.
    removed_by_hand: set[str] = field(default_factory=set)

    @classmethod
    async def open(cls, config: Config, keystore: KeyStore, *, runs_services: bool, embedded: bool) -> AgentHost:
        """The ``keys`` stage: the node key, every enabled agent's key and, on a
        service node, the services' keys."""
        store = keystore
        node_key = await asyncio.to_thread(store.get_or_create, "node")
        host = cls(keystore=store, node_key=node_key, config_file=config_file_label(config))
        names = [CLI_AGENT_NAME, *(n for n, a in config.agents.items() if a.enabled)]
        if config.a2a.listen is not None:
            names.append(BRIDGE_AGENT_NAME)  # config refuses [agents.a2a-bridge] then
        # One worker-thread hop for the whole roster, not one per agent.
        keys = await asyncio.to_thread(get_or_create_all, store, [f"agent.{name}" for name in names])
        host.agent_keys.update(zip(names, keys, strict=True))
        if runs_services:
            key_dir = config.services.key_dir
            if key_dir is not None:
                # Shared with the mesh's other service nodes: callers pin these keys.
                shared = await asyncio.to_thread(load_service_keys, key_dir)
                for name, key in shared.items():
                    host.agent_keys[f"service.{name}"] = key
            else:
                if not embedded:
                    log.warning(
                        "[services] run = true without [services] key_dir: this node's services "
                        "sign with keys of their own, so a second service node on this mesh "
                        "would be refused by callers that pinned these (set key_dir on each)"
                    )
                for name in SERVICE_NAMES:
                    host.agent_keys[f"service.{name}"] = await asyncio.to_thread(
                        store.get_or_create, f"service.{name}"
                    )
        log.info("keys held by %s", store.describe())
        return host

    def roster(self) -> list[KeyPair]:
        """The keys the node credential covers: hosted agents, not services."""
        return [k for n, k in self.agent_keys.items() if not n.startswith("service.")]

    def service_key(self, name: str) -> KeyPair:
        return self.agent_keys[f"service.{name}"]

    def running(self) -> Node:
        if self.node is None:
            raise NotFound("the node is not running")
        return self.node

    async def host(
        self,
        name: str,
        kind: str,
        settings: dict[str, Any],
        interaction: str | None,
        *,
        strict: bool,
        max_concurrency: int | None = None,
    ) -> None:
        """Start one agent; a failure is recorded, not raised (unless ``strict``).

        ``max_concurrency`` is ``[agents.<name>] max_concurrency`` (None: the node's default)."""
        node = self.running()
        agent_class = self.catalog.kinds.get(kind)
        key = self.agent_keys[name]
        if agent_class is None:
            self.failed_agents[name] = unknown_kind_message(kind, self.catalog)
            node.absent_agents[key.public_key] = name
            return
        problems = settings_error(self.config_file, name, agent_class, settings)
        if problems:
            # Worded like every config error (file, key, expectation), not pydantic's dump.
            self.failed_agents[name] = "; ".join(f"{p.key}: {p.message}" for p in problems)
            node.absent_agents[key.public_key] = name
            log.error("agent %s (%s) not hosted:\n%s", name, kind, "\n".join(str(p) for p in problems))
            if strict:
                raise ConfigError(problems)
            return
        node.absent_agents.pop(key.public_key, None)
        try:
            await node.host(
                name=name,
                kind=kind,
                agent_class=agent_class,
                settings=settings,
                key=key,
                interaction=interaction,
                max_concurrency=max_concurrency,
            )
        except Exception as exc:  # one agent failing never takes the node down
            self.failed_agents[name] = f"{type(exc).__name__}: {exc}"
            node.absent_agents[self.agent_keys[name].public_key] = name
            # With its traceback (a plugin bug is found from the log), except a
            # timeout, whose traceback is only the supervisor's.
            log.error(
                "agent %s (%s) failed to start: %s", name, kind, exc,
                exc_info=None if isinstance(exc, StartTimeout) else exc,
            )
            if strict:
                raise

    async def host_roster(self, config: Config) -> None:
        """The built-in identities, then every enabled agent of the configuration."""
        strict = config.node.strict_plugins
        await self.host(CLI_AGENT_NAME, "builtin:cli", {}, None, strict=strict)
        if config.a2a.listen is not None:
            await self.host(BRIDGE_AGENT_NAME, "builtin:a2a-bridge", {}, None, strict=strict)
        # Agents start side by side, a bounded number at a time: each start is
        # mostly waiting (the registry's answer, the mailbox stream it creates),
        # so one after another made a 1,000-agent node take minutes to register
        # ([node] host_concurrency; the registry bounds its side by its own setting).
        gate = asyncio.Semaphore(config.node.host_concurrency)

        async def host_one(name: str, agent_cfg: AgentConfig) -> None:
            async with gate:
                await self.host(
                    name, agent_cfg.plugin, agent_cfg.settings, agent_cfg.interaction,
                    strict=strict, max_concurrency=agent_cfg.max_concurrency,
                )

        await asyncio.gather(*(
            host_one(name, agent_cfg)
            for name, agent_cfg in config.agents.items()
            if agent_cfg.enabled and name not in self.failed_agents
        ))
        await self.deregister_stale(config)

    async def deregister_stale(self, config: Config) -> list[str]:
        """Deregister the agents whose keys this node holds but that the
        configuration no longer hosts (removed, disabled, or added at runtime
        without ``--save``); their names. An agent that is configured but failed
        to start keeps its registration (and its broker buffer): it is meant to
        come back. Best effort: a registry that does not answer is logged."""
        node = self.running()
        hosted = {CLI_AGENT_NAME, BRIDGE_AGENT_NAME, *node.agents,
                  *(n for n, a in config.agents.items() if a.enabled)}
        names = await asyncio.to_thread(self.keystore.names)
        stale = [n.removeprefix("agent.") for n in names
                 if n.startswith("agent.") and n.removeprefix("agent.") not in hosted]
        gone: list[str] = []
        for name in stale:
            key = await asyncio.to_thread(self.keystore.get, f"agent.{name}")
            if key is None:
                continue
            try:
                if await node.deregister_stale(name, key):
                    gone.append(name)
            except Exception as exc:
                log.info("could not deregister %s, no longer hosted here: %s", name, exc)
        return gone

    async def stop_all(self) -> None:
        """The ``stop-agents`` stage: let handlers finish and call ``on_stop``,
        while the connection is still up."""
        if self.node is None:
            return
        await self.node.stop_jobs()
        for name in list(self.node.agents):
            await self.node.unhost(name, grace=3.0)

    async def stop_intake(self) -> None:
        """Say offline, then unsubscribe every agent's inboxes (part of ``stop-intake``)."""
        if self.node is None:
            return
        await self.node.say_offline()
        for hosted in self.node.agents.values():
            for sub in list(hosted.subscriptions):
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
            hosted.subscriptions.clear()

    # -- at runtime ------------------------------------------------------------

    async def add(
        self, config: Config, name: str, table: dict[str, Any], refresh: Callable[[], Awaitable[None]]
    ) -> dict[str, Any]:
        """Host a new agent now: key, re-issued credential (``refresh``), register."""
        outcome = (await self.add_many(config, {name: table}, refresh))[name]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def add_many(
        self, config: Config, tables: dict[str, dict[str, Any]], refresh: Callable[[], Awaitable[None]]
    ) -> dict[str, dict[str, Any] | Exception]:
        """Host new agents now, with one re-issued credential for them all.

        Each agent is checked (name, table, plugin) and given its key; then
        ``refresh`` runs once for those that got this far, and they start side
        by side, ``[node] host_concurrency`` at a time, as at start-up. Returns
        each name's status, or the admin error saying why it is not hosted
        (one agent failing fails alone). Why one refresh: on a joined node each
        is a control-plane request under its per-node rate limit and a
        reconnect; a reload adding 20 agents asked 20 times.
        """
        node = self.running()
        outcome: dict[str, dict[str, Any] | Exception] = {}
        wanted: dict[str, AgentConfig] = {}
        for name, table in tables.items():
            try:
                wanted[name] = self._checked_table(node, name, table)
            except InvalidParameter as exc:
                outcome[name] = exc
        marked = set(wanted)
        self.adding.update(marked)
        try:
            await self._add_checked(config, node, wanted, outcome, refresh)
        finally:
            self.adding.difference_update(marked)
        return outcome

    async def _add_checked(
        self,
        config: Config,
        node: Node,
        wanted: dict[str, AgentConfig],
        outcome: dict[str, dict[str, Any] | Exception],
        refresh: Callable[[], Awaitable[None]],
    ) -> None:
        if any(cfg.plugin not in self.catalog.kinds for cfg in wanted.values()):
            # Installed since the last scan? (pip install, then agents add)
            self.catalog, _ = await asyncio.to_thread(rescan_catalog, config, self.catalog)
        for name, cfg in list(wanted.items()):
            if cfg.plugin not in self.catalog.kinds:
                outcome[name] = InvalidParameter(f"[agents.{name}] plugin: {unknown_kind_message(cfg.plugin, self.catalog)}")
                del wanted[name]
        # One worker-thread hop for all the keys; a bad key file fails its agent alone.
        for name, key in (await asyncio.to_thread(self._keys_each, list(wanted))).items():
            if isinstance(key, KeyStoreError):
                # The message names the key file and the fix (a chmod, a bad seed).
                outcome[name] = Conflict(f"agent {name}: {key}", {"key": f"agent.{name}"})
                del wanted[name]
            else:
                self.agent_keys[name] = key
                self.failed_agents.pop(name, None)
        if not wanted:
            return
        try:
            await refresh()
        except BaseException as exc:
            # Not hosted: the next credential stops covering them.
            for name in wanted:
                self.agent_keys.pop(name, None)
            if not isinstance(exc, Exception):
                raise
            for name in wanted:
                outcome[name] = (
                    NotReady(f"agent {name} not hosted: {exc}; try again")
                    if isinstance(exc, ConnectionError | CredentialUnavailable) else exc
                )
            return
        gate = asyncio.Semaphore(config.node.host_concurrency)

        async def host_one(name: str, agent_cfg: AgentConfig) -> None:
            async with gate:
                try:
                    await self.host(
                        name, agent_cfg.plugin, agent_cfg.settings, agent_cfg.interaction,
                        strict=config.node.strict_plugins, max_concurrency=agent_cfg.max_concurrency,
                    )
                except Exception as exc:  # strict_plugins: raised to this agent's caller
                    outcome[name] = exc
                    return
            if name in self.failed_agents:
                outcome[name] = InvalidParameter(f"agent {name} failed to start: {self.failed_agents.pop(name)}")
            else:
                self.removed_by_hand.discard(name)
                outcome[name] = node.agent_status(node.agents[name])

        await asyncio.gather(*(host_one(name, agent_cfg) for name, agent_cfg in wanted.items()))

    def _checked_table(self, node: Node, name: str, table: dict[str, Any]) -> AgentConfig:
        """``[agents.<name>]`` of an agent to add, checked as the admin API refuses it."""
        if name in node.agents or name in (CLI_AGENT_NAME, BRIDGE_AGENT_NAME):
            raise InvalidParameter(f"an agent named {name!r} is already hosted")
        if name in self.adding:
            raise InvalidParameter(f"an agent named {name!r} is being added")
        if not _AGENT_NAME.fullmatch(name):
            raise InvalidParameter("agent names match [a-z0-9][a-z0-9_-]{0,63}")
        try:
            return AgentConfig.model_validate({"plugin": name, **table})
        except ValueError as exc:
            raise InvalidParameter(f"[agents.{name}]: {exc}") from None

    def _keys_each(self, names: list[str]) -> dict[str, KeyPair | KeyStoreError]:
        keys: dict[str, KeyPair | KeyStoreError] = {}
        for name in names:
            try:
                keys[name] = self.keystore.get_or_create(f"agent.{name}")
            except KeyStoreError as exc:
                keys[name] = exc
        return keys

    async def remove(self, name: str, *, deregister: bool) -> None:
        """Stop an agent (deregistering it: its broker buffer goes too)."""
        node = self.running()
        if name in (CLI_AGENT_NAME, BRIDGE_AGENT_NAME) or name not in node.agents:
            raise NotFound(f"no hosted agent named {name!r}")
        hosted_id = node.agents[name].agent_id
        await node.unhost(name, deregister=deregister)
        self.agent_keys.pop(name, None)
        if deregister:
            node.absent_agents.pop(hosted_id, None)
        else:
            # Registration and buffer kept, nothing answering: shown offline.
            node.absent_agents[hosted_id] = name

    async def restart(self, config: Config, name: str, agent_cfg: AgentConfig | None = None) -> dict[str, Any]:
        """Stop and start one agent with its key kept (and its registration, inbox)."""
        node = self.running()
        hosted = node.agents.get(name)
        if hosted is None:
            raise NotFound(f"no hosted agent named {name!r}")
        cfg = agent_cfg or config.agents.get(name)
        kind = cfg.plugin if cfg is not None else hosted.kind
        settings = cfg.settings if cfg is not None else {}
        interaction = cfg.interaction if cfg is not None else hosted.interaction
        limit = cfg.max_concurrency if cfg is not None else None
        await node.unhost(name, deregister=False)
        self.failed_agents.pop(name, None)
        await self.host(name, kind, settings, interaction, strict=config.node.strict_plugins, max_concurrency=limit)
        if name in self.failed_agents:
            raise InvalidParameter(f"agent {name} failed to start: {self.failed_agents[name]}")
        return node.agent_status(node.agents[name])

    async def revouch_all(self) -> dict[str, Any]:
        """Re-vouch and re-register every agent; their new vouch expiries by name."""
        node = self.running()
        await node.each_agent(node.revouch)
        return {hosted.name: hosted.vouch.get("expires_at") for hosted in node.agents.values()}
