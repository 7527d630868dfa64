"""The subject namespace (AgentMesh §14, §18.3, §18.6): the one place subjects are built.

§14.4 makes the SDKs the convention's only legitimate constructors, so every
subject, stream, consumer and key name meshnode uses comes from a function
here, and every value interpolated into one is validated first. A dot in an
id does not corrupt a subject, it *extends* it: a wire-supplied task_id of
``x.y`` would move a publish into a neighbouring namespace, and ``*``/``>``
would widen a subscription into everyone else's. Builders therefore refuse
such values (SubjectError) instead of emitting them.

Three value classes are checked:

* agent and node ids: valid user nkeys (§4.3);
* ids and topics (task_id, context_id, feed topic): ``[A-Za-z0-9_-]{1,128}``;
* other tokens (event domain and type, log level, trace tokens): printable
  ASCII without ``.``, ``*``, ``>`` or whitespace, never empty.

Parsers (``parse_*``) judge subjects that arrive from the transport and
return None for anything that is not exactly the expected shape.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import NamedTuple

from .nkeys import is_valid_public
from .tasks import is_valid_task_id

__all__ = [
    "AGREEMENTS_EVENT_DOMAIN",
    "AGREEMENTS_LOOKUP",
    "AGREEMENTS_REGISTER",
    "AGREEMENTS_REVOKE",
    "ARTIFACTS_FETCH",
    "ARTIFACTS_PUT",
    "ARTIFACTS_REMOVE",
    "ARTIFACTS_STAT",
    "ARTIFACTS_USAGE",
    "FEED_GET",
    "FEED_GRAMMAR",
    "FEED_STREAM",
    "KV_AGREEMENTS",
    "KV_FEED_STATE",
    "KV_REGISTRY",
    "KV_TASKS",
    "MESH_EVENTS",
    "MESH_HEARTBEAT",
    "MESH_LOG",
    "MESH_METERING",
    "METERING_A2A_CHARGE",
    "METERING_EVENTS",
    "METERING_USAGE",
    "MESH_METRICS",
    "MESH_REGISTRY",
    "MESH_TASKS",
    "MESH_TRACE",
    "PEER_PREFIX",
    "PRESENCE_GET",
    "RATING_LEDGER",
    "REGISTRY_DEREGISTER",
    "REGISTRY_DESCRIPTOR_PUT",
    "REGISTRY_DISCOVER",
    "REGISTRY_EVAL_PUT",
    "REGISTRY_REGISTER",
    "TRACE_ALL",
    "FeedSubject",
    "HeartbeatSubject",
    "SubjectError",
    "TaskSubject",
    "agent_inbox",
    "agent_inbox_guarded",
    "check_token",
    "event_consumer_name",
    "event_filter",
    "event_subject",
    "feed_consumer_name",
    "feed_pattern",
    "feed_state_key",
    "feed_subject",
    "heartbeat",
    "inbox_consumer_name",
    "inbox_stream_name",
    "is_reserved",
    "is_valid_id_token",
    "is_valid_token",
    "log_subject",
    "metrics_subject",
    "parse_feed_subject",
    "parse_heartbeat_subject",
    "parse_inbox_subject",
    "parse_register_subject",
    "parse_task_subject",
    "registry_descriptor_digest",
    "registry_descriptor_get",
    "registry_eval_digest",
    "registry_eval_get",
    "registry_get",
    "registry_register",
    "agreement_key",
    "consumers_ensure",
    "consumers_delete",
    "session_all",
    "session_subject",
    "subscription_overlaps_reserved",
    "task_get",
    "task_stream",
    "task_update",
    "task_update_consumer_name",
    "trace_subject",
]


class SubjectError(ValueError):
    """A value that cannot be placed into a subject or a JetStream name."""


# --- token rules -------------------------------------------------------------

_GENERIC_TOKEN = re.compile(r"[\x21-\x7e]+")
_ID_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_FORBIDDEN_IN_TOKEN = frozenset(".*>")


def is_valid_token(value: object) -> bool:
    """True for one subject token: non-empty printable ASCII, no ``.``, ``*``, ``>``
    and no whitespace or control characters."""
    return (
        isinstance(value, str)
        and _GENERIC_TOKEN.fullmatch(value) is not None
        and not _FORBIDDEN_IN_TOKEN.intersection(value)
    )


def is_valid_id_token(value: object) -> bool:
    """True for an id-shaped token: ``[A-Za-z0-9_-]{1,128}``."""
    return isinstance(value, str) and _ID_TOKEN.fullmatch(value) is not None


def _checked(value: object, valid: Callable[[object], bool], what: str, rule: str) -> str:
    """``value`` when ``valid`` holds for it; else SubjectError "``what`` ``rule``: value"."""
    if not valid(value):
        raise SubjectError(f"{what} {rule}: {value!r:.80}")
    assert isinstance(value, str)
    return value


def check_token(value: object, what: str) -> str:
    """Return ``value`` when it is one valid subject token; raise SubjectError naming ``what``."""
    return _checked(value, is_valid_token, what, "is not a single subject token")


def _id(value: object, what: str) -> str:
    return _checked(value, is_valid_id_token, what, "must match [A-Za-z0-9_-]{1,128}")


def _task_id(value: object) -> str:
    return _checked(value, is_valid_task_id, "task_id", "must match [A-Za-z0-9_-]{1,128}")


def _key(value: object, what: str) -> str:
    return _checked(value, is_valid_public, what, "is not a valid user nkey")


def _is_sha256_hex(value: object) -> bool:
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def _digest(value: object) -> str:
    return _checked(value, _is_sha256_hex, "digest", "must be 64 lowercase hex characters")


# --- registry, presence ------------------------------------------------------

REGISTRY_REGISTER = "mesh.registry.register"
REGISTRY_DEREGISTER = "mesh.registry.deregister"
REGISTRY_DISCOVER = "mesh.registry.discover"
REGISTRY_DESCRIPTOR_PUT = "mesh.registry.descriptor.put"
REGISTRY_EVAL_PUT = "mesh.registry.eval.put"
PRESENCE_GET = "mesh.presence.get"


def external_discover(tenant: str) -> str:
    """``mesh.external.{tenant}.discover``: where another tenant's discovery answers
    in an account that imported it (§15.2 step 2's remapped subject, meshnode's
    naming; the embedded mesh makes the import from ``[[mesh.embedded.exports]]``)."""
    return f"mesh.external.{_checked(tenant, is_valid_id_token, 'tenant', 'must be an id-shaped token')}.discover"


CONSUMERS_ENSURE = "mesh.consumers.ensure"
CONSUMERS_DELETE = "mesh.consumers.delete"

# The platform agreement service (§19.5 "registered with the platform";
# meshnode's subjects, not §14.1's: see :mod:`meshnode.services.agreements`).
AGREEMENTS_REGISTER = "mesh.agreements.register"
AGREEMENTS_REVOKE = "mesh.agreements.revoke"
AGREEMENTS_LOOKUP = "mesh.agreements.lookup"
AGREEMENTS_EVENT_DOMAIN = "agreements"
"""Its events: ``mesh.event.agreements.{registered,revoked}``."""


def agreement_key(consumer_owner: str, seller_agent: str, sku: str) -> str:
    """``{owner}.{seller}.{sku}``: the KV key of one agreement record (the SKU id
    is ``[a-z0-9-]{1,64}``, so it can neither add a token nor a wildcard)."""
    if not re.fullmatch(r"[a-z0-9-]{1,64}", sku or ""):
        raise SubjectError(f"sku must match [a-z0-9-]{{1,64}}, got {sku!r}")
    return f"{_key(consumer_owner, 'consumer owner')}.{_key(seller_agent, 'seller agent')}.{sku}"


def consumers_ensure(node_id: str) -> str:
    """``mesh.consumers.ensure.{node_id}``: ask the consumer service for one of
    this node's consumers on a shared stream (meshnode's, not §14.1's:
    see :mod:`meshnode.services.consumers`). Connection-bound like register."""
    return f"{CONSUMERS_ENSURE}.{_key(node_id, 'node id')}"


def consumers_delete(node_id: str) -> str:
    """``mesh.consumers.delete.{node_id}``: delete one of this node's consumers."""
    return f"{CONSUMERS_DELETE}.{_key(node_id, 'node id')}"


def registry_register(node_id: str | None = None) -> str:
    """``mesh.registry.register``, or the connection-bound ``mesh.registry.register.{node_id}``."""
    if node_id is None:
        return REGISTRY_REGISTER
    return f"{REGISTRY_REGISTER}.{_key(node_id, 'node id')}"


def registry_get(agent_id: str) -> str:
    """``mesh.registry.get.{agent_id}``: manifest lookup."""
    return f"mesh.registry.get.{_key(agent_id, 'agent id')}"


def registry_descriptor_get(agent_id: str) -> str:
    """``mesh.registry.descriptor.get.{agent_id}``: current descriptor lookup."""
    return f"mesh.registry.descriptor.get.{_key(agent_id, 'agent id')}"


def registry_descriptor_digest(sha256_hex: str) -> str:
    """``mesh.registry.descriptor.digest.{sha256}``: a descriptor version by digest."""
    return f"mesh.registry.descriptor.digest.{_digest(sha256_hex)}"


def registry_eval_get(agent_id: str) -> str:
    """``mesh.registry.eval.get.{agent_id}``: latest evaluation record."""
    return f"mesh.registry.eval.get.{_key(agent_id, 'agent id')}"


def registry_eval_digest(sha256_hex: str) -> str:
    """``mesh.registry.eval.digest.{sha256}``: an evaluation record by digest."""
    return f"mesh.registry.eval.digest.{_digest(sha256_hex)}"


# --- agents, tasks -----------------------------------------------------------


def agent_inbox(agent_id: str) -> str:
    """``mesh.agent.{agent_id}.inbox``: requests to an agent and responds addressed to it."""
    return f"mesh.agent.{_key(agent_id, 'agent id')}.inbox"


def agent_inbox_guarded(agent_id: str) -> str:
    """``mesh.agent.{agent_id}.inbox.guarded``: the admission relay's private subject
    (EXT-6; the reference deployment's name, not a core subject)."""
    return f"{agent_inbox(agent_id)}.guarded"


def task_update(task_id: str) -> str:
    """``mesh.task.{task_id}.update``: Task state transitions."""
    return f"mesh.task.{_task_id(task_id)}.update"


def task_stream(task_id: str) -> str:
    """``mesh.task.{task_id}.stream``: Task streaming data."""
    return f"mesh.task.{_task_id(task_id)}.stream"


def task_get(task_id: str) -> str:
    """``mesh.task.get.{task_id}``: the task manager's record lookup (request-reply).

    Not in the §14.1 map (the platform's own lookup, issue 5); it shares the
    four-token shape of the update subject only for a task named ``update``.
    """
    return f"mesh.task.get.{_task_id(task_id)}"


# --- events and feeds --------------------------------------------------------


def event_subject(domain: str, event_type: str) -> str:
    """``mesh.event.{domain}.{event_type}``, for publishing (no wildcards)."""
    return f"mesh.event.{check_token(domain, 'event domain')}.{check_token(event_type, 'event type')}"


def _check_pattern_tail(pattern: str) -> list[str]:
    tokens = pattern.split(".") if isinstance(pattern, str) else []
    if not tokens or pattern == "":
        raise SubjectError(f"event pattern is empty or not a string: {pattern!r:.80}")
    for i, token in enumerate(tokens):
        if token == "*":
            continue
        if token == ">":
            if i != len(tokens) - 1:
                raise SubjectError("'>' may only be the last token of a pattern")
            continue
        check_token(token, "event pattern token")
    return tokens


def event_filter(pattern: str) -> str:
    """``mesh.event.{pattern}`` for a subscription: ``pattern`` is the part after
    ``mesh.event.``, e.g. ``scraping.*`` or ``billing.invoice_ready`` or ``>``."""
    _check_pattern_tail(pattern)
    return f"mesh.event.{pattern}"


FEED_GET = "mesh.feed.get"


def feed_subject(agent_id: str, topic: str) -> str:
    """``mesh.feed.{agent_id}.{topic}``: exactly four tokens (§6.6a).

    A dotted topic would smuggle a fifth token past the owner grant, so it is
    refused here, never split.
    """
    return f"mesh.feed.{_key(agent_id, 'feed owner')}.{_id(topic, 'feed topic')}"


def feed_pattern(agent_id: str, topic: str = "*") -> str:
    """The subscription form of :func:`feed_subject`: topic ``*`` matches all of
    one agent's feeds; any other topic must be a valid topic."""
    if topic == "*":
        return f"mesh.feed.{_key(agent_id, 'feed owner')}.*"
    return feed_subject(agent_id, topic)


def feed_state_key(agent_id: str, topic: str) -> str:
    """The state-feed KV key ``{agent_id}.{topic}`` (§18.3)."""
    return f"{_key(agent_id, 'feed owner')}.{_id(topic, 'feed topic')}"


# --- presence, sessions, observability ----------------------------------------


def heartbeat(node_id: str, agent_id: str | None = None) -> str:
    """``mesh.heartbeat.{node_id}``, or the per-agent override ``mesh.heartbeat.{node_id}.{agent_id}``."""
    subject = f"mesh.heartbeat.{_key(node_id, 'node id')}"
    if agent_id is not None:
        subject += f".{_key(agent_id, 'agent id')}"
    return subject


def session_subject(context_id: str, kind: str) -> str:
    """``mesh.session.{context_id}.{kind}`` (parked sessions, e.g. ``message``, ``disconnect``)."""
    return f"mesh.session.{_id(context_id, 'context_id')}.{check_token(kind, 'session kind')}"


def session_all(context_id: str) -> str:
    """``mesh.session.{context_id}.>``: every message of one session."""
    return f"mesh.session.{_id(context_id, 'context_id')}.>"


TRACE_ALL = "mesh.trace.>"


def trace_subject(*tokens: str) -> str:
    """``mesh.trace.{token...}``: a trace-span subject under ``mesh.trace.>``."""
    if not tokens:
        raise SubjectError("a trace subject needs at least one token after mesh.trace")
    return "mesh.trace." + ".".join(check_token(t, "trace token") for t in tokens)


def metrics_subject(agent_id: str) -> str:
    """``mesh.metrics.{agent_id}``."""
    return f"mesh.metrics.{_key(agent_id, 'agent id')}"


def log_subject(agent_id: str, level: str) -> str:
    """``mesh.log.{agent_id}.{level}``."""
    return f"mesh.log.{_key(agent_id, 'agent id')}.{check_token(level, 'log level')}"


# --- artifact store ------------------------------------------------------------

ARTIFACTS_PUT = "mesh.artifacts.put"
ARTIFACTS_FETCH = "mesh.artifacts.fetch"
ARTIFACTS_STAT = "mesh.artifacts.stat"
ARTIFACTS_REMOVE = "mesh.artifacts.remove"
ARTIFACTS_USAGE = "mesh.artifacts.usage"

# --- metering and rating (§13.5, §19.6) ------------------------------------------

#: §13.5 meter events, one per emit (``data`` = the meter event).
METERING_USAGE = "mesh.event.metering.usage"
#: A charge an external A2A agent made for a call (meshnode's own event type).
METERING_A2A_CHARGE = "mesh.event.metering.a2a_charge"
#: What ``MESH_METERING`` keeps of ``MESH_EVENTS``: receipts, meter events, charges.
METERING_EVENTS = "mesh.event.metering.>"
#: The rating service's ledger lookup (request-reply).
RATING_LEDGER = "mesh.rating.ledger"


# --- JetStream streams, consumers, KV ---------------------------------------------

MESH_REGISTRY = "MESH_REGISTRY"
MESH_TASKS = "MESH_TASKS"
MESH_EVENTS = "MESH_EVENTS"
MESH_HEARTBEAT = "MESH_HEARTBEAT"
MESH_TRACE = "MESH_TRACE"
MESH_METRICS = "MESH_METRICS"
MESH_LOG = "MESH_LOG"
MESH_METERING = "MESH_METERING"
FEED_STREAM = "MESH_FEED"
KV_REGISTRY = "mesh_registry"
KV_TASKS = "mesh_tasks"
KV_FEED_STATE = "mesh_feed_state"
KV_AGREEMENTS = "mesh_agreements"
FEED_GRAMMAR = "mesh.feed.*.*"


def inbox_stream_name(agent_id: str) -> str:
    """``MESH_INBOX_{agent_id}``: the per-agent redelivery buffer (§16.4, §18.3)."""
    return f"MESH_INBOX_{_key(agent_id, 'agent id')}"


def inbox_consumer_name(agent_id: str) -> str:
    """``inbox_{agent_id}``: the durable drain consumer the hosting node binds (§18.6)."""
    return f"inbox_{_key(agent_id, 'agent id')}"


def event_consumer_name(agent_id: str, pattern: str) -> str:
    """``mesh_event_{agent_id}_{hash}`` (§18.6), hash = first 16 lowercase hex of
    SHA-256 over the UTF-8 pattern *as subscribed*, i.e. the part after
    ``mesh.event.`` (``billing.invoice_ready`` → ``99397ba4a29eec30``; a
    cross-SDK contract)."""
    _check_pattern_tail(pattern)
    if pattern.startswith("mesh.event."):
        raise SubjectError("pass the pattern without its mesh.event. prefix")
    digest = hashlib.sha256(pattern.encode("utf-8")).hexdigest()[:16]
    return f"mesh_event_{_key(agent_id, 'agent id')}_{digest}"


def task_update_consumer_name(task_id: str, requester_id: str) -> str:
    """``mesh_task_{task_id}_{requester_id}``: the requester's task update consumer (§18.6)."""
    return f"mesh_task_{_task_id(task_id)}_{_key(requester_id, 'requester id')}"


def feed_consumer_name(agent_id: str, pattern: str | None = None) -> str:
    """``mesh_feed_{agent_id}``, or with ``pattern`` (the subscribed feed subject,
    e.g. ``mesh.feed.{owner}.*``) ``mesh_feed_{agent_id}_{hash}``: one durable
    consumer on MESH_FEED per subscription, hash = first 16 lowercase hex of
    SHA-256 over the pattern's UTF-8 bytes (the event-consumer construction)."""
    base = f"mesh_feed_{_key(agent_id, 'agent id')}"
    if pattern is None:
        return base
    parts = pattern.split(".") if isinstance(pattern, str) else []
    if len(parts) != 4 or parts[:2] != ["mesh", "feed"] or not is_valid_public(parts[2]) or not (
        parts[3] == "*" or is_valid_id_token(parts[3])
    ):
        raise SubjectError(f"not a feed subscription pattern: {pattern!r:.80}")
    return f"{base}_{hashlib.sha256(pattern.encode('utf-8')).hexdigest()[:16]}"


# --- the reserved relay prefix ---------------------------------------------------

PEER_PREFIX = "mesh.peer."
_PEER_TOKENS = ("mesh", "peer")


def is_reserved(subject: str) -> bool:
    """True when ``subject`` lies under ``mesh.peer.`` (§14.1): nobody may publish
    or subscribe there until federation (§21) specifies it."""
    return subject == "mesh.peer" or subject.startswith(PEER_PREFIX)


def subscription_overlaps_reserved(pattern: str) -> bool:
    """True when a subscription pattern could match any subject under ``mesh.peer.>``
    (``mesh.>``, ``mesh.*.x``, ``>``, or a literal ``mesh.peer...``)."""
    tokens = pattern.split(".")
    for i, reserved in enumerate(_PEER_TOKENS):
        if i >= len(tokens):
            return False
        token = tokens[i]
        if token == ">":
            return True
        if token not in ("*", reserved):
            return False
    # Matched "mesh.peer" (or wildcards for it); only more tokens reach inside it.
    return len(tokens) > len(_PEER_TOKENS)


def patterns_intersect(a: str, b: str) -> bool:
    """True when some subject matches both NATS patterns ``a`` and ``b``
    (``*`` one token, ``>`` one or more trailing tokens): ``mesh.event.demo.>``
    and ``mesh.event.*.tick`` intersect, ``mesh.event.metering.>`` and
    ``mesh.event.demo.>`` do not."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb, strict=False):
        if x == ">" or y == ">":
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


# --- parsers -----------------------------------------------------------------------


class HeartbeatSubject(NamedTuple):
    node_id: str
    agent_id: str | None


class TaskSubject(NamedTuple):
    task_id: str
    kind: str  # "update" or "stream"


class FeedSubject(NamedTuple):
    agent_id: str
    topic: str


def parse_inbox_subject(subject: str) -> str | None:
    """The agent id of ``mesh.agent.{agent_id}.inbox``, or None."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if (
        len(parts) == 4
        and parts[:2] == ["mesh", "agent"]
        and parts[3] == "inbox"
        and is_valid_public(parts[2])
    ):
        return parts[2]
    return None


def parse_register_subject(subject: str) -> tuple[bool, str | None] | None:
    """Classify a registration subject.

    Returns ``(True, node_id)`` for the connection-bound form, ``(False, None)``
    for the untokenized form, and None for anything else (including a
    connection-bound subject whose token is not a valid key).
    """
    if subject == REGISTRY_REGISTER:
        return (False, None)
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) == 4 and parts[:3] == ["mesh", "registry", "register"] and is_valid_public(parts[3]):
        return (True, parts[3])
    return None


def parse_heartbeat_subject(subject: str) -> HeartbeatSubject | None:
    """The node (and optional agent) of a heartbeat subject, or None.

    The node a heartbeat speaks for is taken from the subject and MUST be a
    valid key (§10.10); a payload ``node`` field is never consulted.
    """
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) not in (3, 4) or parts[:2] != ["mesh", "heartbeat"]:
        return None
    if not is_valid_public(parts[2]):
        return None
    if len(parts) == 4:
        if not is_valid_public(parts[3]):
            return None
        return HeartbeatSubject(parts[2], parts[3])
    return HeartbeatSubject(parts[2], None)


def parse_task_subject(subject: str) -> TaskSubject | None:
    """The task_id and kind (``update``/``stream``) of a task subject, or None."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if (
        len(parts) == 4
        and parts[:2] == ["mesh", "task"]
        and parts[3] in ("update", "stream")
        and is_valid_task_id(parts[2])
    ):
        return TaskSubject(parts[2], parts[3])
    return None


def parse_feed_subject(subject: str) -> FeedSubject | None:
    """Owner and topic of a feed subject: exactly four tokens, a user nkey owner,
    an id-shaped topic. The lookup subject ``mesh.feed.get`` is not a feed."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) != 4 or parts[:2] != ["mesh", "feed"]:
        return None
    if not is_valid_public(parts[2]) or not is_valid_id_token(parts[3]):
        return None
    return FeedSubject(parts[2], parts[3])
