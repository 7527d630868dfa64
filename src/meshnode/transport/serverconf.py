"""The nats-server config of the embedded mesh, and the ports it reports back."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from .errors import EmbeddedMeshError

__all__ = ["BoundPorts", "ClusterRoutes", "TlsFiles", "is_loopback_host", "render_server_config", "url_host"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A PEM certificate (chain) and its private key: TLS on a listener."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class ClusterRoutes:
    """Where one cluster member listens for routes, and the routes it dials.

    ``routes`` are ``nats-route://host:port`` URLs of the other members (a
    member may list itself too; nats-server ignores a route to itself).
    ``port=0`` lets the server pick a free route port; the bound one is then
    read back (:attr:`EmbeddedNatsServer.cluster_port`) and kept across restarts.
    """

    name: str
    host: str
    port: int
    routes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BoundPorts:
    """The ports a running nats-server actually listens on, as it reported them.

    Read from the ``<executable>_<pid>.ports`` file nats-server writes into its
    ``ports_file_dir`` once every listener is up, so a port configured as 0
    ("any free port") is known without binding and releasing one beforehand
    (which races with every other process picking ports). nats-server does not
    list leafnode listeners there; meshnode configures none.
    """

    client: int
    monitoring: int | None = None
    cluster: int | None = None
    websocket: int | None = None


def _listen_port(port: int | None) -> int:
    """nats-server's spelling of a configured port: -1 is "any free port" (its
    0 means "the default port", 4222 for clients, which is not what 0 means here)."""
    return port or -1


def _conf_string(value: str) -> str:
    if any(c in value for c in '"\\\n\r'):
        raise EmbeddedMeshError(f"cannot place {value!r} in a nats-server config")
    return f'"{value}"'


def render_server_config(
    *,
    server_name: str,
    host: str,
    port: int | None,
    monitor_port: int | None,
    max_payload: int,
    max_control_line: int,
    operator_jwt: str,
    system_account: str,
    account_jwts: dict[str, str],
    store_dir: Path,
    ports_file_dir: Path,
    cluster: ClusterRoutes | None = None,
    websocket_port: int | None = None,
    max_file_store: int | None = None,
    tls: TlsFiles | None = None,
) -> str:
    """The nats-server config of an operator-mode server with a memory resolver.

    ``port`` 0 or None (and ``monitor_port=0``, ``cluster.port=0``) lets the
    server pick a free port; the chosen ports are then read from the ports
    file it writes into ``ports_file_dir`` (:class:`BoundPorts`).
    ``monitor_port=None`` serves no monitoring; ``websocket_port`` likewise
    (None: no WebSocket listener, 0: a free port) for nats.ws clients.
    ``cluster`` makes the server one member of a routed cluster (JetStream
    clustered: ``server_name`` must then be unique among the members).
    ``max_file_store`` caps the server's JetStream file store (bytes; None is
    nats-server's default, most of the disk). nats-server enforces it against
    the sum of the streams' ``max_bytes`` reservations as well as what is stored.
    ``tls`` makes the client listener require TLS (nats-server's ``tls {}``
    block; clients then connect with ``tls://``).
    """
    preload = "\n".join(
        f"  {_conf_string(account)}: {_conf_string(jwt)}" for account, jwt in account_jwts.items()
    )
    lines = [
        "# Written by meshnode on every start; edits are overwritten.",
        f"server_name: {_conf_string(server_name)}",
        f"host: {_conf_string(host)}",
        f"port: {_listen_port(port)}",
        f"max_payload: {max_payload}",
        f"max_control_line: {max_control_line}",
        f"ports_file_dir: {_conf_string(str(ports_file_dir))}",
        f"operator: {_conf_string(operator_jwt)}",
        f"system_account: {_conf_string(system_account)}",
        "resolver: MEMORY",
        "resolver_preload: {",
        preload,
        "}",
        "jetstream {",
        f"  store_dir: {_conf_string(str(store_dir))}",
        *([f"  max_file_store: {int(max_file_store)}"] if max_file_store is not None else []),
        "}",
    ]
    if cluster is not None:
        lines += [
            "cluster {",
            f"  name: {_conf_string(cluster.name)}",
            f"  listen: {_conf_string(f'{cluster.host}:{_listen_port(cluster.port)}')}",
            "  routes: [",
            *(f"    {_conf_string(route)}" for route in cluster.routes),
            "  ]",
            "}",
        ]
    if tls is not None:
        lines += [
            "tls {",
            f"  cert_file: {_conf_string(str(tls.cert))}",
            f"  key_file: {_conf_string(str(tls.key))}",
            "  timeout: 5",
            "}",
        ]
    if websocket_port is not None:
        # Same host as the client port and the same JWT authentication (operator
        # mode applies to every client listener). With the mesh's TLS files the
        # listener is wss://, else plain ws:// (nats-server demands TLS on a
        # WebSocket listener unless told no_tls): the embedded mesh listens on
        # loopback by default (docs/operations/foreign-mesh.md).
        lines += ["websocket {", f"  host: {_conf_string(host)}", f"  port: {_listen_port(websocket_port)}"]
        if tls is not None:
            lines += [
                "  tls {",
                f"    cert_file: {_conf_string(str(tls.cert))}",
                f"    key_file: {_conf_string(str(tls.key))}",
                "  }",
            ]
        else:
            lines.append("  no_tls: true")
        lines.append("}")
    if monitor_port is not None:
        lines.insert(6, f"http: {_conf_string(f'{host}:{_listen_port(monitor_port)}')}")
    return "\n".join(lines) + "\n"


def url_host(host: str) -> str:
    """``host`` as a URL's authority wants it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1): only
    this machine can dial a listener there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
