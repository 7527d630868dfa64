"""The A2A gateways of a node (off unless configured): the inbound bridge that
serves hosted agents over HTTP (``[a2a] listen``) and the outbound bridge that
lets agents call external A2A peers (``[a2a.peers]``, issue #8).

Both need the optional ``a2a-sdk`` (``meshnode[a2a]``); without it the daemon
still runs, and only a configuration that asks for a gateway fails, saying what
to install.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.a2a.charges import Charge, ChargeStore, charge_event
from meshnode.config import Config
from meshnode.config.a2a import listen_fd
from meshnode.daemon.lifecycle import Shutdown
from meshnode.node.builtin import BRIDGE_AGENT_NAME
from meshnode.node.meter_outbox import MeterOutbox, meter_envelope
from meshnode.node.runtime import Node
from meshnode.protocol.a2a_extension import IssuerTrust, parse_verify_key
from meshnode.protocol.nkeys import KeyPair

if TYPE_CHECKING:
    from meshnode.a2a.outbound import A2AOutbound
    from meshnode.a2a.server import A2ABridge

# The bridges are imported only when configured: the SDK is an optional extra,
# and importing it (a2a-sdk, protobuf, starlette, uvicorn, httpx) cost every
# `meshnode run` without A2A ~0.2 s of its start (issue #21's 1,000-agent figure
# includes the start).

__all__ = ["A2AGateways"]

log = logging.getLogger("meshnode.a2a")


class A2AGateways:
    """The node's A2A bridges and the charges its outbound calls recorded."""

    def __init__(self) -> None:
        self.bridge: A2ABridge | None = None
        self.outbound: A2AOutbound | None = None
        self.charges: ChargeStore | None = None

    async def open_outbound(self, config: Config, data_dir: Path, node_key: KeyPair, shutdown: Shutdown) -> None:
        """The outbound bridge, when ``[a2a.peers]`` names any peer; before the node
        is built, which is handed it."""
        cfg = config.a2a
        if not cfg.peers:
            return
        try:
            from meshnode.a2a.outbound import A2AOutbound
        except ImportError as exc:  # pragma: no cover - the test environment installs the extra
            raise RuntimeError(f"[a2a.peers] needs the a2a-sdk: install meshnode[a2a] ({exc})") from None
        charges = ChargeStore(data_dir / "a2a-charges.sqlite3")
        self.charges = charges
        shutdown.push("final-write", charges.close)
        await charges.open()
        self.outbound = A2AOutbound.from_config(
            cfg, default_application=config.node.name, charges=charges, node_key=node_key
        )

    def publish_charges(self, node: Node, outbox: MeterOutbox) -> None:
        """Put every new A2A charge in the mesh's ledger (§19.6): queued on the
        node's meter ``outbox`` (off the call's path) and published as
        ``mesh.event.metering.a2a_charge``, signed by the calling agent, its
        owner the node (the default owner of its agents, §8.3). The charge's
        row is marked published once JetStream acked it: what a stop, a crash
        or a full outbox left is sent by :meth:`republish_charges`."""
        outbound, charges = self.outbound, self.charges
        if outbound is None or charges is None:
            return

        async def on_charge(charge: Charge) -> None:
            hosted = node.by_id.get(charge.agent)
            if hosted is None:
                raise RuntimeError(f"the calling agent {charge.agent} is not hosted here any more")

            async def acked() -> None:
                await charges.mark_published(charge.peer, charge.task_key)

            env = meter_envelope(hosted, charge_event(charge, node.node_id), "a2a_charge")
            if not outbox.put(hosted, env, "a2a_charge", acked=acked):
                raise RuntimeError("the meter outbox is full or stopped; it goes out after the next start")

        outbound.on_charge = on_charge

    async def republish_charges(self, node: Node) -> int:
        """Queue the charges whose ledger event no run published (a stop, a
        crash, a full outbox); after the agents are hosted, whose keys sign
        them. The ledger charges a ``(peer, task_key)`` once, so one that did
        go out before a crash is harmless. Returns how many were queued."""
        outbound, charges = self.outbound, self.charges
        if outbound is None or charges is None or outbound.on_charge is None:
            return 0
        queued, refused = 0, 0
        for charge in await charges.unpublished():
            try:
                await outbound.on_charge(charge)
            except Exception as exc:  # its agent gone, the outbox full: the row stays unpublished
                refused += 1
                if refused == 1:
                    log.warning("A2A charge %s/%s of an earlier run cannot be published now: %s",
                                charge.peer, charge.task_key, exc)
            else:
                queued += 1
        if queued or refused:
            log.info("%d A2A charge(s) of an earlier run were not acked by JetStream: %d queued for the ledger, "
                     "%d left for a later start", queued + refused, queued, refused)
        return queued

    async def start_bridge(
        self, config: Config, node: Node, failed_agents: dict[str, str], data_dir: Path, shutdown: Shutdown
    ) -> None:
        """The ``a2a`` stage: the inbound bridge, when ``[a2a] listen`` is set."""
        a2a = config.a2a
        if a2a.listen is None:
            return
        bridge_agent = node.agents.get(BRIDGE_AGENT_NAME)
        if bridge_agent is None:
            raise RuntimeError(
                f"[a2a]: the bridge identity did not start: {failed_agents.get(BRIDGE_AGENT_NAME)}"
            )
        try:
            from meshnode.a2a.server import A2ABridge, BridgeSettings
        except ImportError as exc:  # pragma: no cover - the test environment installs the extra
            raise RuntimeError(
                f"[a2a] listen is set but the A2A dependencies are missing ({exc}): install meshnode[a2a]"
            ) from None
        fd = listen_fd(a2a.listen)
        # "fd://N": host and port are the inherited socket's, read when it is adopted.
        host, _, port = ("", "", "0") if fd is not None else a2a.listen.rpartition(":")
        trust = IssuerTrust(
            {name: parse_verify_key(issuer.key) for name, issuer in a2a.issuers.items()},
            allow=a2a.allow_issuers,
        )
        settings = BridgeSettings(
            host=host,
            port=int(port),
            listen_fd=fd,
            application=a2a.application or config.node.name,
            expose=tuple(a2a.expose),
            public_url=a2a.public_url,
            max_mesh_hops=a2a.max_mesh_hops,
            idempotency_retention_s=a2a.idempotency_retention.total_seconds(),
            send_wait_s=a2a.send_wait.total_seconds(),
            task_timeout_s=a2a.task_timeout.total_seconds(),
            clock_skew_s=a2a.clock_skew.total_seconds(),
            trust=trust,
        )
        bridge = A2ABridge(node=node, bridge=bridge_agent, settings=settings, data_dir=data_dir)
        self.bridge = bridge
        # Intake stops first; its store closes with the other final writes.
        shutdown.push("stop-intake", bridge.stop_intake)
        shutdown.push("final-write", bridge.close)
        await bridge.start()

    def status(self) -> dict[str, Any] | None:
        return self.bridge.status() if self.bridge is not None else None
