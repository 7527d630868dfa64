"""The manifest a node registers for each hosted agent (§8.1, §8.2, §8.7, §10.14).

Built from what the agent class declares (never from the agent's code at run
time), the node member the node vouches with, and the node's limits; the
describe document is served from the same declared bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshnode.node.pubsub import PubSub
from meshnode.protocol import subjects
from meshnode.protocol.commerce import public_sku
from meshnode.protocol.envelope import PROTOCOL_VERSION
from meshnode.protocol.manifest import describe_document, materialize_public_block

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["build_manifest", "describe"]


def build_manifest(hosted: HostedAgent, node: dict[str, Any], max_inbound_chars: int) -> dict[str, Any]:
    """The manifest a node registers for ``hosted`` (§8.1, §8.2): the agent class's
    declared facts, ``node`` (the node member: its id, the vouch, the operator
    attestation) and the node's inbound limit."""
    cls = type(hosted.agent)
    inbox = subjects.agent_inbox(hosted.agent_id)
    manifest: dict[str, Any] = {
        "id": hosted.agent_id,
        "name": cls.display_name or hosted.name,
        "description": cls.description or f"{hosted.kind} agent",
        "version": cls.version,
        "protocol_version": PROTOCOL_VERSION,
        "endpoint": inbox,
        "endpoints": {"inbox": inbox},
        "node": node,
        "capabilities": list(cls.capabilities),
        "offerings": [spec.manifest_entry() for spec in hosted.offerings.values()],
        "interaction": hosted.interaction,
        "limits": {"max_inbound_chars": max_inbound_chars},
    }
    public: dict[str, Any] = dict(cls.public or {})
    public.setdefault("description", manifest["description"])
    public["offerings"] = [s.id for s in hosted.offerings.values() if s.advertise]
    if hosted.skus:
        # §19.1: the SKUs as declared (their digests are over these bytes), and
        # the storefront's {sku, price, digest} of each SKU covering something
        # advertised (an agent-wide one always): terms a buyer reads pre-admission (§8.7).
        manifest["skus"] = [sku.to_object() for sku in hosted.skus]
        advertised = set(public["offerings"])
        public.setdefault("skus", [
            public_sku(sku) for sku in hosted.skus if sku.covers_agent or advertised & set(sku.offerings)
        ])
    manifest["public"] = public
    for attr in ("provider", "rate_limits"):
        value = getattr(cls, attr)
        if value:
            manifest[attr] = dict(value)
    if cls.limits:
        manifest["limits"] = {**manifest["limits"], **dict(cls.limits)}
    if cls.accepts:
        manifest["accepts"] = [
            p if p.startswith("mesh.event.") else f"mesh.event.{p}" for p in cls.accepts
        ]
    emits = list(cls.emits)
    # Declared feeds are discoverable as the agent's feed subjects (§6.6a).
    emits += PubSub.feed_emits(hosted.agent_id, cls.feeds)
    if emits:
        manifest["emits"] = emits
    if cls.visibility:
        manifest["visibility"] = cls.visibility
    if cls.default_input_modes is not None:
        manifest["default_input_modes"] = list(cls.default_input_modes)
    if cls.default_output_modes is not None:
        manifest["default_output_modes"] = list(cls.default_output_modes)
    return manifest


def describe(manifest: dict[str, Any]) -> dict[str, Any]:
    """The §10.14 document: served from declared bytes, never the agent."""
    # materialize_public_block returns the whole manifest with its public
    # block rebuilt (§8.7); the document carries only that block.
    return describe_document(materialize_public_block(manifest))
