"""The inbound A2A bridge against a real daemon: the official a2a-sdk client
(raw httpx where the SDK cannot show what is tested: 401 bodies, headers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import httpx
import nacl.signing
import pytest
from a2a.client import ClientCallContext, ClientConfig, create_client
from a2a.client.card_resolver import parse_agent_card
from a2a.client.service_parameters import ServiceParametersFactory, with_a2a_extensions
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
)
from a2a.utils.errors import TaskNotFoundError
from google.protobuf.json_format import MessageToDict, ParseDict

from meshnode.a2a.intake import auth_error_info
from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    body_hash,
    build_envelope_claims,
    parse_verify_key,
    sign_envelope,
    unsecured_envelope,
    verify_report,
)
from meshnode.protocol.nkeys import KeyPair, decode_seed
from meshnode.testing import DaemonProcess, DaemonSet, eventually_async

pytestmark = pytest.mark.integration

APP = "me"
CALLER = KeyPair.generate()
CALLER_KEY = nacl.signing.SigningKey(decode_seed(CALLER.seed)[1])
STRANGER_KEY = nacl.signing.SigningKey(b"\x07" * 32)
MESH_CALLER = KeyPair.generate()  # an issuer that is a mesh agent id, allowed by the policy
MESH_OTHER = KeyPair.generate()  # one the policy does not list
HEADERS = {"A2A-Version": "1.0"}
ACTIVATE = {**HEADERS, "A2A-Extensions": EXTENSION_URI}


class Bridge:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        status = daemon.status()["a2a"]
        # The bridge listens on port 0: its Status names the port it bound.
        self.base = status["url"]
        # The bridge identity's key signs the run reports; it survives restarts.
        self.report_key = parse_verify_key(daemon.agent_id("a2a-bridge"))
        assert status["report_key"] == daemon.agent_id("a2a-bridge") and status["application"] == APP

    def url(self, agent: str) -> str:
        return f"{self.base}/agents/{agent}"

    def received(self, agent: str = "target") -> int:
        entry = next(a for a in self.daemon.status()["agents"] if a["name"] == agent)
        return int(entry["counters"].get("received", 0))

    async def areceived(self) -> int:
        # The admin client runs its own event loop: off this test's loop.
        return await asyncio.to_thread(self.received)


@pytest.fixture(scope="module")
def bridge() -> Iterator[Bridge]:
    daemons = DaemonSet()
    try:
        # The bridge serves on a socket this test holds (listen = "fd://N"): the
        # restart test's second run serves the same port, and nothing can take
        # the port while the daemon is down (no bind-then-release race).
        listener = daemons.listening_socket()
        daemon = daemons.embedded(
            "a2a",
            agents={"target": {"plugin": "test-a2a"}, "echo": {"plugin": "echo"}, "asker": {"plugin": "test-asker"}},
            node={"plugin_modules": ["tests.agents:a2a_target_plugin", "tests.agents:asker_plugin"]},
            extra={
                "a2a": {
                    "listen": f"fd://{listener.fileno()}",
                    "expose": ["target", "echo", "asker"],
                    "application": APP,
                    "max_mesh_hops": 3,
                    "idempotency_retention": "1h",
                    "allow_issuers": ["caller", MESH_CALLER.public_key],
                },
                "a2a.issuers.caller": {"key": CALLER.public_key},
            },
            pass_fds=(listener.fileno(),),
        )
        found = Bridge(daemon)
        # It serves where the inherited socket listens.
        assert found.base == f"http://127.0.0.1:{listener.getsockname()[1]}"
        yield found
    finally:
        daemons.close()


# --- helpers ------------------------------------------------------------------------


def message(
    *, text: str | None = None, data: Any = None, skill: str | None = "priced", message_id: str | None = None
) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "messageId": message_id or str(uuid.uuid4()),
        "role": "ROLE_USER",
        "parts": [{"text": text}] if text is not None else [{"data": data}],
    }
    if skill is not None:
        msg["metadata"] = {"skill": skill}
    # As the SDK client will send it (its Struct turns every number into a float).
    out: dict[str, Any] = MessageToDict(ParseDict(msg, Message()))
    return out


def with_envelope(msg: dict[str, Any], *, key: nacl.signing.SigningKey | None = CALLER_KEY, **over: Any) -> dict[str, Any]:
    claims = build_envelope_claims(
        issuer="caller",
        audience=APP,
        now=time.time(),
        message=msg,
        call_chain=[{"application": "caller", "start": "plan", "executionId": "e-1"}],
        origin={"rootExecutionId": "root-1", "executionId": "e-1"},
    )
    claims.update(over)
    claims = {k: v for k, v in claims.items() if v is not None}
    token = sign_envelope(claims, key) if key is not None else unsecured_envelope(claims)
    meta = dict(msg.get("metadata") or {})
    meta[EXTENSION_URI] = {"envelope": token}
    return {**msg, "metadata": meta}


def rpc(url: str, method: str, params: dict[str, Any], headers: dict[str, str] = ACTIVATE) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    return httpx.post(url, json=body, headers=headers, timeout=60)


def activated(headers: dict[str, str] | None = None) -> ClientCallContext:
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    params.update(headers or {})
    return ClientCallContext(service_parameters=params)


async def send(
    url: str, msg: dict[str, Any], *, streaming: bool = False, polling: bool = False,
    headers: dict[str, str] | None = None,
) -> list[StreamResponse]:
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(url, client_config=ClientConfig(streaming=streaming, polling=polling, httpx_client=http))
        request = SendMessageRequest(message=ParseDict(msg, Message()))
        return [event async for event in client.send_message(request, context=activated(headers))]


def task_of(events: list[StreamResponse]) -> dict[str, Any]:
    assert events and events[0].HasField("task"), events
    out: dict[str, Any] = MessageToDict(events[0].task)
    return out


def ext_of(obj: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = obj.get("metadata", {}).get(EXTENSION_URI, {})
    return found


# --- the card and the header ---------------------------------------------------------


def test_cards(bridge: Bridge) -> None:
    card = httpx.get(bridge.url("target") + "/.well-known/agent-card.json").json()
    parse_agent_card(dict(card))  # a valid A2A v1.0 card for the SDK
    assert {s["id"] for s in card["skills"]} == {"priced", "words", "broken-stream", "ask", "secret-fail", "slow"}
    assert card["supportedInterfaces"][0]["url"] == bridge.url("target")
    ext = card["capabilities"]["extensions"]
    assert ext == [
        {
            "uri": EXTENSION_URI,
            "description": ext[0]["description"],
            "required": False,
            "params": {
                "idempotencyRetention": "PT3600S",
                # what a calling meshnode addresses and verifies reports with
                "application": APP,
                "issuerKey": bridge.daemon.agent_id("a2a-bridge"),
            },
        }
    ]
    # §8.12: the http scheme is projected, the mesh-identity one never.
    assert set(card["securitySchemes"]) == {"bearer"}
    assert card["securitySchemes"]["bearer"] == {"httpAuthSecurityScheme": {"scheme": "bearer"}}
    assert card["securityRequirements"] == [{"schemes": {"bearer": {"list": []}}}]
    echo = httpx.get(bridge.url("echo") + "/.well-known/agent-card.json").json()
    assert [s["id"] for s in echo["skills"]] == ["echo"] and "securitySchemes" not in echo
    # Two agents exposed: the host-wide well-known path names neither.
    assert httpx.get(bridge.base + "/.well-known/agent-card.json").status_code == 404
    assert httpx.get(bridge.url("nope") + "/.well-known/agent-card.json").status_code == 404


def test_header_echoed_only_when_activated(bridge: Bridge) -> None:
    msg = message(data={"n": 1}, skill=None)
    on = rpc(bridge.url("echo"), "SendMessage", {"message": msg})
    assert on.status_code == 200 and on.headers.get("A2A-Extensions") == EXTENSION_URI
    assert on.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    off = rpc(bridge.url("echo"), "SendMessage", {"message": message(data={"n": 1}, skill=None)}, HEADERS)
    assert off.status_code == 200 and "A2A-Extensions" not in off.headers
    artifact = off.json()["result"]["task"]["artifacts"][0]
    assert artifact["parts"][0]["data"] == {"ok": {"n": 1}}
    # Accepted output modes reach the agent's content-type admission (echo answers JSON only).
    picky = rpc(bridge.url("echo"), "SendMessage", {
        "message": message(data={"n": 1}, skill=None), "configuration": {"acceptedOutputModes": ["image/png"]},
    })
    picked = picky.json()["result"]["task"]["status"]
    assert picked["state"] == "TASK_STATE_FAILED"
    assert picked["message"]["metadata"][EXTENSION_URI] == {"code": "CONTENT_TYPE_NOT_SUPPORTED"}
    # A stranger's bytes are bounded before anything parses them.
    huge = httpx.post(bridge.url("echo"), content=b"x" * (5 * 1024 * 1024), headers=HEADERS, timeout=60)
    assert huge.status_code == 413
    # Bytes that are not UTF-8 JSON, and JSON nested past the limit, are the caller's errors.
    for body, code in ((b"\x80", -32700), (b"[" * 10_000 + b"]" * 10_000, -32600),
                       (b'{"jsonrpc":"2.0","id":7,"method":"SendMessage","params":' + b"[" * 80 + b"]" * 80 + b"}", -32600)):
        answer = httpx.post(bridge.url("echo"), content=body, headers=HEADERS, timeout=60)
        assert answer.status_code == 200 and answer.json()["error"]["code"] == code, answer.text


async def test_sdk_client_send_and_get(bridge: Bridge) -> None:
    events = await send(bridge.url("echo"), message(text="hello", skill=None))
    task = task_of(events)
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    assert task["artifacts"][0]["parts"][0]["data"] == {"ok": "hello"}
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(bridge.url("echo"), client_config=ClientConfig(httpx_client=http))
        again = await client.get_task(GetTaskRequest(id=task["id"]))
    assert MessageToDict(again)["status"]["state"] == "TASK_STATE_COMPLETED"


# --- the 401s ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "over", "key", "tamper"),
    [
        ("mesh.audience-mismatch", {"audience": "someone-else"}, CALLER_KEY, False),
        ("mesh.audience-missing", {"audience": None}, CALLER_KEY, False),
        ("mesh.signature-invalid", {}, STRANGER_KEY, False),
        ("mesh.envelope-expired", {"issuedAt": "2020-01-01T00:00:00.000Z"}, CALLER_KEY, False),
        ("mesh.body-mismatch", {}, CALLER_KEY, True),
    ],
)
def test_each_401(bridge: Bridge, code: str, over: dict[str, Any], key: Any, tamper: bool) -> None:
    before = bridge.received()
    msg = with_envelope(message(data={"text": "x"}), key=key, **over)
    if tamper:
        msg["parts"] = [{"data": {"text": "changed after signing"}}]
    answer = rpc(bridge.url("target"), "SendMessage", {"message": msg})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["data"] == [auth_error_info(code)]
    assert answer.json()["code"] == code
    assert answer.headers.get("A2A-Extensions") == EXTENSION_URI
    assert bridge.received() == before  # nothing reached the agent
    counters = next(a for a in bridge.daemon.status()["agents"] if a["name"] == "a2a-bridge")["counters"]
    assert counters.get(f"refused.a2a.{code}", 0) >= 1  # a local signal, counted


# --- chain limits -----------------------------------------------------------------------


async def test_mesh_loop_is_rejected_with_details(bridge: Bridge) -> None:
    before = await bridge.areceived()
    chain = [{"application": "caller", "start": "plan"}, {"application": APP, "start": "priced"}]
    msg = with_envelope(message(data={"text": "x"}), key=None, audience=None, callChain=chain)
    task = task_of(await send(bridge.url("target"), msg))
    assert task["status"]["state"] == "TASK_STATE_REJECTED"
    ext = ext_of(task["status"]["message"])
    assert ext["code"] == "limit.mesh-loop"
    assert ext["details"]["entry"] == {"application": APP, "start": "priced"}
    assert ext["details"]["chain"] == chain and "maxMeshHops" not in ext["details"]
    assert await bridge.areceived() == before


async def test_hop_limit_is_rejected_with_details(bridge: Bridge) -> None:
    chain = [{"application": f"app{i}", "start": "s"} for i in range(3)]
    msg = with_envelope(message(data={"text": "x"}), callChain=chain)
    task = task_of(await send(bridge.url("target"), msg))
    assert task["status"]["state"] == "TASK_STATE_REJECTED"
    ext = ext_of(task["status"]["message"])
    assert ext["code"] == "limit.hops"
    assert ext["details"]["maxMeshHops"] == 3 and ext["details"]["chain"] == chain


# --- trusted callers -------------------------------------------------------------------


async def test_trusted_budget_binds_admission(bridge: Bridge) -> None:
    msg = with_envelope(message(data={"text": "x"}), budget={"remaining": "0.0005", "currency": "USD"})
    task = task_of(await send(bridge.url("target"), msg))
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert ext_of(task["status"]["message"]) == {"code": "BUDGET_INSUFFICIENT"}
    # The refusal's message and estimate do not leave (words, not digits: a random
    # id or timestamp in the task may hold any run of digits).
    assert "costs at least" not in str(task) and "estimate" not in str(task)
    # The same budget claimed without a signature binds nothing.
    claim = with_envelope(message(data={"text": "x"}), key=None, audience=None,
                          budget={"remaining": "0.0005", "currency": "USD"})
    assert task_of(await send(bridge.url("target"), claim))["status"]["state"] == "TASK_STATE_COMPLETED"


@pytest.mark.parametrize(("issuer", "trusted"), [(MESH_CALLER, True), (MESH_OTHER, False)])
async def test_nkey_issuers_verify_from_their_id_under_the_allow_policy(
    bridge: Bridge, issuer: KeyPair, trusted: bool
) -> None:
    key = nacl.signing.SigningKey(decode_seed(issuer.seed)[1])
    msg = with_envelope(
        message(data={"text": "x"}), key=key, issuer=issuer.public_key,
        budget={"remaining": "0.0005", "currency": "USD"},
    )
    state = task_of(await send(bridge.url("target"), msg))["status"]["state"]
    # Trusted, its small budget binds (refused by admission); untrusted, it binds nothing.
    assert state == ("TASK_STATE_FAILED" if trusted else "TASK_STATE_COMPLETED")


async def test_trusted_completion_carries_a_verifiable_report(bridge: Bridge) -> None:
    bare = message(data={"text": "paid"})
    msg = with_envelope(bare, budget={"remaining": "1.00", "currency": "USD"}, deadline={"remaining": "PT60S"})
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    task = task_of(await send(bridge.url("target"), msg, headers=traceparent))
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    output = task["artifacts"][0]["parts"][0]["data"]
    assert output["priced"] == "paid" and output["trace_id"] == trace_id  # §13.1: one trace
    # The chain (extended by this hop) and the caller's origin reached the mesh request.
    carried = output["meta"][EXTENSION_URI]
    assert carried["callChain"][-1] == {"application": APP, "start": "priced", "executionId": task["id"]}
    assert carried["callChain"][0]["application"] == "caller"
    assert carried["origin"] == {"rootExecutionId": "root-1", "executionId": "e-1"}
    report = verify_report(
        ext_of(task)["report"],
        issuer_key=bridge.report_key,
        expected_body_hash=body_hash(bare),
        expected_execution_id=task["id"],
    )
    assert report.spend_total == Decimal("0.00025") and report.issuer == APP


async def test_failure_carries_only_the_stable_code(bridge: Bridge) -> None:
    task = task_of(await send(bridge.url("target"), with_envelope(message(data=None, skill="secret-fail"))))
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert ext_of(task["status"]["message"]) == {"code": "QUOTA_HIT"}
    assert "zebra" not in str(task) and "over quota" not in str(task) and "report" not in str(task)


async def test_untrusted_completion_has_no_report(bridge: Bridge) -> None:
    task = task_of(await send(bridge.url("target"), message(data={"text": "free"})))
    assert task["status"]["state"] == "TASK_STATE_COMPLETED" and "metadata" not in task


# --- streaming and cancel -------------------------------------------------------------


async def test_streaming_with_the_report_on_the_last_update(bridge: Bridge) -> None:
    bare = message(text="one two three", skill="words")
    events = await send(bridge.url("target"), with_envelope(bare), streaming=True)
    assert events[0].HasField("task")
    chunks = [
        p.text for e in events if e.HasField("artifact_update") for p in e.artifact_update.artifact.parts
    ]
    assert "".join(chunks) == "one two three "
    last = events[-1]
    assert last.HasField("status_update")
    update = MessageToDict(last.status_update)
    assert update["status"]["state"] == "TASK_STATE_COMPLETED"
    task_id = update["taskId"]
    report = verify_report(
        ext_of(update)["report"],
        issuer_key=bridge.report_key,
        expected_body_hash=body_hash(bare),
        expected_execution_id=task_id,
    )
    assert report.spend_total == 0


async def test_a_stream_failing_midway_ends_failed(bridge: Bridge) -> None:
    events = await send(bridge.url("target"), message(text="x", skill="broken-stream"), streaming=True)
    last = MessageToDict(events[-1].status_update)
    assert last["status"]["state"] == "TASK_STATE_FAILED"
    assert ext_of(last["status"]["message"]) == {"code": "STREAM_BROKE"}
    assert "pipe" not in str([MessageToDict(e) for e in events])


async def test_input_required_answers_a_blocking_send(bridge: Bridge) -> None:
    task = task_of(await send(bridge.url("target"), message(data=None, skill="ask")))
    assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(bridge.url("target"), client_config=ClientConfig(httpx_client=http))
        canceled = MessageToDict(await client.cancel_task(CancelTaskRequest(id=task["id"])))
    assert canceled["status"]["state"] == "TASK_STATE_CANCELED"


async def test_subscribe_then_cancel(bridge: Bridge) -> None:
    events = await send(bridge.url("target"), message(data=None, skill="slow"), polling=True)
    task = task_of(events)
    assert task["status"]["state"] in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
    seen: list[StreamResponse] = []
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(bridge.url("target"), client_config=ClientConfig(httpx_client=http))

        async def follow() -> None:
            async for event in client.subscribe(SubscribeToTaskRequest(id=task["id"])):
                seen.append(event)

        follower = asyncio.create_task(follow())
        await eventually_async(lambda: seen, what="the first event of the subscription")
        canceled = MessageToDict(await client.cancel_task(CancelTaskRequest(id=task["id"])))
        assert canceled["status"]["state"] == "TASK_STATE_CANCELED"
        await asyncio.wait_for(follower, timeout=30)
        got = MessageToDict(await client.get_task(GetTaskRequest(id=task["id"])))
    assert got["status"]["state"] == "TASK_STATE_CANCELED"
    assert seen[0].HasField("task") and seen[-1].HasField("status_update"), [MessageToDict(e) for e in seen]
    assert MessageToDict(seen[-1].status_update)["status"]["state"] == "TASK_STATE_CANCELED"


# --- task ownership and anonymous idempotency ----------------------------------------------

NOT_FOUND = -32001  # A2A TaskNotFoundError


def proof(method: str, task_id: str, *, key: nacl.signing.SigningKey | None = CALLER_KEY,
          issuer: str = "caller", bound_to: str | None = None) -> dict[str, str]:
    """Headers carrying a task-operation envelope for ``method`` on ``task_id``."""
    claims = build_envelope_claims(
        issuer=issuer, audience=APP if key is not None else None, now=time.time(),
        message={"method": bound_to or method, "id": task_id},
    )
    token = sign_envelope(claims, key) if key is not None else unsecured_envelope(claims)
    return {**ACTIVATE, "AGBoss-Mesh-Envelope": token}


def task_call(bridge: Bridge, method: str, task_id: str, headers: dict[str, str] = ACTIVATE) -> httpx.Response:
    return rpc(bridge.url("target"), method, {"id": task_id}, headers)


def error_of(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()["error"]
    return found


def test_a_trusted_callers_task_answers_only_to_its_issuer(bridge: Bridge) -> None:
    sent = rpc(bridge.url("target"), "SendMessage", {
        "message": with_envelope(message(data=None, skill="slow")), "configuration": {"returnImmediately": True},
    })
    task_id = sent.json()["result"]["task"]["id"]
    unknown = error_of(task_call(bridge, "GetTask", "no-such-task"))
    assert unknown["code"] == NOT_FOUND
    mesh_key = nacl.signing.SigningKey(decode_seed(MESH_CALLER.seed)[1])
    strangers: dict[str, Callable[[str], dict[str, str]]] = {
        "anonymous": lambda m: ACTIVATE,
        "not activated": lambda m: {**proof(m, task_id), "A2A-Extensions": ""},
        "claim naming the issuer": lambda m: proof(m, task_id, key=None),
        "another trusted issuer": lambda m: proof(m, task_id, key=mesh_key, issuer=MESH_CALLER.public_key),
    }
    for who, headers in strangers.items():
        # Answered exactly as an unknown task: its existence does not leak.
        assert error_of(task_call(bridge, "GetTask", task_id, headers("GetTask"))) == unknown, who
        assert error_of(task_call(bridge, "CancelTask", task_id, headers("CancelTask"))) == unknown, who
        subscribed = task_call(bridge, "SubscribeToTask", task_id, headers("SubscribeToTask"))
        assert str(NOT_FOUND) in subscribed.text and "TASK_STATE" not in subscribed.text, (who, subscribed.text)
    # A proof for another method (or task) proves nothing: 401 like any bad envelope.
    misbound = task_call(bridge, "CancelTask", task_id, proof("CancelTask", task_id, bound_to="GetTask"))
    assert misbound.status_code == 401 and misbound.json()["error"]["data"][0]["metadata"] == {"code": "mesh.body-mismatch"}
    forged = task_call(bridge, "GetTask", task_id, proof("GetTask", task_id, key=STRANGER_KEY))
    assert forged.status_code == 401 and forged.json()["error"]["data"][0]["metadata"] == {"code": "mesh.signature-invalid"}
    # Its issuer reads it (still running: the strangers' cancels did nothing) and cancels it.
    owned = task_call(bridge, "GetTask", task_id, proof("GetTask", task_id)).json()["result"]
    assert owned["status"]["state"] == "TASK_STATE_WORKING"
    canceled = task_call(bridge, "CancelTask", task_id, proof("CancelTask", task_id)).json()["result"]
    assert canceled["status"]["state"] == "TASK_STATE_CANCELED"
    # Finished and read from the store: still its issuer's alone.
    assert error_of(task_call(bridge, "GetTask", task_id)) == unknown
    stored = task_call(bridge, "GetTask", task_id, proof("GetTask", task_id)).json()["result"]
    assert stored["status"]["state"] == "TASK_STATE_CANCELED"


async def test_an_sdk_client_proves_its_issuer_with_a_service_parameter(bridge: Bridge) -> None:
    task = task_of(await send(bridge.url("echo"), with_envelope(message(data={"n": 3}, skill=None))))
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(bridge.url("echo"), client_config=ClientConfig(httpx_client=http))
        token = proof("GetTask", task["id"])["AGBoss-Mesh-Envelope"]
        got = await client.get_task(GetTaskRequest(id=task["id"]), context=activated({"AGBoss-Mesh-Envelope": token}))
        assert MessageToDict(got)["status"]["state"] == "TASK_STATE_COMPLETED"
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=task["id"]), context=activated())


def test_an_anonymous_task_is_its_ids_holders(bridge: Bridge) -> None:
    sent = rpc(bridge.url("echo"), "SendMessage", {"message": message(data={"n": 2}, skill=None)}, HEADERS)
    task_id = sent.json()["result"]["task"]["id"]
    # The unguessable id is the capability: any holder reads it, trusted or not.
    for headers in (HEADERS, ACTIVATE, proof("GetTask", task_id)):
        got = rpc(bridge.url("echo"), "GetTask", {"id": task_id}, headers).json()["result"]
        assert got["status"]["state"] == "TASK_STATE_COMPLETED"
    # ... on the agent it ran on only.
    assert error_of(task_call(bridge, "GetTask", task_id))["code"] == NOT_FOUND


def test_anonymous_idempotency_is_keyed_on_the_body(bridge: Bridge) -> None:
    def send_echo(msg: dict[str, Any], headers: dict[str, str] = HEADERS) -> dict[str, Any]:
        answer = rpc(bridge.url("echo"), "SendMessage", {"message": msg}, headers)
        task: dict[str, Any] = answer.json()["result"]["task"]
        return task

    mine = message(data={"secret": "mine"}, skill=None, message_id="anon-shared")
    first = send_echo(mine)
    # The very same message again: the same task, nothing run again.
    assert send_echo(mine)["id"] == first["id"]
    # Another anonymous caller reusing the messageId for its own message: a task of its
    # own, its own output, no error (which would confirm the messageId is in use).
    theirs = send_echo(message(data={"secret": "theirs"}, skill=None, message_id="anon-shared"))
    assert theirs["id"] != first["id"] and theirs["artifacts"][0]["parts"][0]["data"] == {"ok": {"secret": "theirs"}}
    # A trusted caller's messageIds are its own: the same message signed is another task.
    assert send_echo(with_envelope(mine), ACTIVATE)["id"] != first["id"]


# --- answering a paused task (input_required / auth_required) ------------------------------

INVALID_PARAMS = -32602
UNSUPPORTED = -32004  # A2A UnsupportedOperationError


async def test_an_sdk_client_answers_input_required_and_the_task_completes(bridge: Bridge) -> None:
    paused = task_of(await send(bridge.url("asker"), message(data={}, skill="ask")))
    assert paused["status"]["state"] == "TASK_STATE_INPUT_REQUIRED", paused
    answer = message(data={"name": "Ada"}, skill="ask")
    answer.update(taskId=paused["id"], contextId=paused["contextId"])
    done = task_of(await send(bridge.url("asker"), answer))
    assert done["id"] == paused["id"] and done["status"]["state"] == "TASK_STATE_COMPLETED", done
    assert done["artifacts"][0]["parts"][0]["data"] == {"hello": "Ada", "rounds": 1}
    # Streamed, the answer is followed to the end the same way (an auth round here).
    # Streamed, each turn's stream closes at the pause; the answer's runs to the end.
    opening = await send(bridge.url("asker"), message(data={}, skill="login"), streaming=True)
    opened = task_of(opening)
    assert MessageToDict(opening[-1].status_update)["status"]["state"] == "TASK_STATE_AUTH_REQUIRED"
    creds = message(data={"user": "ada"}, skill="login")
    creds["taskId"] = opened["id"]
    events = await send(bridge.url("asker"), creds, streaming=True)
    last = MessageToDict(events[-1].status_update)
    assert last["status"]["state"] == "TASK_STATE_COMPLETED", [MessageToDict(e) for e in events]


def test_only_the_owner_answers_a_paused_task_and_only_while_paused(bridge: Bridge) -> None:
    def send_to(msg: dict[str, Any], headers: dict[str, str] = ACTIVATE) -> httpx.Response:
        return rpc(bridge.url("asker"), "SendMessage", {"message": msg}, headers)

    paused = send_to(with_envelope(message(data={}, skill="ask"))).json()["result"]["task"]
    assert paused["status"]["state"] == "TASK_STATE_INPUT_REQUIRED", paused
    task_id, context_id = paused["id"], paused["contextId"]

    def answer(data: Any, **over: Any) -> dict[str, Any]:
        msg = message(data=data, skill="ask")
        msg.update({"taskId": task_id, "contextId": context_id, **over})
        return msg

    before = bridge.received("asker")
    # Anyone but its trusted caller: an unknown task, and nothing reaches the agent.
    for headers in (HEADERS, ACTIVATE):
        assert error_of(send_to(answer({"name": "Mallory"}), headers))["code"] == NOT_FOUND
    assert bridge.received("asker") == before
    assert error_of(send_to(with_envelope(answer({"name": "Ada"}, contextId="other"))))["code"] == INVALID_PARAMS
    # Input the agent's round refuses: InvalidParams, and the task is still paused.
    assert error_of(send_to(with_envelope(answer({"nom": "Ada"}))))["code"] == INVALID_PARAMS
    owned = rpc(bridge.url("asker"), "GetTask", {"id": task_id}, proof("GetTask", task_id)).json()["result"]
    assert owned["status"]["state"] == "TASK_STATE_INPUT_REQUIRED", owned
    done = send_to(with_envelope(answer({"name": "Ada"}))).json()["result"]["task"]
    assert done["status"]["state"] == "TASK_STATE_COMPLETED" and done["id"] == task_id, done
    # Ended: it takes no further message.
    assert error_of(send_to(with_envelope(answer({"name": "Ada"}))))["code"] == UNSUPPORTED


# --- idempotency (restarts the module's daemon: keep last) --------------------------------


async def test_idempotent_replay_across_a_restart(bridge: Bridge) -> None:
    bare = message(data={"text": "once"}, message_id="msg-once")
    first = task_of(await send(bridge.url("target"), with_envelope(bare)))
    assert first["status"]["state"] == "TASK_STATE_COMPLETED"
    await asyncio.to_thread(bridge.daemon.stop)
    await asyncio.to_thread(bridge.daemon.start)
    received = await bridge.areceived()
    # A new envelope (new issuedAt) over the same message: the same task, nothing run again.
    again = task_of(await send(bridge.url("target"), with_envelope(bare)))
    assert again["id"] == first["id"] and again["status"]["state"] == "TASK_STATE_COMPLETED"
    assert ext_of(again)["report"] == ext_of(first)["report"]
    assert await bridge.areceived() == received
    got = rpc(bridge.url("target"), "GetTask", {"id": first["id"]}, proof("GetTask", first["id"])).json()["result"]
    assert got["id"] == first["id"]
    # ... and still its caller's alone.
    assert rpc(bridge.url("target"), "GetTask", {"id": first["id"]}, HEADERS).json()["error"]["code"] == NOT_FOUND
    # Another caller (no trusted envelope) with the same messageId gets its own task.
    other = task_of(await send(bridge.url("target"), bare))
    assert other["id"] != first["id"]
    # The same caller reusing the messageId for another message is refused.
    changed = message(data={"text": "twice"}, message_id="msg-once")
    answer = rpc(bridge.url("target"), "SendMessage", {"message": with_envelope(changed)})
    assert "already used" in answer.json()["error"]["message"]
