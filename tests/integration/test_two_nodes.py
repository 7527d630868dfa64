"""Two real nodes on one real mesh, and one node talking to itself.

Node A runs the embedded mesh (nats-server, registry, presence, control plane);
node B joins it with an invite, as a person would. Every test drives real
``meshnode run`` processes through their admin sockets or the real CLI.

The ``test-probe`` agent kind defined here (loaded into node A through
``[node] plugin_modules``) hand-builds signed requests and hands them to the
node's own delivery function, so a test can send what no well-behaved agent
sends (the same envelope twice, a forged signature, a misaddressed request)
and compare what the local path (§4.7) and the broker path do with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from meshnode.agent import Agent, Context, offering
from meshnode.plugins import hookimpl
from meshnode.protocol.envelope import build_envelope, child_trace, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.testing import DaemonProcess, DaemonSet, consistently, eventually, run_cli

pytestmark = pytest.mark.integration

HEARTBEAT = 1.0  # seconds; both nodes beat this often and presence judges by it
TEST_PLUGINS = "tests.agents:plugin"
PROBE_PLUGIN = "tests.integration.test_two_nodes:probe_plugin"  # imported by the daemon
SECRET = "handler bug with a secret detail"  # the text tests.agents' crash raises


# --------------------------------------------------------------------------- probe agent


class Probe(Agent):
    """Sends one hand-built, signed request through ``Node.deliver`` ``copies`` times.

    ``deliver`` is the node's single send path: it hands the bytes to the
    recipient's pipeline when the recipient is hosted here (§4.7) and publishes
    them to its inbox otherwise. Input members: ``target``, ``offering``,
    ``input``, ``copies`` (default 1), ``tamper`` (change the payload after
    signing), ``address_to`` (put another id in ``to`` than the inbox it goes
    to). A request that should be answered is awaited; the reply's shape and
    trace are returned.
    """

    description = "integration-test probe (raw deliveries)"

    @offering("send", framing=False)
    async def send(self, ctx: Context, input: Any) -> Any:
        hosted = ctx._hosted  # type: ignore[attr-defined]  # the test reaches into the node on purpose
        node = hosted.node
        target: str = input["target"]
        payload: dict[str, Any] = {"offering": input.get("offering", "echo")}
        if input.get("input") is not None:
            payload["input"] = input["input"]
        request_trace = child_trace(ctx.trace or None)
        env = build_envelope(
            "request",
            hosted.agent_id,
            now_ms=node.now_ms(),
            to=input.get("address_to", target),
            payload=payload,
            trace=request_trace,
            ids=node.ids,
        )
        sign_envelope(env, hosted.key)
        if input.get("tamper"):
            env["payload"] = {**payload, "input": "not what was signed"}
        answered = not input.get("tamper") and "address_to" not in input
        if answered:
            node.pending.open(hosted.agent_id, env["id"], target)
        for _ in range(int(input.get("copies", 1))):
            await node.deliver(hosted, env, target)
        if not answered:
            return {"sent": env["id"]}
        reply = await node.pending.wait(hosted.agent_id, env["id"], float(input.get("timeout", 10)))
        return {
            "status": reply.status,
            "output": reply.output,
            "error": dict(reply.error) if reply.error else None,
            "from": reply.envelope["from"],
            "accepted": reply.accepted,
            "request_trace": request_trace,
            "reply_trace": reply.envelope["trace"],
        }


    @offering("fanout", framing=False)
    async def fanout(self, ctx: Context, input: Any) -> Any:
        """``count`` concurrent ``ctx.request``s to ``target``'s ``echo``, all at once:
        the outcome of each (``completed`` or its error code)."""

        async def one(i: int) -> str:
            try:
                reply = await ctx.request(input["target"], "echo", {"i": i}, timeout=20.0)
            except ProtocolError as exc:
                return exc.code
            return str(reply.status)

        outcomes = await asyncio.gather(*(one(i) for i in range(int(input["count"]))))
        return {"outcomes": dict(Counter(outcomes))}


class ProbePlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-probe", Probe)


probe_plugin = ProbePlugin()


# --------------------------------------------------------------------------- helpers


def _node(*modules: str) -> dict[str, Any]:
    return {"plugin_modules": [TEST_PLUGINS, *modules], "heartbeat_interval": f"{HEARTBEAT:g}s"}


def _two_nodes(daemons: DaemonSet) -> tuple[DaemonProcess, DaemonProcess]:
    a = daemons.embedded(
        "a",
        agents={"echo": {"plugin": "echo"}, "faulty": {"plugin": "test-faulty"}, "probe": {"plugin": "test-probe"}},
        node=_node(PROBE_PLUGIN),
    )
    b = daemons.joined(
        "b", via=a, agents={"echo_b": {"plugin": "echo"}, "faulty": {"plugin": "test-faulty"}}, node=_node()
    )
    return a, b


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """One pair for the tests that neither stop nor restart a node: each reads its
    own counters as deltas around its own calls (two daemon starts per test cost
    ~5 s each)."""
    daemons = DaemonSet()
    try:
        yield _two_nodes(daemons)
    finally:
        daemons.close()


def _counters(daemon: DaemonProcess) -> dict[str, dict[str, int]]:
    return {a["name"]: dict(a.get("counters") or {}) for a in daemon.status()["agents"] if "id" in a}


def _delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def _wait_delta(daemon: DaemonProcess, agent: str, before: Mapping[str, int], expected: dict[str, int],
                what: str, timeout: float = 5.0) -> None:
    """Wait until ``agent``'s counters moved by exactly ``expected`` since ``before``."""
    eventually(lambda: _delta(_counters(daemon)[agent], before) == expected,
               what=f"{what}: {agent} counters to move by {expected}", timeout=timeout)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _broker_children(daemon: DaemonProcess) -> list[int]:
    assert daemon.pid is not None
    out = subprocess.run(["pgrep", "-P", str(daemon.pid)], capture_output=True, text=True, check=False).stdout
    pids = [int(p) for p in out.split()]
    brokers = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"nats-server" in fh.read():
                    brokers.append(pid)
        except FileNotFoundError:
            pass
    return brokers


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``meshnode ARGS`` exactly as :func:`run_cli` runs it, for the expected failures."""
    return subprocess.run(
        [sys.executable, "-m", "meshnode.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _discovered(daemon: DaemonProcess, query: dict[str, Any]) -> dict[str, str | None]:
    """Discover (registry query) as ``{agent id: joined availability}``."""
    return {m["id"]: m.get("availability") for m in daemon.admin("Discover", query)["agents"]}


# --------------------------------------------------------------------------- tests


def test_cross_node_request_respond_and_trace(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Both directions through the CLI identity, and agent-to-agent from B's relay to A's echo."""
    a, b = pair
    echo_a, echo_b = a.agent_id("echo"), b.agent_id("echo_b")
    faulty_b = b.agent_id("faulty")
    assert a.status()["mesh"]["mode"] == "embedded" and b.status()["mesh"]["mode"] == "joined"

    # A -> B and B -> A: an accept arrived before the answer, which is signed by the target.
    a_to_b = a.call(echo_b, "echo", {"from": "a"})
    assert a_to_b == {"status": "completed", "output": {"ok": {"from": "a"}}, "from": echo_b,
                      "accepted": True, "task_id": None}
    b_to_a = b.call(echo_a, "echo", {"from": "b"})
    assert b_to_a == {"status": "completed", "output": {"ok": {"from": "b"}}, "from": echo_a,
                      "accepted": True, "task_id": None}

    # Agent to agent across nodes: B's relay handler calls A's echo with ctx.request.
    before_a, before_b = _counters(a), _counters(b)
    relayed = b.call("faulty", "relay", {"target": echo_a, "input": {"hop": 2}})
    assert relayed["status"] == "completed" and relayed["accepted"] is True
    assert relayed["from"] == faulty_b
    out = relayed["output"]
    assert out["relayed"] == {"ok": {"hop": 2}} and out["from"] == echo_a
    # §13.1: the callee's respond continues the trace the relay's request carried.
    assert len(out["trace_id"]) == 32 and out["reply_trace_id"] == out["trace_id"]
    # Both hops crossed the broker: A's echo got the request live, B's relay its answers live.
    assert _delta(_counters(a)["echo"], before_a["echo"]) == {
        "received": 1, "received.live": 1, "dispatched": 1, "completed": 1}
    relay_delta = _delta(_counters(b)["faulty"], before_b["faulty"])
    assert relay_delta["received.live"] == 2  # the accept and the answer from A's echo
    assert relay_delta["received.local"] == 1  # the CLI's request (same node)

    # A handler crash on the far node crosses the wire as INTERNAL_ERROR, without its text.
    crashed = a.call(faulty_b, "crash")
    assert crashed["status"] == "failed" and crashed["error"]["code"] == "INTERNAL_ERROR"
    assert crashed["from"] == faulty_b
    assert SECRET not in json.dumps(crashed) and "ZeroDivisionError" not in json.dumps(crashed)


def test_local_delivery_is_equivalent_to_remote(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """§4.7: relay -> local echo and relay -> remote echo look the same, only the path differs."""
    a, b = pair
    echo_a, echo_b = a.agent_id("echo"), b.agent_id("echo_b")
    faulty_a, faulty_b = a.agent_id("faulty"), b.agent_id("faulty")

    before_a, before_b = _counters(a), _counters(b)
    local = a.call("faulty", "relay", {"target": echo_a, "input": {"n": 1}})
    mid_a = _counters(a)
    remote = a.call("faulty", "relay", {"target": echo_b, "input": {"n": 1}})
    after_a, after_b = _counters(a), _counters(b)

    for result, target in ((local, echo_a), (remote, echo_b)):
        assert result["status"] == "completed" and result["accepted"] is True
        assert result["from"] == faulty_a
        assert result["output"]["relayed"] == {"ok": {"n": 1}}
        assert result["output"]["from"] == target  # the verified sender of the inner answer
        assert result["output"]["reply_trace_id"] == result["output"]["trace_id"]
    assert set(local["output"]) == set(remote["output"])

    # The local call never touched the broker; the remote one did, on both ends.
    assert _delta(mid_a["echo"], before_a["echo"]) == {
        "received": 1, "received.local": 1, "dispatched": 1, "completed": 1}
    assert _delta(mid_a["faulty"], before_a["faulty"]) == {
        "received": 3, "received.local": 3, "dispatched": 1, "completed": 1}
    assert after_a["echo"] == mid_a["echo"]
    assert _delta(after_a["faulty"], mid_a["faulty"]) == {
        "received": 3, "received.local": 1, "received.live": 2, "dispatched": 1, "completed": 1}
    assert _delta(after_b["echo_b"], before_b["echo_b"]) == {
        "received": 1, "received.live": 1, "dispatched": 1, "completed": 1}

    # The inner hop seen from the requesting agent: same shape, same trace rule, accept on both.
    sent: dict[str, dict[str, Any]] = {}
    for where, target in (("local", echo_a), ("remote", echo_b)):
        result = a.call("probe", "send", {"target": target, "input": {"where": where}})
        assert result["status"] == "completed"
        sent[where] = result["output"]
    for where, target in (("local", echo_a), ("remote", echo_b)):
        reply = sent[where]
        assert reply["status"] == "completed" and reply["output"] == {"ok": {"where": where}}
        assert reply["from"] == target and reply["accepted"] is True and reply["error"] is None
        # §13.1: same trace id, and the respond's span is a child of the request's span.
        assert reply["reply_trace"]["trace_id"] == reply["request_trace"]["trace_id"]
        assert reply["reply_trace"]["parent_span_id"] == reply["request_trace"]["span_id"]
    assert set(sent["local"]) == set(sent["remote"])

    # Error paths are equivalent: the same codes whether the callee is local or remote.
    for offering_id, target_local, target_remote, relay_input, code in (
        ("nope", echo_a, echo_b, None, "OFFERING_NOT_FOUND"),
        ("schema", faulty_a, faulty_b, {"n": "not an integer"}, "INPUT_INVALID"),
    ):
        errors = []
        for target in (target_local, target_remote):
            relay = {"target": target, "offering": offering_id, "input": relay_input}
            result = a.call("faulty", "relay", relay)
            assert result["status"] == "failed" and result["from"] == faulty_a
            probed = a.call("probe", "send", relay)["output"]
            # A refusal at admission is the first reply: no accept before it (§6.4a).
            assert probed["status"] == "failed" and probed["accepted"] is False
            assert probed["from"] == target
            assert probed["error"]["code"] == result["error"]["code"] == code
            errors.append((result["error"], probed["error"]))
        assert errors[0] == errors[1]


def test_64_concurrent_first_requests_to_another_node_all_succeed(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Issue #21: the first requests from one agent to a target on another node
    share one registry look-up of its manifest; none fails RATE_LIMITED because
    the platform's bookkeeping spent the agent's 60-a-minute budget."""
    a, b = pair
    result = a.call("probe", "fanout", {"target": b.agent_id("echo_b"), "count": 64}, timeout=60.0)
    assert result["status"] == "completed", result
    assert result["output"]["outcomes"] == {"completed": 64}


def test_local_path_runs_the_same_guard(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Dedup, signature check and addressing run on the local path exactly as on the broker path."""
    a, b = pair
    targets = {"local": (a, "echo", a.agent_id("echo")), "remote": (b, "echo_b", b.agent_id("echo_b"))}
    path_counter = {"local": "received.local", "remote": "received.live"}

    for where, (daemon, name, agent_id) in targets.items():
        path = path_counter[where]

        # The same signed envelope twice: one answer, one handler run, one duplicate signal.
        before = _counters(daemon)[name]
        twice = a.call("probe", "send", {"target": agent_id, "input": where, "copies": 2})
        assert twice["status"] == "completed"
        assert twice["output"]["output"] == {"ok": where} and twice["output"]["accepted"] is True
        expected = {"received": 2, path: 2, "dispatched": 1, "completed": 1, "refused.inbound_duplicate": 1}
        _wait_delta(daemon, name, before, expected, f"{where} duplicate")

        # A payload changed after signing never reaches admission.
        before = _counters(daemon)[name]
        assert a.call("probe", "send", {"target": agent_id, "input": "x", "tamper": True})["status"] == "completed"
        expected = {"received": 1, path: 1, "refused.identity_mismatch": 1}
        _wait_delta(daemon, name, before, expected, f"{where} forged signature")

        # A request addressed to someone else, delivered to this inbox, is dropped.
        before = _counters(daemon)[name]
        other = a.agent_id("faulty")
        sent = a.call("probe", "send", {"target": agent_id, "input": "x", "address_to": other})
        assert sent["status"] == "completed"
        expected = {"received": 1, path: 1, "refused.inbound_misaddressed": 1}
        _wait_delta(daemon, name, before, expected, f"{where} misaddressed")

    # The silently refused deliveries produced no stray answers at the probe.
    assert "unmatched_respond" not in _counters(a)["probe"]


def test_describe_is_a_document_not_a_conversation(pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """§10.14 locally and across nodes: the public block, no handler, no accept."""
    a, b = pair
    echo_a, echo_b = a.agent_id("echo"), b.agent_id("echo_b")
    before_a, before_b = _counters(a), _counters(b)

    docs: dict[str, dict[str, Any]] = {}
    for where, target, daemon, name, before in (
        ("local", "echo", a, "echo", before_a),
        ("remote", echo_b, b, "echo_b", before_b),
    ):
        result = a.call(target, "describe")
        agent_id = echo_a if where == "local" else echo_b
        assert result["status"] == "completed" and result["from"] == agent_id
        assert result["accepted"] is False  # describe never carries an accept (§6.4a scope)
        doc = result["output"]
        assert doc["agent_id"] == agent_id
        public = doc["public"]
        # The materialized public block (§8.7), not the manifest.
        assert public["offerings"] == ["echo"]
        assert [d["id"] for d in public["offering_details"]] == ["echo"]
        assert isinstance(public["description"], str) and public["description"]
        for member in ("public", "node", "endpoint", "endpoints", "id"):
            assert member not in public, f"describe leaked manifest member {member!r}"
        delta = _delta(_counters(daemon)[name], before[name])
        assert delta.get("describe") == 1 and "dispatched" not in delta and "completed" not in delta
        docs[where] = doc
    assert set(docs["local"]) == set(docs["remote"])
    assert set(docs["local"]["public"]) == set(docs["remote"]["public"])

    faulty_doc = a.call(b.agent_id("faulty"), "describe")["output"]
    assert set(faulty_doc["public"]["offerings"]) == {"crash", "refuse", "text", "relay", "sleep", "schema"}


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_presence_follows_heartbeats_registration_survives(meshnode_daemons: DaemonSet, how: str) -> None:
    """§9.5/§9.6: B goes offline within 2 x interval of its last beat; its agents stay registered."""
    a, b = _two_nodes(meshnode_daemons)
    node_a, node_b = a.status()["node"]["id"], b.status()["node"]["id"]
    ids_a = {a.agent_id("echo"), a.agent_id("faulty")}
    echo_b = b.agent_id("echo_b")
    ids_b = {echo_b, b.agent_id("faulty")}

    assert a.admin("Presence", {"node": node_b})["availability"] == "online"
    assert a.admin("Presence", {"node": node_a})["availability"] == "online"
    assert a.admin("Presence", {"agent": echo_b})["node"] == node_b
    online = _discovered(a, {"availability": "online"})
    assert ids_a <= set(online) and ids_b <= set(online)

    if how == "stop":
        assert b.stop() == 0
    else:
        b.kill()
    # Its last beat was at most one interval ago: offline within 2 x interval of it, plus margin.
    eventually(lambda: a.admin("Presence", {"node": node_b})["availability"] == "offline",
               what="B offline", timeout=2 * HEARTBEAT + 2.0)

    # A keeps beating through all of this.
    consistently(lambda: a.admin("Presence", {"node": node_a})["availability"] == "online",
                 during=HEARTBEAT, what="A staying online for a heartbeat interval")
    assert a.admin("Presence", {"node": node_a})["availability"] == "online"
    listed = {n["node"]: n["availability"] for n in a.admin("Presence", {})["nodes"]}
    assert listed[node_a] == "online" and listed[node_b] == "offline"
    by_agent = a.admin("Presence", {"agent": echo_b})
    assert by_agent["node"] == node_b and by_agent["availability"] == "offline"

    # Registration is not presence: B's agents are still discoverable, as offline.
    everything = _discovered(a, {})
    assert ids_b <= set(everything)
    assert {everything[i] for i in ids_b} == {"offline"}
    online = _discovered(a, {"availability": "online"})
    assert ids_a <= set(online) and not ids_b & set(online)


def test_a_crashing_plugin_is_isolated(meshnode_daemons: DaemonSet) -> None:
    node = meshnode_daemons.embedded(
        "iso",
        agents={"bad": {"plugin": "test-crash-on-start"}, "echo": {"plugin": "echo"},
                "faulty": {"plugin": "test-faulty"}},
        node=_node(),
    )
    by_name = {a["name"]: a for a in node.status()["agents"]}
    assert by_name["bad"]["state"] == "failed" and "cannot start" in by_name["bad"]["failure"]
    assert by_name["echo"]["state"] == "running" and by_name["echo"]["registered"]
    assert by_name["faulty"]["state"] == "running"
    assert node.call("echo", "echo", "first")["output"] == {"ok": "first"}

    for _ in range(2):
        crashed = node.call("faulty", "crash")
        assert crashed["status"] == "failed" and crashed["error"]["code"] == "INTERNAL_ERROR"
        assert crashed["from"] == by_name["faulty"]["id"]
        assert SECRET not in json.dumps(crashed) and "ZeroDivisionError" not in json.dumps(crashed)
    # The crash stays in the operator's log, and the node keeps serving: the crashed agent too.
    assert SECRET in node.log_text()
    assert node.call("echo", "echo", "after")["output"] == {"ok": "after"}
    assert node.call("faulty", "schema", {"n": 3})["output"] == {"n": 3}
    counters = _counters(node)["faulty"]
    assert counters["failed"] == 2 and counters["completed"] == 1
    assert node.status()["mesh"]["connected"]


def test_broker_dies_with_the_daemon_on_stop_and_on_kill(meshnode_daemons: DaemonSet) -> None:
    stopped = meshnode_daemons.embedded("stopped", agents={"echo": {"plugin": "echo"}}, node=_node())
    killed = meshnode_daemons.embedded("killed", agents={"echo": {"plugin": "echo"}}, node=_node())
    brokers = {"stopped": _broker_children(stopped), "killed": _broker_children(killed)}
    assert all(len(pids) == 1 for pids in brokers.values()), brokers
    try:
        assert stopped.stop() == 0
        assert not any(_alive(pid) for pid in brokers["stopped"]), "nats-server outlived a clean stop"

        killed.kill()  # SIGKILL: no shutdown code runs; PR_SET_PDEATHSIG must take the broker down
        eventually(lambda: not any(_alive(pid) for pid in brokers["killed"]),
                   what="the broker to die with its daemon", timeout=5.0)
        # The admin socket file is left behind by the kill, but nothing serves it.
        assert os.path.exists(killed.socket_path)
        assert _cli("status", "--json", "--socket", killed.socket_path).returncode == 69
    finally:
        for pid in brokers["stopped"] + brokers["killed"]:
            if _alive(pid):  # only on failure: do not leak the orphan this test caused
                os.kill(pid, signal.SIGKILL)


def test_cli_against_running_and_stopped_daemons(meshnode_daemons: DaemonSet) -> None:
    a, b = _two_nodes(meshnode_daemons)
    echo_b = b.agent_id("echo_b")

    status = json.loads(run_cli("status", "--json", "--socket", a.socket_path).stdout)
    assert status["node"]["id"] == a.admin("Mesh.Info")["node_id"]
    assert {x["name"] for x in status["agents"]} >= {"cli", "echo", "faulty", "probe"}
    # The socket is found from the configuration file too.
    by_config = json.loads(run_cli("status", "--json", "--config", str(b.config_path)).stdout)
    assert by_config["node"]["name"] == "b" and by_config["mesh"]["mode"] == "joined"

    called = run_cli("call", "echo", "echo", '{"x": [1, 2]}', "--json", "--socket", a.socket_path)
    assert json.loads(called.stdout)["output"] == {"ok": {"x": [1, 2]}}
    plain = run_cli("call", echo_b, "echo", "--text", "hi", "--socket", a.socket_path)
    assert json.loads(plain.stdout) == {"ok": {"text": "hi"}}

    unknown = _cli("call", "echo", "no-such-offering", "--socket", a.socket_path)
    assert unknown.returncode == 1 and "OFFERING_NOT_FOUND" in unknown.stderr
    remote_unknown = _cli("call", echo_b, "no-such-offering", "--json", "--socket", a.socket_path)
    assert remote_unknown.returncode == 1
    assert json.loads(remote_unknown.stdout)["error"]["code"] == "OFFERING_NOT_FOUND"

    info = json.loads(run_cli("mesh", "info", "--json", "--socket", a.socket_path).stdout)
    assert info["mode"] == "embedded" and info["name"] == "a" and info["nats_urls"]
    assert info == a.admin("Mesh.Info")
    info_b = json.loads(run_cli("mesh", "info", "--json", "--socket", b.socket_path).stdout)
    assert info_b["mode"] == "joined" and info_b["nats_urls"] == info["nats_urls"]

    assert b.stop() == 0
    gone = _cli("status", "--json", "--socket", b.socket_path)
    assert gone.returncode == 69 and gone.stdout == ""
    assert _cli("call", "echo_b", "echo", "--socket", b.socket_path).returncode == 69
