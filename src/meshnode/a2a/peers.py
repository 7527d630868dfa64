"""The outbound bridge's view of a peer: its card, the parts mapping, one call's state.

Pure (no I/O): what :mod:`meshnode.a2a.outbound` and :mod:`meshnode.a2a.stream`
share about a peer — its ``[a2a.peers.<name>]`` settings, what its Agent Card
declares, how mesh input and output map onto A2A parts, the A2A task states,
and :class:`Sent`, the record of one message sent and its task.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import nacl.signing
from a2a.client.card_resolver import parse_agent_card
from a2a.types.a2a_pb2 import AgentCard
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH

from meshnode.node.gateway import CallContext
from meshnode.protocol.a2a_extension import EXTENSION_URI, parse_duration, parse_verify_key

__all__ = [
    "INTERRUPTED_STATES",
    "OPEN_STATES",
    "TERMINAL_STATES",
    "PeerCard",
    "PeerSettings",
    "Sent",
    "card_url_of",
    "input_parts",
    "output_of_parts",
    "read_card",
    "report_of",
]

log = logging.getLogger("meshnode.a2a.outbound")

#: A2A task states that end a task, by their mesh status.
TERMINAL_STATES = {
    "TASK_STATE_COMPLETED": "completed",
    "TASK_STATE_FAILED": "failed",
    "TASK_STATE_CANCELED": "canceled",
    "TASK_STATE_REJECTED": "rejected",
}
#: A2A task states that pause a task for its caller, by their mesh status.
INTERRUPTED_STATES = {
    "TASK_STATE_INPUT_REQUIRED": "input_required",
    "TASK_STATE_AUTH_REQUIRED": "auth_required",
}

# --- parts ----------------------------------------------------------------------


def input_parts(value: Any) -> list[dict[str, Any]]:
    """A mesh request input as A2A parts (ProtoJSON): a string is one text part,
    anything else (an object, a list, a number) one data part; None is an empty
    data object (a Message needs a part)."""
    if isinstance(value, str):
        return [{"text": value}]
    return [{"data": {} if value is None else value}]


def output_of_parts(parts: list[dict[str, Any]]) -> Any:
    """A2A parts as a mesh output: one data part → its data; only text parts → the
    text joined; nothing → None; anything else → the parts as sent (ProtoJSON)."""
    if not parts:
        return None
    if len(parts) == 1 and "data" in parts[0]:
        return parts[0]["data"]
    if all("text" in p for p in parts):
        return "".join(str(p["text"]) for p in parts)
    return parts


# --- peers and cards ------------------------------------------------------------


@dataclass(frozen=True)
class PeerSettings:
    """One ``[a2a.peers.<name>]`` table, typed."""

    url: str
    contract_price: Decimal
    audience: str | None = None
    issuer_key: str | None = None
    timeout_s: float = 30.0
    card_ttl_s: float = 600.0


@dataclass(frozen=True)
class PeerCard:
    """What the bridge read from a peer's Agent Card."""

    card: AgentCard
    raw: dict[str, Any]
    fetched_at: float
    #: The card declares the mesh extension.
    mesh: bool
    #: ``params.idempotencyRetention`` in seconds; None when not declared.
    retention_s: float | None
    audience: str | None
    issuer_key: nacl.signing.VerifyKey | None


def card_url_of(url: str) -> str:
    """The card URL of a configured peer URL (a ``….json`` URL is the card itself)."""
    if url.split("?", 1)[0].endswith(".json"):
        return url
    return url.rstrip("/") + AGENT_CARD_WELL_KNOWN_PATH


def read_card(raw: Mapping[str, Any], settings: PeerSettings, *, now: float) -> PeerCard:
    """Interpret a fetched card: the extension's declaration and what it binds."""
    card = parse_agent_card(copy.deepcopy(dict(raw)))
    declared: Mapping[str, Any] | None = None
    caps = raw.get("capabilities")
    for ext in (caps.get("extensions") if isinstance(caps, Mapping) else None) or []:
        if isinstance(ext, Mapping) and ext.get("uri") == EXTENSION_URI:
            declared = ext
            break
    params = declared.get("params") if declared is not None else None
    params = params if isinstance(params, Mapping) else {}
    retention: float | None = None
    if "idempotencyRetention" in params:
        try:
            retention = parse_duration(params["idempotencyRetention"])
        except ValueError:
            log.warning("A2A peer %s declares a malformed idempotencyRetention %r: no resends",
                        settings.url, params["idempotencyRetention"])
    audience = settings.audience or _str(params.get("application")) or _str(raw.get("name"))
    key_text = settings.issuer_key or _str(params.get("issuerKey"))
    key: nacl.signing.VerifyKey | None = None
    if key_text:
        try:
            key = parse_verify_key(key_text)
        except ValueError:
            log.warning("A2A peer %s: its card's issuerKey is not an Ed25519 key; reports unverifiable",
                        settings.url)
    return PeerCard(card, dict(raw), now, declared is not None, retention, audience, key)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None

#: A2A task states still open, by their mesh status.
OPEN_STATES = {"TASK_STATE_SUBMITTED": "submitted", "TASK_STATE_WORKING": "working"}


def report_of(container: Mapping[str, Any]) -> str | None:
    """``metadata[uri].report`` of a task or a status update (ProtoJSON), if any."""
    meta = container.get("metadata")
    ext = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
    token = ext.get("report") if isinstance(ext, Mapping) else None
    return token if isinstance(token, str) else None


# --- one call -------------------------------------------------------------------


@dataclass
class Sent:
    """One message sent to a peer, and what is known of its task so far."""

    name: str
    settings: PeerSettings
    peer: PeerCard
    call: CallContext
    message_id: str
    sent_hash: str
    headers: dict[str, str]
    mesh: bool = False
    task_id: str | None = None
    #: The task reached a terminal or interrupted state (nothing left to cancel).
    finished: bool = False
