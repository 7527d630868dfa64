"""Reading artifact request payloads: typed members or ``INPUT_INVALID`` with the member named (§12).

Split out of :mod:`.artifacts` (issue #16).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Any

from meshnode.protocol.errors import ProtocolError

from .base import Envelope

__all__: list[str] = []  # helpers of the artifact service only


def _b64decode(value: object, member: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError("INPUT_INVALID", f"{member} is base64 text", {"member": member})
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("INPUT_INVALID", f"{member} is not valid base64", {"member": member}) from None


def _payload(env: Envelope) -> dict[str, Any]:
    payload = env.get("payload")
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise ProtocolError("INPUT_INVALID", "the payload is an object", {"member": "payload"})
    return payload


def _int(payload: Mapping[str, Any], name: str, *, default: int | None = None, minimum: int = 0) -> int:
    value = payload.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProtocolError(
            "INPUT_INVALID", f"{name} is an integer of at least {minimum}", {"member": f"payload.{name}"}
        )
    return value


def _str(payload: Mapping[str, Any], name: str, *, required: bool = False, max_len: int = 1024) -> str | None:
    value = payload.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ProtocolError(
            "INPUT_INVALID", f"{name} is a non-empty string (at most {max_len})", {"member": f"payload.{name}"}
        )
    return value



def _new_id() -> str:
    """128 random bits, base64url without padding (§7.5.4, §18.5)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
