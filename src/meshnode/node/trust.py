"""Is the sender vouched for? (AgentMesh §5.3 step 2), asked once per sender per node.

A verified signature proves who wrote an envelope; the registry says whether a
node currently vouches for that key. The answer is memoised for every agent
of the node: *revoked* is remembered for good, *vouched* for a minute,
*unvouched* for a few seconds (a new agent registers quickly). When the
registry cannot be asked, traffic is let through and the node says so once —
an outage of the registry must not become an outage of the mesh.

The same look-up yields the sender's node standing (§9.7): the manifest's
``node.trust_attestation``, verified here again (expiry enforced) against the
operators this node trusts, is remembered as the sender's tier until the
attestation expires. :meth:`VouchMemo.tier_of` answers it; an agent that sets
``refuse_sandbox_senders`` is not run for a sandbox sender.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from meshnode.node.resolver import discover_one, not_granted
from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.attestations import verify_trust_attestation, verify_vouch
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.timeutil import try_parse_rfc3339

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort

__all__ = ["VouchMemo"]

log = logging.getLogger("meshnode.trust")

VOUCHED, UNVOUCHED, REVOKED, UNKNOWN = "vouched", "unvouched", "revoked", "unknown"


class VouchMemo:
    def __init__(
        self,
        node: NodePort,
        *,
        vouched_ttl_s: float = 60.0,
        unvouched_ttl_s: float = 5.0,
        capacity: int = 50_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.vouched_ttl_s = vouched_ttl_s
        self.unvouched_ttl_s = unvouched_ttl_s
        self.capacity = capacity
        # One registry look-up in flight per sender, however many envelopes of
        # it arrive at once (the registry counts each against the asker).
        # Refreshed in the background from three quarters of its lifetime on: a
        # sender that keeps writing is never made to wait for the registry again,
        # for a third more look-ups than waiting for expiry (the registry counts
        # them against the asking agent's budget, so not from half).
        self._memo: SingleFlightCache[str, str] = SingleFlightCache(
            capacity=capacity, refresh_ahead=0.75, clock=clock
        )
        self._outage_logged = False
        self.lookups = 0
        self._tiers: dict[str, tuple[str, int]] = {}  # sender -> (attested tier, expires ms)

    def tier_of(self, sender: str) -> str | None:
        """The sender's node tier as a trusted attestation proved it at the last
        look-up, while that attestation lasts; None when nothing proved one."""
        if sender in self.node.by_id:
            own = self.node.trust_attestation
            claims = own.get("claims") if isinstance(own, Mapping) else None
            tier = claims.get("trust_tier") if isinstance(claims, Mapping) else None
            return tier if isinstance(tier, str) else None
        entry = self._tiers.get(sender)
        if entry is None:
            return None
        if entry[1] <= self.node.now_ms():
            del self._tiers[sender]  # expiry is the only control (§9.7)
            return None
        return entry[0]

    def _learn_tier(self, sender: str, node: Mapping[str, Any]) -> None:
        self._tiers.pop(sender, None)
        attestation = node.get("trust_attestation")
        trusted = self.node.trusted_operators
        if attestation is None or not trusted:
            return
        try:
            claims = verify_trust_attestation(
                attestation, now_ms=self.node.now_ms(), expected_subject=node.get("id"),
                trusted_issuers=trusted,
            )
        except ProtocolError as exc:
            # Forged, stale or from an operator we do not trust: it proves nothing.
            log.info("sender %s carries an attestation we do not accept: %s", sender, exc.details.get("reason"))
            return
        tier = claims.get("trust_tier")
        expires = try_parse_rfc3339(attestation["expires_at"]) if isinstance(attestation, Mapping) else None
        if tier is not None and expires is not None:
            if len(self._tiers) >= self.capacity:
                self._tiers.pop(next(iter(self._tiers)))
            self._tiers[sender] = (tier, expires // 1000)  # parsed as microseconds

    def _ttl(self, status: str) -> float:
        """How long a status is remembered: revoked for good (entries evicted for
        capacity are re-learnt), unknown not at all."""
        if status == REVOKED:
            return math.inf
        if status == VOUCHED:
            return self.vouched_ttl_s
        return self.unvouched_ttl_s if status == UNVOUCHED else 0.0

    def known(self, sender: str) -> bool:
        """Whether :meth:`status` answers ``sender`` from memory, without the registry."""
        return sender in self.node.by_id or self._memo.peek(sender) is not None

    async def status(self, asker: HostedAgent, sender: str) -> str:
        if sender in self.node.by_id:
            return VOUCHED  # we vouch for our own agents

        async def load() -> tuple[str, float]:
            status = await self._lookup(asker, sender)
            return status, self._ttl(status)

        return await self._memo.get(sender, load)

    async def _lookup(self, asker: HostedAgent, sender: str) -> str:
        self.lookups += 1
        try:
            manifest = await self.node.service_call(
                asker, subjects.registry_get(sender), "discover", {"agent_id": sender}
            )
        except ProtocolError as exc:
            details: Mapping[str, Any] = exc.details or {}
            if not_granted(exc):
                return await self._lookup_by_discovery(asker, sender)
            if exc.code == "NOT_FOUND":
                return UNVOUCHED
            if exc.code == "UNAUTHORIZED" and details.get("reason") == "agent_key_revoked":
                return REVOKED
            if not self._outage_logged:
                log.warning("registry unreachable (%s); sender vouches are not being checked", exc.code)
                self._outage_logged = True
            return UNKNOWN
        self._outage_logged = False
        return self._judge(sender, manifest)

    async def _lookup_by_discovery(self, asker: HostedAgent, sender: str) -> str:
        """The look-up on a mesh whose credential grants discovery but no
        ``mesh.registry.get.*`` (spec §14.3's example). Discovery lists only
        listed agents, so a sender it does not show is *unknown* (let through),
        not unvouched; said once."""
        try:
            manifest = await discover_one(self.node, asker, sender)
        except ProtocolError as exc:
            manifest, reason = None, exc.code
        else:
            reason = "unlisted"
        if manifest is None:
            if not self._outage_logged:
                log.warning(
                    "this node's credential grants no mesh.registry.get.*: senders' vouches are checked "
                    "through discovery, which does not show unlisted agents (%s); those are let through",
                    reason,
                )
                self._outage_logged = True
            return UNKNOWN
        return self._judge(sender, manifest)

    def _judge(self, sender: str, manifest: Mapping[str, Any]) -> str:
        node = manifest.get("node") if isinstance(manifest.get("node"), Mapping) else {}
        attestation = node.get("attestation") if isinstance(node, Mapping) else None
        try:
            verify_vouch(attestation, now_ms=self.node.now_ms(), expected_agent=sender)
        except ProtocolError:
            return UNVOUCHED
        if isinstance(node, Mapping):
            self._learn_tier(sender, node)
        return VOUCHED
