"""The control plane's HTTP/1.1 server side: request parsing, limits, responses."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .wire import (
    _CONTROL_CHARS,
    _LINGER_BYTES,
    _LINGER_S,
    _MAX_HEADERS,
    _REASONS,
    _REQUEST_LINE,
    _TOKEN,
    MAX_REQUEST_BODY,
    MAX_REQUEST_HEAD,
    CredentialRequestError,
    _malformed,
)

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

# --- HTTP/1.1 (server side) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def _parse_head_lines(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """Split a head (without its final blank line) into its first line and headers."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line or "\x00" in line for line in lines):
        raise CredentialRequestError(400, "bare CR or LF in the header section", "malformed_request")
    if len(lines) - 1 > _MAX_HEADERS:
        raise CredentialRequestError(431, "too many header fields", "headers_too_large")
    fields: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            # Also refuses obsolete line folding (a line starting with SP/HT).
            raise CredentialRequestError(400, "malformed header field", "malformed_request")
        value = value.strip(" \t")
        if _CONTROL_CHARS.search(value):
            raise CredentialRequestError(400, "control character in a header", "malformed_request")
        fields.append((name.lower(), value))
    return lines[0], fields


async def _read_request(
    reader: asyncio.StreamReader, *, head_timeout_s: float | None = None
) -> _Request:
    """Read one request; the head must arrive within ``head_timeout_s`` (TimeoutError)."""
    try:
        async with asyncio.timeout(head_timeout_s):
            head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise CredentialRequestError(
            431, f"request line and headers exceed {MAX_REQUEST_HEAD} bytes", "headers_too_large"
        ) from None
    if len(head) > MAX_REQUEST_HEAD:
        raise CredentialRequestError(
            431, f"request line and headers exceed {MAX_REQUEST_HEAD} bytes", "headers_too_large"
        )
    first, fields = _parse_head_lines(head[:-4])
    match = _REQUEST_LINE.fullmatch(first)
    if match is None:
        raise CredentialRequestError(400, "malformed request line", "malformed_request")
    method, target, minor = match.groups()
    headers: dict[str, str] = {}
    for name, value in fields:
        if name in headers:
            if name in ("content-length", "transfer-encoding", "host", "content-type"):
                raise CredentialRequestError(400, f"repeated {name} header", "malformed_request")
            headers[name] += ", " + value
        else:
            headers[name] = value
    if minor == "1" and "host" not in headers:
        raise CredentialRequestError(400, "HTTP/1.1 request without Host", "malformed_request")
    if "transfer-encoding" in headers:
        # Only Content-Length framing: one framing, no request smuggling.
        raise CredentialRequestError(
            501, "Transfer-Encoding is not supported; send Content-Length", "not_implemented"
        )
    length = 0
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or len(text) > 9:
            raise CredentialRequestError(400, "malformed Content-Length", "malformed_request")
        length = int(text)
        if length > MAX_REQUEST_BODY:
            raise CredentialRequestError(
                413, f"request body exceeds {MAX_REQUEST_BODY} bytes", "payload_too_large"
            )
    elif method == "POST":
        raise CredentialRequestError(411, "POST requires Content-Length", "length_required")
    body = await reader.readexactly(length) if length else b""
    return _Request(method, target.split("?", 1)[0], headers, body)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_body(request: _Request) -> object:
    content_type = request.headers.get("content-type")
    if content_type is not None and content_type.split(";")[0].strip().lower() != "application/json":
        raise CredentialRequestError(
            415, "the request body must be application/json", "unsupported_media_type"
        )
    try:
        return json.loads(request.body, object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _malformed("request body is not a JSON object") from None


def _response_bytes(
    status: int, payload: Mapping[str, Any], extra: Mapping[str, str] | None = None
) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    headers = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Cache-Control": "no-store",
        "Connection": "close",
        **(extra or {}),
    }
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    return head.encode("latin-1") + b"\r\n" + body


def _utc(epoch_s: int) -> str:
    return _dt.datetime.fromtimestamp(epoch_s, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _remaining(expires_at: int | None, now: int) -> str | None:
    if expires_at is None or expires_at <= now:
        return None
    hours = math.ceil((expires_at - now) / 3600)
    return f"until {_utc(expires_at)} (up to {hours} h)"



async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # After answering a request whose body we did not read, half-close and
    # swallow what the client is still sending: closing with unread data makes
    # the kernel reset the connection, and a reset can destroy the answer
    # before the client reads it.
    if not writer.can_write_eof():
        return
    with contextlib.suppress(Exception):
        writer.write_eof()
        async with asyncio.timeout(_LINGER_S):
            swallowed = 0
            while swallowed < _LINGER_BYTES:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                swallowed += len(chunk)
