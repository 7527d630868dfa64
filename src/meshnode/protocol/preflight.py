"""Sender pre-flight (AgentMesh §6.4b): the recipient's published limits, enforced locally.

Before publishing, a sending SDK checks what it is about to send against what
the recipient declared (§8.1) and what the transport carries (§18.9), and
refuses locally with the *same* code the recipient would answer with, so a
caller's error handling never has to know which side refused. A local refusal
publishes nothing, so nothing is signed, deduplicated or retried.

Checks (each raises :class:`~meshnode.protocol.errors.ProtocolError`):

* sender text vs ``limits.max_inbound_chars`` (default 65,536), measured by the
  §22.5 ladder in UTF-16 code units, strictly greater-than → CONTEXT_TOO_LARGE;
* the serialized envelope vs the transport's maximum payload, at-bound legal →
  CONTEXT_TOO_LARGE with ``details.limit = "transport_max_payload"``;
* ``config.accepted_output`` vs the offering's output modes, declared input
  types vs its input modes → CONTENT_TYPE_NOT_SUPPORTED.

Anything the sender cannot know locally (no manifest, undeclared modes) is left
to the recipient: a pre-flight must never refuse what the recipient would take.

The rate-limit self-throttle (a SHOULD) is a pure calculator:
:func:`next_allowed_at` says when the next request may go.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .envelope import encode_envelope
from .errors import ProtocolError
from .offerings import normalize_request_payload, resolve_modes
from .protections import (
    DEFAULT_MAX_INBOUND_CHARS,
    exceeds_size_cap,
    measure_sender_text,
    sender_body,
)

__all__ = [
    "DEFAULT_MAX_INBOUND_CHARS",
    "check_content_type",
    "check_envelope_size",
    "check_sender_text",
    "media_type_matches",
    "next_allowed_at",
    "preflight_envelope",
    "preflight_request",
    "prune_history",
    "recipient_text_cap",
]


def recipient_text_cap(manifest: Mapping[str, Any] | None) -> int:
    """The recipient's inbound cap: its declared ``limits.max_inbound_chars`` when
    that is a non-negative number, else the §22.5 default. 0 means no cap."""
    if isinstance(manifest, Mapping):
        limits = manifest.get("limits")
        if isinstance(limits, Mapping):
            declared = limits.get("max_inbound_chars")
            if (
                isinstance(declared, (int, float))
                and not isinstance(declared, bool)
                and math.isfinite(declared)
                and declared >= 0
            ):
                return int(declared)
    return DEFAULT_MAX_INBOUND_CHARS


def check_sender_text(body: Any, cap: int) -> int:
    """Refuse ``body`` (what reaches the recipient's handler: a request's
    ``payload.input``) when its §22.5 measurement is strictly greater than
    ``cap``; a cap of 0 disables the check.

    The measurement is the receiver's own function
    (:func:`meshnode.protocol.protections.measure_sender_text`), so the two
    sides cannot disagree. Returns the measured length in UTF-16 code units.
    Raises CONTEXT_TOO_LARGE (not retryable) with
    ``details = {limit: "max_inbound_chars", cap, measured}``.
    """
    measured = measure_sender_text(body).length
    if exceeds_size_cap(measured, cap):
        raise ProtocolError(
            "CONTEXT_TOO_LARGE",
            f"refused before publish: the sender text is {measured} UTF-16 code units, "
            f"over the recipient's inbound cap of {cap}",
            {"limit": "max_inbound_chars", "cap": cap, "measured": measured},
        )
    return measured


def check_envelope_size(envelope_bytes: int, max_payload_bytes: int | None) -> None:
    """Refuse a serialized envelope larger than the transport's maximum payload.

    At the bound is legal. ``max_payload_bytes`` None or ≤ 0 (not yet known)
    skips the check. Raises CONTEXT_TOO_LARGE with
    ``details = {limit: "transport_max_payload", max_payload, envelope_bytes}``;
    the remedy is an Object Store ref part (§18.9).
    """
    if max_payload_bytes is None or max_payload_bytes <= 0:
        return
    if envelope_bytes > max_payload_bytes:
        raise ProtocolError(
            "CONTEXT_TOO_LARGE",
            f"refused before publish: the envelope is {envelope_bytes} bytes, over the "
            f"transport's maximum payload of {max_payload_bytes}; send the content as "
            "an Object Store ref part",
            {
                "limit": "transport_max_payload",
                "max_payload": max_payload_bytes,
                "envelope_bytes": envelope_bytes,
            },
        )


def _media_parts(media_type: str) -> tuple[str, str]:
    essence = media_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = essence.partition("/")
    return kind, subtype or "*"


def media_type_matches(a: str, b: str) -> bool:
    """True when two media types (or ranges) can name the same content:
    parameters and case are ignored, and ``*`` on either side matches."""
    a_type, a_sub = _media_parts(a)
    b_type, b_sub = _media_parts(b)
    if "*" not in (a_type, b_type) and a_type != b_type:
        return False
    return "*" in (a_sub, b_sub) or a_sub == b_sub


def _strings(value: Any) -> list[str]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [v for v in value if isinstance(v, str)]
    return []


def check_content_type(
    manifest: Mapping[str, Any] | None,
    offering_id: str | None,
    accepted_output: Iterable[str] | None = None,
    input_types: Iterable[str] = (),
) -> None:
    """Refuse what the offering's modes (§8.5 resolution) exclude.

    ``accepted_output`` is the request's ``config.accepted_output``: refused
    when none of it matches any resolved output mode. ``input_types`` are the
    media types the sender itself declares for its input (an attached file's
    ``media_type``, an explicit type): each must match a resolved input mode.
    No manifest, an empty ``accepted_output``, or unstated modes refuse nothing.
    Raises CONTENT_TYPE_NOT_SUPPORTED (not retryable).
    """
    wanted = list(accepted_output or ())
    input_types = list(input_types)
    if not isinstance(manifest, Mapping) or (not wanted and not input_types):
        return  # nothing asked for, nothing to refuse: skip the §8.5 resolution (every request pays it)
    modes = resolve_modes(manifest, offering_id)
    output_modes = modes.output_modes
    if (
        wanted
        and output_modes is not None
        and not any(media_type_matches(w, m) for w in wanted for m in output_modes)
    ):
        raise ProtocolError(
            "CONTENT_TYPE_NOT_SUPPORTED",
            f"refused before publish: no requested output type is one offering "
            f"{offering_id!r} produces",
            {
                "offering": offering_id,
                "accepted_output": wanted,
                "output_modes": list(output_modes),
            },
        )
    if modes.input_modes is not None:
        for input_type in input_types:
            if not any(media_type_matches(input_type, m) for m in modes.input_modes):
                raise ProtocolError(
                    "CONTENT_TYPE_NOT_SUPPORTED",
                    f"refused before publish: offering {offering_id!r} does not take "
                    f"{input_type!r}",
                    {
                        "offering": offering_id,
                        "input_type": input_type,
                        "input_modes": list(modes.input_modes),
                    },
                )


def _attached_media_types(payload: Mapping[str, Any]) -> list[str]:
    files = payload.get("files")
    if not isinstance(files, list):
        return []
    return [
        f["media_type"] for f in files if isinstance(f, Mapping) and isinstance(f.get("media_type"), str)
    ]


def _check_request_types(
    payload: Any, recipient_manifest: Mapping[str, Any] | None, input_types: Iterable[str]
) -> None:
    normalized = normalize_request_payload(payload)
    if not isinstance(normalized, Mapping):
        return
    offering = normalized.get("offering")
    config = normalized.get("config")
    accepted = _strings(config.get("accepted_output")) if isinstance(config, Mapping) else []
    check_content_type(
        recipient_manifest,
        offering if isinstance(offering, str) else None,
        accepted,
        [*input_types, *_attached_media_types(normalized)],
    )


def preflight_request(
    payload: Any,
    recipient_manifest: Mapping[str, Any] | None,
    *,
    input_types: Iterable[str] = (),
) -> None:
    """Every payload-level pre-flight check on an outgoing request payload.

    Measures the body the recipient's handler will receive (``payload.input``,
    or the whole payload when it has none, exactly as §22.5's receiver does)
    against the recipient's cap; then checks ``config.accepted_output`` and the
    declared input types (``input_types`` plus any ``files[].media_type``)
    against the target offering's modes. Legacy ``skill`` is read as
    ``offering``. Raises the first refusal.
    """
    request = {"type": "request", "payload": payload}
    check_sender_text(sender_body(request), recipient_text_cap(recipient_manifest))
    _check_request_types(payload, recipient_manifest, input_types)


def preflight_envelope(
    envelope: Mapping[str, Any],
    recipient_manifest: Mapping[str, Any] | None,
    max_payload_bytes: int | None,
    *,
    input_types: Iterable[str] = (),
) -> int:
    """Pre-flight a built (normally signed) envelope just before publishing.

    A request meets the checks of :func:`preflight_request`; every envelope
    then meets the transport size check on its wire bytes. Returns the wire
    size in bytes.
    """
    if envelope.get("type") == "request":
        check_sender_text(sender_body(envelope), recipient_text_cap(recipient_manifest))
        _check_request_types(envelope.get("payload"), recipient_manifest, input_types)
    size = len(encode_envelope(envelope))
    check_envelope_size(size, max_payload_bytes)
    return size


# --- rate-limit self-throttle (§6.4b SHOULD, §8.1 rate_limits) ---------------

_WINDOWS_MS = (("requests_per_second", 1000), ("requests_per_minute", 60_000))


def _declared_rates(limits: Mapping[str, Any] | None) -> list[tuple[int, int]]:
    rates: list[tuple[int, int]] = []
    if not isinstance(limits, Mapping):
        return rates
    for name, window_ms in _WINDOWS_MS:
        value = limits.get(name)
        # A zero or malformed rate is ignored: it cannot mean "wait forever".
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 1
        ):
            rates.append((int(value), window_ms))
    return rates


def next_allowed_at(history: Iterable[int], limits: Mapping[str, Any] | None, now_ms: int) -> int:
    """The earliest instant (epoch ms, ≥ ``now_ms``) the next request may be sent.

    ``history`` holds the send instants of earlier requests to this recipient;
    ``limits`` is its published ``rate_limits``. Each declared rate (per second,
    per minute) is a sliding window: at instant ``x`` the window holds the sends
    with ``x - window < t ≤ x``, and a send is allowed while it holds fewer than
    the rate. Returns ``now_ms`` when a request may go now.
    ``concurrent_tasks`` is not a rate and is not considered here.
    """
    times = sorted(history)
    allowed = now_ms
    for rate, window_ms in _declared_rates(limits):
        if len(times) >= rate:
            allowed = max(allowed, times[-rate] + window_ms)
    return allowed


def prune_history(history: Iterable[int], limits: Mapping[str, Any] | None, now_ms: int) -> list[int]:
    """The sends that can still affect :func:`next_allowed_at` (within the longest
    declared window), sorted; the rest may be forgotten."""
    rates = _declared_rates(limits)
    if not rates:
        return []
    horizon = now_ms - max(window for _, window in rates)
    return sorted(t for t in history if t > horizon)
