"""The control plane's client: what a joined node uses to renew its credential."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl as _ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from meshnode.aio import wait_for
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.jwt import JwtError, decode_jwt

from .wire import (
    _HTTP_SCHEMES,
    _MAX_RESPONSE_BODY,
    _MAX_RESPONSE_HEAD,
    _REASONS,
    _STATUS_LINE,
    _TOKEN,
    ControlPlaneBadResponse,
    ControlPlaneUnreachable,
    CredentialRefused,
    node_credential_request,
)

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

# --- the client ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CredentialGrant:
    """A renewed node credential and where to use it (§18.10: re-read on every renewal)."""

    jwt: str = field(repr=False)
    expires_at: int
    nats_endpoints: tuple[str, ...]
    mesh_name: str | None
    trust_attestation: dict[str, Any] | None = None
    """The operator's §9.7 attestation of the node, unverified here (the
    registry and other readers verify it); None from a control plane that issues none."""


@dataclass(frozen=True, slots=True)
class MeshInfo:
    """The public description of a mesh (``GET /v1/mesh``)."""

    name: str | None
    protocol: str | None
    nats_endpoints: tuple[str, ...]
    control_plane: str | None


def _endpoint_list(mesh: Mapping[str, Any]) -> tuple[str, ...]:
    endpoints = mesh.get("nats_endpoints", mesh.get("endpoints"))
    if endpoints is None:
        return ()
    if not isinstance(endpoints, list) or not all(isinstance(e, str) for e in endpoints):
        raise ControlPlaneBadResponse("mesh endpoints must be a list of URLs")
    return tuple(endpoints)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].decode("latin-1").split("\r\n")
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise ControlPlaneBadResponse("not an HTTP/1.x response")
        status = int(match.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not _TOKEN.fullmatch(name):
                raise ControlPlaneBadResponse("malformed response header")
            name = name.lower()
            if name == "content-length" and name in headers:
                raise ControlPlaneBadResponse("repeated Content-Length")
            headers[name] = (headers[name] + ", " if name in headers else "") + value.strip()
        if status >= 200 or status == 101:
            break  # interim 1xx answers precede the real one
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, headers, await _read_chunked(reader)
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or int(text) > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("bad or oversized Content-Length")
        return status, headers, await reader.readexactly(int(text))
    body = bytearray()
    while chunk := await reader.read(65536):
        body += chunk
        if len(body) > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("response body too large")
    return status, headers, bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ControlPlaneBadResponse("malformed chunk size") from None
        if size < 0 or len(body) + size > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("response body too large")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailer fields
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ControlPlaneBadResponse("malformed chunk")


class ControlPlaneClient:
    """Talks to a control plane over HTTP(S), with no NATS connection (§4.8).

    ``url`` is the control plane's base URL (``http[s]://host[:port][/prefix]``);
    ``/v1/...`` is appended to its path.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        ssl_context: _ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in _HTTP_SCHEMES or not parts.hostname:
            raise ValueError(f"control-plane URL {url!r} must be http(s)://host[:port][/path]")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError("control-plane URL must not carry credentials, query or fragment")
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._host_header = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self._ssl: _ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl_context or _ssl.create_default_context()
        self._timeout_s = timeout_s
        self._clock = clock

    async def request_credential(
        self, node_key: KeyPair, agent_keys: Iterable[KeyPair]
    ) -> CredentialGrant:
        """Renew the node credential for ``node_key`` hosting ``agent_keys``.

        Raises CredentialRefused for any non-2xx answer (``revoked`` tells a
        revocation from a passing failure), ControlPlaneUnreachable when no
        usable answer arrives.
        """
        body = node_credential_request(node_key, agent_keys, int(self._clock()))
        status, payload = await self._call("POST", "/v1/node-credential", body)
        jwt = payload.get("jwt")
        if not isinstance(jwt, str):
            raise ControlPlaneBadResponse("credential response without a jwt")
        try:
            _, claims = decode_jwt(jwt)
        except JwtError as exc:
            raise ControlPlaneBadResponse(f"credential response holds a bad jwt: {exc}") from None
        if claims.get("sub") != node_key.public_key:
            raise ControlPlaneBadResponse("the credential was issued to another key")
        # The broker enforces the JWT's own exp; a differing expires_at field
        # would only mislead the renewal schedule.
        expires_at = claims.get("exp", payload.get("expires_at"))
        if not isinstance(expires_at, int) or isinstance(expires_at, bool):
            raise ControlPlaneBadResponse("credential response without an expiry")
        mesh = payload.get("mesh") or {}
        if not isinstance(mesh, dict):
            raise ControlPlaneBadResponse("mesh must be an object")
        name = mesh.get("name")
        attestation = payload.get("trust_attestation")
        return CredentialGrant(
            jwt=jwt,
            expires_at=expires_at,
            nats_endpoints=_endpoint_list(mesh),
            mesh_name=name if isinstance(name, str) else None,
            trust_attestation=attestation if isinstance(attestation, dict) else None,
        )

    async def mesh_info(self) -> MeshInfo:
        """``GET /v1/mesh``. Raises CredentialRefused or ControlPlaneUnreachable."""
        _, payload = await self._call("GET", "/v1/mesh", None)

        def text(key: str) -> str | None:
            value = payload.get(key)
            return value if isinstance(value, str) else None

        return MeshInfo(
            name=text("name"),
            protocol=text("protocol"),
            nats_endpoints=_endpoint_list(payload),
            control_plane=text("control_plane"),
        )

    async def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None
    ) -> tuple[int, dict[str, Any]]:
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = [
            f"{method} {self._prefix}{path} HTTP/1.1",
            f"Host: {self._host_header}",
            "Accept: application/json",
            "User-Agent: meshnode",
            "Connection: close",
        ]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data

        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl, limit=_MAX_RESPONSE_HEAD
                )
                writer.write(request)
                await writer.drain()
                status, headers, raw = await _read_response(reader)
        except TimeoutError:
            raise ControlPlaneUnreachable(f"{self.url}: no answer within {self._timeout_s} s") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise ControlPlaneBadResponse(f"{self.url}: truncated or oversized answer") from exc
        except OSError as exc:  # refused, reset, unreachable, TLS failures
            raise ControlPlaneUnreachable(f"{self.url}: {exc}") from exc
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await wait_for(writer.wait_closed(), 1.0)

        try:
            payload = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError, RecursionError):
            payload = None
        if 200 <= status < 300:
            if not isinstance(payload, dict):
                raise ControlPlaneBadResponse(f"{self.url}: answer is not a JSON object")
            return status, payload
        raise _refusal_from(status, headers, payload)


def _refusal_from(status: int, headers: Mapping[str, str], payload: object) -> CredentialRefused:
    error: str = _REASONS.get(status, "refused")
    code: str | None = None
    retry_after_ms: int | None = None
    if isinstance(payload, dict):
        raw_error, raw_code = payload.get("error"), payload.get("code")
        if isinstance(raw_error, dict):  # {error: {code, message}}, as some services answer
            raw_code = raw_code or raw_error.get("code")
            raw_error = raw_error.get("message")
        if isinstance(raw_error, str) and raw_error:
            error = raw_error[:500]
        if isinstance(raw_code, str) and raw_code:
            code = raw_code[:64].lower()
        retry = payload.get("retry_after_ms")
        if isinstance(retry, int) and not isinstance(retry, bool) and retry >= 0:
            retry_after_ms = retry
    if retry_after_ms is None and headers.get("retry-after", "").isdigit():
        retry_after_ms = int(headers["retry-after"]) * 1000
    return CredentialRefused(status, error, code, retry_after_ms=retry_after_ms)
