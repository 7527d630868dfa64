"""The ``Allowance.*`` admin methods (EXT-8): set, add, show, clear and decline owner allowances.

The owner key is this node's key (read from the keystore at start), as for
``Agreements.Sign``: the node is the default owner of every agent it hosts
(§8.3), so it is who limits what they may spend. ``Allowance.Set`` builds and
signs the document here; the CLI never sees the key. ``Allowance.Add``
installs a document someone signed elsewhere (another owner key): verified
like a configured file, refused naming the member or the reason, stored like
``Set``'s. Which signers are accepted is :mod:`meshnode.node.allowance`'s
rule (the agent's owner, unless ``[agents.X] allowance_any_owner``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.admin.methods import param
from meshnode.admin.protocol import InvalidParameter, NotFound
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.config import Config
from meshnode.node.allowance import AllowanceKeeper, SpendStore, describe_refusal
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.hosted import HostedAgent
from meshnode.protocol.allowance import (
    Ceiling,
    CostModel,
    OnExhausted,
    Scope,
    make_allowance,
    verify_allowance,
)
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["allowance_settings", "open_allowances", "register_allowance_methods", "reload_allowances"]

_SCOPES = (("per_task", Scope.TASK), ("per_context", Scope.CONTEXT), ("per_day", Scope.DAY))


def allowance_settings(config: Config) -> tuple[dict[str, Path], set[str]]:
    """``[agents.X] allowance_file`` by agent name, and the names with
    ``allowance_any_owner = true``."""
    configured = {name: Path(a.allowance_file) for name, a in config.agents.items() if a.allowance_file is not None}
    return configured, {name for name, a in config.agents.items() if a.allowance_any_owner}


def open_allowances(config: Config, data_dir: Path, now_ms: Callable[[], int]) -> AllowanceKeeper:
    """The node's allowance keeper: documents in ``<data>/allowances/``, spend in
    ``<data>/allowance.sqlite3``, and each ``[agents.X] allowance_file``."""
    configured, any_owner = allowance_settings(config)
    return AllowanceKeeper(
        data_dir / "allowances", SpendStore(data_dir / "allowance.sqlite3"), configured=configured,
        any_owner=any_owner, now_ms=now_ms,
    )


def reload_allowances(daemon: Daemon, config: Config) -> dict[str, dict[str, Any]]:
    """A reload's part: re-read every agent's allowance under ``config``
    (:meth:`AllowanceKeeper.reload`); ``{agent name: {source, valid, errors}}``."""
    node = daemon.node
    if node is None or node.allowance is None:
        return {}
    configured, any_owner = allowance_settings(config)
    agents = [h for n, h in node.agents.items() if n != CLI_AGENT_NAME]
    return node.allowance.reload(agents, configured=configured, any_owner=any_owner)


def register_allowance_methods(daemon: Daemon, methods: MethodRegistry) -> None:
    """Add the ``Allowance.*`` admin methods (module docstring)."""
    ops = _AllowanceMethods(daemon)
    methods.add(
        "Allowance.Set", ops.set, level="admin",
        doc="params {agent, per_task?, per_context?, per_day?, cost_model?: {per_1k_tokens_micro, currency}, "
        "on_exhausted?} -> the allowance as shown: this node's key (the owner of its agents) signs a new document "
        "(replacing the stored one; the cost model and mode default to the current document's); held work re-checks",
    )
    methods.add(
        "Allowance.Add", ops.add, level="admin",
        doc="params {document} -> the allowance as shown: install an allowance signed elsewhere (its agent is "
        "the document's agent; verified: shape, signature, owner); stored like Allowance.Set's; held work re-checks",
    )
    methods.add(
        "Allowance.Show", ops.show, level="operator",
        doc="params {agent?} -> {owner, allowances: [...]}: each agent's document, spend so far, remaining, held work",
    )
    methods.add(
        "Allowance.Clear", ops.clear, level="admin",
        doc="params {agent} -> {cleared}: remove the stored document (a configured allowance_file stays)",
    )
    methods.add(
        "Allowance.Decline", ops.decline, level="admin",
        doc="params {agent, task_id?} -> {declined: [task ids]}: refuse held work (BUDGET_INSUFFICIENT)",
    )


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _AllowanceMethods:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _keeper(self) -> AllowanceKeeper:
        node = self.d.node
        if node is None or node.allowance is None:
            raise NotFound("the node is not running")
        return node.allowance

    def _agent(self, name: str) -> HostedAgent:
        node = self.d.node
        assert node is not None
        hosted = node.agents.get(name) or node.by_id.get(name)
        if hosted is None or hosted.name == CLI_AGENT_NAME:
            hosted_names = ", ".join(sorted(n for n in node.agents if n != CLI_AGENT_NAME)) or "none"
            raise NotFound(f"no agent {name!r} is hosted here (hosted: {hosted_names})", {"parameter": "agent"})
        return hosted

    def _hosted(self) -> list[HostedAgent]:
        node = self.d.node
        assert node is not None
        return [h for n, h in node.agents.items() if n != CLI_AGENT_NAME]

    async def set(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        keeper = self._keeper()
        hosted = self._agent(param(params, "agent", str))
        current = keeper.policy(hosted)
        ceilings: list[Ceiling] = []
        for name, scope in _SCOPES:
            amount = param(params, name, int, None)
            if amount is None:
                continue
            if amount < 0:
                raise InvalidParameter(f"{name} is a non-negative integer of micro-units", {"parameter": name})
            ceilings.append(Ceiling(scope, amount))
        if not ceilings:
            raise InvalidParameter("give at least one ceiling: per_task, per_context or per_day",
                                   {"parameter": "per_day"})
        raw_model = param(params, "cost_model", dict, None)
        if raw_model is not None:
            rate, currency = raw_model.get("per_1k_tokens_micro"), raw_model.get("currency")
            if type(rate) is not int or rate < 0 or not isinstance(currency, str):
                raise InvalidParameter("cost_model is {per_1k_tokens_micro: non-negative int, currency: ISO 4217}",
                                       {"parameter": "cost_model"})
            model = CostModel(rate, currency)
        elif current is not None and current.cost_model is not None:
            model = current.cost_model
        else:
            raise InvalidParameter("the first allowance of an agent needs a cost model (--cost-model)",
                                   {"parameter": "cost_model"})
        mode = param(params, "on_exhausted", str, None)
        if mode is None:
            mode = current.on_exhausted.value if current is not None else OnExhausted.REFUSE.value
        if mode not in {o.value for o in OnExhausted}:
            raise InvalidParameter("on_exhausted is refuse or ask_owner", {"parameter": "on_exhausted"})
        key = self.d.node_key
        assert key is not None
        try:
            document = make_allowance(key, agent=hosted.agent_id, cost_model=model, ceilings=ceilings,
                                      on_exhausted=mode, updated_at_ms=_now_ms())
            keeper.set(hosted, document)
        except ProtocolError as exc:
            raise InvalidParameter(f"allowance refused: {exc.message}", exc.details) from None
        return keeper.show(hosted)

    async def add(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        keeper = self._keeper()
        document = param(params, "document", dict)
        agent = document.get("agent")
        node = self.d.node
        assert node is not None
        hosted = node.by_id.get(agent) if isinstance(agent, str) else None
        if hosted is None or hosted.name == CLI_AGENT_NAME:
            # A document that does not verify is refused for that (naming the
            # member); only a sound one for an agent not hosted here is NotFound.
            try:
                verify_allowance(document)
            except ProtocolError as exc:
                raise InvalidParameter(f"allowance refused: {describe_refusal(exc)}", exc.details) from None
            hosted_ids = ", ".join(sorted(h.agent_id for n, h in node.agents.items() if n != CLI_AGENT_NAME)) or "none"
            raise NotFound(f"the allowance governs {agent}, which is not hosted here (hosted: {hosted_ids})",
                           {"parameter": "document.agent"})
        try:
            keeper.set(hosted, document)
        except ProtocolError as exc:
            raise InvalidParameter(f"allowance refused: {describe_refusal(exc)}", exc.details) from None
        return keeper.show(hosted)

    async def show(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        keeper = self._keeper()
        name = param(params, "agent", str, None)
        agents = [self._agent(name)] if name is not None else self._hosted()
        key = self.d.node_key
        return {
            "owner": key.public_key if key is not None else None,
            "allowances": [keeper.show(h) for h in agents],
        }

    async def clear(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        keeper = self._keeper()
        hosted = self._agent(param(params, "agent", str))
        cleared = keeper.clear(hosted)
        return {"cleared": cleared, "allowance": keeper.show(hosted)}

    async def decline(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        keeper = self._keeper()
        hosted = self._agent(param(params, "agent", str))
        return {"declined": keeper.decline(hosted, param(params, "task_id", str, None))}
