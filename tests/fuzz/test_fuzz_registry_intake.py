"""Hostile registrations against the registry's manifest intake (§8, §9, §4.4).

:func:`check_registration` is what ``RegistryService._register`` runs on every
registration payload after the envelope verified. Invariants: any payload
ends in either a stored manifest or a ProtocolError with a registry code
(``INVALID_MANIFEST``, ``IDENTITY_MISMATCH``, ``UNAUTHORIZED``), never another
exception (the service would answer INTERNAL_ERROR, a bug); a stored manifest
is always this sender's, bound to the vouching node, and serializable as JSON
(it goes to KV and into discover answers). The manifest the node itself
builds is accepted, so a refuse-everything intake would fail here too.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.node.hosted import HostedAgent
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.canonical import canonicalize
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.manifest import RegistrationResult, check_registration
from meshnode.protocol.nkeys import KeyPair
from tests.fuzz.profile import fuzz_settings
from tests.fuzz.strategies import wire_values as json_values

NOW_MS = 1_782_900_000_000
REGISTRY_CODES = {"INVALID_MANIFEST", "IDENTITY_MISMATCH", "UNAUTHORIZED"}

MEMBERS = [
    "id", "name", "description", "version", "protocol_version", "capabilities", "offerings", "skills",
    "endpoint", "endpoints", "node", "owner", "visibility", "sandbox", "public", "interaction", "trust",
    "sealing", "data_use", "compliance", "limits", "rate_limits", "accepts", "emits", "meta", "provider",
    "availability_class", "descriptor", "default_input_modes", "default_output_modes",
]


class Shop(Agent):
    description = "registry fuzz subject"

    @offering("sell", input_schema={"type": "object"})
    async def sell(self, ctx: Context, input: Any) -> Any:
        return input


class _Conn:
    max_payload = 1024 * 1024

    def on_reconnect(self, callback: Any) -> None:
        pass

    def on_error(self, callback: Any) -> None:
        pass


def _valid() -> tuple[dict[str, Any], str, str]:
    """A manifest exactly as a node registers it: (manifest, agent id, node id)."""
    node = Node(settings=NodeSettings(name="fuzz"), node_key=KeyPair.generate(),
                connection=_Conn(), clock=lambda: NOW_MS)  # type: ignore[arg-type]
    key = KeyPair.generate()
    hosted = HostedAgent(node, name="shop", kind="shop", agent=Shop("shop", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    hosted.vouch = node._vouch(hosted.agent_id)
    return node.build_manifest(hosted), hosted.agent_id, node.node_id


VALID, AGENT_ID, NODE_ID = _valid()


def _intake(manifest: Any, sender: str = AGENT_ID, subject_node: str | None = NODE_ID) -> RegistrationResult | None:
    try:
        return check_registration(manifest, sender=sender, now_ms=NOW_MS, subject_node=subject_node,
                                  require_connection_bound=True)
    except ProtocolError as exc:
        assert exc.code in REGISTRY_CODES, f"intake refused with {exc.code}"
        assert isinstance(exc.to_object(), dict)
        orjson.dumps(exc.to_object())  # the refusal itself must travel
        return None


def _check_stored(result: RegistrationResult | None) -> None:
    if result is None:
        return
    stored = result.manifest
    assert stored["id"] == AGENT_ID
    assert stored["node"]["id"] == NODE_ID
    canonicalize(stored)  # KV and discover answers carry it


def test_the_nodes_own_manifest_is_accepted() -> None:
    _check_stored(_intake(copy.deepcopy(VALID)))
    assert _intake(copy.deepcopy(VALID)) is not None


@fuzz_settings(300)
@given(payload=json_values)
def test_any_json_value_as_a_registration_is_refused_cleanly(payload: Any) -> None:
    _check_stored(_intake(payload))


@fuzz_settings(400)
@given(member=st.sampled_from(MEMBERS), value=json_values, drop=st.booleans())
def test_a_valid_manifest_with_one_member_replaced_never_crashes_intake(member: str, value: Any, drop: bool) -> None:
    manifest = copy.deepcopy(VALID)
    if drop:
        manifest.pop(member, None)
    else:
        manifest[member] = value
    _check_stored(_intake(manifest))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


NESTED_PATHS = [p for p in _paths(VALID) if len(p) >= 2]


@fuzz_settings(400)
@given(path=st.sampled_from(NESTED_PATHS), value=json_values)
def test_a_valid_manifest_with_a_nested_member_replaced_never_crashes_intake(path: tuple[Any, ...], value: Any) -> None:
    manifest = copy.deepcopy(VALID)
    target: Any = manifest
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    _check_stored(_intake(manifest))


@fuzz_settings(100)
@given(sender=st.one_of(st.just(AGENT_ID), st.builds(lambda: KeyPair.generate().public_key)),
       subject_node=st.one_of(st.just(NODE_ID), st.none(), st.builds(lambda: KeyPair.generate().public_key)))
def test_a_registration_for_somebody_else_is_refused(sender: str, subject_node: str | None) -> None:
    result = _intake(copy.deepcopy(VALID), sender=sender, subject_node=subject_node)
    if sender != AGENT_ID or subject_node != NODE_ID:
        assert result is None, "a registration by or through somebody else was accepted"
    else:
        _check_stored(result)


@fuzz_settings(30)
@given(depth=st.integers(min_value=1, max_value=97), member=st.sampled_from(["meta", "public", "limits", "trust"]))
def test_deep_members_within_the_envelope_bound_never_crash_intake(depth: int, member: str) -> None:
    inner: Any = {"x": 1}
    for _ in range(depth):
        inner = {"x": inner}
    manifest = copy.deepcopy(VALID)
    manifest[member] = inner
    _check_stored(_intake(manifest))
