"""The admin API's method table: :class:`MethodRegistry` of :class:`Method`, the
:class:`CallContext` a method is called with, and :func:`param` to read its
params (see :mod:`.server` for how a method is written)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .peers import PeerCredentials
from .protocol import (
    InvalidParameter,
    Level,
    RequestId,
    is_valid_method_name,
)

__all__ = ["CallContext", "Method", "MethodFn", "MethodRegistry", "param"]


class CallContext:
    """What a method knows about the call it is serving."""

    def __init__(
        self,
        *,
        peer: PeerCredentials,
        level: Level,
        method: str,
        request_id: RequestId,
        sender: Callable[[Any], Awaitable[None]] | None,
    ) -> None:
        self.peer = peer
        self.level = level
        self.method = method
        self.request_id = request_id
        self._sender = sender

    @property
    def uid(self) -> int:
        return self.peer.uid

    @property
    def gid(self) -> int:
        return self.peer.gid

    @property
    def pid(self) -> int:
        return self.peer.pid

    @property
    def streaming(self) -> bool:
        """True when the client accepts several replies (it sent ``more: true``)."""
        return self._sender is not None

    async def send(self, result: Any) -> None:
        """Send an intermediate reply (``continues: true``) for a streaming call.

        Waits while the client is slow to read (back-pressure). Raises
        ``RuntimeError`` if the call is not streaming.
        """
        if self._sender is None:
            raise RuntimeError(f"{self.method}: intermediate replies need a streaming call")
        await self._sender(result)


#: ``async def (params, call) -> result``, or an async generator for streaming.
MethodFn = Callable[[dict[str, Any], CallContext], Awaitable[Any] | AsyncIterator[Any]]


@dataclass(frozen=True, slots=True)
class Method:
    """One registered method."""

    name: str
    fn: MethodFn
    level: Level
    streaming: bool
    doc: str


class MethodRegistry:
    """The methods an :class:`AdminServer` serves; the daemon and plugins add to it.

    Adding or removing methods while the server runs is allowed; a call
    already in progress keeps the method it started with.
    """

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}

    def add(
        self,
        name: str,
        fn: MethodFn,
        *,
        level: Level | str = Level.READ,
        streaming: bool = False,
        doc: str = "",
    ) -> Method:
        """Register ``fn`` as method ``name``.

        ``name`` is CamelCase, dotted for plugins (``Chat.Send``). ``level`` is the
        minimum access level (``read``, ``operator``, ``admin``). ``doc`` should
        state the params and result shape: it is the public contract. Raises
        ``ValueError`` for a bad or taken name, ``TypeError`` for a non-async ``fn``
        or an async generator not declared ``streaming``.
        """
        if not is_valid_method_name(name):
            raise ValueError(f"invalid admin method name {name!r} (CamelCase, dotted)")
        if name in self._methods:
            raise ValueError(f"admin method {name!r} is already registered")
        is_generator = inspect.isasyncgenfunction(fn)
        if not (is_generator or inspect.iscoroutinefunction(fn)):
            raise TypeError(f"admin method {name!r} must be an async function")
        if is_generator and not streaming:
            raise TypeError(f"admin method {name!r} is an async generator: add streaming=True")
        method = Method(name, fn, Level.parse(level), streaming, inspect.cleandoc(doc))
        self._methods[name] = method
        return method

    def remove(self, name: str) -> None:
        """Unregister ``name`` (a no-op if absent)."""
        self._methods.pop(name, None)

    def get(self, name: str) -> Method | None:
        return self._methods.get(name)

    def names(self) -> list[str]:
        """Every method name, sorted."""
        return sorted(self._methods)

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __iter__(self) -> Iterator[Method]:
        return iter([self._methods[name] for name in self.names()])

    def __len__(self) -> int:
        return len(self._methods)


_MISSING: Any = object()


def param(
    params: Mapping[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = _MISSING,
) -> Any:
    """Fetch ``params[name]`` checked against ``kind``; :class:`InvalidParameter` if not.

    ``default`` makes the member optional. Booleans are not accepted as ints.
    """
    if name not in params:
        if default is _MISSING:
            raise InvalidParameter(f"missing parameter {name!r}", {"parameter": name})
        return default
    value = params[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    bool_as_number = isinstance(value, bool) and bool not in kinds
    if bool_as_number or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise InvalidParameter(
            f"parameter {name!r} must be {expected}", {"parameter": name, "expected": expected}
        )
    return value


