"""Full mesh round trips against raw nats-py request-reply, and CPU against the crypto floor.

Every meshnode round trip here is the real thing: a signed request, the §22
checks and admission on the receiver, a signed accept, the echo handler, a
signed answer to the requester's inbox, and the requester's own checks on
both replies. Baselines are measured in the same run on the same broker:

* raw nats-py request-reply of the same payload size (latency at concurrency
  1, throughput at concurrency 64);
* the crypto floor: the Ed25519 work a round trip cannot avoid (3 signatures and
  3 verifications of envelopes of these sizes) timed with bare PyNaCl.

Two nodes are two Node instances with their own connections in one process (the
target's manifest is pre-resolved, so no registry lookup is timed); "local" is
one node delivering between its own agents without the broker.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import nacl.signing
import nats

from meshnode.node.context import AgentContext
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.envelope import new_root_trace
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.streams import ensure_mesh_streams
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix

from .harness import print_table, write_result

PAYLOAD = {"text": "x" * 200, "n": 42}


async def _node(mesh: EmbeddedNatsServer, agents: list[KeyPair]) -> Node:
    key = KeyPair.generate()
    jwt = mesh.mint_node_credential(key.public_key, [a.public_key for a in agents], 3600, role="service")
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, inbox_prefix=node_inbox_prefix(key.public_key))
    await conn.connect()
    node = Node(settings=NodeSettings(name="bench", registry_timeout_s=0.2), node_key=key, connection=conn)
    node.trust = None
    return node


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _latency(call: Any, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - t) * 1e6)
    return _percentiles(samples)


async def _throughput(call: Any, total: int, concurrency: int) -> float:
    queue = iter(range(total))

    async def worker() -> None:
        for _ in queue:
            await call()

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t)


def _crypto_floor_us(sizes: list[int]) -> float:
    sk = nacl.signing.SigningKey.generate()
    vk = sk.verify_key
    total = 0.0
    for size in sizes:
        msg = b"x" * size
        sig = sk.sign(msg).signature
        reps = 2000
        t = time.perf_counter()
        for _ in range(reps):
            sk.sign(msg)
        total += (time.perf_counter() - t) / reps
        t = time.perf_counter()
        for _ in range(reps):
            vk.verify(msg, sig)
        total += (time.perf_counter() - t) / reps
    return total * 1e6


def run(quick: bool = False) -> dict[str, Any]:
    n_lat = 200 if quick else 2000
    n_tp = 500 if quick else 5000

    async def main() -> dict[str, Any]:
        from meshnode_echo import EchoAgent

        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            mesh = EmbeddedNatsServer(Path(tmp) / "mesh")
            await mesh.start()
            try:
                # raw nats-py baseline (same broker, same payload size)
                raw_key = KeyPair.generate()
                raw_jwt = mesh.mint_user("raw", raw_key.public_key, [">"], [">"], 3600)
                from meshnode.transport.jwt import nats_auth_callbacks

                jwt_cb, sig_cb = nats_auth_callbacks(lambda: raw_jwt, raw_key)
                nc = await nats.connect(mesh.url, user_jwt_cb=jwt_cb, signature_cb=sig_cb)
                body = b"x" * 700

                async def responder(msg: Any) -> None:
                    await msg.respond(body)

                await nc.subscribe("bench.raw", cb=responder)

                async def raw_call() -> None:
                    await nc.request("bench.raw", body, timeout=5)

                await _latency(raw_call, 100)
                raw_p50, raw_p99 = await _latency(raw_call, n_lat)
                raw_tp = await _throughput(raw_call, n_tp, 64)

                caller_key, echo_key, local_echo_key = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
                node_a = await _node(mesh, [caller_key, local_echo_key])
                node_b = await _node(mesh, [echo_key])
                await ensure_mesh_streams(node_a.connection.js, 1)
                caller = await node_a.host(name="caller", kind="echo", agent_class=EchoAgent, settings={}, key=caller_key)
                local_echo = await node_a.host(name="echo_local", kind="echo", agent_class=EchoAgent, settings={}, key=local_echo_key)
                remote_echo = await node_b.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=echo_key)
                node_a._manifests[remote_echo.agent_id] = (remote_echo.manifest, 1e18)
                ctx = AgentContext(caller, trace=new_root_trace())

                async def remote_call() -> None:
                    await ctx.request(remote_echo.agent_id, "echo", PAYLOAD, timeout=10)

                async def local_call() -> None:
                    await ctx.request(local_echo.agent_id, "echo", PAYLOAD, timeout=10)

                await _latency(remote_call, 100)
                mesh_p50, mesh_p99 = await _latency(remote_call, n_lat)
                mesh_tp = await _throughput(remote_call, n_tp, 64)
                await _latency(local_call, 100)
                local_p50, local_p99 = await _latency(local_call, n_lat)
                local_tp = await _throughput(local_call, n_tp, 64)

                cpu0 = time.process_time()
                for _ in range(n_lat):
                    await remote_call()
                cpu_per_rt = (time.process_time() - cpu0) / n_lat * 1e6
                floor = _crypto_floor_us([900, 750, 800])  # request, accept, answer envelopes
                await nc.close()
                for node in (node_a, node_b):
                    await node.connection.close()
            finally:
                await mesh.stop()
        rows = [
            ("measurement", "p50 µs", "p99 µs", "req/s @64", "vs raw nats-py"),
            ("raw nats-py request-reply", f"{raw_p50:.0f}", f"{raw_p99:.0f}", f"{raw_tp:,.0f}", "baseline"),
            ("meshnode, two nodes", f"{mesh_p50:.0f}", f"{mesh_p99:.0f}", f"{mesh_tp:,.0f}",
             f"latency {mesh_p50 / raw_p50:.2f}x, throughput {mesh_tp / raw_tp:.0%}"),
            ("meshnode, local delivery", f"{local_p50:.0f}", f"{local_p99:.0f}", f"{local_tp:,.0f}",
             f"latency {local_p50 / raw_p50:.2f}x, throughput {local_tp / raw_tp:.0%}"),
        ]
        print_table("round trip: request → accept → answer, all signed and checked", rows)
        print(f"CPU per two-node round trip: {cpu_per_rt:.0f} µs; crypto floor (3 sign + 3 verify): {floor:.0f} µs "
              f"→ {cpu_per_rt / floor:.2f}x the floor (both nodes' work, one process)")
        result = {
            "raw": {"p50_us": raw_p50, "p99_us": raw_p99, "throughput": raw_tp},
            "two_nodes": {"p50_us": mesh_p50, "p99_us": mesh_p99, "throughput": mesh_tp},
            "local": {"p50_us": local_p50, "p99_us": local_p99, "throughput": local_tp},
            "latency_ratio": mesh_p50 / raw_p50,
            "throughput_ratio": mesh_tp / raw_tp,
            "cpu_per_round_trip_us": cpu_per_rt,
            "crypto_floor_us": floor,
            "cpu_vs_floor": cpu_per_rt / floor,
            "samples": {"latency": n_lat, "throughput": n_tp},
        }
        print(f"written {write_result('roundtrip', result)}")
        return result

    return asyncio.run(main())
