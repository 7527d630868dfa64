"""The seller's node asks the platform agreement service at admission (§19.5).

A paid request is admitted when its requester's owner holds an agreement,
which the owner registered with the platform (:mod:`meshnode.services.agreements`)
or the seller's operator added to this node's own store. Asking the platform
for every request would make admission one service round trip per request,
so :class:`PlatformAgreements` remembers each (owner, seller, SKU) answer:

* one look-up in flight per key, however many requests of that owner arrive
  at once (:class:`~meshnode.node.singleflight.SingleFlightCache`); the
  service does not charge look-ups to the asker's budget, so a herd never
  fails paid work with RATE_LIMITED for the platform's own bookkeeping;
* an answer (found or not) is remembered ``ttl_s`` (``[commerce]
  agreement_cache_ttl``, 30 s by default); a service that cannot be asked
  (no agreement service on the mesh, a credential without the grant, an
  outage) is remembered as "no agreements" for ``unavailable_ttl_s``, logged
  once: admission then rests on the local store alone, which refuses
  rather than admits;
* every ``mesh.event.agreements.registered`` / ``.revoked`` event signed by a
  platform key drops the key it names at once, and an answer whose look-up
  raced such an event is not remembered. A revoked agreement therefore stops
  admitting as soon as the event arrives here, and at the latest ``ttl_s``
  after the revocation when the event is missed (a disconnect).

Every agreement the service returns is verified again here (shape and the
owner's signature): the service is trusted with revocations, never to make
up an agreement.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshnode.node.pipeline import Refused, decode_verified
from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.commerce import AgreementRecord, verify_agreement
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort
    from meshnode.transport.connection import Message, Subscription

__all__ = ["PlatformAgreements", "parse_records"]

log = logging.getLogger("meshnode.commerce")

_Key = tuple[str, str, str]


def parse_records(answer: Mapping[str, Any]) -> list[AgreementRecord]:
    """The verified records of a look-up answer; a record that does not verify is dropped."""
    out: list[AgreementRecord] = []
    items = answer.get("agreements")
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        try:
            agreement = verify_agreement(item.get("agreement"))
        except ProtocolError as exc:
            log.warning("the agreement service returned an agreement that does not verify: %s", exc.message)
            continue
        revoked = item.get("revoked_at_ms")
        out.append(AgreementRecord(agreement, revoked if isinstance(revoked, int) else None))
    return out


class PlatformAgreements:
    """Cached, single-flight look-ups of the platform's agreements (module docstring)."""

    def __init__(
        self, node: NodePort, *, ttl_s: float = 30.0, unavailable_ttl_s: float = 5.0, capacity: int = 10_000
    ) -> None:
        self.node = node
        self.ttl_s = ttl_s
        self.unavailable_ttl_s = unavailable_ttl_s
        self._cache: SingleFlightCache[_Key, list[AgreementRecord]] = SingleFlightCache(capacity=capacity)
        self._generation: dict[_Key, int] = {}
        self._outage_logged = False
        self._subscription: Subscription | None = None
        self.lookups = 0

    async def records(self, hosted: HostedAgent, consumer_owner: str, sku: str) -> list[AgreementRecord]:
        """The platform's records of ``consumer_owner``'s agreements to ``sku`` of ``hosted``."""
        key = (consumer_owner, hosted.agent_id, sku)

        async def load() -> tuple[list[AgreementRecord], float]:
            started = self._generation.get(key, 0)
            records, ttl = await self._lookup(hosted, key)
            if self._generation.get(key, 0) != started:
                ttl = 0.0  # an event said it changed while we asked: answer, remember nothing
            return records, ttl

        return await self._cache.get(key, load)

    async def _lookup(self, hosted: HostedAgent, key: _Key) -> tuple[list[AgreementRecord], float]:
        self.lookups += 1
        owner, seller, sku = key
        try:
            answer = await self.node.service_call(
                hosted, subjects.AGREEMENTS_LOOKUP, "request",
                {"consumer_owner": owner, "seller_agent": seller, "sku": sku},
            )
        except ProtocolError as exc:
            if not self._outage_logged:
                log.warning(
                    "the platform agreement service cannot be asked (%s: %s); admission uses this node's "
                    "agreement store only until it can", exc.code, exc.message,
                )
                self._outage_logged = True
            return [], self.unavailable_ttl_s
        self._outage_logged = False
        return parse_records(answer), self.ttl_s

    def invalidate(self, consumer_owner: str, seller_agent: str, sku: str) -> None:
        """Drop the remembered answer for this key (and spoil a look-up in flight)."""
        key = (consumer_owner, seller_agent, sku)
        if seller_agent not in self.node.by_id:
            return  # not one of ours: nothing remembered, nothing to track
        self._generation[key] = self._generation.get(key, 0) + 1
        if len(self._generation) > 50_000:
            self._generation.pop(next(iter(self._generation)))
        self._cache.forget(key)

    async def on_event(self, msg: Message) -> None:
        """A ``mesh.event.agreements.*`` event: drop the key it names when a platform key signed it."""
        try:
            env = decode_verified(msg.data)
        except Refused:
            return
        if env.get("from") not in self.node.platform_keys:
            return  # anyone may publish on the event bus; only the platform's count
        payload = env.get("payload")
        data = payload.get("data") if isinstance(payload, Mapping) else None
        if not isinstance(data, Mapping):
            return
        owner, seller, sku = data.get("consumer_owner"), data.get("seller_agent"), data.get("sku")
        if isinstance(owner, str) and isinstance(seller, str) and isinstance(sku, str):
            self.invalidate(owner, seller, sku)

    async def start(self) -> None:
        """Follow the agreement service's events (a core subscription: a missed
        event costs at most ``ttl_s`` of staleness, never a wrong admission for longer)."""
        if self._subscription is None:
            self._subscription = await self.node.connection.subscribe(
                f"mesh.event.{subjects.AGREEMENTS_EVENT_DOMAIN}.*", self.on_event
            )

    async def close(self) -> None:
        sub, self._subscription = self._subscription, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a closed connection has nothing to unsubscribe
                log.debug("unsubscribe failed: %s", exc)
        await self._cache.close()
