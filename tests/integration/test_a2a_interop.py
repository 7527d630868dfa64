"""The edges an independent A2A client and peer found (issue #20), against a real
daemon: the official a2a-sdk client, and meshnode calling its own bridge
(meshnode -> meshnode, ``[a2a.peers.self]``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import nacl.signing
import pytest
from a2a.client import ClientCallContext, ClientConfig, create_client
from a2a.client.card_resolver import parse_agent_card
from a2a.client.errors import A2AClientError
from a2a.client.service_parameters import ServiceParametersFactory, with_a2a_extensions
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    SendMessageRequest,
    StreamResponse,
)
from a2a.utils.errors import TaskNotFoundError
from google.protobuf.json_format import MessageToDict, ParseDict

from meshnode.a2a.client import causes
from meshnode.admin.protocol import NotFound, Refused
from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    TASK_ENVELOPE_HEADER,
    build_envelope_claims,
    format_instant,
    sign_envelope,
    task_operation,
    unsecured_envelope,
)
from meshnode.protocol.nkeys import KeyPair, decode_seed
from meshnode.testing import DaemonProcess, DaemonSet, eventually, eventually_async

pytestmark = pytest.mark.integration

APP = "acme"
HEADERS = {"A2A-Version": "1.0"}
# A trusted issuer: a mesh agent id, allowed by allow_issuers = ["*"], carries its own key.
ISSUER = KeyPair.generate()
ISSUER_KEY = nacl.signing.SigningKey(decode_seed(ISSUER.seed)[1])
ACTIVATE = {**HEADERS, "A2A-Extensions": EXTENSION_URI}


class Acme:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        # The bridge listens on port 0: its Status names the port it bound.
        self.base = daemon.status()["a2a"]["url"]

    def url(self, agent: str) -> str:
        return f"{self.base}/agents/{agent}"

    def call_peer(self, offering: str, input: Any, *, via: str = "call", timeout: float = 60,
                  peer: str = "self") -> Any:
        """The caller agent calls ``a2a:self`` (our own bridge) with ``input``."""
        result = self.daemon.call(
            "caller", via, {"peer": peer, "offering": offering, "input": input, "timeout": timeout},
            timeout=timeout + 30,
        )
        return result["output"]


@pytest.fixture(scope="module")
def acme() -> Iterator[Acme]:
    daemons = DaemonSet()
    try:
        # Its own bridge as its peers: it serves on a socket this test holds
        # (listen = "fd://N"), so its URL is known before it starts.
        listener = daemons.listening_socket()
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        daemon = daemons.embedded(
            APP,
            agents={"longtask": {"plugin": "longtask"}, "caller": {"plugin": "test-a2a-caller"},
                    "target": {"plugin": "test-a2a"}},
            node={"plugin_modules": ["tests.agents.a2a_caller:plugin", "tests.agents:a2a_target_plugin"]},
            extra={
                "a2a": {
                    "listen": f"fd://{listener.fileno()}",
                    "expose": ["longtask", "target"],
                    "application": APP,
                    # Trust agent-id issuers: the outbound signs as the calling agent.
                    "allow_issuers": ["*"],
                    "send_wait": "2s",
                },
                "a2a.peers.self": {"url": f"{base}/agents/longtask", "contract_price": "0.05"},
                "a2a.peers.target": {"url": f"{base}/agents/target", "contract_price": "0.05"},
                # Our own bridge, called with an envelope addressed to someone else: a 401.
                "a2a.peers.wrong": {"url": f"{base}/agents/longtask", "contract_price": "0.05",
                                    "audience": "someone-else"},
            },
            pass_fds=(listener.fileno(),),
        )
        yield Acme(daemon)
    finally:
        daemons.close()


def sdk_message(data: Any, *, skill: str | None = "count") -> Message:
    msg: dict[str, Any] = {"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"data": data}]}
    if skill is not None:
        msg["metadata"] = {"skill": skill}
    parsed: Message = ParseDict(msg, Message())
    return parsed


async def sdk_send(url: str, msg: Message, *, streaming: bool = False, activate: bool = False,
                   headers: dict[str, str] | None = None) -> list[StreamResponse]:
    """SendMessage (or SendStreamingMessage) by the official SDK client;
    ``activate`` asks for the mesh extension, ``headers`` are service parameters."""
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])]) if activate else {}
    params.update(headers or {})
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(url, client_config=ClientConfig(streaming=streaming, httpx_client=http))
        context = ClientCallContext(service_parameters=params)
        return [event async for event in client.send_message(SendMessageRequest(message=msg), context=context)]


def rpc(url: str, method: str, params: dict[str, Any], headers: dict[str, str] = HEADERS) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    return httpx.post(url, json=body, headers=headers, timeout=60)


# --- gap 2: integers arrive as floats ------------------------------------------------


async def test_an_sdk_clients_integer_input_reaches_the_agent_as_an_integer(acme: Acme) -> None:
    # The SDK's Struct sends {"to": 2} as {"to": 2.0}; the offering's schema says integer.
    msg = sdk_message({"to": 2, "every": 0.01})
    assert type(MessageToDict(msg)["parts"][0]["data"]["to"]) is float
    events = await sdk_send(acme.url("longtask"), msg)
    task = MessageToDict(events[0].task)
    if task["status"]["state"] != "TASK_STATE_COMPLETED":
        async with httpx.AsyncClient(timeout=60) as http:
            client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))
            for _ in range(200):
                task = MessageToDict(await client.get_task(GetTaskRequest(id=task["id"])))
                if task["status"]["state"] == "TASK_STATE_COMPLETED":
                    break
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    assert task["artifacts"][0]["parts"][0]["data"] == {"counted": 2}


def test_integer_outputs_leave_as_integers(acme: Acme) -> None:
    msg = MessageToDict(sdk_message({"to": 1, "every": 0}))
    answer = rpc(acme.url("longtask"), "SendMessage", {"message": msg})
    task = answer.json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    # On the wire: 1, not 1.0 (a JSON reader that tells them apart gets an int).
    assert '"counted": 1}' in answer.text or '"counted":1}' in answer.text
    got = rpc(acme.url("longtask"), "GetTask", {"id": task["id"]})
    assert type(got.json()["result"]["artifacts"][0]["parts"][0]["data"]["counted"]) is int


def test_integer_outputs_leave_a_stream_as_integers(acme: Acme) -> None:
    msg = MessageToDict(sdk_message({"to": 1, "every": 0}))
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": {"message": msg}}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", acme.url("longtask"), json=body, headers=HEADERS, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    artifacts = [e["result"]["artifactUpdate"] for e in events if "artifactUpdate" in e["result"]]
    assert artifacts and artifacts[-1]["artifact"]["parts"][0]["data"] == {"counted": 1}
    assert type(artifacts[-1]["artifact"]["parts"][0]["data"]["counted"]) is int
    assert events[-1]["result"]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"


def test_meshnode_to_meshnode_streamed_integer_outputs_stay_integers(acme: Acme) -> None:
    out = acme.daemon.call("caller", "stream", {"peer": "self", "offering": "count", "input": {"to": 2, "every": 0}},
                           timeout=60)["output"]
    assert out["status"] == "completed", out
    assert out["chunks"] == [{"counted": 2}] and type(out["chunks"][0]["counted"]) is int
    assert type(out["output"]["counted"]) is int


def test_meshnode_to_meshnode_integer_inputs_stay_integers(acme: Acme) -> None:
    out = acme.call_peer("count", {"to": 2, "every": 0.01})
    assert out.get("status") == "completed", out
    assert out["output"] == {"counted": 2} and type(out["output"]["counted"]) is int


# --- gap 3: the 401's shape ----------------------------------------------------------------


def with_claim(msg: Message, **over: Any) -> Message:
    """``msg`` carrying an unsigned envelope (a claim) with ``over`` in its claims."""
    as_dict = MessageToDict(msg)
    claims = build_envelope_claims(issuer="stranger", audience=APP, now=time.time(), message=as_dict)
    claims.update(over)
    as_dict.setdefault("metadata", {})[EXTENSION_URI] = {"envelope": unsecured_envelope(claims)}
    parsed: Message = ParseDict(as_dict, Message())
    return parsed


async def test_an_sdk_client_sees_the_401_with_its_code_and_challenge(acme: Acme) -> None:
    msg = with_claim(sdk_message({"to": 1, "every": 0}), audience="someone-else")
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))
        with pytest.raises(A2AClientError) as refused:
            async for _ in client.send_message(SendMessageRequest(message=msg),
                                               context=ClientCallContext(service_parameters=params)):
                pass
    status = next(c for c in causes(refused.value) if isinstance(c, httpx.HTTPStatusError))
    assert status.response.status_code == 401
    assert status.response.headers["WWW-Authenticate"].startswith('AGBoss-Mesh realm="acme"')
    assert 'error="mesh.audience-mismatch"' in status.response.headers["WWW-Authenticate"]
    body = status.response.json()
    # The seed's {code}, and the JSON-RPC error meshnode always answered.
    assert body["code"] == "mesh.audience-mismatch"
    assert body["error"]["code"] == 401 and body["error"]["data"][0]["metadata"] == {"code": "mesh.audience-mismatch"}


def test_meshnode_to_meshnode_a_401_keeps_its_code(acme: Acme) -> None:
    out = acme.call_peer("count", {"to": 1, "every": 0}, peer="wrong")
    error = out["error"]
    assert error["code"] == "UNAUTHORIZED", out
    assert error["details"] == {"http_status": 401, "code": "mesh.audience-mismatch"}


# --- gap 5: lastChunk -----------------------------------------------------------------------


async def test_the_last_streamed_chunk_says_so(acme: Acme) -> None:
    msg = ParseDict({"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"text": "one two three"}],
                     "metadata": {"skill": "words"}}, Message())
    events = await sdk_send(acme.url("target"), msg, streaming=True)
    updates = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert "".join(p.text for u in updates for p in u.artifact.parts) == "one two three "
    assert [u.last_chunk for u in updates] == [False] * (len(updates) - 1) + [True]
    assert all(u.append for u in updates[1:]) and not updates[0].append
    assert MessageToDict(events[-1].status_update)["status"]["state"] == "TASK_STATE_COMPLETED"


def test_meshnode_to_meshnode_streams_the_chunks_and_nothing_else(acme: Acme) -> None:
    out = acme.daemon.call("caller", "stream", {"peer": "target", "offering": "words", "input": "one two three"},
                           timeout=60)["output"]
    assert out["status"] == "completed", out
    assert out["chunks"] == ["one ", "two ", "three "] and out["output"] == "one two three "


# --- gap 4: the replay window ------------------------------------------------------------


def signed(msg: Message, **over: Any) -> Message:
    """``msg`` carrying an envelope signed by the trusted ``ISSUER``."""
    as_dict = MessageToDict(msg)
    claims = build_envelope_claims(issuer=ISSUER.public_key, audience=APP, now=time.time(), message=as_dict)
    claims.update(over)
    as_dict.setdefault("metadata", {})[EXTENSION_URI] = {"envelope": sign_envelope(claims, ISSUER_KEY)}
    parsed: Message = ParseDict(as_dict, Message())
    return parsed


async def sdk_refusal(url: str, msg: Message) -> httpx.Response:
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(url, client_config=ClientConfig(streaming=False, httpx_client=http))
        with pytest.raises(A2AClientError) as refused:
            async for _ in client.send_message(SendMessageRequest(message=msg),
                                               context=ClientCallContext(service_parameters=params)):
                pass
    status = next(c for c in causes(refused.value) if isinstance(c, httpx.HTTPStatusError))
    return status.response


async def test_a_sender_cannot_widen_the_replay_window(acme: Acme) -> None:
    # Issued 300 s ago with PT600S: the window is the seed's PT60S (plus the skew).
    msg = signed(sdk_message({"to": 1, "every": 0}), issuedAt=format_instant(time.time() - 300),
                 expiresIn="PT600S")
    answer = await sdk_refusal(acme.url("longtask"), msg)
    assert answer.status_code == 401 and answer.json()["code"] == "mesh.envelope-expired"


async def test_a_replayed_envelope_is_refused(acme: Acme) -> None:
    msg = signed(sdk_message({"to": 1, "every": 0}))
    first = await sdk_send(acme.url("longtask"), msg, activate=True)
    assert MessageToDict(first[0].task)["status"]["state"] == "TASK_STATE_COMPLETED"
    # The very same request again (same token) inside the window: a replay.
    answer = await sdk_refusal(acme.url("longtask"), msg)
    assert answer.status_code == 401 and answer.json()["code"] == "mesh.envelope-expired"
    # A resend of the same message under a new envelope is the idempotent resend: the same task.
    again = await sdk_send(acme.url("longtask"), signed(strip_envelope(msg)), activate=True)
    assert MessageToDict(again[0].task)["id"] == MessageToDict(first[0].task)["id"]


def strip_envelope(msg: Message) -> Message:
    as_dict = MessageToDict(msg)
    del as_dict["metadata"][EXTENSION_URI]
    parsed: Message = ParseDict(as_dict, Message())
    return parsed


# --- gap 1: ownership proof on follow-up task operations ---------------------------------


def ownership(method: str, task_id: str | None, *, issuer: KeyPair = ISSUER) -> dict[str, str]:
    """The task-operation envelope proving ``issuer`` for ``method`` on ``task_id``."""
    claims = build_envelope_claims(issuer=issuer.public_key, audience=APP, now=time.time(),
                                   message=task_operation(method, task_id))
    key = nacl.signing.SigningKey(decode_seed(issuer.seed)[1])
    return {TASK_ENVELOPE_HEADER: sign_envelope(claims, key)}


async def test_an_sdk_client_follows_its_trusted_task_with_the_ownership_proof(acme: Acme) -> None:
    # Outlives the 2 s send wait: the blocking send answers with the task working.
    first = await sdk_send(acme.url("longtask"), signed(sdk_message({"to": 3, "every": 1})), activate=True)
    task = MessageToDict(first[0].task)
    assert task["status"]["state"] in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"), task
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))
        # Without the proof a trusted caller's task is no one's to see (as if unknown).
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=task["id"]), context=ClientCallContext(service_parameters=params))
        async def completed() -> dict[str, Any] | None:
            context = ClientCallContext(service_parameters={**params, **ownership("GetTask", task["id"])})
            seen = MessageToDict(await client.get_task(GetTaskRequest(id=task["id"]), context=context))
            return seen if seen["status"]["state"] == "TASK_STATE_COMPLETED" else None

        if task["status"]["state"] != "TASK_STATE_COMPLETED":
            task = await eventually_async(completed, what="the trusted task completed (GetTask with the proof)")
    assert task["artifacts"][0]["parts"][0]["data"] == {"counted": 3}


async def test_an_sdk_client_cancels_its_trusted_task_with_the_ownership_proof(acme: Acme) -> None:
    first = await sdk_send(acme.url("longtask"), signed(sdk_message({"to": 100, "every": 0.2})), activate=True)
    task_id = MessageToDict(first[0].task)["id"]
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))
        context = ClientCallContext(service_parameters={**params, **ownership("CancelTask", task_id)})
        canceled = MessageToDict(await client.cancel_task(CancelTaskRequest(id=task_id), context=context))
    assert canceled["status"]["state"] == "TASK_STATE_CANCELED"


def test_meshnode_to_meshnode_a_task_outliving_the_send_wait_completes(acme: Acme) -> None:
    out = acme.call_peer("count", {"to": 3, "every": 1})
    assert out.get("status") == "completed", out
    assert out["output"] == {"counted": 3}
    assert out["a2a"]["mesh"] is True and out["a2a"]["report"] == "verified"


def test_meshnode_to_meshnode_cancel_propagates_and_the_peer_task_stops(acme: Acme) -> None:
    daemon = acme.daemon
    opened = daemon.admin("Call", {"agent": "caller", "offering": "slow", "wait_task": False, "timeout": 30,
                                   "input": {"peer": "self", "offering": "count", "stream": True,
                                             "input": {"to": 600, "every": 0.1}}})
    assert opened["status"] == "working", opened

    def stream_open() -> bool:  # the caller's handler says so once the bridge knows the peer's task
        try:
            return "a2a-stream-open" in json.dumps(daemon.admin("Tasks.Show", {"task_id": opened["task_id"]}))
        except (NotFound, Refused):  # not recorded yet (Tasks.Show answers NotFound since 4434165)
            return False

    eventually(stream_open)
    assert daemon.status()["a2a"]["running_tasks"] >= 1
    answer = daemon.admin("Tasks.Cancel", {"task_id": opened["task_id"], "agent": "caller",
                                           "reason": "user_requested"})
    assert answer["status"] == "canceled"

    def charged() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = daemon.admin("A2A.Charges", {"peer": "self"})["charges"]
        return [r for r in rows if r["report"] == "canceled" and "CancelTask sent" in (r["note"] or "")]

    eventually(lambda: bool(charged()))
    row = charged()[0]
    # The peer (our own bridge) took the proof: its task is canceled, not left running.
    assert "TASK_STATE_CANCELED" in row["note"] and row["charged"] == "0", row
    eventually(lambda: daemon.status()["a2a"]["running_tasks"] == 0)


# --- gap 6: history, historyLength, ListTasks -----------------------------------------------


async def test_history_holds_the_callers_messages_and_history_length_is_honoured(acme: Acme) -> None:
    msg = signed(sdk_message({"to": 1, "every": 0}))
    task = MessageToDict((await sdk_send(acme.url("longtask"), msg, activate=True))[0].task)
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    [entry] = task["history"]
    assert entry["messageId"] == msg.message_id and entry["role"] == "ROLE_USER"
    assert entry["taskId"] == task["id"] and entry["parts"] == [{"data": {"to": 1.0, "every": 0.0}}]
    assert EXTENSION_URI not in entry.get("metadata", {})  # the envelope is a credential, not history
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))

        async def get(**kw: Any) -> dict[str, Any]:
            context = ClientCallContext(service_parameters={**params, **ownership("GetTask", task["id"])})
            out: dict[str, Any] = MessageToDict(await client.get_task(GetTaskRequest(id=task["id"], **kw),
                                                                      context=context))
            return out

        assert len((await get())["history"]) == 1
        assert "history" not in await get(history_length=0)


async def test_list_tasks_lists_the_callers_own_tasks_only(acme: Acme) -> None:
    mine = MessageToDict((await sdk_send(acme.url("longtask"), signed(sdk_message({"to": 1, "every": 0})),
                                         activate=True))[0].task)
    other = KeyPair.generate()
    theirs_msg = sdk_message({"to": 1, "every": 0})
    as_dict = MessageToDict(theirs_msg)
    claims = build_envelope_claims(issuer=other.public_key, audience=APP, now=time.time(), message=as_dict)
    as_dict.setdefault("metadata", {})[EXTENSION_URI] = {
        "envelope": sign_envelope(claims, nacl.signing.SigningKey(decode_seed(other.seed)[1]))}
    theirs = MessageToDict((await sdk_send(acme.url("longtask"), ParseDict(as_dict, Message()),
                                           activate=True))[0].task)
    anonymous = MessageToDict((await sdk_send(acme.url("longtask"), sdk_message({"to": 1, "every": 0})))[0].task)
    params = ServiceParametersFactory.create([with_a2a_extensions([EXTENSION_URI])])
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(acme.url("longtask"), client_config=ClientConfig(streaming=False, httpx_client=http))

        async def listed(headers: dict[str, str], **kw: Any) -> dict[str, Any]:
            context = ClientCallContext(service_parameters={**params, **headers})
            out: dict[str, Any] = MessageToDict(await client.list_tasks(ListTasksRequest(**kw), context=context))
            return out

        found = await listed(ownership("ListTasks", None))
        ids = [t["id"] for t in found["tasks"]]
        assert mine["id"] in ids and theirs["id"] not in ids and anonymous["id"] not in ids
        assert all("artifacts" not in t for t in found["tasks"])  # includeArtifacts defaults to false
        with_artifacts = await listed(ownership("ListTasks", None), include_artifacts=True, page_size=1)
        assert with_artifacts["tasks"][0]["artifacts"] and len(with_artifacts["tasks"]) == 1
        assert (await listed(ownership("ListTasks", None, issuer=other)))["tasks"][0]["id"] == theirs["id"]
        # Without a proof: nothing (anonymous tasks are capabilities, never handed out).
        assert (await listed({})).get("tasks", []) == []


# --- gap 7: discovery ----------------------------------------------------------------------------


def test_the_discovery_document_lists_every_exposed_agent_and_its_card(acme: Acme) -> None:
    doc = httpx.get(acme.base + "/.well-known/agent-cards.json", timeout=30).json()
    assert doc["application"] == APP
    by_name = {a["name"]: a for a in doc["agents"]}
    assert set(by_name) == {"longtask", "target"}
    for name, entry in by_name.items():
        assert entry["url"] == acme.url(name)
        # The card listed is the agent's own card, as the SDK reads it.
        own = httpx.get(entry["agentCardUrl"], timeout=30).json()
        assert entry["card"] == own and parse_agent_card(dict(own)).name
    # Two agents: the single well-known card still names neither, and says where they are.
    root = httpx.get(acme.base + "/.well-known/agent-card.json", timeout=30)
    assert root.status_code == 404 and "agent-cards.json" in root.text


async def test_an_sdk_client_reaches_every_agent_from_the_discovery_document(acme: Acme) -> None:
    doc = httpx.get(acme.base + "/.well-known/agent-cards.json", timeout=30).json()
    entry = next(a for a in doc["agents"] if a["name"] == "longtask")
    async with httpx.AsyncClient(timeout=60) as http:
        client = await create_client(parse_agent_card(dict(entry["card"])),
                                     client_config=ClientConfig(streaming=False, httpx_client=http))
        events = [e async for e in client.send_message(SendMessageRequest(message=sdk_message({"to": 1, "every": 0})))]
    assert MessageToDict(events[0].task)["status"]["state"] == "TASK_STATE_COMPLETED"
