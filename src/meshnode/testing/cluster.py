"""A whole mesh on one host: a 3-server NATS cluster, its control plane, and node provisioning.

:class:`LocalCluster` is what ``scripts/cluster.py`` runs for demos and what
the cluster fault tests run against: a :class:`~meshnode.transport.cluster.NatsCluster`
(operator/JWT mode, routed, JetStream R3-capable), a credential control plane
over it, the platform services' shared signing keys, and
:meth:`LocalCluster.provision`, which enrols a node and prepares its data
directory the way ``meshnode join`` does, returning the configuration tables
for ``meshnode run``.

Layout under ``root``::

    cluster.json          ports of the NATS members (kept across restarts)
    control-port          the control plane's port (likewise kept)
    mesh/                 operator and account seeds (0600)
    n1/ n2/ n3/           each member's config, log and JetStream store
    control/              the control plane's enrolment state
    service-keys/         the services' shared signing keys (<name>.nk)
    service-nodes.json    node ids that get the service role
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshnode.daemon.credentials import store_credential
from meshnode.keystore import FileKeyStore
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.identity import load_service_keys
from meshnode.transport.cluster import NatsCluster
from meshnode.transport.control_plane import ControlPlaneServer
from meshnode.transport.permissions import Role

__all__ = ["LocalCluster"]

_SERVICE_NODES = "service-nodes.json"


class LocalCluster:
    """A NATS cluster plus control plane on loopback, with node provisioning."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        size: int = 3,
        host: str = "127.0.0.1",
        control_port: int = 0,
        client_ports: list[int] | None = None,
        route_ports: list[int] | None = None,
        credential_ttl_s: int = 86400,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        mesh_name: str = "meshnode-cluster",
    ) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.nats = NatsCluster(
            self.root,
            size=size,
            host=host,
            client_ports=client_ports,
            route_ports=route_ports,
            restart_backoff_s=restart_backoff_s,
        )
        control_port = self._control_port(control_port)
        self.service_key_dir = self.root / "service-keys"
        load_service_keys(self.service_key_dir, create=True)
        self.control = ControlPlaneServer(
            self.nats,
            self.root / "control",
            host=host,
            port=control_port,
            credential_ttl_s=credential_ttl_s,
            mesh_name=mesh_name,
            role_of=self._role_of,
        )

    def _control_port(self, asked: int) -> int:
        # 0 lets the first start pick a free port (read back from the socket and
        # recorded by start()); like the NATS ports it is then kept, so the node
        # configurations written on the first run stay valid on the next.
        if asked == 0:
            try:
                return int((self.root / "control-port").read_text(encoding="ascii").strip())
            except (OSError, ValueError):
                return 0
        return asked

    # -- roles --

    def _service_nodes(self) -> set[str]:
        try:
            data = json.loads((self.root / _SERVICE_NODES).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return set()
        return {str(n) for n in data} if isinstance(data, list) else set()

    def _role_of(self, node_id: str) -> Role:
        # Read on every renewal, so a node marked as a service node by another
        # process (this script run again) gets the role at its next renewal.
        return "service" if node_id in self._service_nodes() else "participant"

    # -- lifecycle --

    @property
    def urls(self) -> list[str]:
        return self.nats.urls

    @property
    def control_url(self) -> str:
        return self.control.url

    async def start(self) -> None:
        await self.nats.start()
        try:
            await self.control.start()
        except BaseException:
            await self.nats.stop()
            raise
        (self.root / "control-port").write_text(f"{self.control.port}\n", encoding="ascii")

    async def stop(self) -> None:
        try:
            await self.control.stop()
        finally:
            await self.nats.stop()

    # -- nodes --

    def provision(
        self,
        name: str,
        workdir: str | os.PathLike[str],
        *,
        service: bool = False,
        agents: dict[str, dict[str, Any]] | None = None,
        node: dict[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Enrol node ``name``, prepare ``workdir/data`` as ``meshnode join`` would, and
        return its configuration tables (``[node]``, ``[mesh]``, ``[services]``,
        ``[admin]``, ``[keystore]``, ``[agents.*]``).

        A service node gets the service role at its first renewal (start-up)
        and the shared service keys; every node gets all the members' URLs.
        """
        work = Path(workdir).absolute()
        data_dir = work / "data"
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        bundle = self.control.invite(name)
        if service:
            ids = sorted(self._service_nodes() | {bundle.node_id})
            (self.root / _SERVICE_NODES).write_text(json.dumps(ids) + "\n", encoding="utf-8")
        FileKeyStore(data_dir).import_key("node", KeyPair.from_seed(bundle.node_seed))
        store_credential(data_dir, bundle.jwt, [])
        tables: dict[str, dict[str, Any]] = {
            "node": {"name": name, "data_dir": str(data_dir), **(node or {})},
            "mesh": {"servers": self.urls, "control_plane": self.control_url},
            "services": {"run": service},
            "admin": {"socket": str(work / "admin.sock")},
            "keystore": {"backend": "file"},
        }
        if service:
            tables["services"]["key_dir"] = str(self.service_key_dir)
        for agent_name, table in (agents or {}).items():
            tables[f"agents.{agent_name}"] = dict(table)
        return tables
