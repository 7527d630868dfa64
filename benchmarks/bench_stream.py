"""Streamed chunks per second, unsigned (the default, §11.6) against signing every chunk.

One node, a real embedded nats-server: the wordstream agent streams N chunks on
``mesh.task.{id}.stream`` and a requester on the same node consumes them through
``RequesterTask.stream()`` (which checks order, the opener and the signed final
chunk). Both variants run in the same process, same broker, same machine.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from meshnode.node.context import AgentContext
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.envelope import new_root_trace
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import ensure_mesh_streams

from .harness import print_table, run_loop, write_result


async def _measure(node: Node, requester: Any, target: str, words: int, sign: bool) -> float:
    ctx = AgentContext(requester, trace=new_root_trace())
    text = " ".join(f"w{i}" for i in range(words))
    started = time.perf_counter()
    reply = await ctx.request(target, "words", {"text": text}, config={"stream": True, "sign_chunks": sign}, timeout=60)
    assert reply.task is not None
    received = 0
    async for _ in reply.task.stream(timeout=30):
        received += 1
    elapsed = time.perf_counter() - started
    assert received == words, received
    return words / elapsed


def run(quick: bool = False) -> dict[str, Any]:
    words = 500 if quick else 5000

    async def main() -> dict[str, Any]:
        from meshnode_echo import EchoAgent
        from meshnode_wordstream import WordStreamAgent

        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            mesh = EmbeddedNatsServer(Path(tmp) / "mesh")
            await mesh.start()
            try:
                node_key, streamer, caller = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
                jwt = mesh.mint_node_credential(node_key.public_key, [streamer.public_key, caller.public_key], 3600, role="service")
                conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                                      inbox_prefix=node_inbox_prefix(node_key.public_key))
                await conn.connect()
                await ensure_mesh_streams(conn.jetstream, 1)
                node = Node(settings=NodeSettings(name="bench", registry_timeout_s=0.2), node_key=node_key, connection=conn)
                ws = await node.host(name="ws", kind="wordstream", agent_class=WordStreamAgent, settings={}, key=streamer)
                req = await node.host(name="req", kind="echo", agent_class=EchoAgent, settings={}, key=caller)
                await _measure(node, req, ws.agent_id, 100, False)  # warm-up
                unsigned = [await _measure(node, req, ws.agent_id, words, False) for _ in range(3)]
                signed = [await _measure(node, req, ws.agent_id, words, True) for _ in range(3)]
                await conn.close()
            finally:
                await mesh.stop()
        u, s = sorted(unsigned)[1], sorted(signed)[1]
        print_table(f"streaming, {words} chunks per stream (median of 3)", [
            ("variant", "chunks/s", "µs/chunk", "ratio"),
            ("unsigned chunks (default, §11.6)", f"{u:,.0f}", f"{1e6 / u:.0f}", "1.00x"),
            ("every chunk signed (sign_chunks)", f"{s:,.0f}", f"{1e6 / s:.0f}", f"{u / s:.2f}x slower"),
        ])
        result = {"chunks": words, "unsigned_chunks_per_s": u, "signed_chunks_per_s": s, "signing_cost_ratio": u / s}
        print(f"written {write_result('stream', result)}")
        return result

    return run_loop(main())
