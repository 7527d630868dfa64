"""The registry service (§6.2, §6.3, §9): manifests in KV, discovery from a watched cache.

Every operation is request-reply on a queue group (``mesh_registry``), so any
number of registry instances can serve at once. Manifests live in the KV
bucket ``mesh_registry`` keyed by agent id; each instance keeps an in-memory
copy fed by a KV watch (a write by any instance is seen by all; a reconnect
rebuilds the copy from a fresh watch), and answers discover and get from it.

Every answer is a ``respond`` signed by the registry key with ``to`` = the
caller and ``in_reply_to`` = the request id (see :mod:`.base`), payload as
below, or ``{status: "failed"}`` with an ``error`` object.

Subjects and payloads (the contract):

``mesh.registry.register.{node_id}`` (connection-bound, §4.4 b) and ``mesh.registry.register``
    Request payload: the manifest (§8.1; legacy ``skills`` read as
    ``offerings``). The trailing token must be the manifest's ``node.id``;
    the vouch must verify for that node and this agent, and be unexpired.
    The untokenized subject carries no identity. It is accepted from an
    ``sdk``-enrolled node (an AgentMesh SDK agent enrolled with ``meshnode mesh
    token``): the manifest's ``node.id`` must be an active sdk enrolment's node
    key whose agent is the manifest's ``id`` (or that agent's own key: a
    self-vouch, the Python SDK's default), and the vouch must verify for that
    node, so only the holder of that enrolment's keys can produce it. Stored with
    ``node_binding: "sdk_enrolled"`` and ``node.profile.enrolment: "sdk"``.
    Every other untokenized registration is refused ``UNAUTHORIZED``
    (``details.reason: "untokenized_registration"``, or
    ``"sdk_enrolment_mismatch"`` for an sdk node registering another agent)
    unless ``require_connection_bound=False``, in which case the node binding
    is stored as self-asserted.
    Reply: ``{status: "registered", agent_id, node_binding:
    "connection_bound"|"sdk_enrolled"|"self_asserted", platform_keys?: [the
    platform services' signing keys], dropped?: [member paths dropped as
    unreadable]}``. Errors: ``INVALID_MANIFEST`` (``details.field``),
    ``IDENTITY_MISMATCH`` (``from`` ≠ ``id``), ``UNAUTHORIZED``
    (``details.reason``), ``RATE_LIMITED``.
    The stored manifest is the validated, normalized one: ``owner`` and
    ``visibility`` defaulted, ``endpoints`` stamped, the public block
    materialized (§8.7), plus registry-owned ``meta.registry =
    {node_binding, registered_at}`` (any registrant value is replaced).
    Unless the agent is sandboxed, its redelivery buffer ``MESH_INBOX_{id}``
    is created (or updated) before the manifest is stored. Emits
    ``mesh.event.registry.agent_registered`` with data ``{agent_id, node}``.
    The legacy TS/Python deregistration (payload ``{deregister: true}``) is
    accepted on these subjects too.

``mesh.registry.deregister``
    Payload ``{deregister: true}`` (TS/Python), ``{agent_id}`` (Rust) or none.
    The agent is the verified ``from``; an ``agent_id`` naming anybody else
    is ``UNAUTHORIZED``. Removes the manifest and the agent's
    ``MESH_INBOX`` stream. Idempotent: reply ``{status: "deregistered",
    agent_id, existed}``. Emits ``mesh.event.registry.agent_deregistered``
    when a manifest was removed.

``mesh.registry.discover``
    Payload: a query (:mod:`.query`). Reply ``{agents: [manifest + joined
    availability], total, cursor?}``: matches sorted by agent id, ``total``
    counting every match, ``cursor`` present when more remain. Listing
    tiers (§8.6): public listed, unlisted never listed, private listed only
    to its owner (the caller's key or the caller's own manifest owner).
    ``INVALID_QUERY`` for a malformed query.

``mesh.registry.get.{agent_id}``
    Payload ``{agent_id}`` (must match the token) or none. Reply: the stored
    manifest plus joined ``availability``. Unlisted agents are returned (get
    is by id); a private agent shows anybody but its owner only its id, endpoints and vouch,
    and so is an unknown id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import orjson

from meshnode.aio import KeyedConcurrency
from meshnode.protocol import subjects
from meshnode.protocol.attestations import verify_trust_attestation
from meshnode.protocol.envelope import build_envelope, decode_envelope, encode_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.manifest import check_registration
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339
from meshnode.transport.connection import Message
from meshnode.transport.errors import Conflict, NotFound, StoreFull
from meshnode.transport.jetstream import KeyValue
from meshnode.transport.streams import (
    DEFAULT_MAILBOX_BYTES,
    DEFAULT_MAILBOX_MSGS,
    SweepCursor,
    ensure_inbox_stream,
    ensure_key_value,
    purge_acked_page,
    registry_bucket_config,
)

from .base import Envelope, KVMirror, ServiceBase, ServiceContext
from .presence import PresenceService
from .query import DiscoverQuery, encode_cursor, listed_for, parse_discover_query

__all__ = ["DEFAULT_REGISTRATION_CONCURRENCY", "RegistryService"]

#: Registrations served at once by one registry instance ([registry] max_concurrent_registrations).
DEFAULT_REGISTRATION_CONCURRENCY = 32

#: Room left in a discover reply for the envelope around the agents.
_ENVELOPE_SLACK = 4096


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value)


class RegistryService(ServiceBase):
    """Registration, deregistration, discovery and lookup (module docstring)."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        require_connection_bound: bool = True,
        inbox_max_age_s: float = 7 * 86400,
        inbox_max_bytes: int = DEFAULT_MAILBOX_BYTES,
        inbox_max_msgs: int = DEFAULT_MAILBOX_MSGS,
        inbox_discard: Literal["new", "old"] = "new",
        inbox_sweep_interval_s: float = 60.0,
        presence: PresenceService | None = None,
        sync_timeout_s: float = 10.0,
        is_revoked: Callable[[str], bool] | None = None,
        trust_tier_of: Callable[[str], str | None] | None = None,
        trusted_issuers: Collection[str] = (),
        imported: Mapping[str, str] | None = None,
        sdk_agent_of: Callable[[str], str | None] | None = None,
        allow_foreign_endpoints: bool = False,
        max_concurrent_registrations: int = DEFAULT_REGISTRATION_CONCURRENCY,
    ) -> None:
        super().__init__(ctx, name="registry", queue="mesh_registry")
        # Registrations and deregistrations are mostly waiting on JetStream
        # (the mailbox stream, the revision-checked KV write): served side by
        # side, this many at once, but one at a time per agent (the sender), so
        # one agent's register and deregister never interleave on this instance
        # (two instances are kept apart by the compare-and-set in _store).
        self.registrations = KeyedConcurrency(max_concurrent_registrations)
        # The one agent of a node's active sdk enrolment (None: not one), from
        # the control plane's enrolment records: the only word on who may use
        # the untokenized register subject. A claim in the credential would not
        # do: a subscriber never learns which credential published a message.
        self._sdk_agent_of = sdk_agent_of
        # Endpoints are carried verbatim to callers (§14.4): unless the operator
        # opts out, only the agent's own subjects are stored (§8.2).
        self.allow_foreign_endpoints = allow_foreign_endpoints
        # Agents another tenant exported to this one (§15.2): agent id -> the
        # subject where the exporting tenant's registry answers a get for it.
        self._imported = dict(imported or {})
        # Operator keys whose portable trust attestations (§9.7) this registry
        # believes: local policy. Any attestation is still verified (a forged
        # or expired one refuses the registration); only these are applied.
        self._trusted_issuers = frozenset(trusted_issuers)
        self.require_connection_bound = require_connection_bound
        self.inbox_max_age_s = inbox_max_age_s
        self.inbox_max_bytes = inbox_max_bytes
        self.inbox_max_msgs = inbox_max_msgs
        self.inbox_discard: Literal["new", "old"] = inbox_discard
        self.inbox_sweep_interval_s = inbox_sweep_interval_s
        #: Where the mailbox sweep resumes in the stream listing (one page per tick).
        self.sweep_cursor = SweepCursor()
        #: The sweep's pages, purges and failures (``mailbox_sweep.*``).
        self.counters: Counter[str] = Counter()
        self.presence = presence
        if presence is not None and presence.vouched_by is None:
            presence.vouched_by = self.vouched_by
        # The operator-attested tier of a node (§9.7): the sandbox clamp and the
        # discovery filter. Without it nothing is sandboxed and every node
        # counts as standard.
        self._trust_tier_of = trust_tier_of
        self._sync_timeout_s = sync_timeout_s
        # Keys the operator retired (§4.8): answered as revoked, never registered again.
        self._is_revoked = is_revoked
        self._kv: KeyValue | None = None
        self._mirror: KVMirror | None = None
        #: The platform services' signing keys (this one's included), named in
        #: every registration reply as ``platform_keys``: what they emit is the
        #: platform's, though no node vouches for them (§5.3 step 2 on events).
        self.platform_keys: frozenset[str] = frozenset()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Open (or create) the bucket, load it through a watch, then serve."""
        if self.running:
            return
        js = self.ctx.connection.jetstream
        await ensure_key_value(js, registry_bucket_config(self.ctx.replicas, self.ctx.stream_limits))
        self._kv = await js.key_value(subjects.KV_REGISTRY)
        self._running = True
        self._mirror = KVMirror(self, self._kv, "registry")
        try:
            await self._mirror.start(self._sync_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.hook_reconnect(self._on_reconnect)
        gate = self.registrations
        await self.serve("mesh.registry.register.*", self._register, concurrency=gate)
        await self.serve(subjects.REGISTRY_REGISTER, self._register, concurrency=gate)
        await self.serve(subjects.REGISTRY_DEREGISTER, self._deregister, concurrency=gate)
        await self.serve(subjects.REGISTRY_DISCOVER, self._discover)
        await self.serve("mesh.registry.get.*", self._get)
        await self.ctx.connection.flush()
        if self.inbox_sweep_interval_s > 0:
            self.spawn(self._mailbox_sweep_loop, "mailbox-sweep")

    async def _mailbox_sweep_loop(self) -> None:
        # Issue #22.4: the mailboxes refuse new mail at their bound, so what a
        # client has acked through its drain durable is purged here, whatever
        # the client (a meshnode node also purges its own after each drain).
        # Issue #21: one page of the stream listing per tick (256 streams), not
        # the whole listing: the cost per tick is bounded whatever the number
        # of agents; a complete pass takes ceil(streams / 256) ticks.
        while self.running:
            await asyncio.sleep(self.inbox_sweep_interval_s)
            await self.sweep_mailbox_page()

    async def sweep_mailbox_page(self) -> dict[str, int]:
        """One tick of the mailbox sweep: the next page of the stream listing
        (:class:`~meshnode.transport.streams.SweepCursor`); the purged mailboxes.
        A failed page is logged and retried at the next tick (the cursor stays)."""
        cursor = self.sweep_cursor
        try:
            purged, listed = await purge_acked_page(self.ctx.connection.jetstream, cursor.offset)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters["mailbox_sweep.failed"] += 1
            self.log.warning("mailbox sweep failed (streams from offset %d): %s", cursor.offset, exc)
            return {}
        cursor.advance(listed)
        self.counters["mailbox_sweep.pages"] += 1
        self.counters["mailbox_sweep.purged"] += len(purged)
        if purged:
            self.log.debug("mailbox sweep purged %d mailbox(es)", len(purged))
        return purged

    async def stop(self) -> None:
        await super().stop()
        if self._mirror is not None:
            await self._mirror.stop()

    async def _on_reconnect(self) -> None:
        # An ordered consumer can miss changes across a reconnect; a fresh
        # watch replays the latest value of every key, deletions included.
        if self.running and self._mirror is not None:
            self._mirror.restart()

    # -- the cache -----------------------------------------------------------

    @property
    def _cache(self) -> dict[str, dict[str, Any]]:
        """Every stored manifest by agent id, as the bucket's watch last showed it."""
        return self._mirror.entries if self._mirror is not None else {}

    def manifest(self, agent_id: str) -> dict[str, Any] | None:
        """The stored manifest of ``agent_id`` (from the cache), or None."""
        return self._cache.get(agent_id)

    def agent_ids(self) -> list[str]:
        """Every registered agent id, sorted."""
        return sorted(self._cache)

    def node_of(self, agent_id: str) -> str | None:
        """The node a stored manifest names for ``agent_id`` (vouch not checked)."""
        manifest = self._cache.get(agent_id)
        node = manifest.get("node") if manifest else None
        node_id = node.get("id") if isinstance(node, Mapping) else None
        return node_id if isinstance(node_id, str) else None

    def vouched_by(self, agent_id: str) -> str | None:
        """The node whose *current* (unexpired) vouch the registry holds for
        ``agent_id``, or None. Presence asks this of every non-node beat."""
        manifest = self._cache.get(agent_id)
        if manifest is None:
            return None
        node = manifest.get("node")
        if not isinstance(node, Mapping):
            return None
        attestation = node.get("attestation")
        expires_us = (
            try_parse_rfc3339(attestation.get("expires_at"))
            if isinstance(attestation, Mapping)
            else None
        )
        if expires_us is None or expires_us <= self.ctx.now_ms() * 1000:
            return None
        node_id = node.get("id")
        return node_id if isinstance(node_id, str) else None

    def _with_availability(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(manifest)
        if self.presence is not None:
            out["availability"] = self.presence.availability_of(
                str(manifest.get("id")), self.node_of(str(manifest.get("id")))
            )
        return out

    def _caller_owners(self, caller: str) -> set[str]:
        owners = {caller}
        own = self._cache.get(caller)
        if own is not None and isinstance(own.get("owner"), str):
            owners.add(own["owner"])
        return owners

    # -- register / deregister -------------------------------------------------

    def _attested_tier(self, node: object, node_id: str, now_ms: int) -> str | None:
        """The tier a manifest's ``node.trust_attestation`` (§9.7) proves, if any.

        Raises UNAUTHORIZED (``details.reason`` from the verifier) for an
        attestation that is forged, about another node, malformed or expired:
        a node presenting a claim that does not hold learns so at once.
        An intact one from an issuer this registry does not trust proves nothing.
        """
        attestation = node.get("trust_attestation") if isinstance(node, Mapping) else None
        if attestation is None:
            return None
        try:
            claims = verify_trust_attestation(attestation, now_ms=now_ms, expected_subject=node_id)
        except ProtocolError as exc:
            field = exc.details.get("field")
            exc.details["field"] = f"node.trust_attestation.{field}" if field else "node.trust_attestation"
            raise
        if attestation["issuer"] not in self._trusted_issuers:
            return None
        return claims.get("trust_tier")

    def _tier_of(self, node_id: str, manifest: Mapping[str, Any] | None, now_ms: int) -> str | None:
        """A node's tier: the operator's enrolment record first (it is the freshest
        word), else the trusted attestation its manifest carries, checked now."""
        if self._trust_tier_of is not None:
            tier = self._trust_tier_of(node_id)
            if tier is not None:
                return tier
        if manifest is None:
            return None
        try:
            return self._attested_tier(manifest.get("node"), node_id, now_ms)
        except ProtocolError:
            return None  # expired since it was stored: it proves nothing any more

    def bound_node(self, msg: Message) -> str | None:
        """A connection-bound registration counts against the node its subject names."""
        parsed = subjects.parse_register_subject(msg.subject)
        return parsed[1] if parsed is not None and parsed[0] else None

    async def _register(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        parsed = subjects.parse_register_subject(msg.subject)
        if parsed is None:
            raise ProtocolError(
                "UNAUTHORIZED",
                "the registration subject's node token is not a node key",
                {"reason": "invalid_subject_node"},
            )
        bound, subject_node = parsed
        payload = env.get("payload")
        if isinstance(payload, Mapping) and payload.get("deregister") is True:
            return await self._remove(env["from"])
        sdk_node = None if bound else self._sdk_node(payload, env["from"])
        if not bound and sdk_node is None and self.require_connection_bound:
            # Refused before any schema work: on this path nothing the
            # manifest says about its node can be believed (§4.4 b).
            raise self._untokenized_refusal(payload, env["from"])
        if self._is_revoked is not None and self._is_revoked(env["from"]):
            raise ProtocolError("UNAUTHORIZED", "this agent's key was revoked", {"reason": "agent_key_revoked"})
        now = self.ctx.now_ms()
        sandbox = False
        manifest_node = _manifest_node_id(payload)
        if manifest_node is not None:
            assert isinstance(payload, Mapping)
            attested = self._attested_tier(payload.get("node"), manifest_node, now)
            enrolled = self._trust_tier_of(manifest_node) if self._trust_tier_of is not None else None
            sandbox = (enrolled or attested) == "sandbox"
        result = check_registration(
            payload,
            sender=env["from"],
            now_ms=now,
            # An sdk node is bound by its enrolment instead of the subject:
            # checked as though it had arrived on its own tokenized subject,
            # so the vouch must verify for exactly that node.
            subject_node=subject_node if sdk_node is None else sdk_node,
            require_connection_bound=self.require_connection_bound,
            own_endpoints_only=not self.allow_foreign_endpoints,
            sandbox=sandbox,
            enrolment=None if sdk_node is None else "sdk",
        )
        stored = result.manifest
        agent_id: str = stored["id"]
        node_id: str = stored["node"]["id"]
        binding = "connection_bound" if bound else "sdk_enrolled" if sdk_node else "self_asserted"
        meta = dict(stored.get("meta") or {})
        meta["registry"] = {"node_binding": binding, "registered_at": format_ts(now)}
        stored["meta"] = meta
        if result.dropped:
            self.log.info("registration of %s dropped %s", agent_id, ", ".join(result.dropped))
        js = self.ctx.connection.jetstream
        if stored.get("sandbox"):
            # §16.4: a sandbox agent gets no buffer, including one left from
            # an earlier, unsandboxed registration.
            with contextlib.suppress(NotFound):
                await js.delete_stream(subjects.inbox_stream_name(agent_id))
        else:
            # The buffer exists before the manifest says the agent is reachable.
            try:
                await ensure_inbox_stream(
                    js,
                    agent_id,
                    max_age_s=self.inbox_max_age_s,
                    max_bytes=self.inbox_max_bytes,
                    max_msgs=self.inbox_max_msgs,
                    discard=self.inbox_discard,
                    replicas=self.ctx.replicas,
                    # An agent the registry does not hold has (almost always) no
                    # mailbox yet: create it without the look-up first (issue #21).
                    fresh=agent_id not in self._cache,
                )
            except StoreFull as exc:
                # Name the store that is full: the mailbox's reservation did not fit.
                stream = subjects.inbox_stream_name(agent_id)
                raise StoreFull(
                    f"reserving the mailbox {stream} ({self.inbox_max_bytes} bytes, [inbox] "
                    f"buffer_max_bytes) in the account's store: {exc}",
                    code=exc.code,
                    err_code=exc.err_code,
                ) from exc
        revision, kept = await self._store(agent_id, stored)
        if kept is not None:
            # Another instance stored a registration with a newer vouch while
            # this one was in flight: that one stands (see _store).
            self.log.info("registration of %s superseded by a newer one; kept it", agent_id)
            stored = kept
        # Read-your-writes on this instance; the watch confirms it (and tells the others).
        assert self._mirror is not None
        self._mirror.wrote(agent_id, revision, stored)
        # This process's own node logs each of its registrations already ("registered
        # NAME as ID"): a second line per agent only doubled an embedded node's start-up
        # log (20,000 lines at 10,000 agents). Other nodes' registrations stay INFO.
        self.log.log(logging.DEBUG if node_id == self.ctx.node_id else logging.INFO,
                     "registered %s on node %s (%s)", agent_id, node_id, binding)
        await self.emit("registry", "agent_registered", {"agent_id": agent_id, "node": node_id})
        reply: dict[str, Any] = {"status": "registered", "agent_id": agent_id, "node_binding": binding}
        if self.platform_keys:
            reply["platform_keys"] = sorted(self.platform_keys)
        if result.dropped:
            reply["dropped"] = result.dropped
        return reply

    def _sdk_node(self, payload: object, sender: str) -> str | None:
        """The manifest's node when it is an sdk enrolment of ``sender``, else None.

        Only the enrolment is looked at here; the vouch is verified for this
        node by :func:`check_registration` before anything is stored.
        """
        node_id = _manifest_node_id(payload)
        if node_id is None or self._sdk_agent_of is None:
            return None
        return node_id if self._sdk_agent_of(node_id) == sender else None

    def _untokenized_refusal(self, payload: object, sender: str) -> ProtocolError:
        node_id = _manifest_node_id(payload)
        enrolled = (
            self._sdk_agent_of(node_id) if node_id is not None and self._sdk_agent_of else None
        )
        if enrolled is not None:
            return ProtocolError(
                "UNAUTHORIZED",
                f"node {node_id} is an sdk enrolment for agent {enrolled}, not for {sender}",
                {"field": "node.id", "reason": "sdk_enrolment_mismatch"},
            )
        return ProtocolError(
            "UNAUTHORIZED",
            "an untokenized registration is accepted only from an sdk-enrolled node; "
            "register on mesh.registry.register.<node_id>, enrol an SDK agent with "
            "`meshnode mesh token`, or set [registry] require_connection_bound = false",
            {"field": "node.id", "reason": "untokenized_registration"},
        )

    async def _store(
        self, agent_id: str, stored: dict[str, Any]
    ) -> tuple[int, dict[str, Any] | None]:
        """Write ``stored`` revision-checked; return (revision, the record kept instead or None).

        With several registry instances (§9.4) two registrations of one agent
        can be in flight at once, e.g. a node's retry landing on the second
        instance while the first is still writing. A blind put lets whichever
        write lands last win, which may be the older vouch. Here each write
        names the revision it read (compare-and-set); on a lost race it re-reads,
        and a stored record whose vouch was issued later than ours is kept.
        """
        assert self._kv is not None and self._mirror is not None
        data = _dumps(stored)
        for attempt in range(_CAS_ATTEMPTS):
            if attempt == 0:
                # The watched copy first: a KV read less per registration. A stale
                # copy costs nothing but a retry, since the write below names the
                # revision the copy was at and fails if the bucket moved on.
                current = self._mirror.entries.get(agent_id)
                revision = self._mirror.revisions.get(agent_id, 0) if current is not None else 0
            else:
                current, revision = await self._mirror.get(agent_id)
            if current is not None and _vouch_issued(current) > _vouch_issued(stored):
                return revision, current
            try:
                if revision == 0:
                    # Absent or deleted: create() also reuses a deletion marker's revision.
                    return await self._kv.create(agent_id, data), None
                return await self._kv.update(agent_id, data, last=revision), None
            except Conflict:
                continue  # another instance wrote in between: read again
        raise ProtocolError(
            "INTERNAL_ERROR", "the registration kept losing concurrent writes; retry", {"agent_id": agent_id}
        )

    async def _deregister(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        if payload is not None and not isinstance(payload, Mapping):
            raise ProtocolError("INVALID_ENVELOPE", "a deregistration payload is an object")
        claimed = payload.get("agent_id") if isinstance(payload, Mapping) else None
        if claimed is not None and claimed != env["from"]:
            raise ProtocolError(
                "UNAUTHORIZED",
                "an agent deregisters only itself",
                {"reason": "not_the_sender", "agent_id": claimed if isinstance(claimed, str) else None},
            )
        return await self._remove(env["from"])

    async def _remove(self, agent_id: str) -> Mapping[str, Any]:
        assert self._kv is not None
        existing = self._cache.get(agent_id)
        node_id = self.node_of(agent_id)
        # Deleted even when this instance's copy lags another's fresh write.
        await self._kv.delete(agent_id)
        self._cache.pop(agent_id, None)
        with contextlib.suppress(NotFound):
            await self.ctx.connection.jetstream.delete_stream(subjects.inbox_stream_name(agent_id))
        if existing is not None:
            self.log.info("deregistered %s", agent_id)
            await self.emit(
                "registry", "agent_deregistered", {"agent_id": agent_id, "node": node_id}
            )
        return {"status": "deregistered", "agent_id": agent_id, "existed": existing is not None}

    # -- discover / get --------------------------------------------------------

    def search(self, query: DiscoverQuery, caller: str) -> tuple[list[dict[str, Any]], int, str | None]:
        """One page of matches for ``caller``: (manifests with availability, total, next cursor)."""
        owners = self._caller_owners(caller)
        matches: list[dict[str, Any]] = []
        tiers: dict[str, str | None] = {}  # one look-up per node per search
        now = self.ctx.now_ms()
        for agent_id in sorted(self._cache):
            manifest = self._cache[agent_id]
            node_tier = None
            if query.trust_tier is not None:
                node_id = self.node_of(agent_id)
                if node_id is not None:
                    if node_id not in tiers:
                        tiers[node_id] = self._tier_of(node_id, manifest, now)
                    node_tier = tiers[node_id]
            if not listed_for(manifest, owners) or not query.matches(manifest, node_tier):
                continue
            joined = self._with_availability(manifest)
            if query.availability is not None and joined.get("availability") != query.availability:
                continue
            matches.append(joined)
        start = 0
        if query.after is not None:
            start = next(
                (i for i, m in enumerate(matches) if m["id"] > query.after), len(matches)
            )
        page = matches[start : start + query.limit]
        more = start + len(page) < len(matches)
        cursor = encode_cursor(page[-1]["id"]) if more and page else None
        return page, len(matches), cursor

    async def _discover(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        query = parse_discover_query(env.get("payload"))
        if query.availability is not None and self.presence is None:
            raise ProtocolError(
                "INVALID_QUERY",
                "availability: this registry has no presence service to join",
                {"field": "availability", "reason": "presence_unavailable"},
            )
        page, total, cursor = self.search(query, env["from"])
        return self._fit(page, total, cursor)

    def _fit(
        self, page: list[dict[str, Any]], total: int, cursor: str | None
    ) -> dict[str, Any]:
        """Shorten the page until the reply fits the broker's max payload (§18.9)."""
        budget = self.ctx.connection.max_payload - _ENVELOPE_SLACK
        while True:
            reply: dict[str, Any] = {"agents": page, "total": total}
            if cursor is not None:
                reply["cursor"] = cursor
            if len(page) <= 1 or len(encode_envelope({"payload": reply})) <= budget:
                return reply
            page = page[: len(page) // 2]
            cursor = encode_cursor(page[-1]["id"])

    async def _get(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        token = msg.subject.rsplit(".", 1)[-1]
        payload = env.get("payload")
        if payload is not None and not isinstance(payload, Mapping):
            raise ProtocolError("INVALID_QUERY", "query: must be an object", {"field": "query"})
        claimed = payload.get("agent_id") if isinstance(payload, Mapping) else None
        if claimed is not None and claimed != token:
            raise ProtocolError(
                "INVALID_QUERY", "agent_id: does not match the subject", {"field": "agent_id"}
            )
        if self._is_revoked is not None and is_valid_public(token) and self._is_revoked(token):
            raise ProtocolError("UNAUTHORIZED", "this agent's key was revoked", {"reason": "agent_key_revoked"})
        manifest = self._cache.get(token) if is_valid_public(token) else None
        if manifest is None and token in self._imported:
            return await self._get_imported(token, env)
        if manifest is None:
            raise ProtocolError(
                "NOT_FOUND",
                "no such agent: this registry holds none by that id (never registered, deregistered,"
                " or an agent of another tenant that is not exported to this one)",
                {"agent_id": token},
            )
        if manifest.get("visibility") == "private" and manifest.get("owner") not in self._caller_owners(env["from"]):
            # A private agent is never listed and its description stays with its
            # owner, but whoever it wrote to must be able to answer it and to
            # check that a node vouches for it (§5.3 step 2): only those facts.
            return {k: manifest[k] for k in _PRIVATE_FACTS if k in manifest}
        return self._with_availability(manifest)


    async def _get_imported(self, agent_id: str, request: Envelope) -> Mapping[str, Any]:
        """Resolve an agent exported to this tenant through its own tenant's registry.

        The look-up is this registry's own signed request; the answer is verified
        (signature, bound to the request) before it is passed on.
        """
        env = self.sign(build_envelope(
            "discover", self.ctx.service_id, now_ms=self.ctx.now_ms(),
            payload={"agent_id": agent_id}, ids=self.ctx.ids,
        ))
        try:
            msg = await self.ctx.connection.request(
                self._imported[agent_id], encode_envelope(env), timeout=5.0
            )
            reply = decode_envelope(msg.data)
        except ProtocolError:
            raise ProtocolError(
                "DEPENDENCY_FAILED", "the exporting tenant's registry answered unreadably"
            ) from None
        except Exception:
            raise ProtocolError(
                "AGENT_UNAVAILABLE", "the exporting tenant's registry did not answer",
                {"agent_id": agent_id},
            ) from None
        if reply.get("in_reply_to") != env["id"] or reply.get("to") != self.ctx.service_id:
            raise ProtocolError("DEPENDENCY_FAILED", "the exporting registry answered another request")
        error = reply.get("error")
        if isinstance(error, Mapping):
            raise ProtocolError(str(error.get("code", "NOT_FOUND")), str(error.get("message", "")),
                                {"agent_id": agent_id})
        payload = reply.get("payload")
        if not isinstance(payload, Mapping) or payload.get("id") != agent_id:
            raise ProtocolError("NOT_FOUND", "no such agent", {"agent_id": agent_id})
        self.log.debug("resolved %s for %s through its tenant", agent_id, request["from"])
        return payload


#: What a non-owner learns of a private agent by id: identity, where to answer, the vouch.
_PRIVATE_FACTS = ("id", "endpoint", "endpoints", "node", "visibility", "protocol_version")


#: Compare-and-set rounds before a registration gives up (each lost round means
#: another instance wrote the same agent in between).
_CAS_ATTEMPTS = 8


def _vouch_issued(manifest: Mapping[str, Any]) -> int:
    """The vouch's issue time (microseconds; 0 when absent or unreadable)."""
    node = manifest.get("node")
    attestation = node.get("attestation") if isinstance(node, Mapping) else None
    issued = attestation.get("issued_at") if isinstance(attestation, Mapping) else None
    return (try_parse_rfc3339(issued) or 0) if isinstance(issued, str) else 0


def _manifest_node_id(payload: object) -> str | None:
    if not isinstance(payload, Mapping):
        return None
    node = payload.get("node")
    node_id = node.get("id") if isinstance(node, Mapping) else None
    return node_id if isinstance(node_id, str) else None
