"""The outbound A2A bridge's pure parts: parts mapping, card reading, limits,
charges (real SQLite), config errors, and the call chain carried by ctx.request."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import nacl.signing
import pytest

from meshnode.a2a.charges import Charge, ChargeStore, charge_amount
from meshnode.a2a.client import Ambiguous, Unsent, classify, refusal_code, stream_results
from meshnode.a2a.outbound import A2AOutbound, A2AStreamTask, CallContext
from meshnode.a2a.peers import (
    PeerSettings,
    Sent,
    card_url_of,
    input_parts,
    output_of_parts,
    read_card,
)
from meshnode.config import ConfigError, load_config
from meshnode.node.context import AgentContext
from meshnode.protocol.a2a_extension import EXTENSION_URI, chain_meta_of, peer_name_of
from meshnode.protocol.envelope import new_root_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from tests.fakes import FakeNode

SETTINGS = PeerSettings(url="http://peer.example/", contract_price=Decimal("0.10"))


def test_targets_and_chain_meta() -> None:
    assert peer_name_of("a2a:weather") == "weather"
    assert peer_name_of("UABC") is None
    chain = {"callChain": [{"application": "p"}], "origin": {"rootExecutionId": "r"}}
    assert chain_meta_of({"meta": {EXTENSION_URI: chain}}) == chain
    assert chain_meta_of({"meta": {"hops": 1}}) is None and chain_meta_of(None) is None


def test_parts_both_ways() -> None:
    assert input_parts("hi") == [{"text": "hi"}]
    assert input_parts({"a": 1}) == [{"data": {"a": 1}}]
    assert input_parts(None) == [{"data": {}}]
    assert output_of_parts([{"data": {"x": 1}}]) == {"x": 1}
    assert output_of_parts([{"text": "a"}, {"text": "b"}]) == "ab"
    mixed: list[dict[str, Any]] = [{"text": "a"}, {"data": 1}]
    assert output_of_parts(mixed) == mixed and output_of_parts([]) is None


def test_card_url() -> None:
    assert card_url_of("https://x.example/agent") == "https://x.example/agent/.well-known/agent-card.json"
    assert card_url_of("https://x.example/cards/a.json") == "https://x.example/cards/a.json"


def _card(extension: dict[str, Any] | None) -> dict[str, Any]:
    card: dict[str, Any] = {
        "name": "Peer Co",
        "description": "d",
        "version": "1",
        "supportedInterfaces": [{"url": "http://peer.example/", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
        "capabilities": {"extensions": [extension] if extension else []},
        "defaultInputModes": [],
        "defaultOutputModes": [],
        "skills": [],
    }
    return card


def test_read_card_declaration_retention_audience_and_key() -> None:
    key = nacl.signing.SigningKey.generate().verify_key
    nkey = KeyPair.from_raw_seed(b"\x01" * 32).public_key
    ext = {"uri": EXTENSION_URI, "params": {"idempotencyRetention": "PT86400S", "application": "peer-app",
                                           "issuerKey": nkey}}
    card = read_card(_card(ext), SETTINGS, now=0.0)
    assert card.mesh and card.retention_s == 86400 and card.audience == "peer-app"
    assert card.issuer_key is not None and bytes(card.issuer_key) == KeyPair.from_raw_seed(b"\x01" * 32).raw_public
    # Configuration overrides the card; a card without the extension is plain A2A.
    import base64

    override = PeerSettings(url=SETTINGS.url, contract_price=Decimal(1), audience="mine",
                            issuer_key=base64.urlsafe_b64encode(bytes(key)).decode())
    card = read_card(_card(None), override, now=0.0)
    assert not card.mesh and card.retention_s is None and card.audience == "mine"
    assert card.issuer_key == key
    # Name as the audience of last resort; a malformed retention means no resends.
    card = read_card(_card({"uri": EXTENSION_URI, "params": {"idempotencyRetention": "P1M"}}), SETTINGS, now=0.0)
    assert card.mesh and card.retention_s is None and card.audience == "Peer Co" and card.issuer_key is None


def test_charge_is_the_larger_of_verified_spend_and_contract() -> None:
    assert charge_amount(Decimal("0.10"), Decimal("0.30")) == Decimal("0.30")
    assert charge_amount(Decimal("0.10"), Decimal("0.01")) == Decimal("0.10")
    assert charge_amount(Decimal("0.10"), None) == Decimal("0.10")


def _charge(task: str, charged: str, report: str = "verified", execution: str = "e1") -> Charge:
    return Charge(peer="w", task_key=f"task:{task}", message_id="m", task_id=task, agent="U", execution_id=execution,
                  mesh=True, report=report, reported_spend=None, contract_price="0.1", charged=charged,
                  currency="USD", charged_at_ms=1)


async def test_charge_recorded_once_across_passes_and_restarts(tmp_path: Path) -> None:
    store = ChargeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    assert await store.record(_charge("t1", "0.3"))
    assert not await store.record(_charge("t1", "0.1", report="missing"))  # a later pass
    await store.close()
    store = ChargeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    assert not await store.record(_charge("t1", "0.1"))  # after a restart
    assert await store.record(_charge("t2", "0.25", execution="e2"))
    stands = await store.get("w", "task:t1")
    assert stands is not None and stands.charged == "0.3" and stands.report == "verified"
    assert await store.spent_by_execution("e1") == Decimal("0.3")
    assert await store.totals() == {"w": {"count": 2, "total": "0.55"}}
    assert {c.task_id for c in await store.recent(peer="w")} == {"t1", "t2"}
    assert await store.recent(peer="other") == []
    await store.close()


async def test_limits_from_the_work_being_handled(tmp_path: Path) -> None:
    store = ChargeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    await store.record(_charge("t1", "0.5", execution="req-1"))
    out = A2AOutbound("acme", "agent", {}, store, KeyPair.generate(), clock=lambda: 1_000.0)
    agent = KeyPair.generate()
    env = {"id": "req-1", "budget": {"revision": 0, "cost_ceiling": {"amount_micro": 2_000_000, "currency": "USD"},
                                     "deadline": "1970-01-01T00:16:50Z"}}
    call = CallContext(agent.public_key, agent, new_root_trace(), envelope=env)
    remaining, deadline = await out._limits(call, "req-1", 30.0)
    assert remaining == Decimal("1.5") and deadline == 10.0  # ceiling less what was charged; deadline - now
    # An explicit budget wins and is not reduced; a non-USD ceiling sends no budget.
    call.budget = {"revision": 0, "cost_ceiling": {"amount_micro": 700_000, "currency": "USD"}}
    assert await out._limits(call, "req-1", 30.0) == (Decimal("0.7"), 30.0)
    call.budget = {"revision": 0, "cost_ceiling": {"amount_micro": 700_000, "currency": "EUR"}}
    assert await out._limits(call, "req-1", 5.0) == (None, 5.0)
    await store.close()


def test_send_failures_are_classified() -> None:
    request = httpx.Request("POST", "http://peer.example/")

    def wrapped(cause: BaseException) -> Exception:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise RuntimeError("sdk error") from inner
        except RuntimeError as outer:
            return outer

    with pytest.raises(Unsent):
        classify(wrapped(httpx.ConnectError("refused", request=request)))
    for ambiguous in (httpx.ReadTimeout("slow", request=request), httpx.RemoteProtocolError("dropped", request=request)):
        with pytest.raises(Ambiguous):
            classify(wrapped(ambiguous))
    response = httpx.Response(401, json={"code": "mesh.audience-mismatch"}, request=request)
    with pytest.raises(ProtocolError) as refused:
        classify(wrapped(httpx.HTTPStatusError("401", request=request, response=response)))
    assert refused.value.code == "UNAUTHORIZED" and refused.value.details["code"] == "mesh.audience-mismatch"
    # Any other failure: the peer's words, bounded (they said only "InvalidParamsError").
    class InvalidParamsError(Exception):
        pass

    with pytest.raises(ProtocolError) as failed:
        classify(InvalidParamsError("metadata.skill names no skill of this agent: 'nope'\n" + "x" * 1000))
    assert failed.value.code == "DEPENDENCY_FAILED"
    assert str(failed.value.message).startswith(
        "the A2A call failed: InvalidParamsError: metadata.skill names no skill of this agent: 'nope' xxx")
    assert len(failed.value.details["peer_message"]) == 300
    with pytest.raises(ProtocolError) as silent:
        classify(InvalidParamsError())
    assert silent.value.message == "the A2A call failed: InvalidParamsError" and "peer_message" not in silent.value.details


def test_config_names_the_peer_key_at_fault(tmp_path: Path) -> None:
    path = tmp_path / "meshnode.toml"
    path.write_text('[a2a.peers.weather]\nurl = "http://127.0.0.1:9/"\ncontract_price = 0.05\n', encoding="utf-8")
    with pytest.raises(ConfigError) as bad:
        load_config(path, env={})
    assert "a2a.peers.weather.contract_price" in str(bad.value)
    path.write_text('[a2a.peers.weather]\nurl = "http://127.0.0.1:9/"\ncontract_price = "0.05"\n'
                    'issuer_key = "nope"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as bad:
        load_config(path, env={})
    assert "a2a.peers.weather.issuer_key" in str(bad.value)
    path.write_text('[a2a]\napplication = "acme"\n[a2a.peers.weather]\nurl = "https://w.example/"\n'
                    'contract_price = "0.05"\ntimeout = "5s"\n', encoding="utf-8")
    cfg = load_config(path, env={})
    assert cfg.a2a.application == "acme" and cfg.a2a.signing == "agent"
    assert cfg.a2a.peers["weather"].timeout.total_seconds() == 5


# -- ctx.request: the chain crosses the mesh ------------------------------------------


class _FakeHosted:
    agent_id = "UAGENT"

    def __init__(self) -> None:
        self.node = FakeNode()


async def test_work_that_entered_by_a2a_carries_its_chain_into_mesh_sub_requests() -> None:
    hosted = _FakeHosted()
    chain: Mapping[str, Any] = {"callChain": [{"application": "peer", "start": "s", "executionId": "x"}],
                                "origin": {"rootExecutionId": "x"}}
    env = {"id": "req", "type": "request", "trace": new_root_trace(), "meta": {EXTENSION_URI: chain}}
    ctx = AgentContext(hosted, envelope=env)  # type: ignore[arg-type]
    other = KeyPair.generate().public_key  # an agent id (a name would be resolved first)
    await ctx.request(other, "work", {})
    assert hosted.node.sent[-1]["meta"] == {EXTENSION_URI: chain}
    await ctx.request("a2a:weather", "forecast", {"q": 1}, budget={"revision": 0})
    a2a = hosted.node.a2a_calls[-1]
    assert a2a["peer"] == "weather" and a2a["envelope"] is env and a2a["budget"] == {"revision": 0}
    assert a2a["trace"]["trace_id"] == env["trace"]["trace_id"]
    # Work that did not enter by A2A adds nothing.
    plain = AgentContext(hosted, envelope={"id": "r2", "type": "request", "trace": new_root_trace()})  # type: ignore[arg-type]
    await plain.request(other, "work", {})
    assert hosted.node.sent[-1]["meta"] is None


async def test_onward_a2a_call_extends_the_incoming_chain(tmp_path: Path) -> None:
    store = ChargeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    out = A2AOutbound("acme", "agent", {"w": SETTINGS}, store, KeyPair.generate(), clock=lambda: 1_000.0)
    peer = read_card(_card({"uri": EXTENSION_URI, "params": {"application": "peer-app"}}), SETTINGS, now=0.0)
    agent = KeyPair.generate()
    incoming = {"callChain": [{"application": "peer-app", "start": "forecast", "executionId": "p1"}],
                "origin": {"rootExecutionId": "root-0", "executionId": "p1"}}
    env = {"id": "req-9", "payload": {"offering": "relay"}, "meta": {EXTENSION_URI: incoming}}
    claims = await out._envelope_claims(peer, CallContext(agent.public_key, agent, new_root_trace(), envelope=env),
                                        {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}, 10.0)
    assert claims["callChain"] == [*incoming["callChain"],
                                   {"application": "acme", "start": "relay", "executionId": "req-9"}]
    assert claims["origin"] == {"rootExecutionId": "root-0", "executionId": "req-9"}
    assert claims["audience"] == "peer-app" and claims["issuer"] == agent.public_key
    await store.close()


async def _stream_fixture(tmp_path: Path) -> tuple[ChargeStore, A2AOutbound, Sent]:
    store = ChargeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    out = A2AOutbound("acme", "agent", {"w": SETTINGS}, store, KeyPair.generate(), clock=lambda: 1_000.0)
    raw = _card(None)
    raw["supportedInterfaces"][0]["url"] = "http://127.0.0.1:9/"  # nothing listens: sends fail fast
    peer = read_card(raw, SETTINGS, now=0.0)
    call = CallContext(agent_id="UCALLER", agent_key=KeyPair.generate(), trace=new_root_trace())
    return store, out, Sent("w", SETTINGS, peer, call, "m-1", "sha256:00", {})


async def test_stream_events_map_to_chunks_and_a_charged_result(tmp_path: Path) -> None:
    store, out, sent = await _stream_fixture(tmp_path)
    handle = A2AStreamTask(out, sent)
    await handle._event({"task": {"id": "t-1", "status": {"state": "TASK_STATE_WORKING"}}})
    assert handle.task_id == "t-1" and handle.state == "working" and handle.final is None
    for word in ("a ", "b "):
        await handle._event({"artifactUpdate": {"taskId": "t-1", "artifact": {"parts": [{"text": word}]}}})
    await handle._event({"statusUpdate": {"taskId": "t-1", "status": {"state": "TASK_STATE_COMPLETED"}}})
    assert [c async for c in handle.stream(timeout=1)] == ["a ", "b "]
    final = await handle.result(timeout=1)
    assert final["payload"] == {"status": "completed", "output": "a b "}
    info = final["meta"][EXTENSION_URI]
    assert info["report"] == "not_expected" and info["charge"]["charged"] == "0.1" and info["chunks"] == 2
    await store.close()


async def test_cancel_is_sent_once_and_recorded_at_zero(tmp_path: Path) -> None:
    store, out, sent = await _stream_fixture(tmp_path)
    sent.task_id = "t-2"
    handle = A2AStreamTask(out, sent)
    assert await handle.cancel("user_requested") == {"task_id": "t-2", "status": "canceled"}
    assert (await handle.result(timeout=1))["payload"]["status"] == "canceled"
    assert await out._cancel_peer(sent, "again") is None  # once
    row = await store.get("w", "task:t-2")
    assert row is not None and row.report == "canceled" and row.charged == "0"
    assert row.note is not None and "not confirmed" in row.note
    # Abandoned before the peer named a task: nothing to cancel, still recorded.
    early = Sent("w", SETTINGS, sent.peer, sent.call, "m-1", "sha256:00", {})
    await out._cancel_peer(early, "the calling mesh work was canceled")
    first = await store.get("w", "message:m-1")
    assert first is not None and first.task_id is None and "no CancelTask" in (first.note or "")
    await store.close()


def test_a_refusals_code_is_read_wherever_a_peer_puts_it() -> None:
    info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "MESH_BODY_MISMATCH",
            "domain": "agboss.dev", "metadata": {"code": "mesh.body-mismatch"}}
    assert refusal_code({"code": "mesh.audience-mismatch"}) == "mesh.audience-mismatch"
    assert refusal_code({"error": {"code": "mesh.envelope-expired"}}) == "mesh.envelope-expired"
    # meshnode's own 401: error.code is the number 401, the code sits in data.
    assert refusal_code({"error": {"code": 401, "message": "x", "data": {"code": "mesh.signature-invalid"}}}) == (
        "mesh.signature-invalid")
    assert refusal_code({"error": {"code": 401, "data": [info]}}) == "mesh.body-mismatch"
    assert refusal_code({"error": {"code": 401, "data": [{**info, "metadata": {}}]}}) == "MESH_BODY_MISMATCH"
    assert refusal_code({"error": {"code": 401, "data": [{"reason": "not ErrorInfo"}]}}) is None
    assert refusal_code(["not", "an", "object"]) is None and refusal_code({"error": "x"}) is None


def test_stream_results_reads_complete_events_in_order() -> None:
    raw = (b'event: x\r\ndata: {"jsonrpc": "2.0", "result": {"artifactUpdate": {"n": 1}}}\r\n\r\n'
           b'data: {"result": {"statusUpdate": {}}}\n\n'
           b'data: not json\n\n'
           b'data: {"result": {"task": {"id": "t"')
    results, end = stream_results(raw)
    assert results == [{"artifactUpdate": {"n": 1}}, {"statusUpdate": {}}, None]
    assert raw[end:] == b'data: {"result": {"task": {"id": "t"'  # the incomplete event waits
    assert stream_results(raw, end) == ([], end)
