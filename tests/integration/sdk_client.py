"""An SDK-shaped AgentMesh client: what the public AgentMesh SDKs do on the wire, for tests.

Written here from the behaviour described in issue #17 (no SDK code is used or
copied), on top of :mod:`tests.integration.wire_client`'s spec-only primitives
(keys, envelopes, vouches, manifests), and like it importing nothing from
``meshnode``. Where it differs from :class:`~.wire_client.WireClient`, it does
what an SDK does rather than what a meshnode node does:

* its first credential comes from ``POST /v1/bootstrap`` with a single-use
  ``am_…`` token and the agent's public key; the answer's ``seed`` is the
  connection key, which is also the node key that vouches for the agent;
* one agent per connection;
* request/reply under the NATS client's default reply prefix ``_INBOX.``;
* registration on the untokenized ``mesh.registry.register`` subject;
* heartbeats signed by the agent, on ``mesh.heartbeat.{node_id}``;
* ``self_vouch=True``: the node key is the agent's own key (the Python SDK's
  default when no node seed is given), so the vouch and the heartbeat subject
  name the agent;
* a deferred answer: ``working`` with a task id at once, the final respond on
  ``mesh.task.{task_id}.update``;
* its mailbox drained over JetStream (``MESH_INBOX_{agent}``, durable
  ``inbox_{agent}``), as an SDK does when it (re)connects;
* renewal through ``POST /v1/node-credential``.

``servers`` overrides the NATS URLs the bootstrap answer names (a WebSocket
URL for a nats.ws-shaped case, say).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from tests.integration.wire_client import (
    ENVELOPE_TAG,
    CredentialRefused,
    Invite,
    UserKey,
    WireAgent,
    WireClient,
    build_envelope,
    child_trace,
    new_id,
    request_credential,
    sign_object,
)

__all__ = ["SDK_INBOX_PREFIX", "SdkClient", "bootstrap"]

SDK_INBOX_PREFIX = "_INBOX"
"""The NATS clients' default reply prefix, which the TypeScript SDK cannot change."""


def bootstrap(control_plane: str, token: str, agent_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """``POST {control_plane}/v1/bootstrap`` (blocking; run it in a thread)."""
    request = urllib.request.Request(
        control_plane.rstrip("/") + "/v1/bootstrap",
        data=json.dumps({"token": token, "agent_id": agent_id}).encode("utf-8"),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise CredentialRefused(exc.code, json.loads(exc.read() or b"null")) from None
    if not isinstance(answer, dict):
        raise ValueError(f"bootstrap answered {answer!r}")
    return answer


class SdkClient(WireClient):
    """One SDK agent on one connection: ``bootstrap`` → ``connect`` → ``register``."""

    def __init__(
        self, control_plane: str, agent: WireAgent, *, servers: Sequence[str] | None = None,
        self_vouch: bool = False,
    ) -> None:
        # Deliberately not WireClient.__init__: there is no invite, only a token.
        self.control_plane = control_plane
        self.agent = agent
        self.servers = list(servers) if servers is not None else None
        self.invite = Invite(jwt="", seed="", nats_urls=(), control_plane=control_plane, node_name=None)
        self.node_key: UserKey = UserKey.generate()  # replaced by the bootstrap answer
        self.node_id = self.node_key.public_key
        self.jwt = ""
        self.nats_urls: list[str] = []
        self.nc = None
        self.service_keys: dict[str, str] = {}
        self.errors: list[Exception] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.answer: dict[str, Any] = {}
        #: Offerings answered the deferred way (working now, the result as a task update).
        self.deferred: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.self_vouch = self_vouch

    @property
    def vouching_key(self) -> UserKey:
        """The key in ``manifest.node``: the credential's, or the agent's for a self-vouch."""
        return self.agent.key if self.self_vouch else self.node_key

    @property
    def inbox_prefix(self) -> str:
        return SDK_INBOX_PREFIX

    async def bootstrap(self, token: str) -> dict[str, Any]:
        answer = await asyncio.to_thread(bootstrap, self.control_plane, token, self.agent.id)
        self.answer = answer
        self.node_key = UserKey.from_seed(answer["seed"])
        self.node_id = self.node_key.public_key
        self.jwt = answer["jwt"]
        self.nats_urls = list(self.servers or answer["mesh"]["endpoints"])
        return answer

    async def renew(self) -> dict[str, Any]:
        """``POST /v1/node-credential`` for this node key and its one agent."""
        grant = await asyncio.to_thread(request_credential, self.control_plane, self.node_key, [self.agent.key])
        self.jwt = grant["jwt"]
        return grant

    async def start(self, token: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Bootstrap, connect, serve the inbox and register (what an SDK's first run does)."""
        await self.bootstrap(token)
        await self.connect()
        await self.serve(self.agent)
        return await self.register(self.agent)

    async def register(self, agent: WireAgent) -> tuple[dict[str, Any], dict[str, Any]]:
        """Register on the untokenized subject, vouched by the credential's key."""
        if agent is not self.agent:
            raise ValueError("an SDK connection hosts exactly one agent")
        manifest = agent.manifest(self.vouching_key)
        return await self.service_request("mesh.registry.register", "register", agent, manifest)

    async def heartbeat(self, availability: str = "online") -> None:
        node = self.vouching_key.public_key
        env = build_envelope("emit", self.agent.key, payload={"node": node, "availability": availability})
        await self.conn.publish(f"mesh.heartbeat.{node}", json.dumps(env).encode("utf-8"))
        await self.barrier()

    async def discover(self, query: Mapping[str, Any]) -> list[dict[str, Any]]:
        _, reply = await self.service_request("mesh.registry.discover", "discover", self.agent, dict(query))
        agents = (reply.get("payload") or {}).get("agents")
        assert isinstance(agents, list)
        return agents

    async def emit(self, topic: str, data: Any) -> None:
        domain, _, event_type = topic.partition(".")
        env = build_envelope("emit", self.agent.key, payload={"domain": domain, "event_type": event_type, "data": data})
        await self.conn.publish(f"mesh.event.{topic}", json.dumps(env).encode("utf-8"))
        await self.barrier()

    async def subscribe_events(self, pattern: str) -> None:
        async def on_event(msg: Msg) -> None:
            self.events.append(json.loads(msg.data))

        await self.conn.subscribe(f"mesh.event.{pattern}", cb=on_event)
        await self.barrier()

    async def drain_mailbox(self, *, max_messages: int = 100) -> list[dict[str, Any]]:
        """Pull and ack what ``MESH_INBOX_{agent}`` held while the agent was away."""
        js = self.conn.jetstream()
        stream, durable = f"MESH_INBOX_{self.agent.id}", f"inbox_{self.agent.id}"
        info = await js.stream_info(stream)
        if info.state.messages == 0:
            return []
        try:
            await js.consumer_info(stream, durable)
        except NotFoundError:
            await js.add_consumer(stream, ConsumerConfig(
                durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            ))
        psub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        drained: list[dict[str, Any]] = []
        try:
            for msg in await psub.fetch(max_messages, timeout=5):
                drained.append(json.loads(msg.data))
                await msg.ack()
        finally:
            await psub.unsubscribe()
        return drained

    async def disconnect(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()
        self.nc = None

    # -- serving: bare and deferred answers --------------------------------------------

    async def _handle_request(self, agent: WireAgent, request: dict[str, Any]) -> None:
        payload = request.get("payload")
        offering = payload.get("offering") if isinstance(payload, dict) else None
        if offering not in self.deferred:
            await super()._handle_request(agent, request)
            return
        inbox = f"mesh.agent.{request['from']}.inbox"  # as the SDKs answer: the §6.1 subject
        task_id = new_id()
        await self.conn.publish(inbox, self._respond(request, {"status": "working"}, task_id))
        handler = agent.offerings[offering]
        output = handler(payload.get("input") if isinstance(payload, dict) else None, request)
        await self.conn.publish(
            f"mesh.task.{task_id}.update", self._respond(request, {"status": "completed", "output": output}, task_id)
        )

    def _respond(self, request: Mapping[str, Any], payload: dict[str, Any], task_id: str) -> bytes:
        env = build_envelope(
            "respond", self.agent.key, to=request["from"], in_reply_to=request["id"],
            trace=child_trace(request.get("trace")), payload=payload,
        )
        env.pop("sig")
        env["task_id"] = task_id
        return json.dumps(sign_object(env, ENVELOPE_TAG, self.agent.key)).encode("utf-8")
