"""A wire client enrolled on a running mesh: the steps tests share before speaking the wire."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from meshnode.testing import DaemonProcess, run_cli
from tests.integration.wire_client import UserKey, WireAgent, WireClient, read_invite


@contextlib.asynccontextmanager
async def enrolled_wire_agent(
    hub: DaemonProcess, directory: Path, invite_name: str, agent_name: str
) -> AsyncIterator[tuple[WireClient, WireAgent]]:
    """Invite ``invite_name`` into ``hub``'s mesh (as a person would, with the CLI),
    join it with the wire client, and serve and register one agent; closed at the end."""
    invite = directory / f"{invite_name}.creds"
    await asyncio.to_thread(run_cli, "mesh", "invite", invite_name, "--out", str(invite), "--socket", hub.socket_path)
    client = WireClient(read_invite(invite))
    agent = WireAgent(UserKey.generate(), agent_name)
    try:
        await client.join([agent])
        await client.serve(agent)
        await client.register(agent)
        yield client, agent
    finally:
        await client.close()
