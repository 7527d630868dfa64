"""The platform services of a service node, wired as the daemon runs them (§9, §15).

:func:`start_platform_services` is the one wiring of registry, presence,
artifact store, task manager and feeds on one account: the daemon calls it for
its own account and for every tenant of an embedded mesh, and the integration
tests call it to get exactly what a daemon serves. It creates or updates the
mesh's JetStream objects first (§18.3, §18.4), then starts the services in the
order they depend on each other: the registry loads its cache before serving,
presence asks it who vouched for an agent, the artifact store and the task
manager read manifests from its cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from meshnode.config import Config
from meshnode.services.agreements import DEFAULT_MAX_PER_OWNER, AgreementService
from meshnode.services.artifacts import ArtifactLimits, ArtifactService
from meshnode.services.base import ServiceBase, ServiceContext
from meshnode.services.consumers import DEFAULT_MAX_PER_AGENT, ConsumerService
from meshnode.services.feeds import FeedService
from meshnode.services.presence import PresenceService
from meshnode.services.rating import AgreementSource, RatingService
from meshnode.services.registry import DEFAULT_REGISTRATION_CONCURRENCY, RegistryService
from meshnode.services.tasks import TaskManagerService
from meshnode.transport.streams import (
    DEFAULT_MAILBOX_BYTES,
    DEFAULT_MAILBOX_MSGS,
    StreamLimits,
    ensure_mesh_streams,
    wait_jetstream_ready,
)

__all__ = [
    "SERVICE_ORDER",
    "PlatformServices",
    "PlatformSettings",
    "artifact_limits",
    "start_platform_services",
    "stream_limits",
]

log = logging.getLogger("meshnode.daemon")


_S = TypeVar(
    "_S", RegistryService, PresenceService, ArtifactService, TaskManagerService, FeedService, ConsumerService,
    AgreementService,
    RatingService,
)


def _same(ctx: ServiceContext) -> Callable[[str], ServiceContext]:
    return lambda _name: ctx

#: The services in start order (each stops in reverse).
SERVICE_ORDER = ("registry", "presence", "artifacts", "tasks", "feeds", "consumers", "agreements", "rating")


def stream_limits(config: Config) -> StreamLimits:
    """The bounds of the platform's streams and buckets from ``[storage]``."""
    s = config.storage
    return StreamLimits(
        tasks=s.tasks_max_bytes,
        events=s.events_max_bytes,
        feed=s.feed_max_bytes,
        heartbeat=s.heartbeat_max_bytes,
        registry_events=s.registry_events_max_bytes,
        metering=s.metering_max_bytes,
        registry=s.registry_max_bytes,
        task_records=s.task_records_max_bytes,
        feed_state=s.feed_state_max_bytes,
        artifacts=s.artifacts_max_bytes,
        artifact_index=s.artifact_index_max_bytes,
        artifact_uploads=s.artifact_uploads_max_bytes,
        agreements=s.agreements_max_bytes,
        max_msg_size=s.max_msg_size if s.max_msg_size is not None else config.mesh.embedded.max_payload,
        max_consumers=s.max_consumers_per_stream,
    )


def artifact_limits(config: Config) -> ArtifactLimits:
    """The artifact store's limits from ``[artifacts]``."""
    a = config.artifacts
    return ArtifactLimits(
        quota_bytes=a.quota_bytes,
        quota_objects=a.quota_objects,
        max_object_bytes=a.max_object_size,
        default_retention_s=int(a.default_retention.total_seconds()),
        max_retention_s=int(a.max_retention.total_seconds()),
        upload_idle_s=a.upload_idle.total_seconds(),
        sweep_interval_s=a.sweep_interval.total_seconds(),
    )


@dataclass(frozen=True)
class PlatformSettings:
    """What the services read from the configuration (defaults: the config's)."""

    heartbeat_interval_s: float = 30.0
    require_connection_bound: bool = True
    allow_foreign_endpoints: bool = False
    inbox_max_age_s: int = 7 * 86400
    inbox_max_bytes: int = DEFAULT_MAILBOX_BYTES
    inbox_max_msgs: int = DEFAULT_MAILBOX_MSGS
    inbox_discard: Literal["new", "old"] = "new"
    inbox_sweep_interval_s: float = 60.0
    artifacts: ArtifactLimits = field(default_factory=ArtifactLimits)
    max_consumers_per_agent: int = DEFAULT_MAX_PER_AGENT
    max_concurrent_registrations: int = DEFAULT_REGISTRATION_CONCURRENCY
    max_agreements_per_owner: int = DEFAULT_MAX_PER_OWNER

    @classmethod
    def from_config(cls, config: Config) -> PlatformSettings:
        return cls(
            heartbeat_interval_s=config.node.heartbeat_interval.total_seconds(),
            require_connection_bound=config.registry.require_connection_bound,
            allow_foreign_endpoints=config.registry.allow_foreign_endpoints,
            inbox_max_age_s=int(config.inbox.buffer_max_age.total_seconds()),
            inbox_max_bytes=config.inbox.buffer_max_bytes,
            inbox_max_msgs=config.inbox.buffer_max_msgs,
            inbox_discard=config.inbox.buffer_discard,
            inbox_sweep_interval_s=config.inbox.buffer_sweep_interval.total_seconds(),
            artifacts=artifact_limits(config),
            max_consumers_per_agent=config.services.max_consumers_per_agent,
            max_concurrent_registrations=config.registry.max_concurrent_registrations,
            max_agreements_per_owner=config.services.max_agreements_per_owner,
        )


@dataclass
class PlatformServices:
    """The running services of one account, in start order."""

    registry: RegistryService
    presence: PresenceService
    artifacts: ArtifactService
    tasks: TaskManagerService
    feeds: FeedService
    consumers: ConsumerService
    agreements: AgreementService
    rating: RatingService

    def all(self) -> list[ServiceBase]:
        return [
            self.registry, self.presence, self.artifacts, self.tasks, self.feeds, self.consumers, self.agreements,
            self.rating,
        ]

    async def stop(self) -> None:
        """Stop every service, last started first."""
        await self.stop_all(self.all())

    @staticmethod
    async def stop_all(services: Sequence[ServiceBase]) -> None:
        """Stop ``services`` in reverse; one failing does not keep the others running."""
        for service in reversed(services):
            try:
                await service.stop()
            except Exception as exc:
                log.warning("stopping %s failed: %s", type(service).__name__, exc)


async def start_platform_services(
    context: ServiceContext | Callable[[str], ServiceContext],
    settings: PlatformSettings | None = None,
    *,
    is_revoked: Callable[[str], bool] | None = None,
    trust_tier_of: Callable[[str], str | None] | None = None,
    trusted_issuers: Collection[str] = (),
    imported: Mapping[str, str] | None = None,
    wait_ready: bool = False,
    sdk_agent_of: Callable[[str], str | None] | None = None,
    agreement_source: AgreementSource | None = None,
) -> PlatformServices:
    """Ensure the mesh streams, then start every platform service of one account.

    ``context`` is one context for all services, or a function of the service
    name (the daemon gives each service its own key). ``is_revoked`` and
    ``trust_tier_of`` come from the control plane (enrolment knows who was
    retired and each node's attested tier, §9.7); ``trusted_issuers`` are the
    operators whose portable attestations the registry believes; ``imported``
    maps agents other tenants exported here to where their registry answers.
    ``sdk_agent_of`` (control plane) names the one agent of a node's sdk
    enrolment: the registry accepts untokenized registrations from those only.
    ``agreement_source`` is an agreement store the rating service reads beside
    the agreements the meter events carry (None: those alone).
    ``wait_ready`` waits for the streams to have leaders first: a cluster
    (re)started moments ago answers before they do.
    """
    settings = settings or PlatformSettings()
    contexts: Callable[[str], ServiceContext] = (
        context if not isinstance(context, ServiceContext) else _same(context)
    )
    first = contexts("registry")
    if wait_ready:
        await wait_jetstream_ready(first.connection.jetstream, timeout=20.0)
    await ensure_mesh_streams(first.connection.jetstream, first.replicas, first.stream_limits)
    presence = PresenceService(contexts("presence"), heartbeat_interval_s=settings.heartbeat_interval_s)
    registry = RegistryService(
        first,
        require_connection_bound=settings.require_connection_bound,
        allow_foreign_endpoints=settings.allow_foreign_endpoints,
        inbox_max_age_s=settings.inbox_max_age_s,
        inbox_max_bytes=settings.inbox_max_bytes,
        inbox_max_msgs=settings.inbox_max_msgs,
        inbox_discard=settings.inbox_discard,
        inbox_sweep_interval_s=settings.inbox_sweep_interval_s,
        presence=presence,
        is_revoked=is_revoked,
        trust_tier_of=trust_tier_of,
        trusted_issuers=trusted_issuers,
        imported=imported,
        sdk_agent_of=sdk_agent_of,
        max_concurrent_registrations=settings.max_concurrent_registrations,
    )
    presence.vouched_by = registry.vouched_by
    # The registry names its sibling services' keys in each registration reply,
    # so a node (which pins the registry's key) knows every platform emitter and
    # applies §5.3 step 2 to events without refusing the platform's own.
    registry.platform_keys = frozenset(
        contexts(name).key.public_key for name in ("registry", "presence", "artifacts", "tasks", "feeds")
    )
    if first.node_budget is not None and first.node_budget.node_of is None:
        # The per-node budget attributes a sender to the node the registry
        # holds a current vouch from (one registry per account, so per tenant).
        first.node_budget.node_of = registry.vouched_by

    async def owner_of(agent_id: str) -> str | None:
        # Artifact owners resolve from the registry's cache (§7.5.2, §8.6).
        manifest = registry.manifest(agent_id)
        owner = manifest.get("owner") if manifest is not None else None
        return owner if isinstance(owner, str) and owner else None

    started: list[ServiceBase] = []

    async def start(service: _S) -> _S:
        await service.start()
        started.append(service)
        return service

    try:
        await start(registry)
        await start(presence)
        artifacts = await start(
            ArtifactService(contexts("artifacts"), owner_of=owner_of, limits=settings.artifacts)
        )
        # Attribution (§10.8a) reads the responder's needs from the registry's cache.
        tasks = await start(TaskManagerService(contexts("tasks"), manifest_of=registry.manifest))
        # Feeds (§6.6a, §18.3): MESH_FEED, the state-feed KV and mesh.feed.get.
        feeds = await start(FeedService(contexts("feeds")))
        # Participants' consumers on the shared streams (#22): signed with the
        # registry's key, so no deployment needs a new service key file.
        consumers = await start(
            ConsumerService(contexts("registry"), max_per_agent=settings.max_consumers_per_agent)
        )
        # Agreements registered with the platform (§19.5): who owns a requesting
        # agent is the registry's answer; signed with the registry's key, like
        # the consumer service (no new service key file for a deployment).
        agreements = await start(
            AgreementService(
                contexts("registry"),
                owner_of=lambda agent: _owner(registry.manifest(agent)),
                max_per_owner=settings.max_agreements_per_owner,
            )
        )
        # Rating (§19.6) folds MESH_METERING into a ledger; it signs with the task
        # manager's key (the other metering emitter), so no deployment needs a
        # new service key file. Owners resolve from the registry's cache.
        rating = await start(
            RatingService(
                contexts("tasks"), owner_of=lambda agent: _owner(registry.manifest(agent)), agreements=agreement_source
            )
        )
    except BaseException:
        await PlatformServices.stop_all(started)
        raise
    return PlatformServices(registry, presence, artifacts, tasks, feeds, consumers, agreements, rating)


def _owner(manifest: Mapping[str, object] | None) -> str | None:
    owner = manifest.get("owner") if manifest is not None else None
    return owner if isinstance(owner, str) and owner else None
