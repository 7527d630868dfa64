"""Usage reports and the rating ledger (meshnode.node.commerce metering,
meshnode.services.rating.Ledger): what the seller's node publishes for a
priced offering, and the pure fold of those envelopes into charges (§13.5, §19.6)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, cast

import orjson
import pytest

from meshnode.a2a.charges import Charge as A2ACharge
from meshnode.a2a.charges import charge_event
from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.node.commerce import AgreementGate, AgreementStore
from meshnode.node.context import AgentContext
from meshnode.node.hosted import HostedAgent
from meshnode.node.manifests import build_manifest
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.usage_log import LogSpan, UsageLog
from meshnode.protocol.commerce import Charge, ChargeOutcome, ParsedOnce, make_agreement
from meshnode.protocol.envelope import IdGenerator, build_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.rating import (
    Ledger,
    LedgerView,
    PageRequest,
    PageRequestError,
    ledger_view,
    line_filter,
    page_request,
)
from tests.fakes import FakeConnection

NOW = 1_800_000_000_000
PER_TOKEN = {"model": "per_unit", "currency": "USD", "meter": "tokens_out", "amount_micro": 3}
PACKAGE = {"model": "package", "currency": "USD", "meter": "tool_calls", "size": 10, "amount_micro": 500,
           "period": "month"}


class Shop(Agent):
    skus: ClassVar[list[dict[str, Any]]] = []

    @offering("generate", price=PER_TOKEN)
    async def generate(self, ctx: Context, input: Any) -> Any:
        return None

    @offering("tools", price=PACKAGE)
    async def tools(self, ctx: Context, input: Any) -> Any:
        return None


class Caller(Agent):
    @offering("noop")
    async def noop(self, ctx: Context, input: Any) -> Any:
        return None


def _host(node: Node, name: str, agent: Agent) -> HostedAgent:
    key = KeyPair.generate()
    hosted = HostedAgent(node, name=name, kind="test", agent=agent, key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    node.agents[name] = hosted
    node.by_id[hosted.agent_id] = hosted
    hosted.manifest = build_manifest(hosted, {"id": node.node_id}, 65536)
    return hosted


class Published:
    """What the gate's publisher was handed: the signed emits a real node sends."""

    def __init__(self) -> None:
        self.envelopes: list[dict[str, Any]] = []
        self.ids = IdGenerator()

    async def __call__(self, hosted: HostedAgent, data: Mapping[str, Any], event_type: str = "usage", *,
                       span: LogSpan | None = None) -> None:
        env = build_envelope("emit", hosted.agent_id, now_ms=NOW, ids=self.ids,
                             payload={"domain": "metering", "event_type": event_type, "data": dict(data)})
        self.envelopes.append(sign_envelope(env, hosted.key))


@pytest.fixture
def shop(tmp_path: Path) -> tuple[Node, HostedAgent, HostedAgent, AgreementGate, Published]:
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=FakeConnection().as_connection(), clock=lambda: NOW)
    published = Published()
    gate = AgreementGate(AgreementStore(tmp_path / "agreements.json"), approval_surface="https://a.example",
                         gate_free_terms=False, usage=UsageLog(tmp_path / "usage.jsonl"), publisher=published)
    node.commerce = gate
    seller = _host(node, "shop", Shop("shop", AgentSettings()))
    buyer = _host(node, "caller", Caller("caller", AgentSettings()))
    return node, seller, buyer, gate, published


def _request(buyer: HostedAgent, rid: str, ceiling: int | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {"from": buyer.agent_id, "id": rid}
    if ceiling is not None:
        env["budget"] = {"revision": 1, "cost_ceiling": {"amount_micro": ceiling, "currency": "USD"}}
    return env


async def _serve(gate: AgreementGate, seller: HostedAgent, env: dict[str, Any], offering: str,
                 usage: list[dict[str, Any]]) -> None:
    await gate.check(seller, env, offering, NOW)
    await gate.delivered(seller, env, offering, NOW + 1, usage=usage, receipt_id=f"resp-{env['id']}")


def _agree(node: Node, gate: AgreementGate, seller: HostedAgent, sku_id: str) -> None:
    sku = next(s for s in seller.skus if s.sku == sku_id)
    gate.store.add(make_agreement(node.key, seller_agent=seller.agent_id, sku=sku, agreed_at_ms=NOW - 1))


def _fold(envelopes: list[dict[str, Any]]) -> Ledger:
    ledger = Ledger()
    for env in envelopes:
        ledger.fold(env)
    return ledger


async def test_report_usage_is_cumulative_and_refuses_observed_or_bad_meters(shop: Any) -> None:
    _, seller, _, _, _ = shop
    ctx = AgentContext(seller, envelope={"from": "x", "id": "r"})
    await ctx.report_usage("tokens_out", 10)
    await ctx.report_usage("tokens_out", 25)  # supersedes: the running total
    await ctx.report_usage("tool_calls", 0)
    assert ctx.usage_report == [{"meter": "tokens_out", "quantity": 25}, {"meter": "tool_calls", "quantity": 0}]
    for meter, quantity in (("requests", 1), ("Tokens", 1), ("tokens_out", -1), ("tokens_out", 1.5), (None, 3)):
        with pytest.raises(ValueError, match="report_usage"):
            await ctx.report_usage(meter, cast(int, quantity))


async def test_declared_usage_is_published_with_what_rating_needs(shop: Any) -> None:
    node, seller, buyer, gate, published = shop
    _agree(node, gate, seller, "generate")
    await _serve(gate, seller, _request(buyer, "r1", ceiling=900), "generate", [{"meter": "tokens_out", "quantity": 400}])
    requests, tokens = (env["payload"]["data"] for env in published.envelopes)
    assert (requests["meter"], requests["class"], requests["envelope_id"]) == ("requests", "observed", "r1")
    assert (tokens["meter"], tokens["class"], tokens["quantity"], tokens["envelope_id"]) == (
        "tokens_out", "declared", 400, "resp-r1")
    rating = tokens["rating"]
    assert rating["consumer_owner"] == node.node_id and rating["interaction"] == "r1"
    assert rating["cost_ceiling"] == {"amount_micro": 900, "currency": "USD"}
    assert rating["agreement"]["sku"] == "generate" and rating["sku"]["price"] == PER_TOKEN
    # The node's own log holds the same events and rates them the same way.
    local = gate.usage.rate(gate.store.records())
    assert [(c.meter, c.amount_micro) for c in local] == [("requests", 0), ("tokens_out", 900)]


async def test_the_fold_charges_replays_identically_and_clamps_at_the_ceiling(shop: Any) -> None:
    node, seller, buyer, gate, published = shop
    _agree(node, gate, seller, "generate")
    _agree(node, gate, seller, "tools")
    await _serve(gate, seller, _request(buyer, "r1"), "generate", [{"meter": "tokens_out", "quantity": 1001}])
    await _serve(gate, seller, _request(buyer, "r2", ceiling=1000), "generate", [{"meter": "tokens_out", "quantity": 500}])
    for rid, calls in (("r3", 4), ("r4", 7)):  # package of 10: 4 + 7 = 11 calls = two packages
        await _serve(gate, seller, _request(buyer, rid), "tools", [{"meter": "tool_calls", "quantity": calls}])
    ledger = _fold(published.envelopes)
    rated = [(c.meter, c.outcome.value, c.amount_micro, c.computed_micro) for c in ledger.lines]
    assert rated == [
        ("requests", "unrated_meter", 0, 0), ("tokens_out", "charged", 3003, 3003),
        ("requests", "unrated_meter", 0, 0), ("tokens_out", "clamped", 1000, 1500),
        ("requests", "unrated_meter", 0, 0), ("tool_calls", "charged", 500, 500),
        ("requests", "unrated_meter", 0, 0), ("tool_calls", "charged", 500, 500),
    ]
    # Replay: a fresh fold of the same envelopes, the same lines to the micro-unit.
    assert [c.to_object() for c in _fold(published.envelopes).lines] == [c.to_object() for c in ledger.lines]
    # Redelivered (the same deriving envelope): not charged twice.
    assert ledger.fold(published.envelopes[1]) is None and len(ledger.lines) == 8
    view = ledger_view(ledger.lines)
    assert [(t["consumer_owner"], t["seller_agent"], t["amount_micro"]) for t in view["totals"]] == [
        (node.node_id, seller.agent_id, 5003)]
    assert ledger_view(ledger.lines, period="1999")["charges"] == []

    # Pages: within half the budget, in ledger order, the totals over every line; none without charges.
    whole = [c.to_object() for c in ledger.lines]
    one_line = len(orjson.dumps(whole[1])) + 1
    paged: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        page = ledger_view(ledger.lines, page=PageRequest(charges_offset=offset), budget=4 * one_line)
        assert 1 <= len(page["charges"]) <= 2 and page["events"] == 8 and page["totals"] == view["totals"]
        paged.extend(page["charges"])
        offset = page["charges_next"]
    assert paged == whole
    brief = ledger_view(ledger.lines, page=PageRequest(charges=False))
    assert (brief["events"], brief["charges"], brief["charges_next"], brief["totals"]) == (8, [], None, view["totals"])

    # Kept up to date as the ledger grows: the same answer as one over every line.
    growing = LedgerView(line_filter(seller=seller.agent_id))
    growing.update(ledger.lines[:3])
    assert growing.answer()["events"] == 3
    growing.update(ledger.lines)
    assert growing.answer() == ledger_view(ledger.lines, seller=seller.agent_id)


async def test_the_ledger_lets_go_of_the_lines_whose_events_the_stream_discarded(shop: Any) -> None:
    """The ledger holds what the stream holds: lines of events stored before
    the stream's first message go, with their duplicate keys, and a replay of
    the events still held gives the very same lines."""
    node, seller, buyer, gate, published = shop
    _agree(node, gate, seller, "generate")
    for rid in ("r1", "r2", "r3"):
        await _serve(gate, seller, _request(buyer, rid, ceiling=10**6), "generate",
                     [{"meter": "tokens_out", "quantity": 10}])
    charge = A2ACharge(peer="weather", task_key="task:t1", message_id="m1", task_id="t1", agent=buyer.agent_id,
                       execution_id="e1", mesh=True, report="verified", reported_spend="0.3",
                       contract_price="0.10", charged="0.3", currency="USD", charged_at_ms=NOW)
    await published(buyer, charge_event(charge, node.node_id), "a2a_charge")
    ledger = Ledger()
    seqs = [10 * (i + 1) for i in range(len(published.envelopes))]  # other events in between
    for env, seq in zip(published.envelopes, seqs, strict=True):
        ledger.fold(env, seq)
    assert ledger.seqs == seqs and ledger.held_before(31) == 3 and ledger.held_before(70) == 6
    remembered = ledger.state_size()

    assert ledger.forget_before(31) == 3 and ledger.dropped == 3 and ledger.seqs == seqs[3:]
    replay = Ledger()
    for env, seq in zip(published.envelopes[3:], seqs[3:], strict=True):
        replay.fold(env, seq)
    assert ledger.lines == replay.lines and ledger.state_size() < remembered
    assert ledger.fold(published.envelopes[4], 80) is None, "a held line's event is still a duplicate"
    assert ledger.fold(published.envelopes[0], 80) is not None, "a forgotten one rates as new"

    held = len(ledger.lines)
    assert ledger.forget_before(10**6) == held and ledger.dropped == 3 + held
    assert ledger.lines == [] and ledger.state_size() == 0
    assert ledger.fold(published.envelopes[6], 10**6) is not None, "the A2A charge's key went with its line"


def _lines_of_many_owners(count: int) -> list[Charge]:
    """``count`` charged lines, each of another consumer owner: one totals row each."""
    return [
        Charge(f"E{i:025d}", "tokens_out", 10, "sku-x", "sha256:" + "a" * 64, f"U{i:055d}", "U" + "C" * 55, 30,
               "USD", ChargeOutcome.CHARGED, 30, f"I{i:025d}", NOW + i)
        for i in range(count)
    ]


def test_the_totals_page_too_and_later_pages_answer_for_the_first_ones_lines() -> None:
    """A seller with many customers has as many totals rows: they page like
    the lines. A ledger that grows between pages does not mix states: with
    ``as_of`` (the first page's ``events``) every page answers for those lines."""
    lines = _lines_of_many_owners(40)
    view = LedgerView(line_filter())
    view.update(lines[:30])
    first = view.answer(budget=3000)
    assert first["events"] == 30 and first["totals_next"] is not None and first["charges_next"] is not None
    view.update(lines)  # ten more rated meanwhile
    charges, totals = list(first["charges"]), list(first["totals"])
    following = (first["charges_next"], first["totals_next"])
    while following != (None, None):
        at_charges, at_totals = following
        page = view.answer(PageRequest(charges=at_charges is not None, charges_offset=at_charges or 0,
                                       totals_offset=len(totals) if at_totals is None else at_totals, as_of=30),
                           budget=3000)
        assert page["events"] == 30
        if at_charges is not None:
            charges.extend(page["charges"])
        if at_totals is not None:
            totals.extend(page["totals"])
        following = (page["charges_next"] if at_charges is not None else None,
                     page["totals_next"] if at_totals is not None else None)
    snapshot = ledger_view(lines[:30])
    assert charges == snapshot["charges"] and totals == snapshot["totals"] and len(totals) == 30


def test_usage_reads_every_page_as_of_its_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``meshnode usage --json`` reads the lines and the totals page by page,
    while the ledger grows, and shows what its first page counted."""
    from meshnode.cli import agreements as cli

    lines = _lines_of_many_owners(50)
    view = LedgerView(line_filter())
    view.update(lines[:20])
    asked: list[dict[str, Any]] = []

    def admin(args: object, method: str, params: dict[str, Any], **options: Any) -> tuple[int, dict[str, Any]]:
        # A page may take long: from the node's own log the first rates it whole.
        assert options == {"timeout": cli._USAGE_TIMEOUT_S} and cli._USAGE_TIMEOUT_S >= 300
        asked.append(params)
        answer = view.answer(page_request(params), budget=2500)
        view.update(lines[: 20 + 5 * len(asked)])  # rated meanwhile
        return 0, answer

    monkeypatch.setattr(cli, "_admin", admin)
    code, result = cli._usage_pages(argparse.Namespace(), {"charges": True})
    snapshot = ledger_view(lines[:20])
    assert code == 0 and len(asked) > 2 and all(p.get("as_of") == 20 for p in asked[1:])
    assert result["charges"] == snapshot["charges"] and result["totals"] == snapshot["totals"]
    assert result["events"] == 20 and (result["charges_next"], result["totals_next"]) == (None, None)


def test_usage_starts_over_when_the_ledger_lets_lines_go_between_pages(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lines let go between two pages shift the offsets: the CLI sees the
    answer's ``ledger.dropped`` move, reads again, and gives up (EX_TEMPFAIL,
    saying why) only when that keeps happening."""
    from meshnode.cli import agreements as cli
    from meshnode.cli.exitcodes import EX_TEMPFAIL

    lines = _lines_of_many_owners(60)

    class Service:
        first = 0  # the oldest line held
        asked = 0
        let_go_at: ClassVar[set[int]] = {3}  # the requests before which it lets ten lines go

    def admin(args: object, method: str, params: dict[str, Any], **options: Any) -> tuple[int, dict[str, Any]]:
        Service.asked += 1
        if Service.asked in Service.let_go_at:
            Service.first += 10
        view = LedgerView(line_filter())
        view.update(lines[Service.first:])
        return 0, {**view.answer(page_request(params), budget=2500), "ledger": {"dropped": Service.first}}

    monkeypatch.setattr(cli, "_admin", admin)
    code, result = cli._usage_pages(argparse.Namespace(), {"charges": True})
    assert code == 0 and Service.asked > 4
    assert result["charges"] == ledger_view(lines[10:])["charges"] and result["events"] == 50
    assert result["totals"] == ledger_view(lines[10:])["totals"]

    Service.first, Service.asked, Service.let_go_at = 0, 0, {2, 4, 6, 8, 10}  # every read's second page
    code, result = cli._usage_pages(argparse.Namespace(), {"charges": True})
    assert (code, result, Service.asked) == (EX_TEMPFAIL, None, 10)
    assert "let lines go while it was read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("params", "member"),
    [({"charges": "yes"}, "charges"), ({"charges_offset": -1}, "charges_offset"),
     ({"charges_offset": 1.5}, "charges_offset"), ({"totals_offset": "2"}, "totals_offset"),
     ({"charges_bytes": 0}, "charges_bytes"), ({"as_of": -1}, "as_of")],
)
def test_a_malformed_page_request_names_its_member(params: dict[str, Any], member: str) -> None:
    with pytest.raises(PageRequestError) as refused:
        page_request(params)
    assert refused.value.member == member
    assert page_request({}) == PageRequest()
    assert page_request({"charges_offset": 3, "totals_offset": 1, "as_of": 0}) == PageRequest(
        charges_offset=3, totals_offset=1, as_of=0)


async def test_refusals_and_unagreed_or_forged_usage_rate_to_zero(shop: Any) -> None:
    node, seller, buyer, gate, published = shop
    with pytest.raises(ProtocolError):
        await gate.check(seller, _request(buyer, "r1"), "generate", NOW)
    assert _fold(published.envelopes).lines[0].outcome.value == "refused"

    # The seller claims an agreement its buyer's owner never signed: not believed.
    stranger = KeyPair.generate()
    sku = next(s for s in seller.skus if s.sku == "generate")
    forged = dict(make_agreement(stranger, seller_agent=seller.agent_id, sku=sku, agreed_at_ms=NOW - 1))
    forged["consumer_owner"] = node.node_id
    env = published.envelopes[0]
    data = dict(env["payload"]["data"])
    for key in ("refused", "refusal_code"):
        data.pop(key)
    data.update(meter="tokens_out", **{"class": "declared"}, quantity=100, envelope_id="x1")
    data["rating"] = {**data["rating"], "agreement": forged}
    await published(seller, data)
    # A meter event signed by someone other than its provider: refused outright.
    await published(buyer, {**data, "envelope_id": "x2"})
    ledger = _fold(published.envelopes)
    assert [(c.outcome.value, c.amount_micro) for c in ledger.lines] == [("refused", 0), ("no_agreement", 0)]
    assert ledger.stats["refused.agreement"] == 1 and ledger.stats["refused.event"] == 1


async def test_an_a2a_charge_is_a_ledger_line_once(shop: Any) -> None:
    node, _, buyer, _, published = shop
    charge = A2ACharge(peer="weather", task_key="task:t1", message_id="m1", task_id="t1", agent=buyer.agent_id,
                       execution_id="e1", mesh=True, report="verified", reported_spend="0.3",
                       contract_price="0.10", charged="0.3", currency="USD", charged_at_ms=NOW)
    await published(buyer, charge_event(charge, node.node_id), "a2a_charge")
    await published(buyer, charge_event(charge, node.node_id), "a2a_charge")  # recorded again: once
    other = KeyPair.generate()
    env = build_envelope("emit", other.public_key, now_ms=NOW, payload=published.envelopes[0]["payload"])
    published.envelopes.append(sign_envelope(env, other))  # somebody else stating the buyer's debt
    ledger = _fold(published.envelopes)
    assert [(c.sku, c.consumer_owner, c.amount_micro, c.currency) for c in ledger.lines] == [
        ("a2a:weather", node.node_id, 300_000, "USD")]
    assert ledger.stats["refused.a2a"] == 1


def test_documents_events_repeat_are_parsed_once_and_bad_ones_every_time() -> None:
    """Every meter event carries its SKU and its agreement: the fold parses
    (and signature-checks) each distinct document once (~60 % of its CPU
    before), keyed on the exact content, within a bound; a document that fails
    is never kept, so it is refused, and counted, every time."""
    calls: list[object] = []

    def parse(document: object) -> str:
        calls.append(document)
        if not isinstance(document, dict) or "bad" in document:
            raise ProtocolError("INVALID_ENVELOPE", "bad document")
        return f"parsed {document['n']}"

    once = ParsedOnce(parse, bound=2)
    assert [once({"n": 1, "z": [1, 2]}), once({"z": [1, 2], "n": 1})] == ["parsed 1"] * 2  # key order is not content
    assert once({"n": 1, "z": [1, 2, 3]}) == "parsed 1" and len(calls) == 2  # other content: parsed anew
    for _ in range(2):
        with pytest.raises(ProtocolError):
            once({"bad": True, "n": 0})
    assert len(calls) == 4
    once({"n": 1, "z": [1, 2]})  # a hit: now the most recently used of the two kept
    once({"n": 3})  # evicts the least recently used ({"n": 1, "z": [1, 2, 3]})
    assert len(calls) == 5
    once({"n": 1, "z": [1, 2]})
    once({"n": 1, "z": [1, 2, 3]})
    assert len(calls) == 6


async def test_a_forged_agreement_is_refused_by_every_event_that_carries_it(shop: Any) -> None:
    node, seller, buyer, gate, published = shop
    _agree(node, gate, seller, "generate")
    for rid in ("r1", "r2"):
        await _serve(gate, seller, _request(buyer, rid), "generate", [{"meter": "tokens_out", "quantity": 10}])
    stranger = KeyPair.generate()
    sku = next(s for s in seller.skus if s.sku == "generate")
    forged = dict(make_agreement(stranger, seller_agent=seller.agent_id, sku=sku, agreed_at_ms=NOW - 1))
    forged["consumer_owner"] = node.node_id  # claimed for the buyer's owner: the signature no longer covers it
    for n in range(3):
        data = dict(published.envelopes[1]["payload"]["data"])
        data.update(envelope_id=f"f{n}", rating={**data["rating"], "agreement": forged})
        await published(seller, data)
    ledger = _fold(published.envelopes)
    assert ledger.stats["refused.agreement"] == 3
    assert [(c.meter, c.amount_micro) for c in ledger.lines[:4]] == [
        ("requests", 0), ("tokens_out", 30), ("requests", 0), ("tokens_out", 30)]
