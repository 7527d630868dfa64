"""Inbound protections (AgentMesh §22) and the relay guard (§21.2), as pure parts.

What stands between "the envelope verified" and "the handler ran":

* :class:`DedupMemory`: bounded (from, id) memory, first-seen eviction (§22.2);
* :func:`check_freshness` with a :class:`FreshnessWindow` (§22.3);
* :func:`check_addressing`: byte-exact ``to`` (§22.4);
* :func:`exceeds_hop_bound`: ``meta.hops`` over the relay bound (§21.2);
* :func:`measure_sender_text` and :func:`exceeds_size_cap` (§22.5), measuring
  non-prose as :func:`~.js_json.compact_json` writes it;
* :data:`REFUSAL_RULES`: who learns about each refusal (§22.7);
* :class:`InboundGuard`: all of the above, per receiving agent, in order.

Fencing (§22.6) lives in :mod:`meshnode.protocol.fencing`.

Nothing here reads a clock or does I/O: ``now_ms`` (epoch milliseconds) is a
parameter. Every check assumes the envelope's signature was verified first
(§22.1): the dedup memory is keyed on ``from``, and an unverified ``from`` would
make it forgeable.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from .envelope import hops as envelope_hops
from .errors import error_object
from .fencing import LADDER_FIELDS, LadderField
from .js_json import compact_json  # re-exported: §22.5 measures with it
from .timeutil import try_parse_rfc3339

__all__ = [
    "ABSENT",
    "DEFAULT_DEDUP_CAPACITY",
    "DEFAULT_FRESHNESS_WINDOW",
    "DEFAULT_MAX_HOPS",
    "DEFAULT_MAX_INBOUND_CHARS",
    "LOCAL_SIGNAL_DUPLICATE",
    "LOCAL_SIGNAL_HOPS_EXCEEDED",
    "LOCAL_SIGNAL_MISADDRESSED",
    "LOCAL_SIGNAL_OVERSIZE",
    "LOCAL_SIGNAL_STALE",
    "REFUSAL_RULES",
    "DedupMemory",
    "DeliverySource",
    "FreshnessWindow",
    "InboundGuard",
    "InboundVerdict",
    "Protection",
    "RefusalRule",
    "SenderAnswer",
    "SenderText",
    "check_addressing",
    "check_freshness",
    "compact_json",
    "context_too_large_error",
    "exceeds_hop_bound",
    "exceeds_size_cap",
    "measure_sender_text",
    "sender_body",
    "utf16_length",
]

DEFAULT_DEDUP_CAPACITY: Final = 5000
DEFAULT_MAX_INBOUND_CHARS: Final = 65536
DEFAULT_MAX_HOPS: Final = 3

#: The §22.7 security-warning name of a size-cap refusal (pinned by the spec).
LOCAL_SIGNAL_OVERSIZE: Final = "inbound_oversize"
# The names of the other local signals are this implementation's own: §22.7
# requires that the refusal be visible, not what it is called.
LOCAL_SIGNAL_DUPLICATE: Final = "inbound_duplicate"
LOCAL_SIGNAL_STALE: Final = "inbound_stale"
LOCAL_SIGNAL_MISADDRESSED: Final = "inbound_misaddressed"
LOCAL_SIGNAL_HOPS_EXCEEDED: Final = "inbound_hops_exceeded"


# --------------------------------------------------------------------------- §22.2


class DedupMemory:
    """The bounded (from, id) memory of §22.2.

    :meth:`check_and_remember` records every pair it is shown, before any later
    check judges the envelope ("remember first, then judge"): a stale envelope
    refused on the live path must still be refused as a duplicate when the
    mailbox drain delivers it again. When full, the pair seen first is evicted
    first; a repeat does not refresh a pair's age.

    The memory is bounded by construction (``capacity >= 1``). It holds a
    keyed 64-bit hash of each pair, not the pair: a node keeps one memory per
    agent (5,000 pairs by the spec's recommendation), and the strings of a
    decoded pair cost ~360 bytes an entry against ~75 for a hash (1.8 MB
    against 0.4 MB a busy agent, times the roster). The key is secret and
    random per process, so no sender can choose an id whose hash collides with
    another party's pair; a chance collision (~5,000 in 2**64 per check) would
    refuse one message as a duplicate. Nothing is lost at a restart: the node
    rebuilds the memory from the inbox's durable pairs (:meth:`restore`), at
    the agent's first delivery.
    """

    __slots__ = ("_capacity", "_order", "_seen")

    def __init__(self, capacity: int = DEFAULT_DEDUP_CAPACITY) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(
                "dedup capacity must be an integer >= 1: an unbounded memory fed from "
                "the wire is a remote memory-exhaustion primitive (§22.2)"
            )
        self._capacity = capacity
        # A deque for the first-seen order and a dict for membership: both O(1).
        # A dict used as a FIFO costs O(evicted) per eviction, because
        # next(iter(d)) walks the holes that front deletions leave behind. The
        # dict (values unused) rather than a set: at 5,000 keys a set's table
        # takes ~105 bytes a key, the dict's compact one ~30.
        self._order: deque[int] = deque()
        self._seen: dict[int, None] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, pair: object) -> bool:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return False
        sender, msg_id = pair
        if not isinstance(sender, str) or not isinstance(msg_id, str):
            return False
        return _pair_digest(sender, msg_id) in self._seen

    def check_and_remember(self, sender: str, msg_id: str) -> bool:
        """Record (sender, msg_id); True when the pair was already remembered."""
        key = _pair_digest(sender, msg_id)
        if key in self._seen:
            return True
        self._seen[key] = None
        self._order.append(key)
        if len(self._order) > self._capacity:
            del self._seen[self._order.popleft()]
        return False

    def forget(self, sender: str, msg_id: str) -> None:
        """Drop one pair (O(n); for the rare envelope that was remembered and
        then could not be handled at all, so a later delivery must still run it)."""
        key = _pair_digest(sender, msg_id)
        if key in self._seen:
            del self._seen[key]
            self._order.remove(key)

    def copy(self) -> DedupMemory:
        """An independent memory in this one's state (same pairs, same order)."""
        twin = DedupMemory(self._capacity)
        twin._order = self._order.copy()
        twin._seen = dict(self._seen)
        return twin

    @classmethod
    def from_entries(
        cls, entries: Iterable[Sequence[str]], capacity: int = DEFAULT_DEDUP_CAPACITY
    ) -> DedupMemory:
        """Restore a memory from (from, id) pairs in first-seen order (tuples,
        or two-element lists as a store gives them back).

        Restoring replays the pairs, so more pairs than ``capacity`` keep only
        the newest, and a repeated pair keeps its first position.
        """
        memory = cls(capacity)
        memory.restore(entries)
        return memory

    def restore(self, entries: Iterable[Sequence[str]]) -> None:
        """Add pairs remembered before this memory was made (a store's, oldest
        first), as older than any pair it already holds."""
        held = self._order
        self._order, self._seen = deque(), {}
        remember = self.check_and_remember
        for entry in entries:
            if isinstance(entry, str) or len(entry) != 2:
                raise ValueError(f"a dedup entry is a (from, id) pair, not {entry!r}")
            sender, msg_id = entry
            if not isinstance(sender, str) or not isinstance(msg_id, str):
                raise ValueError(f"a dedup entry is a pair of strings, not {entry!r}")
            remember(sender, msg_id)
        for key in held:  # the newest: kept last, a repeat keeping its first position
            if key not in self._seen:
                self._seen[key] = None
                self._order.append(key)
                if len(self._order) > self._capacity:
                    del self._seen[self._order.popleft()]


# Mixed into every pair's hash: with it, even an operator's fixed PYTHONHASHSEED
# (which makes str hashes predictable) leaves the hash of a pair unknowable to a
# sender, so no sender can aim a collision at another party's pair.
_PAIR_SALT: Final = os.urandom(16).hex()


def _pair_digest(sender: str, msg_id: str) -> int:
    """The memory's key for (sender, msg_id): a 64-bit hash keyed by the
    interpreter's per-process hash secret and a per-process random salt.

    CPython's tuple hash, not a cryptographic one, because it is what the old
    key (the tuple in a set) already cost per check (~0.1 µs) and a node
    rebuilds 5,000 per busy agent at every start: BLAKE2b took ~0.5 µs a pair,
    ~4 ms more per busy agent, 40 s more at 10,000. Its inputs, the str hashes,
    are SipHash outputs under the secret.
    """
    return hash((_PAIR_SALT, sender, msg_id))


# --------------------------------------------------------------------------- §22.3


class DeliverySource(StrEnum):
    """The path an envelope arrived on, which selects its maximum age (§22.3).

    The node's one delivery-path enum. Event subscriptions (§6.7) are live
    deliveries; ``LOCAL`` (between two agents of one node, §4.7) is judged
    with the live window, so local and remote delivery are equivalent;
    ``MAILBOX`` is anything out of a buffer (the drain, a durable consumer).
    """

    LIVE = "live"
    LOCAL = "local"
    MAILBOX = "mailbox"


@dataclass(frozen=True, slots=True)
class FreshnessWindow:
    """The §22.3 window, in milliseconds. Configurable, never disableable.

    Every bound must be a positive integer: §22.3 forbids offering a way to
    turn the window off, because the bounded dedup memory is only sufficient
    inside it. The mailbox age must not exceed the mailbox retention actually
    configured (§22.3); that is the caller's to enforce.
    """

    max_clock_skew_ahead_ms: int = 300_000
    max_age_live_ms: int = 600_000
    max_age_mailbox_ms: int = 604_800_000

    def __post_init__(self) -> None:
        for name in ("max_clock_skew_ahead_ms", "max_age_live_ms", "max_age_mailbox_ms"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(
                    f"{name} must be a positive integer of milliseconds (got {value!r}); "
                    "the freshness window may be tuned but never disabled (§22.3)"
                )

    def max_age_ms(self, source: DeliverySource | str) -> int:
        """The maximum age for ``source``; an unknown source is an error, never live."""
        if source == DeliverySource.LIVE or source == DeliverySource.LOCAL:
            return self.max_age_live_ms
        if source == DeliverySource.MAILBOX:
            return self.max_age_mailbox_ms
        raise ValueError(f"unknown delivery source {source!r}; expected 'live', 'local' or 'mailbox'")


DEFAULT_FRESHNESS_WINDOW: Final = FreshnessWindow()


def _has_sub_microsecond_part(ts: str) -> bool:
    """True when ``ts`` has non-zero fraction digits beyond the sixth.

    parse_rfc3339 truncates to microseconds; this tells the one comparison
    that cares (exact equality at the future bound) that the true instant is
    strictly later than the truncated one.
    """
    dot = ts.find(".")
    if dot < 0:
        return False
    end = dot + 1
    while end < len(ts) and ts[end].isdigit():
        end += 1
    return ts[dot + 7 : end].strip("0") != ""


def check_freshness(
    ts: object,
    now_ms: int,
    source: DeliverySource | str,
    window: FreshnessWindow = DEFAULT_FRESHNESS_WINDOW,
) -> bool:
    """True when ``ts`` is inside the §22.3 window at ``now_ms``.

    ``ts`` must be an RFC 3339 date-time in any form (``Z`` or a numeric
    offset); anything else (empty, unparseable, not a string) is refused.
    With drift = now - ts: refused when drift < -max_clock_skew_ahead, else
    accepted when drift <= max_age(source). Both bounds are inclusive and the
    future bound is the same on every path. Compared exactly in microseconds.
    An unknown ``source`` raises ValueError (it never falls back to a window).
    """
    return _is_fresh(ts, now_ms, window.max_age_ms(source), window.max_clock_skew_ahead_ms)


def _is_fresh(ts: object, now_ms: int, max_age_ms: int, max_skew_ahead_ms: int) -> bool:
    ts_us = try_parse_rfc3339(ts)
    if ts_us is None:
        return False
    assert isinstance(ts, str)  # try_parse_rfc3339 reads only strings
    now_us = now_ms * 1000
    latest_us = now_us + max_skew_ahead_ms * 1000
    if ts_us > latest_us or (ts_us == latest_us and _has_sub_microsecond_part(ts)):
        return False
    return now_us - ts_us <= max_age_ms * 1000


# --------------------------------------------------------------------------- §22.4


def check_addressing(envelope: Mapping[str, Any], self_id: str) -> bool:
    """True when the envelope may be delivered to ``self_id`` (§22.4).

    An absent ``to`` is accepted. A present ``to`` must be exactly ``self_id``,
    code point for code point: no case folding, trimming or normalisation. An
    explicit ``null`` is present and is not this agent's id, so it is refused.
    """
    if "to" not in envelope:
        return True
    to = envelope["to"]
    return type(to) is str and to == self_id


# --------------------------------------------------------------------------- §21.2


def exceeds_hop_bound(envelope: Mapping[str, Any], max_hops: int = DEFAULT_MAX_HOPS) -> bool:
    """True when ``meta.hops`` is over the relay bound (§21.2: drop when hops > 3).

    An absent counter is 0. A malformed one is left to envelope validation,
    which refuses it before this check runs.
    """
    return envelope_hops(envelope) > max_hops


# --------------------------------------------------------------------------- §22.5


class _Absent:
    """The type of :data:`ABSENT`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


#: A missing payload: distinct from JSON ``null`` (which measures 4), it measures 0.
ABSENT: Final = _Absent()


def utf16_length(text: str) -> int:
    """The length of ``text`` in UTF-16 code units (U+1F600 counts 2).

    A lone surrogate (which JSON can carry as an escape) counts 1, as in
    ECMAScript.
    """
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


@dataclass(frozen=True, slots=True)
class SenderText:
    """What the §22.5 ladder found in a payload.

    * ``text``: the sender text (prose), or None when what was measured is not
      prose (a non-string rung, a structured or null payload);
    * ``measured``: the string that was measured (``text`` itself, or compact
      JSON, or a type name; empty for an absent payload);
    * ``length``: ``measured`` in UTF-16 code units;
    * ``field``: where ``text`` came from (``"self"`` for a bare string
      payload), or None when there is no sender text.
    """

    text: str | None
    measured: str
    length: int
    field: LadderField | None


_NOTHING_MEASURED: Final = SenderText(None, "", 0, None)


def _prose(text: str, field: LadderField) -> SenderText:
    return SenderText(text, text, utf16_length(text), field)


def _not_prose(value: Any) -> SenderText:
    measured = compact_json(value)
    return SenderText(None, measured, utf16_length(measured), None)


def measure_sender_text(payload: Any) -> SenderText:
    """Walk the §22.5 extraction ladder over ``payload`` and measure the result.

    1. a string payload is the sender text;
    2. else the first of text, message, prompt that is present and not null:
       a string is the sender text, anything else is measured as compact JSON
       and there is no sender text;
    3. else the whole payload is measured as compact JSON.

    :data:`ABSENT` (no payload at all) measures 0.
    """
    if isinstance(payload, str):
        return _prose(payload, "self")
    if payload is ABSENT:
        return _NOTHING_MEASURED
    if isinstance(payload, Mapping):
        for field in LADDER_FIELDS:
            value = payload.get(field)
            if value is None:
                continue
            if isinstance(value, str):
                return _prose(value, field)
            return _not_prose(value)
    return _not_prose(payload)


def exceeds_size_cap(length: int, max_inbound_chars: int = DEFAULT_MAX_INBOUND_CHARS) -> bool:
    """True when ``length`` is strictly greater than the cap; a cap of 0 means no cap."""
    return max_inbound_chars != 0 and length > max_inbound_chars


def sender_body(envelope: Mapping[str, Any]) -> Any:
    """The part of an envelope that reaches a handler, which §22.5 measures and
    §22.6 frames: ``payload.input`` of a request (§6.4), otherwise the whole
    payload; :data:`ABSENT` when the envelope carries no payload."""
    if "payload" not in envelope:
        return ABSENT
    payload = envelope["payload"]
    if envelope.get("type") == "request" and isinstance(payload, Mapping) and "input" in payload:
        return payload["input"]
    return payload


def context_too_large_error(measured_chars: int, max_inbound_chars: int) -> dict[str, Any]:
    """The §12.1 error object a size-cap refusal answers with (CONTEXT_TOO_LARGE,
    not retryable). The message is informative, not part of the contract."""
    return error_object(
        "CONTEXT_TOO_LARGE",
        f"inbound sender text is {measured_chars} UTF-16 code units; "
        f"this agent accepts at most {max_inbound_chars} (max_inbound_chars)",
        # The same details the sender-side pre-flight (§6.4b) refuses with.
        {"limit": "max_inbound_chars", "cap": max_inbound_chars, "measured": measured_chars},
    )


# --------------------------------------------------------------------------- §22.7


class Protection(StrEnum):
    """The inbound protections, in the order :class:`InboundGuard` applies them."""

    DUPLICATE = "duplicate"
    FRESHNESS = "freshness"
    ADDRESSING = "addressing"
    HOPS = "hops"
    SIZE_CAP = "size_cap"


@dataclass(frozen=True, slots=True)
class RefusalRule:
    """One row of the §22.7 refusal table: who learns about a refusal.

    * ``refusal``: the row's name (``duplicate``, ``stale``, ``misaddressed``,
      ``hops_exceeded``, ``size_cap``);
    * ``answers_sender``: whether an error respond goes back to the sender,
      with ``error_code`` and ``retryable`` when it does;
    * ``local_signal``: the name of the signal raised to the recipient, and
      ``local_signal_required`` whether raising it is a MUST (else SHOULD);
    * the handler is never invoked for a refused envelope.
    """

    protection: Protection
    refusal: str
    section: str
    answers_sender: bool
    error_code: str | None
    retryable: bool | None
    local_signal: str
    local_signal_required: bool
    handler_invoked: bool = False


def _silent_rule(protection: Protection, refusal: str, section: str, signal: str) -> RefusalRule:
    return RefusalRule(
        protection=protection,
        refusal=refusal,
        section=section,
        answers_sender=False,
        error_code=None,
        retryable=None,
        local_signal=signal,
        local_signal_required=False,
    )


#: §22.7 as data. Only the size cap answers the sender, because only its
#: trigger is something an honest sender can fix; answering the others would
#: tell a replayer what still works and sign replies to messages never sent.
REFUSAL_RULES: Final[Mapping[Protection, RefusalRule]] = {
    Protection.DUPLICATE: _silent_rule(
        Protection.DUPLICATE, "duplicate", "§22.2", LOCAL_SIGNAL_DUPLICATE
    ),
    Protection.FRESHNESS: _silent_rule(Protection.FRESHNESS, "stale", "§22.3", LOCAL_SIGNAL_STALE),
    Protection.ADDRESSING: _silent_rule(
        Protection.ADDRESSING, "misaddressed", "§22.4", LOCAL_SIGNAL_MISADDRESSED
    ),
    Protection.HOPS: _silent_rule(
        Protection.HOPS, "hops_exceeded", "§21.2", LOCAL_SIGNAL_HOPS_EXCEEDED
    ),
    Protection.SIZE_CAP: RefusalRule(
        protection=Protection.SIZE_CAP,
        refusal="size_cap",
        section="§22.5",
        answers_sender=True,
        error_code="CONTEXT_TOO_LARGE",
        retryable=False,
        local_signal=LOCAL_SIGNAL_OVERSIZE,
        local_signal_required=True,
    ),
}


@dataclass(frozen=True, slots=True)
class SenderAnswer:
    """The error respond a refusal owes the sender (§22.7, §12.3): a respond
    envelope with this ``error``, ``in_reply_to`` the request's id and ``to``
    the request's ``from``. Sent wherever a reply path exists."""

    error: dict[str, Any]
    in_reply_to: str
    to: str


@dataclass(frozen=True, slots=True)
class InboundVerdict:
    """The outcome of :meth:`InboundGuard.check`.

    Accepted: ``accepted`` is True, ``measurement`` holds the §22.5 result
    (reuse it rather than measuring again). Refused: ``protection`` and
    ``rule`` say which protection refused and who must learn of it;
    ``answer`` is the error respond owed to the sender (size cap only), and
    ``local_signal`` the signal to raise to the recipient.
    """

    accepted: bool
    protection: Protection | None = None
    rule: RefusalRule | None = None
    reason: str = ""
    measurement: SenderText | None = None
    answer: SenderAnswer | None = None

    @property
    def answers_sender(self) -> bool:
        return self.answer is not None

    @property
    def local_signal(self) -> str | None:
        return self.rule.local_signal if self.rule is not None else None

    @property
    def local_signal_required(self) -> bool:
        return self.rule is not None and self.rule.local_signal_required


def _silent_refusal(protection: Protection, reason: str) -> InboundVerdict:
    return InboundVerdict(False, protection, REFUSAL_RULES[protection], reason)


# The silent refusals carry nothing per-message, so they are built once.
_DUPLICATE: Final = _silent_refusal(Protection.DUPLICATE, "(from, id) already seen")
_STALE: Final = _silent_refusal(Protection.FRESHNESS, "ts outside the freshness window")
_MISADDRESSED: Final = _silent_refusal(Protection.ADDRESSING, "to names another agent")
_HOPS_EXCEEDED: Final = _silent_refusal(Protection.HOPS, "meta.hops over the relay bound")

_BODY_FROM_ENVELOPE: Final = object()


class InboundGuard:
    """The §22.2-§22.5 protections and the §21.2 relay guard for one receiving agent.

    :meth:`check` applies, in this order: remember (dedup), freshness (window
    by delivery source), addressing, hops, size cap. The dedup step comes
    first and records every envelope it sees (§22.2's normative ordering); the
    others are each sufficient to refuse. Framing (§22.6) is a rewrite, not a
    refusal, and is applied afterwards with :func:`meshnode.protocol.fencing.frame_payload`.

    Run it on every delivery path (live inbox, mailbox drain, event
    subscriptions), and only on envelopes whose signature has been verified.
    """

    __slots__ = ("_max_hops", "_max_inbound_chars", "_memory", "_self_id", "_window")

    def __init__(
        self,
        self_id: str,
        *,
        window: FreshnessWindow = DEFAULT_FRESHNESS_WINDOW,
        max_inbound_chars: int = DEFAULT_MAX_INBOUND_CHARS,
        max_hops: int = DEFAULT_MAX_HOPS,
        memory: DedupMemory | None = None,
    ) -> None:
        if not isinstance(self_id, str) or not self_id:
            raise ValueError("self_id must be this agent's id")
        if not isinstance(window, FreshnessWindow):
            raise TypeError("window must be a FreshnessWindow")
        if type(max_inbound_chars) is not int or max_inbound_chars < 0:
            raise ValueError(
                "max_inbound_chars must be an integer >= 0 (0 explicitly means no cap)"
            )
        if type(max_hops) is not int or max_hops < 0:
            raise ValueError("max_hops must be a non-negative integer")
        self._self_id = self_id
        self._window = window
        self._max_inbound_chars = max_inbound_chars
        self._max_hops = max_hops
        self._memory = memory if memory is not None else DedupMemory()

    # Read-only: settings are validated once, here; a new configuration is a new
    # guard (pass the old guard's memory to keep what it remembers).
    @property
    def self_id(self) -> str:
        return self._self_id

    @property
    def window(self) -> FreshnessWindow:
        return self._window

    @property
    def max_inbound_chars(self) -> int:
        return self._max_inbound_chars

    @property
    def max_hops(self) -> int:
        return self._max_hops

    @property
    def memory(self) -> DedupMemory:
        return self._memory

    def check(
        self,
        envelope: Mapping[str, Any],
        *,
        source: DeliverySource | str,
        now_ms: int,
        body: Any = _BODY_FROM_ENVELOPE,
    ) -> InboundVerdict:
        """Judge one verified inbound envelope delivered on ``source`` at ``now_ms``.

        ``body`` is what the handler would receive, which the size cap
        measures; by default it is :func:`sender_body` of the envelope. An
        unknown ``source`` raises ValueError before anything is remembered.
        """
        window = self._window
        max_age_ms = window.max_age_ms(source)
        if self._memory.check_and_remember(envelope["from"], envelope["id"]):
            return _DUPLICATE
        if not _is_fresh(envelope.get("ts"), now_ms, max_age_ms, window.max_clock_skew_ahead_ms):
            return _STALE
        if not check_addressing(envelope, self._self_id):
            return _MISADDRESSED
        if envelope_hops(envelope) > self._max_hops:
            return _HOPS_EXCEEDED
        measurement = measure_sender_text(
            sender_body(envelope) if body is _BODY_FROM_ENVELOPE else body
        )
        if exceeds_size_cap(measurement.length, self._max_inbound_chars):
            return InboundVerdict(
                False,
                Protection.SIZE_CAP,
                REFUSAL_RULES[Protection.SIZE_CAP],
                "sender text over max_inbound_chars",
                measurement,
                SenderAnswer(
                    context_too_large_error(measurement.length, self._max_inbound_chars),
                    envelope["id"],
                    envelope["from"],
                ),
            )
        return InboundVerdict(True, measurement=measurement)
