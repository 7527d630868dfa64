"""Subject permissions of a node credential, as a function of its roster (AgentMesh §14.3).

A node's user JWT must grant exactly what its hosted agents need and nothing
that lets it act for, or read the mail of, another node. The broker enforces
these lists on every publish and subscribe, so each grant below is a security
decision; the comment beside it says why it is there.

Three narrowings go beyond the §14.3 example, each closing a hole the broker
would otherwise leave open:

* **Registration is connection-bound.** A node registers on
  ``mesh.registry.register.{node_id}``, which only its own credential may
  publish. The untokenized ``mesh.registry.register`` carries no identity
  (§14.3's last paragraph, §4.4 b), and meshnode's registry refuses it with
  ``UNAUTHORIZED`` (``details.reason: "untokenized_registration"``) except from
  an ``sdk``-profile node (below). *Decision:* every credential may publish
  the untokenized subject anyway. The grant gives a node no power (the
  registry, not the broker, is the gate, and §4.4 (b) stays intact because the
  registry refuses), but it turns a broker drop (a silent 5 s timeout in the
  client) into the §4.4 answer ``UNAUTHORIZED`` with a reason the client can
  read, and it is what makes ``[registry] require_connection_bound = false``
  work end to end.
* **Private reply inboxes.** Every node gets its own inbox prefix
  (``_INBOX_{node_id}``, passed to ``nats.connect(inbox_prefix=...)``) and may
  subscribe under that prefix only. A shared ``_INBOX.>`` subscription would
  let any node read every other node's request replies *and* its JetStream
  pull deliveries — its drained mailbox. Replies to other parties' requests
  go out under the ``resp`` permission of the JWT (one reply per request
  received), not under a publish grant on anybody's inbox.
* **Scoped JetStream API.** ``$JS.API.>`` would let a participant node create
  a consumer on another agent's ``MESH_INBOX_*`` stream (reading its mail),
  read messages by sequence, or delete streams. A participant gets the API
  subjects for its own agents' mailbox streams; only a service-role node
  administers JetStream.
* **No consumer management on the shared streams (#22).** Every consumer a
  node keeps on MESH_TASKS, MESH_EVENTS and MESH_FEED is named (§18.6) after
  its agent *and* a run-time part: ``mesh_event_{agent}_{hash}``,
  ``mesh_feed_{agent}_{hash}``, ``mesh_task_{task}_{requester}[_stream]``. The
  broker's permissions match whole tokens, so no grant can say "consumers
  whose name starts with my agent's id": ``$JS.API.CONSUMER.*.MESH_TASKS.>``
  let any participant retarget, pull from, ack for or delete anyone's
  consumer, the task manager's ``mesh_task_manager`` and the feed-state
  writer included. The operation is therefore behind a service: a
  participant asks ``mesh.consumers.{ensure,delete}.{node_id}`` (its own token
  only) with a request its agent signs, the consumer service
  (:mod:`meshnode.services.consumers`) derives the name and the whole §18.6
  configuration from it, delivers under this node's private inbox prefix and
  bounds how many an agent holds. The participant keeps only what binding and
  acking a push consumer needs: the stream and consumer info reads and
  ``$JS.ACK.{stream}.>``, minus the platform consumers' acks
  (:data:`PLATFORM_CONSUMERS`, denied by :func:`node_denials`). It pulls from
  no shared-stream consumer (no ``MSG.NEXT``), so it cannot steal the task
  manager's updates.

**Profiles.** :func:`node_permissions` is the grant of meshnode's own nodes
(profile ``node``). :func:`sdk_permissions` is the grant of an ``sdk``-profile
credential, minted by ``POST /v1/bootstrap`` for one agent written with the
public AgentMesh SDKs, which cannot be told to use a private reply prefix (the
TypeScript SDK has no option for it) and register on the untokenized subject.
It differs from ``node`` in exactly these ways, each forced by what the SDKs do:

* it subscribes ``_INBOX.>``, the NATS clients' default reply prefix. The cost:
  sdk-profile connections can read replies (and JetStream pull deliveries)
  addressed to each other's ``_INBOX.`` subjects. They can never read those of
  meshnode's nodes, whose replies go to ``_INBOX_{node_id}.``: a different
  first token, which ``_INBOX.>`` does not match;
* it publishes the untokenized register subject (as every credential now does);
  the registry accepts it only from an sdk-enrolled node whose vouch verifies
  and whose enrolment names the agent;
* it is for one agent (its enrolment's), publishes nothing owner-bound for any
  other, and gets no trace, metrics, log, artifact, task-stream or task-lookup
  grant: what the SDKs do not call. The SDKs' harmless extras (the responder's
  copy on ``mesh.agent.{self}.outbox``) are not granted; the broker refuses
  them with a permission error the SDK logs as a warning and carries on.

The subject patterns live here as module constants so they can move to
``meshnode.protocol.subjects`` once that module lands.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Literal, NamedTuple

from meshnode.protocol.nkeys import KeyPair, Prefix, is_valid_public

__all__ = [
    "LEGACY_INBOX_PREFIX",
    "PLATFORM_CONSUMERS",
    "RESERVED_SUBJECTS",
    "STARTER_PERMISSIONS",
    "STARTER_TAG",
    "NodePermissions",
    "Profile",
    "Role",
    "SDK_INBOX_PREFIX",
    "grants_revision",
    "inbox_prefix_for",
    "node_denials",
    "node_inbox_prefix",
    "node_permissions",
    "sdk_permissions",
]

Role = Literal["participant", "service"]
Profile = Literal["node", "sdk"]
"""The enrolment profile of a credential: ``node`` (a meshnode node) or ``sdk``
(one agent written with the public AgentMesh SDKs, see the module note)."""

# --- subject patterns (§14.1); {node}, {agent}, {stream} are filled per roster ---

REGISTER_BOUND = "mesh.registry.register.{node}"
REGISTER_UNBOUND = "mesh.registry.register"
DEREGISTER = "mesh.registry.deregister"
DISCOVER = "mesh.registry.discover"
REGISTRY_GET = "mesh.registry.get.*"
DESCRIPTOR_PUT = "mesh.registry.descriptor.put"
DESCRIPTOR_LOOKUPS = "mesh.registry.descriptor.*.*"
EVAL_PUT = "mesh.registry.eval.put"
EVAL_LOOKUPS = "mesh.registry.eval.*.*"
PRESENCE_GET = "mesh.presence.get"
EXTERNAL_DISCOVER = "mesh.external.*.discover"
EXTERNAL_GET = "mesh.external.*.get.*"
HEARTBEAT = "mesh.heartbeat.{node}"
HEARTBEAT_AGENT = "mesh.heartbeat.{node}.*"
ANY_AGENT_INBOX = "mesh.agent.*.inbox"
AGENT_INBOX = "mesh.agent.{agent}.inbox"
TASK_UPDATE = "mesh.task.*.update"
TASK_STREAM = "mesh.task.*.stream"
TASK_GET = "mesh.task.get.*"
EVENTS = "mesh.event.>"
REGISTRY_EVENTS = "mesh.event.registry.>"
AGENT_FEED = "mesh.feed.{agent}.>"
FEED_GET = "mesh.feed.get"
FEED_GRAMMAR = "mesh.feed.*.*"
ALL_TRACES = "mesh.trace.>"
ALL_METRICS = "mesh.metrics.>"
ALL_LOGS = "mesh.log.>"
AGENT_METRICS = "mesh.metrics.{agent}"
AGENT_LOG = "mesh.log.{agent}.>"
TRACES = "mesh.trace.>"
ARTIFACTS = "mesh.artifacts.>"
CONSUMERS_ENSURE = "mesh.consumers.ensure.{node}"
CONSUMERS_DELETE = "mesh.consumers.delete.{node}"
ALL_CONSUMERS = "mesh.consumers.>"
RATING_LEDGER = "mesh.rating.ledger"
ALL_RATING = "mesh.rating.>"
AGREEMENTS_REGISTER = "mesh.agreements.register"
AGREEMENTS_REVOKE = "mesh.agreements.revoke"
AGREEMENTS_LOOKUP = "mesh.agreements.lookup"
ALL_AGREEMENTS = "mesh.agreements.>"

ALL_REGISTRY = "mesh.registry.>"
ALL_PRESENCE = "mesh.presence.>"
ALL_HEARTBEATS = "mesh.heartbeat.>"
ALL_TASKS = "mesh.task.>"

RESERVED_SUBJECTS = ("mesh.peer.>",)
"""Reserved for federation (§14.1): granted to nobody, and denied explicitly."""

LEGACY_INBOX_PREFIX = "_INBOX"
"""The shared reply prefix of §14.3's example; see the module note before using it."""

SDK_INBOX_PREFIX = LEGACY_INBOX_PREFIX
"""The reply prefix an ``sdk``-profile credential allows: the NATS clients' default."""

AGENT_MAILBOX_STREAM = "MESH_INBOX_{agent}"

SHARED_STREAMS = ("MESH_TASKS", "MESH_EVENTS", "MESH_FEED")

JS_ACCOUNT_INFO = "$JS.API.INFO"
JS_STREAM_INFO = "$JS.API.STREAM.INFO.{stream}"
JS_STREAM_PURGE = "$JS.API.STREAM.PURGE.{stream}"
JS_STREAM_MSG_GET = "$JS.API.STREAM.MSG.GET.{stream}"
JS_CONSUMER_ANY_OP = "$JS.API.CONSUMER.*.{stream}.>"
JS_CONSUMER_CREATE_NAMED = "$JS.API.CONSUMER.CREATE.{stream}.>"
JS_CONSUMER_DURABLE_CREATE = "$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>"
JS_CONSUMER_INFO = "$JS.API.CONSUMER.INFO.{stream}.>"
JS_CONSUMER_LIST = "$JS.API.CONSUMER.LIST.{stream}"
JS_CONSUMER_NEXT = "$JS.API.CONSUMER.MSG.NEXT.{stream}.>"
JS_ACK = "$JS.ACK.{stream}.>"

JS_ACK_CONSUMER = "$JS.ACK.{stream}.{consumer}.>"

PLATFORM_CONSUMERS: tuple[tuple[str, str], ...] = (
    ("MESH_TASKS", "mesh_task_manager"),
    ("MESH_FEED", "mesh_feed_state_writer"),
)
"""(stream, consumer) of the service-role pull consumers on participant-readable
streams. Participants may not even ack for them (:func:`node_denials`)."""

JS_API_ALL = "$JS.API.>"
JS_ACK_ALL = "$JS.ACK.>"
JS_FLOW_CONTROL_ALL = "$JS.FC.>"
KV_ALL = "$KV.>"
OBJECT_STORE_ALL = "$O.>"


class NodePermissions(NamedTuple):
    """The publish and subscribe allow lists of one node credential."""

    pub_allow: list[str]
    sub_allow: list[str]


STARTER_PERMISSIONS = NodePermissions([], [])
"""The grants of an invite's starter credential: none in either direction.

An empty allow list denies everything (``jwt.mint_user_jwt``), so the holder
can open a connection and do nothing on it. Enrolment never needed NATS: the
node's first start proves the invite's node key to the control plane over
HTTP and receives its roster credential (§4.8). A leaked invite JWT is
therefore harmless on the mesh; a leaked invite *seed* is not (it is the node
key), which is why ``meshnode mesh retire`` exists.
"""

STARTER_TAG = "agentmesh:role:starter"
"""The JWT tag (``nats.tags``) marking a starter credential: nodes never connect with one."""


def node_inbox_prefix(node_id: str) -> str:
    """The private reply-inbox prefix of ``node_id``; pass it to ``nats.connect(inbox_prefix=...)``."""
    _require_user_key(node_id, "node_id")
    return f"_INBOX_{node_id}"


def _require_user_key(key: str, what: str) -> None:
    # Ids become subject tokens: anything but a well-formed user nkey could
    # smuggle a wildcard or an extra token into a grant.
    if not is_valid_public(key, Prefix.USER):
        raise ValueError(f"{what} must be a user nkey, got {key!r}")


def _own_stream_grants(stream: str) -> list[str]:
    # Everything a node does with the consumers of a stream only its own agent
    # reads (its mailbox): read the stream's last sequence (§18.6 drains up to
    # it), create/look up/delete its consumer, pull and ack. The single-token
    # wildcard sits before the stream token, so it cannot reach another stream:
    # every two-token operation (DURABLE.CREATE, MSG.NEXT) is listed instead,
    # because "CONSUMER.*.*.{stream}" would also match a consumer *named*
    # {stream} on somebody else's stream.
    # Purge too (issue #22.4): the mailbox discards new mail at its bound, so
    # the drain removes what it committed, or a busy agent's mailbox would
    # fill with mail already handled and refuse the next offline request.
    # And read a message by sequence: a copy whose delivery went with a cut
    # connection stops the purge for the ack wait unless the drain reads it.
    return [
        JS_STREAM_INFO.format(stream=stream),
        JS_STREAM_PURGE.format(stream=stream),
        JS_STREAM_MSG_GET.format(stream=stream),
        JS_CONSUMER_ANY_OP.format(stream=stream),
        JS_CONSUMER_DURABLE_CREATE.format(stream=stream),
        JS_CONSUMER_NEXT.format(stream=stream),
        JS_ACK.format(stream=stream),
    ]


def _shared_stream_grants(stream: str) -> list[str]:
    # A stream every node reads: look up the stream and a consumer (binding
    # reads both), and ack what a push consumer delivered to this node. No
    # create, update, pull or delete: those go through the consumer service
    # (module note), because no grant here can tell this node's consumer
    # names from anybody else's.
    return [
        JS_STREAM_INFO.format(stream=stream),
        JS_CONSUMER_INFO.format(stream=stream),
        JS_ACK.format(stream=stream),
    ]


def _sdk_shared_stream_grants(stream: str) -> list[str]:
    # The grant of a shared stream for a client that makes its own consumers
    # there (the sdk profile, MESH_FEED only): any name, minus the platform's
    # (node_denials).
    return [
        JS_STREAM_INFO.format(stream=stream),
        JS_CONSUMER_CREATE_NAMED.format(stream=stream),
        JS_CONSUMER_DURABLE_CREATE.format(stream=stream),
        JS_CONSUMER_INFO.format(stream=stream),
        JS_CONSUMER_NEXT.format(stream=stream),
        JS_ACK.format(stream=stream),
    ]


def node_denials(role: Role = "participant") -> list[str]:
    """Publish subjects denied to a participant credential over its allow list.

    Every operation on the platform's pull consumers but reading their info:
    create or update (either subject form), pull, delete, and ack. A node
    profile's allow list holds none of these anyway; the denials keep them
    out of reach of a profile that may create consumers on a shared stream
    (sdk, on MESH_FEED), and of acks (a participant acks its push consumers
    by stream): an ack or ``+TERM`` for a message the task manager fetched and
    has not recorded yet would drop the update from the record. A
    service-role node is denied nothing here.
    """
    if role == "service":
        return []
    out: list[str] = []
    for stream, consumer in PLATFORM_CONSUMERS:
        out += [
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{consumer}",
            JS_ACK_CONSUMER.format(stream=stream, consumer=consumer),
        ]
    return out


def _unique(subjects: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(subjects))


def node_permissions(
    node_id: str,
    agent_ids: Iterable[str],
    *,
    role: Role = "participant",
    require_connection_bound: bool = True,
    inbox_prefix: str | None = None,
) -> NodePermissions:
    """The §14.3 permission set for ``node_id`` hosting ``agent_ids``.

    ``role="service"`` is for a node hosting the platform services (registry,
    presence, task manager): it additionally listens on their request subjects
    and administers JetStream. ``require_connection_bound`` no longer changes
    the grant (the untokenized register subject is always granted, module
    note); it is accepted for callers that pass it.
    ``inbox_prefix`` defaults to :func:`node_inbox_prefix`; pass
    ``LEGACY_INBOX_PREFIX`` only for a client that cannot set its own prefix.

    Replies to received requests (queued acks, service answers) need the user
    JWT's ``resp`` permission; mint the credential with one.
    """
    _require_user_key(node_id, "node_id")
    agents = list(dict.fromkeys(agent_ids))
    for agent in agents:
        _require_user_key(agent, "agent id")
    if role not in ("participant", "service"):
        raise ValueError(f"unknown node role {role!r}")
    inbox = node_inbox_prefix(node_id) if inbox_prefix is None else inbox_prefix
    if not inbox or any(c in inbox for c in " \t*>") or inbox.endswith("."):
        raise ValueError(f"invalid inbox prefix {inbox!r}")

    pub: list[str] = [
        # Register only under the node's own key, so it cannot register agents
        # under another node's identity (§4.4 b).
        REGISTER_BOUND.format(node=node_id),
        # Deregistration, discovery and lookups are requests to the registry,
        # which identifies the agent from the signed envelope, not the subject.
        DEREGISTER,
        DISCOVER,
        REGISTRY_GET,
        DESCRIPTOR_PUT,
        DESCRIPTOR_LOOKUPS,
        EVAL_PUT,
        EVAL_LOOKUPS,
        PRESENCE_GET,
        # Another tenant's discovery, where the operator imported it (§15.2).
        # The subject leads nowhere in an account without that import.
        EXTERNAL_DISCOVER,
        # Presence reads the node from the subject token (§10.10): a node may
        # beat only for itself, plus per-agent availability beneath it.
        HEARTBEAT.format(node=node_id),
        HEARTBEAT_AGENT.format(node=node_id),
        # Requests go to any agent's inbox, and every respond goes to the
        # requester's inbox (§6.5), so any inbox is a legitimate destination.
        ANY_AGENT_INBOX,
        # Task updates and stream chunks carry a runtime task id (§14.4); the
        # envelope signature, not the subject, says who may speak for a task.
        TASK_UPDATE,
        TASK_STREAM,
        # Task record lookups are requests to the task manager, which answers
        # only the Task's parties (identified from the signed envelope).
        TASK_GET,
        # Domain events are a shared bus; emitters are identified in-envelope.
        EVENTS,
        # State-feed lookups are requests to the platform.
        FEED_GET,
        # Ledger lookups are requests to the rating service, which answers an
        # agent only about its own owner's and its own agents' charges (§19.6).
        RATING_LEDGER,
        # The node's consumers on the shared streams, made and deleted by the
        # consumer service for the agent that signs the request (module note);
        # connection-bound, so the deliver subject it names is checked against
        # this node's inbox prefix.
        CONSUMERS_ENSURE.format(node=node_id),
        CONSUMERS_DELETE.format(node=node_id),
        # Agreements registered with the platform (§19.5): requests to the
        # agreement service, which takes a document only from (an agent of)
        # its signing owner and answers look-ups to the parties only. Its state
        # is a KV bucket no participant can write ($KV.> is the services').
        AGREEMENTS_REGISTER,
        AGREEMENTS_REVOKE,
        AGREEMENTS_LOOKUP,
    ]
    # The untokenized subject, so that the registry can answer UNAUTHORIZED
    # (§4.4) instead of the broker dropping it: see the module note. Kept for
    # every value of require_connection_bound (the registry applies that).
    pub.insert(1, REGISTER_UNBOUND)
    # A service node holds the agent-scoped grants as wildcards, whatever its
    # roster. It loses nothing it could be kept from: with $JS.API.> it reads
    # every mailbox stream (which captures the same inbox subjects), and feeds,
    # metrics and logs are signed envelopes that consumers verify against their
    # owner. And a per-agent list costs the broker on every JetStream call:
    # nats-server copies the caller's JWT into the client info it attaches to
    # each API request, so a credential of ~0.4 KiB per agent made every call
    # O(roster) (issue #21: at 1,000 agents JSON work on that copy was about a
    # quarter of the broker's CPU in a start; the per-agent form also stops
    # fitting the broker's ~1 MiB JWT limit near 2,600 agents). Participants
    # never get this: their grants stay per agent, their rosters capped
    # (control_plane.MAX_ROSTER).
    wide = role == "service"
    for agent in [] if wide else agents:
        pub += [
            # Feeds are owner-rooted: only the owning agent's node publishes (§6.6a).
            AGENT_FEED.format(agent=agent),
            # Metrics and logs are per-agent subjects; no node writes another's.
            AGENT_METRICS.format(agent=agent),
            AGENT_LOG.format(agent=agent),
        ]
    if wide:
        pub += [AGENT_FEED.format(agent="*"), AGENT_METRICS.format(agent="*"), AGENT_LOG.format(agent="*")]
    pub += [
        # Trace spans and artifact traffic are not owner-bound subjects.
        TRACES,
        ARTIFACTS,
    ]

    sub: list[str] = [
        # A node reads its own agents' inboxes and nobody else's.
        *([ANY_AGENT_INBOX] if wide else (AGENT_INBOX.format(agent=agent) for agent in agents)),
        # Requesters follow the tasks they started (§7).
        TASK_UPDATE,
        TASK_STREAM,
        # Agents subscribe to domain events; registry events are listed on
        # their own so that narrowing the bus later keeps them.
        EVENTS,
        REGISTRY_EVENTS,
        # Feeds are readable by anyone; only publishing is owner-bound. The
        # four-token grammar, not mesh.feed.>: that would also let any node
        # listen on the lookup subject mesh.feed.get and answer for the platform.
        FEED_GRAMMAR,
        # Spans, metrics and logs are ordinary emit traffic an observer reads
        # (§13.4: an exporter is an ordinary agent); each is signed by its agent.
        ALL_TRACES,
        ALL_METRICS,
        ALL_LOGS,
        # Replies to this node's requests and its JetStream pull deliveries.
        f"{inbox}.>",
    ]

    if role == "service":
        pub += [
            # A tenant's registry resolves an agent another tenant exported to
            # it through that tenant's registry (§15.2), where imported.
            EXTERNAL_GET,
            # The services own the JetStream objects (§18.3-18.5): streams,
            # mailboxes, KV buckets, object stores, and their consumers.
            JS_API_ALL,
            JS_ACK_ALL,
            JS_FLOW_CONTROL_ALL,
            KV_ALL,
            OBJECT_STORE_ALL,
        ]
        sub += [
            # The request subjects the registry, presence service and task
            # manager answer, and the heartbeats presence folds.
            ALL_REGISTRY,
            ALL_PRESENCE,
            ALL_HEARTBEATS,
            ALL_TASKS,
            ARTIFACTS,
            # The state-feed lookup the feed service answers (§18.3).
            FEED_GET,
            # The consumer service's requests (module note).
            ALL_CONSUMERS,
            # The rating service's ledger lookups (§19.6).
            ALL_RATING,
            # The agreement service's requests (§19.5).
            ALL_AGREEMENTS,
        ]
    else:
        # A participant binds consumers on its own agents' mailboxes, and binds
        # and acks (never makes) its consumers on the shared task, event and
        # feed streams; never another agent's mailbox, never stream administration.
        pub.append(JS_ACCOUNT_INFO)
        for agent in agents:
            pub += _own_stream_grants(AGENT_MAILBOX_STREAM.format(agent=agent))
        for stream in SHARED_STREAMS:
            pub += _shared_stream_grants(stream)

    return NodePermissions(_unique(pub), _unique(sub))


def inbox_prefix_for(profile: Profile, node_id: str) -> str:
    """The reply prefix a credential of ``profile`` for ``node_id`` may subscribe under."""
    return SDK_INBOX_PREFIX if profile == "sdk" else node_inbox_prefix(node_id)


def sdk_permissions(node_id: str, agent_id: str) -> NodePermissions:
    """The grant of an ``sdk``-profile credential: ``node_id`` hosting ``agent_id`` alone.

    What the public SDKs call, and nothing more (module note): registry,
    discovery, lookups, presence and state-feed lookups as requests; the
    node's heartbeat; requests and responds to any agent's inbox; deferred
    answers as task updates; events; its agent's feeds; its agent's mailbox
    stream and its durable consumer on ``MESH_FEED`` (the SDK's mailbox drain
    and durable feed subscription). Replies under ``_INBOX.`` (the clients'
    default prefix). The credential needs the JWT's ``resp`` permission like
    every other (an SDK answers its liveness probes on the reply subject).
    """
    _require_user_key(node_id, "node_id")
    _require_user_key(agent_id, "agent id")
    pub: list[str] = [
        REGISTER_UNBOUND,
        DEREGISTER,
        DISCOVER,
        REGISTRY_GET,
        PRESENCE_GET,
        FEED_GET,
        HEARTBEAT.format(node=node_id),
        HEARTBEAT_AGENT.format(node=node_id),
        # The Python SDK's node key defaults to the agent key (a self-vouch),
        # so it beats for the agent key; nobody else's node is reachable so.
        HEARTBEAT.format(node=agent_id),
        ANY_AGENT_INBOX,
        TASK_UPDATE,
        EVENTS,
        AGENT_FEED.format(agent=agent_id),
        *_own_stream_grants(AGENT_MAILBOX_STREAM.format(agent=agent_id)),
        # The SDKs create their durable feed consumer themselves and know no
        # consumer service, so this profile keeps consumer creation on
        # MESH_FEED (the platform's writer is denied by node_denials). The
        # trade-off: an sdk credential can still retarget other agents' feed
        # consumers there; their nodes repair them at the next bind.
        *_sdk_shared_stream_grants("MESH_FEED"),
    ]
    sub: list[str] = [
        AGENT_INBOX.format(agent=agent_id),
        # await_task follows a deferred answer on its task's update subject.
        TASK_UPDATE,
        EVENTS,
        REGISTRY_EVENTS,
        FEED_GRAMMAR,
        f"{SDK_INBOX_PREFIX}.>",
    ]
    return NodePermissions(_unique(pub), _unique(sub))


@functools.cache
def grants_revision() -> str:
    """A short digest of every grant this version of meshnode mints (both node
    roles, their denials, the ``sdk`` profile), for fixed placeholder keys.

    A node stores it beside its credential; a credential stored under another
    revision is renewed at the next start rather than used until it is due.
    After an upgrade that added a grant (``$JS.API.STREAM.PURGE`` on the
    mailboxes, say), the node otherwise ran up to two thirds of a credential's
    life on the old grants, the broker refusing what the new code does.
    Computed, so a change to the grants changes it with no constant to bump.
    """
    node = KeyPair.from_raw_seed(bytes(32)).public_key
    agent = KeyPair.from_raw_seed(bytes([1]) * 32).public_key
    roles: tuple[Role, ...] = ("participant", "service")
    grants = [
        *(list(node_permissions(node, [agent], role=role)) for role in roles),
        *(node_denials(role) for role in roles),
        list(sdk_permissions(node, agent)),
    ]
    return hashlib.sha256(json.dumps(grants, sort_keys=True).encode()).hexdigest()[:16]
