"""Portable trust attestations (§9.7) issued and used: the control plane signs one
with every credential, a node carries it in its manifests' ``node`` member, and
the registry verifies it (expiry enforced) before applying the tier.

The registry here runs on a real embedded mesh, trusting the mesh operator's
key; every registration arrives on the connection-bound subject of a
participant credential, so the broker's checks apply as in production.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.control_plane import ControlPlaneServer, node_credential_request
from meshnode.daemon.platform import PlatformServices, start_platform_services
from meshnode.protocol.attestations import make_trust_attestation, verify_trust_attestation
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.services import ServiceContext
from meshnode.testing import DaemonSet
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import decode_jwt

from .conftest import connect
from .test_services import Mesh, Participant, discover, error_code

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture
async def world(mesh: EmbeddedNatsServer) -> AsyncIterator[Mesh]:
    service_key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(service_key.public_key, [], 300, role="service")
    conn = await connect(mesh, service_key, jwt)
    world = Mesh(mesh, service_key, conn)
    platform: PlatformServices | None = None
    try:
        platform = await start_platform_services(
            ServiceContext(connection=conn, key=KeyPair.generate(Prefix.USER), node_id=service_key.public_key),
            trusted_issuers=(mesh.operator_public_key,),
        )
        yield world
    finally:
        if platform is not None:
            await platform.stop()
        for c in [*world.connections, conn]:
            with contextlib.suppress(Exception):
                await c.close(drain_timeout=1)


def attest(issuer: KeyPair, node: Participant, tier: str, *, expires_in_ms: int = HOUR_MS) -> dict[str, Any]:
    t = now_ms()
    return make_trust_attestation(
        issuer, node.node_id, {"trust_tier": tier, "role": "participant"},
        t - 2 * HOUR_MS, t + expires_in_ms,
    )


async def register_with(node: Participant, attestation: dict[str, Any]) -> dict[str, Any]:
    manifest = node.manifest(node.agents[0])
    manifest["node"]["trust_attestation"] = attestation
    return await node.register(node.agents[0], manifest)


async def test_the_control_plane_issues_an_operator_signed_attestation_with_each_credential(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    control = ControlPlaneServer(mesh, tmp_path / "control")
    node_key, agent = KeyPair.generate(Prefix.USER), KeyPair.generate(Prefix.USER)
    control.enrol_node(node_key.public_key, "laptop", trust_tier="verified")
    grant = control.issue_credential(node_credential_request(node_key, [agent], int(time.time())))
    claims = verify_trust_attestation(
        grant["trust_attestation"], now_ms=now_ms(), expected_subject=node_key.public_key,
        trusted_issuers=(mesh.operator_public_key,),
    )
    assert claims == {"trust_tier": "verified", "role": "participant"}
    # It lives exactly as long as the credential it came with.
    _, jwt_claims = decode_jwt(grant["jwt"])
    assert grant["trust_attestation"]["expires_at"].startswith(
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(jwt_claims["exp"]))
    )


async def test_a_valid_sandbox_attestation_clamps_and_a_verified_one_is_findable(
    world: Mesh,
) -> None:
    operator = world.server.keys.operator
    sandboxed, verified, observer = [await world.participant() for _ in range(3)]
    assert "error" not in await register_with(sandboxed, attest(operator, sandboxed, "sandbox"))
    assert "error" not in await register_with(verified, attest(operator, verified, "verified"))
    assert "error" not in await observer.register(observer.agents[0])

    # The sandbox clamp (§8.6): never listed. The verified node passes a tier filter
    # that the unattested observer (standard) does not.
    listed = {m["id"] for m in (await discover(observer, observer.agents[0]))["agents"]}
    assert sandboxed.agents[0].public_key not in listed
    assert verified.agents[0].public_key in listed
    found = await discover(observer, observer.agents[0], {"trust_tier": "verified"})
    assert [m["id"] for m in found["agents"]] == [verified.agents[0].public_key]
    # The attestation travels with the manifest, for any reader to verify again.
    manifest = found["agents"][0]
    assert verify_trust_attestation(
        manifest["node"]["trust_attestation"], now_ms=now_ms(), expected_subject=verified.node_id
    ) == {"trust_tier": "verified", "role": "participant"}


async def test_expired_forged_and_misaddressed_attestations_refuse_the_registration(
    world: Mesh,
) -> None:
    operator = world.server.keys.operator
    node = await world.participant()
    other = await world.participant()

    expired = attest(operator, node, "verified", expires_in_ms=-60_000)
    reply = await register_with(node, expired)
    assert error_code(reply) == "UNAUTHORIZED"
    assert reply["error"]["details"]["reason"] == "trust_attestation_expired"

    # Claims edited after signing: the operator's signature no longer covers them.
    forged = attest(operator, node, "standard")
    forged["claims"]["trust_tier"] = "verified"
    reply = await register_with(node, forged)
    assert reply["error"]["details"]["reason"] == "trust_attestation_signature_invalid"

    # A genuine attestation of another node proves nothing about this one.
    reply = await register_with(node, attest(operator, other, "verified"))
    assert reply["error"]["details"]["reason"] == "trust_attestation_subject_mismatch"


async def test_an_intact_attestation_from_an_untrusted_issuer_is_not_applied(world: Mesh) -> None:
    stranger = KeyPair.generate(Prefix.OPERATOR)
    node = await world.participant()
    assert "error" not in await register_with(node, attest(stranger, node, "sandbox"))
    listed = {m["id"] for m in (await discover(node, node.agents[0]))["agents"]}
    assert node.agents[0].public_key in listed  # not clamped: the claim carries no weight here


# --- the receiving node: two real daemons --------------------------------------------


def test_a_receiving_node_verifies_the_sender_attestation_and_applies_its_tier(
    meshnode_daemons: DaemonSet,
) -> None:
    node = {"plugin_modules": ["tests.agents:plugin"]}
    a = meshnode_daemons.embedded(
        "a", agents={"picky": {"plugin": "test-picky"}, "probe": {"plugin": "test-tier"}}, node=node,
    )
    s = meshnode_daemons.joined("s", via=a, node=node, invite_args=("--trust-tier", "sandbox"))
    # The joined node knows what it was attested as, from its own credential.
    assert s.status()["credential"]["trust_tier"] == "sandbox"

    # The tier reaches a handler only as the sender's verified attestation proves it...
    answered = s.call(a.agent_id("probe"), "tier")
    assert answered["status"] == "completed", answered
    assert answered["output"] == {"sender_tier": "sandbox"}
    # ...and an agent that takes no sandbox work is never run for it.
    refused = s.call(a.agent_id("picky"), "tier")
    assert refused["status"] == "failed", refused
    assert refused["error"]["code"] == "UNAUTHORIZED"
    assert refused["error"]["details"]["reason"] == "sender_sandboxed"
    # The embedded node's own agents are standard: picky serves them.
    assert a.call("picky", "tier")["output"] == {"sender_tier": "standard"}
