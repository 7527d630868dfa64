"""The schema's tables: ``[node]``, ``[mesh]``, ``[registry]`` ... ``[observability]``
and ``[agents.<name>]`` (see :mod:`meshnode.config`)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.functional_validators import BeforeValidator

from .values import (
    _PATH_SCHEMA,
    _PLUGIN_NAME,
    ByteSize,
    DirPath,
    Duration,
    NatsUrl,
    OptionalDuration,
    OptionalFilePath,
    OptionalHttpUrl,
    SocketMode,
    _choice,
    _choice_schema,
    _default_data_dir_factory,
    _hostname,
    _optional_dir_path,
    _optional_group,
    _optional_socket_path,
    format_size,
)

__all__ = [
    "AdminConfig",
    "AgentConfig",
    "ArtifactsConfig",
    "CommerceConfig",
    "EmbeddedMeshConfig",
    "EventsConfig",
    "InboxConfig",
    "KeystoreConfig",
    "LoggingConfig",
    "MeshConfig",
    "NodeConfig",
    "ObservabilityConfig",
    "ProtectionsConfig",
    "RegistryConfig",
    "ServicesConfig",
]


# --------------------------------------------------------------------------- the schema

_FORBID = ConfigDict(extra="forbid")


class NodeConfig(BaseModel):
    """``[node]``: this host's identity and timing."""

    model_config = _FORBID

    name: Annotated[str, Field(min_length=1, max_length=253)] = Field(default_factory=_hostname)
    """Display name; defaults to the host name."""
    data_dir: DirPath = Field(default_factory=_default_data_dir_factory)
    """State directory (inbox, keys). ``$MESHNODE_DATA_DIR`` overrides the file."""
    availability_class: Annotated[
        Literal["always_on", "intermittent", "on_demand"] | None,
        _choice("always_on", "intermittent", "on_demand", optional=True),
        _choice_schema("always_on", "intermittent", "on_demand", optional=True),
    ] = None
    """Declared availability; None (absent) means undeclared."""
    vouch_ttl: OptionalDuration = None
    """Explicit vouch lifetime; None lets the runtime choose."""
    heartbeat_interval: Duration = timedelta(seconds=30)
    agent_start_warn: Duration = timedelta(seconds=10)
    """An agent's ``on_start`` still running after this long is logged as slow."""
    agent_start_timeout: Duration = timedelta(seconds=60)
    """An agent whose ``on_start`` runs longer is cancelled and failed (that agent only)."""
    agent_max_concurrency: Annotated[int, Field(ge=1, le=100_000)] = 64
    """Requests one agent may have in its handlers at once; past it a request is
    refused ``AGENT_OVERLOADED`` (retryable) instead of queued without bound.
    ``[agents.<name>] max_concurrency`` overrides it for one agent."""
    loop_block_threshold: Duration = timedelta(seconds=1)
    """The event loop stalled this long (a handler blocking it, e.g. ``time.sleep``)
    is logged with the agent whose handler was running, and counted."""
    strict_plugins: bool = False
    """Fail fast on a broken plugin instead of logging and skipping it (development)."""
    host_concurrency: Annotated[int, Field(ge=1, le=1024)] = 32
    """Agents started (and registered) at once when the node starts, and
    re-registered at once when every agent is (a new trust attestation,
    ``meshnode renew``); the rest wait their turn. Each is mostly waiting on the
    registry's answer."""
    plugin_modules: list[
        Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")]
    ] = Field(default_factory=list)
    """Extra plugins to load as if installed (``"package.module"`` or
    ``"package.module:AgentClass"``): for developing a plugin without packaging it."""


_AGENT_ID = re.compile(r"U[A-Z2-7]{55}")


class TenantExportConfig(BaseModel):
    """``[[mesh.embedded.exports]]``: what one tenant makes reachable from another (§15.2).

    ``from`` and ``to`` name tenants (``mesh`` is the mesh's own account).
    ``agents`` lists agent ids whose inboxes ``to``'s nodes may send to;
    ``discover`` lets ``to`` query ``from``'s registry on
    ``mesh.external.<from>.discover``. Nothing else crosses.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_: Annotated[str, Field(alias="from", pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    to: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    agents: list[str] = Field(default_factory=list)
    discover: bool = False

    @field_validator("agents")
    @classmethod
    def _agent_ids(cls, agents: list[str]) -> list[str]:
        for agent in agents:
            if not _AGENT_ID.fullmatch(agent):
                # Names are a node's own and repeat across nodes; the broker's
                # import names one inbox subject, so an export names the id.
                raise ValueError(
                    f"{agent!r} is not an agent id: an export names agents by id (U..., 56 characters,"
                    " as `meshnode status` or `meshnode discover` shows), not by name"
                )
        return agents

    @model_validator(mode="after")
    def _two_tenants(self) -> TenantExportConfig:
        if self.from_ == self.to:
            raise ValueError(f"tenant {self.to!r} cannot export to itself")
        if not self.agents and not self.discover:
            raise ValueError("an export names agents, discover = true, or both")
        return self


class ControlPlaneConfig(BaseModel):
    """``[mesh.embedded.control_plane]``: the limits of the credential control plane.

    A request whose node signature verifies for an enrolled node counts against
    that node key; any other request against its peer address, so junk from
    one local process cannot lock out a node on the same host.
    """

    model_config = _FORBID

    rate_limit: Annotated[int, Field(ge=1)] = 30
    """Requests per peer address per ``rate_window`` that carry no enrolled node's signature."""
    node_rate_limit: Annotated[int, Field(ge=1)] = 30
    """Requests per enrolled node key per ``rate_window`` (signature checked first)."""
    rate_window: Duration = timedelta(seconds=60)
    max_connections: Annotated[int, Field(ge=1)] = 64
    """Connections at once; at the limit a new one evicts the oldest still idle."""
    head_timeout: Duration = timedelta(seconds=5)
    """Time from connect (TLS handshake included) to the end of the request head."""
    request_timeout: Duration = timedelta(seconds=10)
    """Time from connect to the end of the request body."""


class EmbeddedMeshConfig(BaseModel):
    """``[mesh.embedded]``: the local nats-server started when no servers are given."""

    model_config = _FORBID

    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 4222
    """0 picks a free port."""
    control_host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    control_port: Annotated[int, Field(ge=0, le=65535)] = 7422
    """HTTP control plane that issues node credentials; 0 picks a free port."""
    advertise_host: Annotated[str, Field(min_length=1)] | None = None
    """The DNS name or address other machines reach this node by. Invites, ``meshnode mesh
    info`` and the control plane's answers give the NATS and control-plane URLs with it (and
    the bound ports) instead of ``host``/``control_host``. Unset: those hosts, except that a
    wildcard (``0.0.0.0``, ``::``), which no other machine can dial, is replaced by this
    machine's name (logged at start). With TLS, the certificate's names must cover it."""
    max_payload: ByteSize = 1024**2
    jetstream_max_store: ByteSize = 4 * 1024**3
    """The embedded nats-server's JetStream file store (its ``max_file_store``). Every
    stream and bucket reserves its ``[storage]`` bound out of it when created; see
    docs/security-quotas.md."""
    account_max_store: ByteSize | None = None
    """Each tenant account's JetStream storage limit (in its account JWT); None splits
    ``jetstream_max_store`` evenly between the mesh account and the tenants."""
    credential_ttl: Duration = timedelta(hours=24)
    invite_ttl: Duration = timedelta(hours=1)
    """Lifetime of the starter credential in an invite. It grants nothing on the mesh
    (the node's first start exchanges the invite's key for its real credential over the
    control plane), so the invite's key, not this credential, is what to protect."""
    invite_valid_for: Duration = timedelta(days=7)
    """How long an invite can be used: the invited node's first start must come within
    it, else the control plane refuses its credential (``invite_expired``) and the operator
    makes a new invite. An invite holds the node's key, so an unused one would otherwise
    enrol whoever holds the file at any later time. \"0s\" never expires invites."""
    tls_cert: OptionalFilePath = None
    """PEM certificate (chain) for TLS on the NATS listener and the control plane; with
    ``tls_key``. Needed before exposing either beyond loopback."""
    tls_key: OptionalFilePath = None
    """PEM private key of ``tls_cert``."""
    control_plane: ControlPlaneConfig = Field(default_factory=ControlPlaneConfig)
    monitor_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    """nats-server's HTTP monitoring (/varz, /jsz) on ``host``; off unless set (it is
    unauthenticated and shows every connection); 0 picks a free port."""
    websocket_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    """A WebSocket listener for nats.ws clients (the TypeScript SDK) on ``host``; off
    unless set; 0 picks a free port. ``wss://`` with ``tls_cert``/``tls_key``, else plain
    ``ws://``: then keep ``host`` on loopback or put a TLS-terminating proxy in front.
    Same credentials as the client port."""
    tenants: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]] = Field(
        default_factory=list
    )
    """Tenants beyond the mesh's own account (``mesh``): each a NATS account with its
    own registry; nodes join one with ``meshnode mesh invite NAME --tenant T`` (§15)."""
    exports: list[TenantExportConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _known_tenants(self) -> EmbeddedMeshConfig:
        if "mesh" in self.tenants or len(set(self.tenants)) != len(self.tenants):
            raise ValueError("tenants must be unique and not 'mesh' (the mesh's own account)")
        known = {"mesh", *self.tenants}
        for i, export in enumerate(self.exports):
            for name in (export.from_, export.to):
                if name not in known:
                    raise ValueError(f"exports[{i}] names tenant {name!r}, not in tenants")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> EmbeddedMeshConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key are set together (or neither)")
        return self

    @field_validator("max_payload")
    @classmethod
    def _nats_payload_limit(cls, value: int) -> int:
        # nats-server refuses to start with max_payload above 64 MiB.
        if value > 64 * 1024**2:
            raise ValueError(f"nats-server allows at most 64MiB, got {format_size(value)}")
        return value


def _server_list(value: object) -> object:
    # One URL, or a comma-separated string of them, reads as a list: a
    # single-server config keeps working when the mesh grows into a cluster.
    if isinstance(value, str):
        return [part for part in (p.strip() for p in value.split(",")) if part]
    return value


class MeshConfig(BaseModel):
    """``[mesh]``: which NATS to use. No servers means the embedded mesh."""

    model_config = _FORBID

    servers: Annotated[list[NatsUrl], BeforeValidator(_server_list)] = Field(default_factory=list)
    """The mesh's NATS servers (one URL, or every server of a cluster); the
    connection fails over across them and any the cluster announces.
    ``nats://``, ``tls://``, or a WebSocket listener's ``ws://`` / ``wss://``
    (those need ``pip install 'meshnode[websocket]'``)."""
    replicas: Annotated[int, Field(ge=1, le=5)] | None = None
    """JetStream replicas of the streams and buckets this node's services create;
    None (absent) means ``min(3, servers in the cluster)`` (1 on the embedded mesh)."""
    credentials: OptionalFilePath = None
    """NATS ``.creds`` file of a joining node; None when unset."""
    control_plane: OptionalHttpUrl = None
    """Control-plane URL for credential renewal (joining node); None when unset."""
    inbox_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")] | None = None
    """The reply-subject prefix of the node's connection. Unset: read from the node's
    own credential (its private ``_INBOX_<node_id>`` when granted, else ``_INBOX`` as in
    §14.3's example, else another ``P.>`` it grants). Set it on a mesh whose
    operator grants a prefix of its own."""
    ca_file: OptionalFilePath = None
    """PEM CA bundle that verifies the mesh's TLS certificates (``tls://`` NATS URLs and
    an ``https://`` control plane) when they are not signed by a system-trusted CA."""
    embedded: EmbeddedMeshConfig = Field(default_factory=EmbeddedMeshConfig)
    connect_timeout: Duration = timedelta(seconds=25)
    """How long the node's first connection to the mesh may take at start. Past it the start
    fails with exit 75 (temporary), naming the servers and the last connection error; a
    supervisor's restart tries again. Once connected, a lost connection is retried forever."""
    broker_check_interval: Duration = timedelta(seconds=5)
    """How often the daemon checks that its broker still answers (a PING/PONG on its
    connection; on the embedded mesh also the nats-server process itself)."""
    broker_check_timeout: Duration = timedelta(seconds=3)
    """The deadline of each check; a broker that misses it is reported unresponsive."""
    broker_restart_after: Duration = timedelta(seconds=20)
    """An unresponsive broker is dealt with after this long: the embedded mesh kills and
    restarts its nats-server (same ports and store); a joined node drops the connection
    and fails over to another of ``servers``. Repeated at this interval while it lasts."""

    @property
    def is_embedded(self) -> bool:
        return not self.servers


class RegistryConfig(BaseModel):
    """``[registry]``."""

    model_config = _FORBID

    require_connection_bound: bool = True
    """Refuse untokenized registrations (``mesh.registry.register``, §4.4 b) except
    from SDK agents enrolled with ``meshnode mesh token``; ``false`` accepts them
    from any node, stored as ``self_asserted`` (every credential may publish the
    subject, so either answer reaches the registrant)."""
    allow_foreign_endpoints: bool = False
    """Store a manifest's ``endpoint``/``endpoints`` even when they are not the agent's own
    subjects (``mesh.agent.<id>.inbox``, subjects under ``mesh.agent.<id>.``/``mesh.feed.<id>.``).
    Off: such a registration is refused ``UNAUTHORIZED`` (``endpoint_not_own``), because
    callers address the stored values verbatim (§14.4) and another agent's inbox there
    would redirect its callers' traffic."""
    rate_limit: Annotated[int, Field(ge=1)] = 60
    """Requests per sender per window across every platform-service subject (§16.1)."""
    node_rate_limit: Annotated[int, Field(ge=1)] = 600
    """Requests per *node* per window across every platform-service subject, beside the
    per-sender budget: a node cannot multiply its budget by signing with fresh keys. The
    node is the one the registry holds a vouch from for the sender (senders no node vouches
    for share one budget, ``unvouched_rate_limit``)."""
    unvouched_rate_limit: Annotated[int, Field(ge=1)] = 600
    """Requests per window, all together, from senders no registered node vouches for."""
    rate_window: Duration = timedelta(seconds=60)
    max_concurrent_registrations: Annotated[int, Field(ge=1, le=1024)] = 32
    """Registrations (and deregistrations) one registry instance serves at once; one
    agent's are still served one at a time, in arrival order. Each is mostly waiting on
    JetStream (the agent's mailbox stream, the revision-checked write), so a node
    registering thousands of agents is bounded by this, not by the CPU; 1 serves them
    strictly one after another."""


class ServicesConfig(BaseModel):
    """``[services]``: the platform services (registry, presence, task manager,
    artifacts, feeds) this node runs."""

    model_config = _FORBID

    run: bool | None = None
    """Run them on this node. None (absent) means: only with the embedded mesh.
    ``true`` on a node joined to an external mesh (a cluster's service node)
    needs a credential with the service role."""
    key_dir: Annotated[Path | None, BeforeValidator(_optional_dir_path), _PATH_SCHEMA] = None
    """Directory of the services' shared signing keys (``registry.nk``,
    ``presence.nk``, ...). Every service node of one mesh must sign with the
    same keys, because callers pin a service's key on first use; None keeps
    per-node keys in the keystore (fine for a single service node)."""
    max_consumers_per_agent: Annotated[int, Field(ge=1)] = 256
    """Consumers one agent may hold on each shared stream (MESH_EVENTS, MESH_FEED,
    MESH_TASKS), made for it by the consumer service; one more is refused
    QUOTA_EXCEEDED. Raise it for an agent with that many durable subscriptions."""
    max_agreements_per_owner: Annotated[int, Field(ge=1)] = 1000
    """Agreements one owner may hold registered with the platform agreement service
    (one per seller and SKU, revoked and expired ones included); one more is
    refused QUOTA_EXCEEDED."""


class AdminConfig(BaseModel):
    """``[admin]``: the Unix-socket admin API."""

    model_config = _FORBID

    socket: Annotated[
        Path, BeforeValidator(_optional_socket_path), WithJsonSchema({"type": "string"})
    ] = Path()
    """Socket path; always resolved to an absolute path after loading."""
    group: Annotated[
        str | None, BeforeValidator(_optional_group), WithJsonSchema({"type": "string"})
    ] = None
    """Group granted operator level; None when unset."""
    mode: SocketMode = None
    """Explicit socket mode; None means 0660 with a group, else 0600."""

    @property
    def effective_mode(self) -> int:
        """The mode to give the socket."""
        if self.mode is not None:
            return self.mode
        return 0o660 if self.group else 0o600


class ProtectionsConfig(BaseModel):
    """``[protections]``: the inbound limits of §22 (tunable, never disabled)."""

    model_config = _FORBID

    max_inbound_chars: Annotated[int, Field(ge=0)] = 65536
    """0 means no cap; only ever by explicit choice."""
    clock_skew_ahead: Duration = timedelta(minutes=5)
    live_max_age: Duration = timedelta(minutes=10)
    mailbox_max_age: Duration = timedelta(days=7)
    """Must not exceed ``inbox.buffer_max_age``."""
    dedup_entries: Annotated[int, Field(ge=1)] = 5000
    """The newest (from, id) pairs each agent keeps in memory against duplicates (§22.2; the spec recommends 5,000). About 75 bytes a pair."""
    check_sender_vouch: bool = True
    """Refuse requests from senders no node vouches for (§5.3 step 2), asking the registry."""


class InboxConfig(BaseModel):
    """``[inbox]``: the node inbox and the broker's redelivery buffer."""

    model_config = _FORBID

    drain_interval: Duration = timedelta(seconds=60)
    buffer_max_age: Duration = timedelta(days=7)
    buffer_max_bytes: ByteSize = 8 * 1024**2
    """One agent's mailbox (``MESH_INBOX_*``), reserved in the mesh's store at
    registration. Full, it refuses new mail and keeps what it holds (a flood
    cannot evict buffered requests); the drain empties it."""
    buffer_max_msgs: Annotated[int, Field(ge=1)] = 2000
    """Messages one mailbox holds (the same refusal when reached)."""
    buffer_discard: Annotated[Literal["new", "old"], _choice("new", "old")] = "new"
    """``new``: a full mailbox refuses new mail (a flood cannot evict what is buffered).
    ``old``: the earlier behaviour, oldest evicted first, for a mesh whose clients
    drain their mailbox without acking it through the §18.6 durable (nothing frees it)."""
    buffer_sweep_interval: Duration = timedelta(seconds=60)
    """How often the registry sweeps the next page (256 streams) of the stream listing,
    purging each mailbox up to what its drain consumer acked; a full pass takes one
    interval per 256 streams."""


class StorageConfig(BaseModel):
    """``[storage]``: the bound (``max_bytes``) of every stream and bucket the platform
    services create, each reserved in the account's JetStream store (issue #22.3).

    Read by the node that runs the services; the total (808 MiB by default) plus
    one ``inbox.buffer_max_bytes`` per agent must fit in the account's limit
    (``[mesh.embedded] account_max_store``). See docs/security-quotas.md.
    """

    model_config = _FORBID

    tasks_max_bytes: ByteSize = 64 * 1024**2
    """``MESH_TASKS`` (task updates and stream chunks; any node may publish)."""
    events_max_bytes: ByteSize = 32 * 1024**2
    """``MESH_EVENTS``."""
    feed_max_bytes: ByteSize = 32 * 1024**2
    """``MESH_FEED``."""
    heartbeat_max_bytes: ByteSize = 8 * 1024**2
    """``MESH_HEARTBEAT``."""
    registry_events_max_bytes: ByteSize = 8 * 1024**2
    """``MESH_REGISTRY``."""
    metering_max_bytes: ByteSize = 16 * 1024**2
    """``MESH_METERING``: the meter events the rating service folds into its ledger
    (the oldest are discarded at the bound, and the ledger forgets them)."""
    registry_max_bytes: ByteSize = 32 * 1024**2
    """KV ``mesh_registry`` (manifests)."""
    task_records_max_bytes: ByteSize = 64 * 1024**2
    """KV ``mesh_tasks`` (task records). Ended Tasks' records are kept for the spec's 7 days while they fit; a full bucket deletes the oldest of them to keep live Tasks written. To keep a week, size it to tasks a day × 7 × their record size (up to ~5 KB with progress history; the default holds ~13,000 such)."""
    feed_state_max_bytes: ByteSize = 16 * 1024**2
    """KV ``mesh_feed_state``."""
    artifacts_max_bytes: ByteSize = 512 * 1024**2
    """The artifact object store, all owners together (``[artifacts]`` has the per-owner quota)."""
    artifact_index_max_bytes: ByteSize = 8 * 1024**2
    artifact_uploads_max_bytes: ByteSize = 8 * 1024**2
    agreements_max_bytes: ByteSize = 8 * 1024**2
    """KV ``mesh_agreements``: the agreements registered with the platform (§19.5)."""
    max_msg_size: ByteSize | None = None
    """One message on ``MESH_TASKS``, ``MESH_EVENTS``, ``MESH_FEED`` and ``MESH_HEARTBEAT``;
    None (absent) is ``[mesh.embedded] max_payload`` (1 MiB by default), so a raised
    payload limit is not refused by the streams."""
    max_consumers_per_stream: Annotated[int, Field(ge=1)] = 100_000
    """Consumers ``MESH_TASKS``, ``MESH_EVENTS`` and ``MESH_FEED`` each hold at most:
    one per agent's event or feed subscription and per task followed. Set on the
    streams because nats-server 2.15 otherwise limits every stream to 1,000
    consumers; ``[services] max_consumers_per_agent`` bounds each agent's share."""
    low_store_warning: Annotated[float, Field(gt=0, le=1)] = 0.8
    """Share of the store (account limit, or a platform object's bound) in use at
    which the node logs a warning once and ``status`` says ``low``."""
    check_interval: Duration = timedelta(seconds=30)
    """How often a service node reads the store's use for ``status`` and the metrics."""


class CommerceConfig(BaseModel):
    """``[commerce]``: the Economics extension's admission check (§19.5)."""

    model_config = _FORBID

    approval_url: str | None = None
    """The deployment's approval surface for ``internal`` SKUs: the approval_url an
    AGREEMENT_REQUIRED refusal carries (``?sku=<id>`` is appended) when the SKU's
    provider names no checkout_url. Unset: the provider's terms_url, else the
    offering cannot be refused usefully and the SKU is refused at start."""
    gate_free_terms: bool = False
    """Also require an agreement for a free SKU that carries a terms_url
    (§19.5: agreement without money is a terms gate)."""
    platform_agreements: bool = True
    """Consult the platform agreement service at admission, beside this node's own
    store (``agreements add``). Off: only the local store admits."""
    agreement_cache_ttl: Duration = timedelta(seconds=30)
    """How long the seller's node remembers the platform's answer for one (owner,
    seller, SKU). A revocation or registration event drops it at once; this is
    the bound when that event is missed (a revoked agreement admits at most this long)."""
    publish_usage: bool = True
    """Publish the meter events of priced offerings (and A2A charges) on
    ``mesh.event.metering.*`` for the rating service (§13.5, §19.6). Off: they
    stay in this node's ``usage.jsonl`` (``meshnode usage`` rates them locally)."""
    usage_log_max_bytes: ByteSize = 1024**3
    """How much of its meter events this node keeps in ``usage.jsonl`` and its
    rotated segments (``usage.jsonl.N``, a sixteenth of this each); past it the
    oldest segment is deleted (logged). A priced call's event is ~1.5 KB. 0:
    never delete (ship or trim the segments yourself)."""


class ArtifactsConfig(BaseModel):
    """``[artifacts]``: the artifact store an embedded-mesh node serves (§7.5.2, §18.5)."""

    model_config = _FORBID

    quota_bytes: ByteSize = 1024**3
    """Per-owner total of stored bytes."""
    quota_objects: Annotated[int, Field(ge=1)] = 10_000
    """Per-owner number of stored objects."""
    max_object_size: ByteSize = 256 * 1024**2
    """One object's limit (larger is PAYLOAD_TOO_LARGE, however empty the quota)."""
    default_retention: Duration = timedelta(days=14)
    """Task retention (7d) plus the 7-day grace window of §7.5.2."""
    max_retention: Duration = timedelta(days=365)
    """The longest lifetime a writer may declare."""
    sweep_interval: Duration = timedelta(minutes=5)
    """How often expired objects are reclaimed (their refs keep answering ARTIFACT_GONE)."""
    upload_idle: Duration = timedelta(hours=1)
    """A chunked upload idle this long is discarded."""


class KeystoreConfig(BaseModel):
    """``[keystore]``: where private keys are kept at rest (see :mod:`meshnode.keystore`)."""

    model_config = _FORBID

    backend: Annotated[
        Literal["auto", "keyring", "systemd-credentials", "file"],
        _choice("auto", "keyring", "systemd-credentials", "file"),
        _choice_schema("auto", "keyring", "systemd-credentials", "file"),
    ] = "auto"


class LoggingConfig(BaseModel):
    """``[logging]``."""

    model_config = _FORBID

    level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"],
        _choice("debug", "info", "warning", "error", "critical", fold_case=True),
        _choice_schema("debug", "info", "warning", "error", "critical"),
    ] = "info"
    format: Annotated[
        Literal["auto", "json", "text", "journald"],
        _choice("auto", "json", "text", "journald"),
        _choice_schema("auto", "json", "text", "journald"),
    ] = "auto"


class EventsConfig(BaseModel):
    """``[events]``: emitting events and feeds (§6.6, §6.6a)."""

    model_config = _FORBID

    emit_limit: Annotated[int, Field(ge=1)] = 600
    """Emits one agent may make on one subject per ``emit_window`` (sender-side)."""
    emit_window: Duration = timedelta(seconds=60)


class ObservabilityConfig(BaseModel):
    """``[observability]``: publishing spans, logs and metrics (§13). All off by default."""

    model_config = _FORBID

    spans: bool = False
    """Publish a span_completed event per hop on ``mesh.trace.{agent}`` (§13.1.1)."""
    logs: bool = False
    """Publish agent log records on ``mesh.log.{agent}.{level}`` (§13.3)."""
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"],
        _choice("debug", "info", "warning", "error", fold_case=True),
        _choice_schema("debug", "info", "warning", "error"),
    ] = "info"
    """The lowest level published when ``logs`` is on."""
    metrics: bool = False
    """Publish §13.2 metrics per agent on ``mesh.metrics.{agent}`` every ``metrics_interval``."""
    metrics_interval: Duration = timedelta(seconds=60)


_AGENT_KEYS = ("plugin", "enabled", "interaction", "max_concurrency", "allowance_file", "allowance_any_owner")


def _plugin_name(value: object) -> str:
    if isinstance(value, str) and _PLUGIN_NAME.fullmatch(value):
        return value
    raise ValueError(
        f"expected an entry point name in group meshnode.agents "
        f"(letters, digits, '_', '.', '-'), got {value!r}"
    )


class AgentConfig(BaseModel):
    """``[agents.<name>]``: one hosted agent.

    Keys other than ``plugin``, ``enabled`` and ``interaction`` belong to the
    plugin: they are collected into :attr:`settings` unvalidated, for the
    plugin's own model.
    """

    model_config = _FORBID

    plugin: Annotated[str, BeforeValidator(_plugin_name), WithJsonSchema({"type": "string"})]
    """Entry point name in group ``meshnode.agents``; defaults to the table name."""
    enabled: bool = True
    interaction: Annotated[
        Literal["service", "interactive"] | None,
        _choice("service", "interactive", optional=True),
        _choice_schema("service", "interactive", optional=True),
    ] = None
    """None lets the plugin decide."""
    max_concurrency: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """This agent's limit of requests in its handlers at once; unset, it takes
    ``[node] agent_max_concurrency``."""
    allowance_file: OptionalFilePath = None
    """An owner-signed allowance document (EXT-8, JSON) for this agent; a
    relative path is relative to the config file, like every path. The
    node verifies its signature against its ``owner_key``; one that does not
    verify fails closed (every ceiling exhausted, new work refused) and is
    named in the log and in ``meshnode allowance show``. ``meshnode allowance
    set`` documents take precedence when their ``updated_at`` is later.
    ``meshnode reload`` reads it again (no restart needed)."""
    allowance_any_owner: bool | None = None
    """``true``: accept allowance documents (``allowance_file``, ``meshnode allowance
    add``) signed by any owner key. Off, a document must be signed by the
    agent's owner as this node knows it (its manifest ``owner``, else this
    node's key, §8.6); one signed by another key is refused naming both keys
    (a file fails closed). Turn on when the owner signs with a key the
    manifest does not name. Unset means false."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """The plugin's own keys from the table, unvalidated."""

    @model_validator(mode="before")
    @classmethod
    def _collect_plugin_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = {k: v for k, v in data.items() if k in _AGENT_KEYS}
        own["settings"] = {k: v for k, v in data.items() if k not in _AGENT_KEYS}
        return own


