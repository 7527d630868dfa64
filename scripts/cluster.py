#!/usr/bin/env python3
"""Run a whole meshnode mesh on this host: a 3-server NATS cluster (JetStream,
operator/JWT mode, routed on loopback), its credential control plane, and
ready-to-run configurations for 2 service nodes and N participant nodes.

    .venv/bin/python scripts/cluster.py --dir /tmp/mesh-cluster --participants 2

prints the client URLs, the control-plane URL and, per node, the command that
starts it; then serves until Ctrl-C. Run again with the same --dir to restart
the same mesh (same ports, keys, enrolled nodes, JetStream data).
See docs/operations/cluster.md.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import signal
import sys
from pathlib import Path
from typing import Any

from meshnode.testing import render_toml
from meshnode.testing.cluster import LocalCluster
from meshnode.transport.errors import EmbeddedMeshError, PortInUse


def _ports(text: str | None) -> list[int] | None:
    return [int(p) for p in text.split(",")] if text else None


def _node_tables(cluster: LocalCluster, root: Path, name: str, service: bool) -> Path:
    """Provision ``name`` once; later runs reuse its directory and enrolment."""
    workdir = root / "nodes" / name
    config_path = workdir / "meshnode.toml"
    if config_path.exists():
        return config_path
    agents: dict[str, dict[str, Any]] = {} if service else {"echo": {"plugin": "echo"}}
    tables = cluster.provision(name, workdir, service=service, agents=agents)
    config_path.write_text(
        f"# Written by scripts/cluster.py for node {name} ({'service' if service else 'participant'}).\n"
        + render_toml(tables),
        encoding="utf-8",
    )
    return config_path


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/meshnode-cluster", help="state directory (default %(default)s)")
    parser.add_argument("--size", type=int, default=3, help="NATS servers (default %(default)s)")
    parser.add_argument("--services", type=int, default=2, help="service nodes to provision (default %(default)s)")
    parser.add_argument("--participants", type=int, default=2, help="participant nodes to provision (default %(default)s)")
    parser.add_argument("--client-ports", help="comma-separated client ports, one per server (default: free ports, then kept)")
    parser.add_argument("--route-ports", help="comma-separated cluster route ports (default: free ports, then kept)")
    # Not 7422: that is the embedded mesh's control port, and a `meshnode run` on
    # this host would collide with it. 0 picks a free port once, then keeps it.
    parser.add_argument("--control-port", type=int, default=0,
                        help="control-plane HTTP port (default 0: a free one, kept across runs)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()

    root = Path(args.dir).expanduser().absolute()
    cluster = LocalCluster(
        root,
        size=args.size,
        control_port=args.control_port,
        client_ports=_ports(args.client_ports),
        route_ports=_ports(args.route_ports),
    )
    try:
        await cluster.start()
    except PortInUse as exc:
        flag = "--control-port" if exc.listener == "control" else (
            "--route-ports" if exc.listener == "cluster" else "--client-ports")
        print(f"cluster.py: {exc.with_hint(f'pass {flag} (or 0 for free ports), or a fresh --dir')}",
              file=sys.stderr)
        return 69  # EX_UNAVAILABLE
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:  # the control plane's port
            print(f"cluster.py: port {cluster.control.port} in use: another meshnode? "
                  "pass --control-port (0 for a free one)", file=sys.stderr)
        else:
            print(f"cluster.py: cannot start the cluster in {root}: {exc}", file=sys.stderr)
        return 69
    except EmbeddedMeshError as exc:
        print(f"cluster.py: cannot start the cluster in {root}: {exc}", file=sys.stderr)
        return 69
    try:
        nodes: dict[str, dict[str, Any]] = {}
        for i in range(args.services):
            path = _node_tables(cluster, root, f"service-{i + 1}", True)
            nodes[f"service-{i + 1}"] = {"role": "service", "config": str(path)}
        for i in range(args.participants):
            path = _node_tables(cluster, root, f"participant-{i + 1}", False)
            nodes[f"participant-{i + 1}"] = {"role": "participant", "config": str(path)}
        summary = {
            "nats_urls": cluster.urls,
            "control_plane": cluster.control_url,
            "operator": cluster.nats.operator_public_key,
            "account": cluster.nats.account_public_key,
            "service_key_dir": str(cluster.service_key_dir),
            "nodes": nodes,
        }
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            print(f"NATS cluster ({args.size} servers, JetStream): {', '.join(cluster.urls)}")
            print(f"control plane: {cluster.control_url}")
            print(f"operator {summary['operator']}, account {summary['account']}")
            print(f"shared service keys: {cluster.service_key_dir}")
            print("start each node (service nodes first) with:")
            for name, node in nodes.items():
                print(f"  meshnode run --config {node['config']}    # {name} ({node['role']})")
            print("more nodes: run this again with a larger --participants (existing nodes are kept). "
                  "Ctrl-C stops the cluster.", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await cluster.stop()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are in place
        sys.exit(130)
