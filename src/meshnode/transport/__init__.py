"""The NATS transport binding (AgentMesh §18): connection, JetStream, credentials, the broker.

Nothing above this package imports ``nats``: it offers transport-level types
and errors instead.

Submodules: ``connection`` (the node's one NATS connection), ``messages``
(:class:`~.messages.Message`, :class:`~.messages.Subscription`), ``jetstream``
(the JetStream facade: mailbox buffer, durable consumers, KV, stream reads),
``streams`` (the §18.3/§18.4 streams and buckets, provisioned idempotently),
``errors`` (the transport error taxonomy), ``jwt`` (the operator → account →
user JWT chain and creds files), ``permissions`` (the §14.3 grants of a
roster), ``embedded`` (the supervised local nats-server of an embedded mesh)
with ``tenants``, ``meshkeys``, ``serverconf`` and ``files``, and ``cluster``
(a routed cluster of them on one host).
"""

import importlib
import importlib.util
import sys
from typing import Any


class _ImportedOnFirstUse:
    """Stands in for a module nats-py would import eagerly, and imports it on
    first use: an attribute read, such as nats-py opening a ``ws://``
    connection with ``aiohttp.ClientSession()``. The real module then replaces
    it in ``nats.aio.transport``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __bool__(self) -> bool:  # nats-py's "is it installed" test
        return True

    def __getattr__(self, attr: str) -> Any:
        import nats.aio.transport

        module = importlib.import_module(self._name)
        setattr(nats.aio.transport, self._name, module)
        return getattr(module, attr)


def _import_nats_deferring_websocket() -> None:
    """Import nats-py, leaving aiohttp for when a ``ws://`` server is dialed.

    nats-py imports aiohttp (and multidict), if installed, as it is itself
    imported, for its WebSocket transport alone. That was 0.25-0.45 s of every
    daemon start here (more than the rest of nats-py), also for the nodes that
    only dial ``nats://``. So nats-py is imported here with aiohttp hidden, and
    its two names are given stand-ins that import the real modules on first
    use. :func:`~.connection.websocket_unsupported` makes that first use before
    a node dials ``ws://``, so an aiohttp that fails to import is reported there
    as a missing one, as before. (The standard library's LazyLoader cannot do
    this: an ``import aiohttp`` statement reads the module's ``__spec__``,
    which loads it.)
    """
    if "nats.aio.transport" in sys.modules or "aiohttp" in sys.modules:
        return
    try:
        installed = importlib.util.find_spec("aiohttp") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # `import aiohttp` raises ImportError
    try:
        import nats.aio.transport
    finally:
        if sys.modules.get("aiohttp", ...) is None:
            del sys.modules["aiohttp"]
    for name in ("aiohttp", "multidict"):  # nats-py's module globals, None after the hidden import
        setattr(nats.aio.transport, name, _ImportedOnFirstUse(name))


_import_nats_deferring_websocket()
