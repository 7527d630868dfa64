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
import statistics
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

from .harness import print_table, run_loop, write_result

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
    """CPU time (process time, like the round trips' figure: a busy shared
    machine inflates wall-clock timings, not the CPU a call uses) of one Ed25519
    sign and one verify per envelope size, with bare PyNaCl."""
    sk = nacl.signing.SigningKey.generate()
    vk = sk.verify_key
    total = 0.0
    for size in sizes:
        msg = b"x" * size
        sig = sk.sign(msg).signature
        reps = 2000
        t = time.process_time()
        for _ in range(reps):
            sk.sign(msg)
        total += (time.process_time() - t) / reps
        t = time.process_time()
        for _ in range(reps):
            vk.verify(msg, sig)
        total += (time.process_time() - t) / reps
    return total * 1e6


def _median(values: list[float]) -> float:
    return statistics.median(values)


async def _series(call: Any, *, n_lat: int, n_tp: int, repeats: int) -> dict[str, Any]:
    """Median p50/p99 and throughput over ``repeats`` batches, and CPU per call at concurrency 1."""
    await _latency(call, 100)  # warm
    p50s, p99s, tps, cpus = [], [], [], []
    for _ in range(repeats):
        cpu0 = time.process_time()
        p50, p99 = await _latency(call, n_lat)
        cpus.append((time.process_time() - cpu0) / n_lat * 1e6)
        p50s.append(p50)
        p99s.append(p99)
        tps.append(await _throughput(call, n_tp, 64))
    return {
        "p50_us": _median(p50s), "p99_us": _median(p99s), "throughput": _median(tps),
        "cpu_us": _median(cpus), "runs": {"p50_us": p50s, "throughput": tps, "cpu_us": cpus},
    }


def run(quick: bool = False) -> dict[str, Any]:
    n_lat = 200 if quick else 1000
    n_tp = 500 if quick else 3000
    repeats = 1 if quick else 5

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

                caller_key, echo_key, local_echo_key = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
                node_a = await _node(mesh, [caller_key, local_echo_key])
                node_b = await _node(mesh, [echo_key])
                await ensure_mesh_streams(node_a.connection.js, 1)
                caller = await node_a.host(name="caller", kind="echo", agent_class=EchoAgent, settings={}, key=caller_key)
                local_echo = await node_a.host(name="echo_local", kind="echo", agent_class=EchoAgent, settings={}, key=local_echo_key)
                remote_echo = await node_b.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=echo_key)
                node_a.manifest_cache.remember(remote_echo.manifest, ttl_s=1e18)
                ctx = AgentContext(caller, trace=new_root_trace())

                async def remote_call() -> None:
                    await ctx.request(remote_echo.agent_id, "echo", PAYLOAD, timeout=10)

                async def local_call() -> None:
                    await ctx.request(local_echo.agent_id, "echo", PAYLOAD, timeout=10)

                sizes = [900, 750, 800]  # request, accept, answer envelopes
                floors = [_crypto_floor_us(sizes)]  # measured between the series, median taken
                raw = await _series(raw_call, n_lat=n_lat, n_tp=n_tp, repeats=repeats)
                floors.append(_crypto_floor_us(sizes))
                mesh_rt = await _series(remote_call, n_lat=n_lat, n_tp=n_tp, repeats=repeats)
                floors.append(_crypto_floor_us(sizes))
                local = await _series(local_call, n_lat=n_lat, n_tp=n_tp, repeats=repeats)
                floors.append(_crypto_floor_us(sizes))
                floor = _median(floors)
                await nc.close()
                for node in (node_a, node_b):
                    await node.connection.close()
            finally:
                await mesh.stop()
        cpu_rt = mesh_rt["cpu_us"]
        # What the node adds on top of what it cannot avoid: the signatures, and
        # the transport's own cost (raw nats-py's CPU for a request-reply, scaled
        # to the three messages a mesh round trip carries).
        transport = raw["cpu_us"] * 1.5
        node_own = cpu_rt - floor - transport
        ceiling = 1e6 / floor  # round trips/s the signatures alone allow on one core
        rows = [
            ("measurement", "p50 µs", "p99 µs", "req/s @64", "CPU µs/rt", "vs raw nats-py"),
            ("raw nats-py request-reply", f"{raw['p50_us']:.0f}", f"{raw['p99_us']:.0f}", f"{raw['throughput']:,.0f}",
             f"{raw['cpu_us']:.0f}", "baseline"),
            ("meshnode, two nodes", f"{mesh_rt['p50_us']:.0f}", f"{mesh_rt['p99_us']:.0f}", f"{mesh_rt['throughput']:,.0f}",
             f"{cpu_rt:.0f}",
             f"latency {mesh_rt['p50_us'] / raw['p50_us']:.2f}x, throughput {mesh_rt['throughput'] / raw['throughput']:.0%}"),
            ("meshnode, local delivery", f"{local['p50_us']:.0f}", f"{local['p99_us']:.0f}", f"{local['throughput']:,.0f}",
             f"{local['cpu_us']:.0f}",
             f"latency {local['p50_us'] / raw['p50_us']:.2f}x, throughput {local['throughput'] / raw['throughput']:.0%}"),
        ]
        print_table(f"round trip: request → accept → answer, all signed and checked (uvloop; medians of {repeats})", rows)
        print(f"CPU per two-node round trip: {cpu_rt:.0f} µs; crypto floor (3 sign + 3 verify): {floor:.0f} µs "
              f"→ {cpu_rt / floor:.2f}x the floor (both nodes' work, one process); local delivery {local['cpu_us'] / floor:.2f}x")
        print(f"  of which transport (raw nats-py CPU x 1.5 messages): {transport:.0f} µs; the node's own code: {node_own:.0f} µs "
              f"({node_own / floor:.2f}x the floor)")
        print(f"  throughput ceiling set by the signatures alone on one core: {ceiling:,.0f} rt/s "
              f"= {ceiling / raw['throughput']:.0%} of raw nats-py")
        result = {
            "loop": "uvloop",
            "raw": raw,
            "two_nodes": mesh_rt,
            "local": local,
            "latency_ratio": mesh_rt["p50_us"] / raw["p50_us"],
            "throughput_ratio": mesh_rt["throughput"] / raw["throughput"],
            "local_latency_ratio": local["p50_us"] / raw["p50_us"],
            "local_throughput_ratio": local["throughput"] / raw["throughput"],
            "cpu_per_round_trip_us": cpu_rt,
            "crypto_floor_us": floor,
            "crypto_floor_runs_us": floors,
            "cpu_vs_floor": cpu_rt / floor,
            "local_cpu_vs_floor": local["cpu_us"] / floor,
            "transport_cpu_us": transport,
            "node_own_cpu_us": node_own,
            "signature_ceiling_rt_per_s": ceiling,
            "signature_ceiling_vs_raw": ceiling / raw["throughput"],
            "samples": {"latency": n_lat, "throughput": n_tp, "repeats": repeats},
        }
        print(f"written {write_result('roundtrip', result)}")
        return result

    return run_loop(main())
