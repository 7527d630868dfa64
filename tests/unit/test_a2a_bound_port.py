"""``[a2a] listen``: the bridge's sockets (``host:port`` bound by the daemon, or
``fd://N`` inherited) and the address it publishes (the bound one, never port 0)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from meshnode.a2a.inbound import BridgeSettings
from meshnode.a2a.listen import ListenError, adopt_listener, bind_listeners
from meshnode.config.a2a import listen_fd


def settings(
    host: str = "127.0.0.1", port: int = 0, public_url: str | None = None, listen_fd: int | None = None
) -> BridgeSettings:
    return BridgeSettings(
        host=host, port=port, application="acme", expose=("echo",), public_url=public_url, listen_fd=listen_fd
    )


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()


def test_port_zero_becomes_the_bound_port_in_every_published_url() -> None:
    assert settings().bound_to(43121).base_url == "http://127.0.0.1:43121"
    assert settings(host="::1").bound_to(43121).base_url == "http://[::1]:43121"
    assert settings(host="[::1]").bound_to(43121).base_url == "http://[::1]:43121"


def test_an_explicit_port_and_a_public_url_are_kept() -> None:
    explicit = settings(port=8700)
    assert explicit.bound_to(43121, "127.0.0.1") is explicit and explicit.base_url == "http://127.0.0.1:8700"
    public = settings(public_url="https://a2a.example/").bound_to(43121)
    assert public.base_url == "https://a2a.example"


def test_an_inherited_socket_gives_host_and_port() -> None:
    assert listen_fd("fd://3") == 3 and listen_fd("127.0.0.1:8700") is None
    inherited = settings(host="", port=0, listen_fd=3).bound_to(43121, "::1")
    assert inherited.base_url == "http://[::1]:43121"


def test_port_zero_binds_a_free_port_that_really_listens() -> None:
    sockets = bind_listeners("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        assert port != 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


def test_a_taken_port_is_an_error_naming_the_setting_and_the_way_out(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    with pytest.raises(ListenError) as caught:
        bind_listeners("127.0.0.1", port)
    message = str(caught.value)
    assert f"[a2a] listen 127.0.0.1:{port}" in message and "in use" in message and "fd://N" in message


def test_a_name_that_does_not_resolve_is_named() -> None:
    with pytest.raises(ListenError, match=r"\[a2a\] listen no-such-host\.invalid:0: 'no-such-host\.invalid' does not resolve"):
        bind_listeners("no-such-host.invalid", 0)


def test_an_inherited_listening_socket_is_served_by_a_duplicate_and_outlives_it(listener: socket.socket) -> None:
    fd = os.dup(listener.fileno())
    os.set_inheritable(fd, True)  # as a supervisor passes it
    try:
        adopted = adopt_listener(fd)
        assert adopted.fileno() != fd and adopted.getsockname() == listener.getsockname()
        assert adopted.getblocking() is False
        # The server closes its socket at a stop; descriptor fd stays open and
        # inheritable for a daemon that re-executes itself.
        adopted.close()
        os.fstat(fd)
        assert os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_a_descriptor_that_cannot_serve_is_refused_and_left_open() -> None:
    read_end, write_end = os.pipe()
    unlistening = socket.socket()
    udp = socket.socket(type=socket.SOCK_DGRAM)
    try:
        with pytest.raises(ListenError, match=rf'fd://{read_end}".*is not a socket'):
            adopt_listener(read_end)
        with pytest.raises(ListenError, match="is not listening"):
            adopt_listener(unlistening.fileno())
        with pytest.raises(ListenError, match="is not a TCP socket"):
            adopt_listener(udp.fileno())
        # The descriptors are the caller's: still open.
        for fd in (read_end, unlistening.fileno(), udp.fileno()):
            os.fstat(fd)
        closed = os.dup(read_end)
        os.close(closed)
        with pytest.raises(ListenError, match="is not open"):
            adopt_listener(closed)
    finally:
        os.close(read_end)
        os.close(write_end)
        unlistening.close()
        udp.close()

