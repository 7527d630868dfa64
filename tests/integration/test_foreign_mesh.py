"""meshnode as a node on a mesh it did not build (issue #17).

The broker is a plain nats-server in operator/JWT mode whose node credential
is minted the way a foreign operator following spec §14.3's example would:
the shared reply prefix ``_INBOX.>`` (not meshnode's private
``_INBOX_<node>.>``), both registration subjects, discovery but no
``mesh.registry.get.*``, and no JetStream API. The one addition to the example
is publishing on ``mesh.agent.*.inbox``, without which no node can answer a
request at all (§6.5: every respond goes to the requester's inbox).

The registry is meshnode's own, run by a service node on that broker with
``[registry] require_connection_bound = false`` (it accepts both forms, §14.1).
The participant must pick the ``_INBOX`` prefix from its own JWT, register,
answer a request, and make one (resolving its target through discovery).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from meshnode.keystore import FileKeyStore
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.identity import load_service_keys
from meshnode.testing import DaemonProcess, eventually, run_cli
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import format_creds

pytestmark = pytest.mark.integration

T = TypeVar("T")

TTL_S = 3600


class ForeignBroker:
    """A nats-server (operator mode) whose loop runs in a thread, so it keeps
    serving while the synchronous tests drive daemon processes."""

    def __init__(self, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="foreign-nats", daemon=True)
        self.thread.start()
        self.server = EmbeddedNatsServer(root, port=0, server_name="foreign")
        self.run(self.server.start())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def example_permissions(node: str, agents: list[str]) -> tuple[list[str], list[str]]:
    """§14.3's example for a node hosting ``agents``, plus mesh.agent.*.inbox publish."""
    pub = [
        "mesh.registry.register",
        f"mesh.registry.register.{node}",
        "mesh.registry.discover",
        "mesh.presence.get",
        "mesh.event.scraping.>",
        f"mesh.heartbeat.{node}",
        "mesh.task.*.update",
        "mesh.task.*.stream",
        # Not in the example: without it no respond reaches a requester (§6.5).
        "mesh.agent.*.inbox",
    ]
    sub = [
        *(f"mesh.agent.{agent}.inbox" for agent in agents),
        "mesh.event.registry.>",
        "mesh.task.*.update",
        "mesh.task.*.stream",
        "_INBOX.>",
    ]
    return pub, sub


def _daemon(
    root: Path,
    broker: ForeignBroker,
    name: str,
    *,
    agents: dict[str, dict[str, Any]],
    service: bool,
    extra: dict[str, dict[str, Any]] | None = None,
) -> DaemonProcess:
    """A node joined with ``meshnode join FILE --server URL`` on a credential the
    foreign operator minted for it (no control plane: the stored credential is used)."""
    work = root / name
    data_dir = work / "data"
    data_dir.mkdir(mode=0o700, parents=True)
    # The agents' keys first: the foreign operator's credential names their inboxes.
    store = FileKeyStore(data_dir)
    agent_ids = [store.get_or_create(f"agent.{a}").public_key for a in ["cli", *agents]]
    node_key = KeyPair.generate()
    mesh = broker.server
    if service:
        # The foreign operator's service node may do anything in its account.
        jwt = mesh.mint_user(f"svc {name}", node_key.public_key, [">"], [">"], TTL_S)
    else:
        pub, sub = example_permissions(node_key.public_key, agent_ids)
        jwt = mesh.mint_user(f"node {name}", node_key.public_key, pub, sub, TTL_S)
    # What the operator hands over: a plain .creds file (no meshnode comment lines),
    # joined as a person would, naming the mesh's URL by hand.
    creds = work / f"{name}.creds"
    creds.write_text(format_creds(jwt, node_key.seed), encoding="utf-8")
    run_cli("join", str(creds), "--server", mesh.url, "--data-dir", str(data_dir),
            "--config-out", str(work / "joined.toml"))
    config: dict[str, dict[str, Any]] = {
        "node": {"name": name, "data_dir": str(data_dir)},
        "mesh": {"servers": [mesh.url]},
        "services": {"run": service},
        "admin": {"socket": str(work / "admin.sock")},
        "keystore": {"backend": "file"},
        "logging": {"level": "info"},
    }
    if service:
        key_dir = root / "service-keys"
        load_service_keys(key_dir, create=True)
        config["services"]["key_dir"] = str(key_dir)
        config["registry"] = {"require_connection_bound": False}
    for table, values in (extra or {}).items():
        config.setdefault(table, {}).update(values)
    for agent_name, agent_table in agents.items():
        config[f"agents.{agent_name}"] = dict(agent_table)
    return DaemonProcess(work, name, config)


@pytest.fixture(scope="module")
def foreign() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    root = Path(tempfile.mkdtemp(prefix="mnf-", dir="/tmp"))
    broker = ForeignBroker(root / "broker")
    daemons: list[DaemonProcess] = []
    try:
        service = _daemon(root, broker, "svc", agents={"echo_s": {"plugin": "echo"}}, service=True)
        daemons.append(service)
        service.start()
        node = _daemon(root, broker, "elsewhere", agents={"echo": {"plugin": "echo"}}, service=False)
        daemons.append(node)
        node.start()
        yield service, node
    finally:
        for daemon in reversed(daemons):
            try:
                daemon.stop()
            except Exception:
                daemon.kill()
        broker.close()
        shutil.rmtree(root, ignore_errors=True)


def _registered(node: DaemonProcess, name: str) -> bool:
    return any(a["name"] == name and a.get("registered") for a in node.status()["agents"])


def test_the_node_takes_the_shared_reply_prefix_its_credential_grants(
    foreign: tuple[DaemonProcess, DaemonProcess],
) -> None:
    _, node = foreign
    assert node.status()["credential"]["inbox_prefix"] == "_INBOX"
    assert "grants the shared reply prefix _INBOX.>" in node.log_text()


def test_the_node_registers_and_answers_a_request(foreign: tuple[DaemonProcess, DaemonProcess]) -> None:
    service, node = foreign
    eventually(lambda: _registered(node, "echo"), timeout=30, detail=node.log_tail)
    echo = node.agent_id("echo")
    listed = {a["id"] for a in service.admin("Discover", {"limit": 100})["agents"]}
    assert echo in listed
    result = service.call(echo, "echo", {"text": "from the platform"})
    assert result["status"] == "completed", result
    assert result["output"] == {"ok": {"text": "from the platform"}}


def test_the_node_calls_an_agent_it_resolves_through_discovery(
    foreign: tuple[DaemonProcess, DaemonProcess],
) -> None:
    service, node = foreign
    eventually(lambda: _registered(service, "echo_s"), timeout=30, detail=service.log_tail)
    target = service.agent_id("echo_s")
    result = node.call(target, "echo", {"text": "from elsewhere"})
    assert result["status"] == "completed", result
    assert result["output"] == {"ok": {"text": "from elsewhere"}}
