"""The raw nats-py responder of the two-process baseline, as its own process.

``python -m benchmarks.raw_responder`` with ``MESHNODE_BENCH_NATS_URL``,
``MESHNODE_BENCH_NATS_JWT`` and ``MESHNODE_BENCH_NATS_SEED`` set: connects,
answers every request on ``bench.raw`` with a body of ``MESHNODE_BENCH_BODY``
bytes, prints ``ready`` once subscribed, and exits when its stdin closes (the
benchmark closes it, or dies). Runs on uvloop, like the daemon.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import nats

from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.jwt import nats_auth_callbacks

from .harness import run_loop

SUBJECT = "bench.raw"


async def main() -> None:
    jwt = os.environ["MESHNODE_BENCH_NATS_JWT"]
    key = KeyPair.from_seed(os.environ["MESHNODE_BENCH_NATS_SEED"])
    body = b"x" * int(os.environ.get("MESHNODE_BENCH_BODY", "700"))
    jwt_cb, sig_cb = nats_auth_callbacks(lambda: jwt, key)
    nc = await nats.connect(os.environ["MESHNODE_BENCH_NATS_URL"], user_jwt_cb=jwt_cb, signature_cb=sig_cb)

    async def respond(msg: Any) -> None:
        await msg.respond(body)

    await nc.subscribe(SUBJECT, cb=respond)
    await nc.flush()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns at EOF: the benchmark is done
    await nc.close()


if __name__ == "__main__":
    run_loop(main())
