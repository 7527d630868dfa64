"""The owner allowance on the node (meshnode.node.allowance): documents held and
their precedence, metering into the persisted spend, the admission refusal
with the estimate, mid-task stops, and the ask_owner hold released by a
raised allowance (the pure rules are tested in test_allowance.py and by the
conformance fixture)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from meshnode.admin.exitcodes import EX_DATAERR, EX_NOINPUT
from meshnode.admin.protocol import NotFound
from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.cli import main
from meshnode.daemon.allowance import _AllowanceMethods
from meshnode.node.allowance import (
    AllowanceKeeper,
    SpendStore,
    agent_owner,
    estimate_of,
    tokens_of_usage,
)
from meshnode.node.hosted import HostedAgent
from meshnode.node.tasks import ResponderTask
from meshnode.protocol.allowance import Ceiling, CostModel, OnExhausted, Scope, make_allowance
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from tests.fakes import FakeNode

NOW = 1_800_000_000_000
MODEL = CostModel(1000, "USD")  # one micro-unit per token


class Worker(Agent):
    @offering("fixed", allowance_estimate={"tokens": 4000})
    async def fixed(self, ctx: Context, input: Any) -> Any:
        return None

    @offering("priced", allowance_estimate={"cost_micro": 7})
    async def priced(self, ctx: Context, input: Any) -> Any:
        return None

    @offering("by-input", allowance_estimate=lambda input: {"tokens": input["n"]})
    async def by_input(self, ctx: Context, input: Any) -> Any:
        return None

    @offering("default")
    async def default(self, ctx: Context, input: Any) -> Any:
        return None


class Env:
    def __init__(self, tmp_path: Path) -> None:
        # The owner is the hosting node's key (§8.6 default ownership).
        self.owner = KeyPair.generate()
        self.node = FakeNode(now_ms=NOW, node_id=self.owner.public_key)
        key = KeyPair.generate()
        self.hosted = HostedAgent(cast(Any, self.node), name="worker", kind="test", agent=Worker("worker", AgentSettings()),
                                  key=key, guard=self.node.new_guard(key.public_key), interaction="service")
        self.node.agents["worker"] = self.hosted
        self.node.by_id[self.hosted.agent_id] = self.hosted
        self.tmp = tmp_path
        self.keeper = self.new_keeper()
        self.node.allowance = self.keeper

    def new_keeper(self, configured: dict[str, Path] | None = None) -> AllowanceKeeper:
        return AllowanceKeeper(self.tmp / "allowances", SpendStore(self.tmp / "allowance.sqlite3"),
                               configured=configured, now_ms=self.node.now_ms)

    def document(self, *ceilings: Ceiling, mode: OnExhausted = OnExhausted.REFUSE, at: int = NOW) -> dict[str, Any]:
        return make_allowance(self.owner, agent=self.hosted.agent_id, cost_model=MODEL, ceilings=ceilings,
                              on_exhausted=mode, updated_at_ms=at)

    def request(self, offering_id: str, input: Any = None, rid: str = "r1") -> dict[str, Any]:
        return {"type": "request", "id": rid, "from": KeyPair.generate().public_key,
                "payload": {"offering": offering_id, "input": input}}

    def events(self) -> list[dict[str, Any]]:
        return [data for domain, kind, data in self.node.emitted if (domain, kind) == ("agent", "allowance_exceeded")]


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def test_estimates_follow_the_declaration_else_the_text_length() -> None:
    specs = Worker.offerings()
    assert estimate_of(specs["fixed"], None, {}) == {"tokens": 4000}
    assert estimate_of(specs["priced"], None, {}) == {"cost_micro": 7}
    assert estimate_of(specs["by-input"], {"n": 12}, {}) == {"tokens": 12}
    request = {"type": "request", "payload": {"offering": "default", "input": "x" * 9}}
    assert estimate_of(specs["default"], "x" * 9, request) == {"tokens": 3}  # ceil(9 / 4)
    with pytest.raises(ValueError, match="allowance_estimate"):
        estimate_of(specs["by-input"], {"n": 1.5}, {})


def test_token_meters_of_a_usage_report_are_summed() -> None:
    usage = [{"meter": "tokens_in", "quantity": 10}, {"meter": "tokens_out", "quantity": 5},
             {"meter": "requests", "quantity": 1}, {"meter": "tokens", "quantity": 1.5}]
    assert tokens_of_usage(usage) == 15


async def test_an_estimate_over_the_binding_ceiling_is_refused_with_it(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 5000), Ceiling(Scope.DAY, 100000)))
    spec = Worker.offerings()["fixed"]
    await env.keeper.admit(env.hosted, env.request("fixed"), spec, None)  # 4000 fits 5000
    with pytest.raises(ProtocolError) as info:
        await env.keeper.admit(env.hosted, env.request("by-input"), Worker.offerings()["by-input"], {"n": 5001})
    assert info.value.code == "BUDGET_INSUFFICIENT"
    assert info.value.details == {"estimate": {"amount_micro": 5001, "currency": "USD"}}
    [event] = env.events()
    assert event["outcome"] == "refused" and event["stage"] == "admission"
    assert event["ceiling"] == {"scope": "task", "amount_micro": 5000, "spent_micro": 0, "remaining_micro": 5000}
    assert env.hosted.counters["allowance.refused"] == 1


async def test_equality_admits_and_the_day_binds_once_spent(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 5000), Ceiling(Scope.DAY, 6000)))
    spec = Worker.offerings()["by-input"]
    await env.keeper.admit(env.hosted, env.request("by-input"), spec, {"n": 5000})
    await env.keeper.report(env.hosted, env.request("x", rid="a"), None, None, tokens=3000)
    # 3000 spent today; 3000 left on the day, less than the task's 5000.
    with pytest.raises(ProtocolError) as info:
        await env.keeper.admit(env.hosted, env.request("by-input"), spec, {"n": 3001})
    assert info.value.code == "BUDGET_INSUFFICIENT"
    await env.keeper.admit(env.hosted, env.request("by-input"), spec, {"n": 3000})


async def test_spend_past_a_ceiling_stops_the_work_and_survives_a_restart(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 5000)))
    request = env.request("fixed", rid="r9")
    await env.keeper.report(env.hosted, request, None, None, tokens=2500)
    await env.keeper.report(env.hosted, request, None, None, tokens=2500)  # exactly at the ceiling: fine
    with pytest.raises(ProtocolError) as info:
        await env.keeper.report(env.hosted, request, None, None, cost_micro=1)
    assert info.value.code == "BUDGET_EXHAUSTED"
    assert info.value.details["spent"] == {"amount_micro": 5001, "currency": "USD"}
    assert [e["outcome"] for e in env.events()] == ["stopped"]
    # A new keeper over the same files: the document and the spend are still there.
    env.keeper.close()
    again = env.new_keeper()
    shown = again.show(env.hosted)
    assert shown["valid"] is True
    assert shown["spend"]["today_micro"] == 5001
    assert shown["spend"]["by_task"] == {"r9": 5001}
    assert oct((env.tmp / "allowances" / f"{env.hosted.agent_id}.json").stat().st_mode & 0o777) == "0o600"
    assert oct((env.tmp / "allowance.sqlite3").stat().st_mode & 0o777) == "0o600"
    again.close()


async def test_cumulative_usage_reports_count_only_their_growth(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.DAY, 10**9)))
    request = env.request("fixed", rid="r2")
    for total in (100, 250, 250, 200):
        await env.keeper.report(env.hosted, request, None, None, cumulative_tokens=total)
    assert env.keeper.show(env.hosted)["spend"]["today_micro"] == 250


def test_a_document_that_does_not_verify_is_refused_or_fails_closed_naming_the_file(env: Env) -> None:
    doc = env.document(Ceiling(Scope.DAY, 1000))
    forged = dict(doc, ceilings=[{"scope": "day", "amount_micro": 10**9}])
    with pytest.raises(ProtocolError) as info:
        env.keeper.set(env.hosted, forged)
    assert info.value.details["reason"] == "bad_signature"
    with pytest.raises(ProtocolError) as info:
        env.keeper.set(env.hosted, {**doc, "ceilings": [{"scope": "week", "amount_micro": 1}]})
    assert info.value.details["member"] == "ceilings[0].scope"
    path = env.tmp / "owner-allowance.json"
    path.write_text(json.dumps(forged), encoding="utf-8")
    keeper = env.new_keeper({"worker": path})
    shown = keeper.show(env.hosted)
    assert shown["valid"] is False
    assert str(path) in shown["errors"][0] and "bad_signature" in shown["errors"][0]
    keeper.close()


async def test_the_newer_of_the_stored_and_configured_documents_governs(env: Env) -> None:
    path = env.tmp / "configured.json"
    path.write_text(json.dumps(env.document(Ceiling(Scope.DAY, 1), at=NOW + 1000)), encoding="utf-8")
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.DAY, 99), at=NOW))
    keeper = env.new_keeper({"worker": path})
    assert keeper.show(env.hosted)["source"] == f"allowance_file {path}"
    keeper.set(env.hosted, env.document(Ceiling(Scope.DAY, 50), at=NOW + 2000))
    assert keeper.show(env.hosted)["ceilings"][0]["amount_micro"] == 50
    keeper.close()


async def _hold_at_admission(env: Env, *, set_document: bool = True) -> tuple[asyncio.Task[None], ResponderTask]:
    if set_document:
        env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 1000), mode=OnExhausted.ASK_OWNER))
    request = env.request("fixed")
    await env.keeper.admit(env.hosted, request, Worker.offerings()["fixed"], None)  # held, not refused
    opened: list[ResponderTask] = []

    async def open_task() -> ResponderTask:
        task = ResponderTask(env.hosted, request, "t1")
        await task._send("working", first=True)
        opened.append(task)
        return task

    waiting = asyncio.ensure_future(env.keeper.before_handler(env.hosted, request, open_task))
    for _ in range(50):
        if env.keeper.holds.get(env.hosted.agent_id):
            break
        await asyncio.sleep(0)
    return waiting, opened[0]


async def test_ask_owner_holds_work_until_the_owner_raises_the_ceiling(env: Env) -> None:
    waiting, task = await _hold_at_admission(env)
    assert task.state == "input_required"
    assert [h["stage"] for h in env.keeper.show(env.hosted)["held"]] == ["admission"]
    # Raised, but not enough: still held.
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 2000), mode=OnExhausted.ASK_OWNER, at=NOW + 1))
    await asyncio.sleep(0)
    assert not waiting.done()
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 4000), mode=OnExhausted.ASK_OWNER, at=NOW + 2))
    await asyncio.wait_for(waiting, 5)
    assert task.state == "working"
    assert env.keeper.show(env.hosted)["held"] == []
    assert [e["outcome"] for e in env.events()] == ["held"]


async def test_a_declined_hold_ends_refused_with_the_estimate(env: Env) -> None:
    waiting, task = await _hold_at_admission(env)
    assert env.keeper.decline(env.hosted) == ["t1"]
    with pytest.raises(ProtocolError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code == "BUDGET_INSUFFICIENT"
    assert info.value.details == {"estimate": {"amount_micro": 4000, "currency": "USD"}}
    assert task.state == "exhausted"


async def test_a_bare_request_paused_mid_task_keeps_its_spend_in_one_place(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 1000), mode=OnExhausted.ASK_OWNER))
    request = env.request("fixed", rid="bare")
    opened: list[ResponderTask] = []

    async def open_task() -> ResponderTask:
        task = ResponderTask(env.hosted, request, "t2")
        await task._send("working", first=True)
        opened.append(task)
        return task

    await env.keeper.report(env.hosted, request, None, open_task, tokens=800)
    waiting = asyncio.ensure_future(env.keeper.report(env.hosted, request, None, open_task, tokens=800))
    for _ in range(50):
        if env.keeper.holds.get(env.hosted.agent_id):
            break
        await asyncio.sleep(0)
    assert opened[0].state == "input_required"
    # 1600 spent on this request (recorded before its Task existed): 1500 is not enough.
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 1500), mode=OnExhausted.ASK_OWNER, at=NOW + 1))
    await asyncio.sleep(0)
    assert not waiting.done()
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 1600), mode=OnExhausted.ASK_OWNER, at=NOW + 2))
    await asyncio.wait_for(waiting, 5)
    assert opened[0].state == "working"
    assert env.keeper.show(env.hosted)["spend"]["by_task"] == {"bare": 1600}
    assert [e["outcome"] for e in env.events()] == ["paused"]


# -- whose signature counts (§8.6), reload, add ------------------------------------------


def test_a_document_signed_by_another_key_than_the_agents_owner_is_refused_naming_both(env: Env) -> None:
    stranger = KeyPair.generate()
    doc = make_allowance(stranger, agent=env.hosted.agent_id, cost_model=MODEL, ceilings=[Ceiling(Scope.DAY, 5)],
                         updated_at_ms=NOW)
    with pytest.raises(ProtocolError) as info:
        env.keeper.set(env.hosted, doc)
    assert info.value.code == "IDENTITY_MISMATCH"
    assert info.value.details == {"reason": "wrong_owner", "member": "owner_key",
                                  "owner_key": stranger.public_key, "owner": env.owner.public_key}
    assert stranger.public_key in info.value.message and env.owner.public_key in info.value.message
    assert "[agents.worker] allowance_any_owner = true" in info.value.message
    assert env.keeper.show(env.hosted)["set"] is False
    # From a file, the same document fails closed, the file, both keys and the way out named.
    path = env.tmp / "stranger.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    keeper = env.new_keeper({"worker": path})
    shown = keeper.show(env.hosted)
    assert shown["valid"] is False and shown["owner"] == env.owner.public_key
    [error] = shown["errors"]
    assert str(path) in error and "wrong_owner" in error and stranger.public_key in error
    assert "allowance_any_owner" in error
    keeper.close()
    # allowance_any_owner: the owner signs with a key the manifest does not name.
    lenient = AllowanceKeeper(env.tmp / "allowances", SpendStore(env.tmp / "allowance.sqlite3"),
                              configured={"worker": path}, any_owner={"worker"}, now_ms=env.node.now_ms)
    shown = lenient.show(env.hosted)
    assert shown["valid"] is True and shown["any_owner"] is True
    assert shown["document"]["owner_key"] == stranger.public_key
    lenient.set(env.hosted, dict(doc))  # `allowance add` of it is accepted too
    lenient.close()
    # allowance_any_owner off again: the stored document signed by the stranger fails closed.
    strict = env.new_keeper()
    shown = strict.show(env.hosted)
    assert shown["valid"] is False and shown["source"].startswith("stored ")
    assert "wrong_owner" in shown["errors"][0]
    strict.close()


def test_the_agents_owner_is_the_attested_manifest_owner_else_the_hosting_node(env: Env) -> None:
    assert agent_owner(env.hosted) == env.owner.public_key  # no manifest owner: the node (§8.6)
    person = KeyPair.generate().public_key
    env.hosted.manifest = {"owner": person}  # claimed without the attestation §8.6 requires: not believed
    assert agent_owner(env.hosted) == env.owner.public_key
    env.hosted.manifest = {"owner": person, "owner_attestation": {"owner": person, "sig": "x"}}
    assert agent_owner(env.hosted) == person
    assert env.keeper.required_owner(env.hosted) == person


async def test_reload_rereads_the_allowance_file_changed_invalid_or_removed(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    path = env.tmp / "configured.json"
    path.write_text(json.dumps(env.document(Ceiling(Scope.TASK, 1000), mode=OnExhausted.ASK_OWNER)), "utf-8")
    keeper = env.new_keeper({"worker": path})
    env.node.allowance = env.keeper = keeper
    waiting, task = await _hold_at_admission(env, set_document=False)
    assert task.state == "input_required"
    # Changed on disk (raised): in force after the reload, the held work goes on.
    path.write_text(json.dumps(env.document(Ceiling(Scope.TASK, 5000), mode=OnExhausted.ASK_OWNER, at=NOW + 1)),
                    "utf-8")
    assert keeper.show(env.hosted)["ceilings"][0]["amount_micro"] == 1000  # read at start, until a reload
    report = keeper.reload([env.hosted], configured={"worker": path}, any_owner=())
    assert report == {"worker": {"source": f"allowance_file {path}", "valid": True, "errors": []}}
    await asyncio.wait_for(waiting, 5)
    assert task.state == "working"
    # Invalid (forged): fails closed as at start, logged naming the file.
    forged = dict(env.document(Ceiling(Scope.TASK, 5000), at=NOW + 2), ceilings=[{"scope": "task", "amount_micro": 9}])
    path.write_text(json.dumps(forged), "utf-8")
    with caplog.at_level("ERROR", logger="meshnode.allowance"):
        report = keeper.reload([env.hosted], configured={"worker": path}, any_owner=())
    assert report["worker"]["valid"] is False and str(path) in report["worker"]["errors"][0]
    assert any(str(path) in r.getMessage() and "bad_signature" in r.getMessage() for r in caplog.records)
    with pytest.raises(ProtocolError) as info:
        await keeper.admit(env.hosted, env.request("priced", rid="r3"), Worker.offerings()["priced"], None)
    assert info.value.code == "BUDGET_INSUFFICIENT"
    # Removed from the file on disk: fails closed too (as a missing file at start).
    path.unlink()
    report = keeper.reload([env.hosted], configured={"worker": path}, any_owner=())
    assert report["worker"]["valid"] is False and "no such file" in report["worker"]["errors"][0]
    # Removed from the configuration: no allowance any more.
    assert keeper.reload([env.hosted], configured={}, any_owner=()) == {}
    assert keeper.show(env.hosted)["set"] is False
    await keeper.admit(env.hosted, env.request("priced", rid="r4"), Worker.offerings()["priced"], None)
    keeper.close()


def test_allowance_add_names_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    assert main(["allowance", "add", str(missing), "--socket", str(tmp_path / "s")]) == EX_NOINPUT
    assert str(missing) in capsys.readouterr().err
    listed = tmp_path / "list.json"
    listed.write_text("[1]", encoding="utf-8")
    assert main(["allowance", "add", str(listed), "--json", "--socket", str(tmp_path / "s")]) == EX_DATAERR
    assert f"{listed}: an allowance document is a JSON object" in capsys.readouterr().err


async def test_declining_a_task_that_is_not_held_is_not_found(env: Env) -> None:
    # `meshnode allowance decline AGENT --task T` for a T nothing holds (a typo, or
    # already resumed) must fail (NotFound, exit 65) naming what is held, not print
    # "declined 0" and exit 0.
    await _hold_at_admission(env)
    methods = _AllowanceMethods(cast(Any, SimpleNamespace(node=env.node)))
    with pytest.raises(NotFound) as info:
        await methods.decline({"agent": "worker", "task_id": "t-typo"}, cast(Any, None))
    assert "'t-typo'" in str(info.value) and "held: t1" in str(info.value)
    assert env.keeper.holds[env.hosted.agent_id]  # nothing was declined
    assert await methods.decline({"agent": "worker", "task_id": "t1"}, cast(Any, None)) == {"declined": ["t1"]}


def test_a_stored_allowance_is_private_and_written_whole(env: Env) -> None:
    env.keeper.set(env.hosted, env.document(Ceiling(Scope.TASK, 5000)))
    stored = env.keeper.directory / f"{env.hosted.agent_id}.json"
    assert stored.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in env.keeper.directory.iterdir()] == [stored.name]  # no temporary left beside it
