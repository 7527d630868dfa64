"""``[a2a] listen = "host:0"``: the bridge publishes the port it bound, not 0."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from starlette.applications import Starlette

from meshnode.a2a.inbound import BridgeSettings
from meshnode.a2a.server import _bound_port, _Uvicorn
from meshnode.testing import eventually_async


def settings(host: str = "127.0.0.1", port: int = 0, public_url: str | None = None) -> BridgeSettings:
    return BridgeSettings(host=host, port=port, application="acme", expose=("echo",), public_url=public_url)


def test_port_zero_becomes_the_bound_port_in_every_published_url() -> None:
    assert settings().bound_to(43121).base_url == "http://127.0.0.1:43121"
    assert settings(host="::1").bound_to(43121).base_url == "http://[::1]:43121"
    assert settings(host="[::1]").bound_to(43121).base_url == "http://[::1]:43121"


def test_an_explicit_port_and_a_public_url_are_kept() -> None:
    explicit = settings(port=8700)
    assert explicit.bound_to(43121) is explicit and explicit.base_url == "http://127.0.0.1:8700"
    public = settings(public_url="https://a2a.example/").bound_to(43121)
    assert public.base_url == "https://a2a.example"


async def test_the_bound_port_is_read_back_from_uvicorns_socket() -> None:
    config = uvicorn.Config(Starlette(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = _Uvicorn(config)
    serving = asyncio.get_running_loop().create_task(server.serve())
    try:
        await eventually_async(lambda: server.started or serving.done(), what="uvicorn started")
        assert server.started
        port = _bound_port(server, 0)
        assert port != 0
        # It really listens there.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout=10)
