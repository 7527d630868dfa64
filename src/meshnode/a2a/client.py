"""The outbound bridge's HTTP plumbing: one official a2a-sdk client per request,
and what a failed request means (unsent, ambiguous, or the peer's refusal)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, NoReturn

import httpx
from a2a.client import Client, ClientCallContext, ClientConfig, ClientFactory
from a2a.extensions.common import HTTP_EXTENSION_HEADER
from a2a.types.a2a_pb2 import AgentCard, StreamResponse
from a2a.utils.constants import PROTOCOL_VERSION_CURRENT, VERSION_HEADER
from google.protobuf import json_format

from meshnode.a2a.mapping import ints_as_sent
from meshnode.protocol.errors import ProtocolError

__all__ = ["Ambiguous", "Unsent", "answer_dict", "causes", "classify", "http_client", "ints_from_wire", "peer_client",
           "stream_results"]


class Ambiguous(Exception):
    """The request may have reached the peer (the connection dropped or timed out after sending)."""


class Unsent(Exception):
    """The request surely did not reach the peer (no connection was made)."""


def http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An httpx client that speaks A2A's current protocol version."""
    return httpx.AsyncClient(headers={VERSION_HEADER: PROTOCOL_VERSION_CURRENT}, **kwargs)


@contextlib.asynccontextmanager
async def peer_client(
    card: AgentCard,
    headers: Mapping[str, str],
    *,
    timeout: float,
    streaming: bool = False,
    echoed: list[str] | None = None,
    bodies: list[Any] | None = None,
    streamed: bytearray | None = None,
) -> AsyncIterator[tuple[Client, ClientCallContext]]:
    """An SDK client for ``card`` and the call context carrying ``headers`` (as
    A2A service parameters). ``echoed`` collects the peer's ``A2A-Extensions``
    answer headers (the extension's activation echo); ``bodies`` the parsed
    JSON of its (non-streamed) answers, ``streamed`` the bytes of its event
    streams as the SDK reads them, for :func:`ints_from_wire` and
    :func:`stream_results`."""

    async def on_response(response: httpx.Response) -> None:
        if echoed is not None:
            echoed.extend(response.headers.get_list(HTTP_EXTENSION_HEADER))
        if bodies is not None and response.headers.get("content-type", "").startswith("application/json"):
            await response.aread()
            with contextlib.suppress(ValueError):
                bodies.append(response.json())

    transport = _TeeTransport(httpx.AsyncHTTPTransport(), streamed) if streamed is not None else None
    async with http_client(timeout=timeout, event_hooks={"response": [on_response]}, transport=transport) as http:
        client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
        yield client, ClientCallContext(service_parameters=dict(headers), timeout=timeout)


class _TeeStream(httpx.AsyncByteStream):
    """An event stream's body, copied into ``sink`` as it is read."""

    def __init__(self, inner: httpx.AsyncByteStream, sink: bytearray) -> None:
        self._inner = inner
        self._sink = sink

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._sink.extend(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _TeeTransport(httpx.AsyncBaseTransport):
    """The default transport, keeping a copy of each ``text/event-stream`` body:
    the SDK parses every event's data into protobuf Structs (numbers become
    doubles), the copy still has the numbers as the peer sent them."""

    def __init__(self, inner: httpx.AsyncBaseTransport, sink: bytearray) -> None:
        self._inner = inner
        self._sink = sink

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return response
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers, request=request,
                              stream=_TeeStream(stream, self._sink), extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


def stream_results(raw: bytes | bytearray, start: int = 0) -> tuple[list[Any], int]:
    """The JSON-RPC ``result`` of each complete server-sent event of ``raw``
    after offset ``start``, in order (None for an event that carries none), and
    the offset after the last complete one (where to start next time)."""
    lf, crlf = raw.rfind(b"\n\n", start), raw.rfind(b"\r\n\r\n", start)
    end = max(lf + 2 if lf >= 0 else start, crlf + 4 if crlf >= 0 else start)
    out: list[Any] = []
    text = bytes(raw[start:end]).decode("utf-8", errors="replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in block.split("\n") if line.startswith("data:"))
        if not data:
            continue
        try:
            body = json.loads(data)
        except ValueError:
            out.append(None)
            continue
        out.append(body.get("result") if isinstance(body, Mapping) else None)
    return out, end


def answer_dict(event: StreamResponse) -> dict[str, Any]:
    """An SDK answer as ProtoJSON (``{"task": …}``, ``{"message": …}``, …)."""
    return dict(json_format.MessageToDict(event))


def ints_from_wire(answer: dict[str, Any], bodies: list[Any]) -> dict[str, Any]:
    """``answer`` (the SDK's parse, every Struct number a double) with the
    numbers the peer sent as integers integers again, read from the last
    JSON-RPC ``result`` among ``bodies``."""
    for body in reversed(bodies):
        result = body.get("result") if isinstance(body, Mapping) else None
        if isinstance(result, Mapping):
            fixed: dict[str, Any] = ints_as_sent(answer, result)
            return fixed
    return answer


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from, the outermost first."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def refusal_code(body: object) -> str | None:
    """The stable code of a peer's HTTP refusal body, wherever a peer puts it:
    a top-level ``code`` (the seed's ``401 {"code": …}``), a string
    ``error.code``, ``error.data.code``, or, in A2A v1.0's error details (a
    list of ``google.rpc.ErrorInfo`` in ``error.data``), an entry's
    ``metadata.code`` or else its ``reason``."""
    if not isinstance(body, Mapping):
        return None
    if isinstance(body.get("code"), str):
        return str(body["code"])
    err = body.get("error")
    if not isinstance(err, Mapping):
        return None
    if isinstance(err.get("code"), str):
        return str(err["code"])
    data = err.get("data")
    if isinstance(data, Mapping):
        return str(data["code"]) if isinstance(data.get("code"), str) else None
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, Mapping) and str(entry.get("@type", "")).endswith("google.rpc.ErrorInfo"):
            meta = entry.get("metadata")
            if isinstance(meta, Mapping) and isinstance(meta.get("code"), str):
                return str(meta["code"])
            if isinstance(entry.get("reason"), str):
                return str(entry["reason"])
    return None


def classify(exc: BaseException) -> NoReturn:
    """Re-raise a failed request as :class:`Unsent`, :class:`Ambiguous` or the
    peer's refusal (a ProtocolError: ``UNAUTHORIZED`` for 401/403 with the
    stable code in ``details.code``, else ``DEPENDENCY_FAILED``)."""
    for cause in causes(exc):
        if isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            raise Unsent() from exc
        if isinstance(cause, httpx.HTTPStatusError):
            response = cause.response
            try:
                code = refusal_code(response.json())
            except ValueError:
                code = None
            status = response.status_code
            mapped = "UNAUTHORIZED" if status in (401, 403) else "DEPENDENCY_FAILED"
            details: dict[str, Any] = {"http_status": status}
            if code:
                details["code"] = code
            raise ProtocolError(mapped, f"the A2A peer refused the call (HTTP {status})", details) from exc
        if isinstance(cause, (httpx.TimeoutException, httpx.TransportError)):
            raise Ambiguous() from exc
    # What the peer said, when it said something (bounded: it is the peer's text).
    said = " ".join(str(exc).split())[:_PEER_TEXT_MAX]
    shown = f": {said}" if said and said != type(exc).__name__ else ""
    raise ProtocolError("DEPENDENCY_FAILED", f"the A2A call failed: {type(exc).__name__}{shown}",
                        {"a2a_error": type(exc).__name__, **({"peer_message": said} if shown else {})}) from exc


#: The most of a peer's error text a refusal repeats.
_PEER_TEXT_MAX = 300
