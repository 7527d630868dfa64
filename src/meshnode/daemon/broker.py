"""Which liveness checks and remedy the daemon's broker watch uses (issue #23 item 11).

The watch itself lives in :mod:`meshnode.transport.liveness`; this picks its
probes and remedy from the mesh mode: the embedded mesh probes the
nats-server process as well as the connection and restarts a frozen server;
a joined node can only fail over to another server of ``[mesh] servers``.
"""

from __future__ import annotations

from meshnode.config.sections import MeshConfig
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.liveness import BrokerWatch, Probe

__all__ = ["broker_watch"]


def broker_watch(config: MeshConfig, connection: MeshConnection, embedded: EmbeddedNatsServer | None) -> BrokerWatch:
    """The watch for this node's broker, configured by ``[mesh] broker_check_*``."""
    probes: list[tuple[str, Probe]] = []
    if embedded is not None:
        # The process first: it answers even while our connection is between
        # attempts, and it is what a restart would fix.
        probes.append(("nats-server process", embedded.probe))
    probes.append(("ping on the connection", connection.ping))
    return BrokerWatch(
        probes,
        interval_s=config.broker_check_interval.total_seconds(),
        timeout_s=config.broker_check_timeout.total_seconds(),
        restart_after_s=config.broker_restart_after.total_seconds(),
        remedy=embedded.kill_unresponsive if embedded is not None else connection.fail_over,
        describe="restarting the embedded nats-server" if embedded is not None else "failing over to another server",
    )
