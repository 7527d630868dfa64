"""The Economics extension on the node (meshnode.node.commerce): SKUs built from
what a plugin declares, the manifest and storefront members, the agreement
store, and the §19.5 admission check."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest

from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.cli import agreements as cli_agreements
from meshnode.cli import build_parser
from meshnode.daemon import agreements as agreements_methods
from meshnode.node import usage_log
from meshnode.node.commerce import (
    AgreementGate,
    AgreementStore,
    declared_skus,
    default_sku_id,
)
from meshnode.node.hosted import HostedAgent
from meshnode.node.manifests import build_manifest
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.usage_log import LogPosition, UsageLog
from meshnode.protocol.commerce import Sku, make_agreement, sku_digest
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing.waiting import eventually_async
from tests.fakes import FakeConnection

NOW = 1_800_000_000_000
FLAT = {"model": "flat", "currency": "USD", "amount_micro": 2000}


class Shop(Agent):
    skus: ClassVar[list[dict[str, Any]]] = [
        {"sku": "all-in", "covers": {"agent": True}, "price": {"model": "free"},
         "provider": {"id": "internal", "terms_url": "https://t.example/v1"}},
    ]

    @offering("Summarize.Text", price=FLAT)
    async def summarize(self, ctx: Context, input: Any) -> Any:
        return "s"

    @offering("secret", price=FLAT, sku="hidden", advertise=False)
    async def secret(self, ctx: Context, input: Any) -> Any:
        return "x"

    @offering("free")
    async def free(self, ctx: Context, input: Any) -> Any:
        return "f"


class Caller(Agent):
    @offering("noop")
    async def noop(self, ctx: Context, input: Any) -> Any:
        return None


def _env(requester: HostedAgent, request_id: str = "r1") -> dict[str, Any]:
    return {"from": requester.agent_id, "id": request_id}


def _host(node: Node, name: str, agent: Agent) -> HostedAgent:
    key = KeyPair.generate()
    hosted = HostedAgent(node, name=name, kind="test", agent=agent, key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    node.agents[name] = hosted
    node.by_id[hosted.agent_id] = hosted
    hosted.manifest = build_manifest(hosted, {"id": node.node_id}, 65536)
    return hosted


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Node, HostedAgent, HostedAgent, AgreementGate]:
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=FakeConnection().as_connection(), clock=lambda: NOW)
    gate = AgreementGate(AgreementStore(tmp_path / "agreements.json"),
                         approval_surface="https://approve.example/ui", gate_free_terms=False)
    node.commerce = gate
    return node, _host(node, "shop", Shop("shop", AgentSettings())), _host(node, "caller", Caller("caller", AgentSettings())), gate


def test_a_priced_offering_becomes_a_sku_with_the_node_computed_digest() -> None:
    assert default_sku_id("Summarize.Text") == "summarize-text"
    skus = {s.sku: s for s in declared_skus(Shop.skus, Shop.offerings().values())}
    assert set(skus) == {"all-in", "summarize-text", "hidden"}
    sku = skus["summarize-text"]
    assert sku.to_object() == {"sku": "summarize-text", "covers": {"offerings": ["Summarize.Text"]},
                               "price": FLAT, "provider": {"id": "internal"}}
    assert sku.digest == sku_digest(sku.to_object())
    assert sku.is_paid and not skus["all-in"].is_paid


def test_a_malformed_price_is_refused_naming_the_member() -> None:
    class Bad(Agent):
        @offering("x", price={"model": "flat", "currency": "usd", "amount_micro": 1})
        async def x(self, ctx: Context, input: Any) -> Any:
            return None

    with pytest.raises(ProtocolError) as info:
        declared_skus((), Bad.offerings().values())
    assert info.value.code == "INVALID_MANIFEST"
    # Named as the author wrote it (a priced offering, not an index into skus).
    assert info.value.details["member"] == '@offering("x") price.currency'
    assert info.value.message.startswith('@offering("x") price.currency: ')

    class BadWhole(Agent):
        skus: ClassVar[list[dict[str, Any]]] = [
            {"sku": "w", "covers": {"agent": True}, "price": {"model": "flat", "currency": "usd", "amount_micro": 1}},
        ]

    with pytest.raises(ProtocolError) as info:
        declared_skus(BadWhole.skus, BadWhole.offerings().values())
    assert str(info.value.details["member"]).startswith("skus[0].")


def test_manifest_carries_the_skus_and_the_storefront_their_terms(setup: Any) -> None:
    _, shop, _, _ = setup
    manifest = shop.manifest
    assert [s["sku"] for s in manifest["skus"]] == ["all-in", "summarize-text", "hidden"]
    public = {s["sku"]: s for s in manifest["public"]["skus"]}
    # The unadvertised offering's SKU stays off the storefront; each entry is {sku, price, digest}.
    assert set(public) == {"all-in", "summarize-text"}
    by_id = {s.sku: s for s in shop.skus}
    assert public["summarize-text"] == {"sku": "summarize-text", "price": FLAT, "digest": by_id["summarize-text"].digest}


async def test_no_agreement_refuses_and_an_agreement_at_the_digest_admits(setup: Any) -> None:
    node, shop, caller, gate = setup
    with pytest.raises(ProtocolError) as info:
        await gate.check(shop, _env(caller), "Summarize.Text", NOW)
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    assert info.value.code == "AGREEMENT_REQUIRED"
    assert info.value.details == {"sku": "summarize-text", "sku_digest": sku.digest,
                                  "approval_url": "https://approve.example/ui?sku=summarize-text"}
    # The caller's owner is its node (§8.3): the node key signs.
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW - 1000))
    assert await gate.check(shop, _env(caller), "Summarize.Text", NOW) == sku
    # Another offering's SKU is not covered by it; a free one needs nothing.
    with pytest.raises(ProtocolError):
        await gate.check(shop, _env(caller), "secret", NOW)
    assert (await gate.check(shop, _env(caller), "free", NOW)).sku == "all-in"


async def test_a_flat_price_above_the_cost_ceiling_is_refused_with_the_price_as_estimate(setup: Any) -> None:
    # §19.3: with an agreement, a ceiling below the flat price (or in another
    # currency) is refused at admission with the price as the estimate; equal admits.
    node, shop, caller, gate = setup
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW - 1000))

    def env(amount: int, currency: str = "USD", request_id: str = "b") -> dict[str, Any]:
        return {**_env(caller, request_id), "budget": {"revision": 1, "cost_ceiling": {"amount_micro": amount, "currency": currency}}}

    for low in (env(1999, request_id="b1"), env(5000, "EUR", request_id="b2")):
        with pytest.raises(ProtocolError) as info:
            await gate.check(shop, low, "Summarize.Text", NOW)
        assert info.value.code == "BUDGET_INSUFFICIENT"
        assert info.value.details == {"estimate": {"amount_micro": 2000, "currency": "USD"}}
    assert await gate.check(shop, env(2000, request_id="b3"), "Summarize.Text", NOW) == sku
    assert await gate.check(shop, _env(caller, "b4"), "Summarize.Text", NOW) == sku  # no budget: admitted


async def test_another_owners_or_stale_or_revoked_agreement_does_not_admit(setup: Any, tmp_path: Path) -> None:
    node, shop, caller, gate = setup
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    stranger = KeyPair.generate()
    gate.store.add(make_agreement(stranger, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW))
    with pytest.raises(ProtocolError):
        await gate.check(shop, _env(caller), "Summarize.Text", NOW)
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW,
                                  expires_at_ms=NOW + 10))
    assert await gate.check(shop, _env(caller), "Summarize.Text", NOW + 5) == sku
    with pytest.raises(ProtocolError):
        await gate.check(shop, _env(caller), "Summarize.Text", NOW + 10)  # expired
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW))
    revoked = gate.store.revoke(sku=sku.sku, consumer_owner=node.node_id, seller_agent=None, now_ms=NOW + 1)
    assert [a.consumer_owner for a in revoked] == [node.node_id]
    assert await gate.check(shop, _env(caller), "Summarize.Text", NOW) == sku  # prospective
    with pytest.raises(ProtocolError):
        await gate.check(shop, _env(caller), "Summarize.Text", NOW + 1)


def test_the_store_accepts_only_the_owners_signature_and_survives_a_restart(setup: Any, tmp_path: Path) -> None:
    node, shop, _, gate = setup
    sku = shop.skus[1]
    doc = make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW)
    forged = dict(doc, consumer_owner=KeyPair.generate().public_key)
    with pytest.raises(ProtocolError) as info:
        gate.store.add(forged)
    assert info.value.code == "IDENTITY_MISMATCH"
    gate.store.add(doc)
    path = tmp_path / "agreements.json"
    assert (path.stat().st_mode & 0o777) == 0o600
    again = AgreementStore(path)
    assert [r.agreement.to_object() for r in again.records()] == [doc]
    # A record edited on disk no longer verifies: dropped, never enforced.
    raw = json.loads(path.read_text())
    raw["agreements"][0]["agreement"]["sku_digest"] = shop.skus[2].digest
    path.write_text(json.dumps(raw))
    assert AgreementStore(path).records() == []


async def test_no_approval_surface_still_refuses_and_says_which_key(tmp_path: Path, setup: Any) -> None:
    _, shop, caller, _ = setup
    gate = AgreementGate(AgreementStore(tmp_path / "other.json"), approval_surface=None, gate_free_terms=True)
    with pytest.raises(ProtocolError) as info:
        await gate.check(shop, _env(caller), "Summarize.Text", NOW)
    assert info.value.code == "AGREEMENT_REQUIRED"
    assert info.value.details["approval_url"] is None
    assert "[commerce] approval_url" in info.value.message
    # gate_free_terms: a free SKU with terms is a terms gate, its url the terms_url.
    with pytest.raises(ProtocolError) as info:
        await gate.check(shop, _env(caller), "free", NOW)
    assert info.value.details["approval_url"] == "https://t.example/v1"


async def test_recorded_usage_rates_deterministically_refusals_at_zero(setup: Any, tmp_path: Path) -> None:
    node, shop, caller, _ = setup
    usage = UsageLog(tmp_path / "usage.jsonl")
    gate = AgreementGate(AgreementStore(tmp_path / "a.json"), approval_surface="https://a.example",
                         gate_free_terms=False, usage=usage)
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    with pytest.raises(ProtocolError):
        await gate.check(shop, _env(caller, "r1"), "Summarize.Text", NOW)
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW))
    for rid in ("r2", "r3"):
        await gate.check(shop, _env(caller, rid), "Summarize.Text", NOW + 1)
        await gate.delivered(shop, _env(caller, rid), "Summarize.Text", NOW + 2)
    await gate.delivered(shop, _env(caller, "r3"), "Summarize.Text", NOW + 3)  # once only
    charges = usage.rate(gate.store.records())
    assert [(c.envelope_id, c.outcome.value, c.amount_micro) for c in charges] == [
        ("r1", "refused", 0), ("r2", "charged", 2000), ("r3", "charged", 2000)]
    assert [c.to_object() for c in usage.rate(gate.store.records())] == [c.to_object() for c in charges]
    # Each line carries the agreement that admitted it: the same charges without the store...
    assert [c.amount_micro for c in usage.rate([])] == [0, 2000, 2000]
    # ... and a line whose agreement no longer verifies rates to zero: no agreement, no charge.
    lines = [json.loads(line) for line in usage.path.read_text().splitlines()]
    for line in lines:
        if "agreement" in line:
            line["agreement"]["sku_digest"] = "A" * len(line["agreement"]["sku_digest"])
    usage.path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert {c.amount_micro for c in usage.rate([])} == {0}


def _recorded_sku(setup: Any, tmp_path: Path) -> tuple[Sku, int]:
    """The SKU the usage-log tests record under, and one record's size in the log."""
    node, shop, _, _ = setup
    sku: Sku = next(s for s in shop.skus if s.sku == "summarize-text")
    probe = UsageLog(tmp_path / "probe.jsonl")
    probe.append({"meter": "requests", "envelope_id": "r000"}, sku, node.node_id)
    return sku, probe.path.stat().st_size


async def test_the_usage_log_is_cut_into_segments_and_keeps_within_its_bound(
    setup: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """usage.jsonl grew for ever (~1.5 KB a priced call's event: ~1 MB a
    second on a busy seller). It is cut into segments of a sixteenth of
    ``[commerce] usage_log_max_bytes``, the oldest deleted past the bound
    (logged); what is kept reads in order, and 0 never deletes."""
    node, _, _, _ = setup
    sku, size = _recorded_sku(setup, tmp_path)
    usage = UsageLog(tmp_path / "usage.jsonl", max_bytes=16 * 4 * size, segments=16)  # 4 records a segment
    with caplog.at_level(logging.WARNING, logger="meshnode.commerce"):
        for i in range(100):
            usage.append({"meter": "requests", "envelope_id": f"r{i:03d}"}, sku, node.node_id)
    kept = usage.segments()
    assert kept[-1] == usage.path and all(p.stat().st_mode & 0o777 == 0o600 for p in kept)
    assert sum(p.stat().st_size for p in kept) <= usage.max_bytes
    ids = [r["event"]["envelope_id"] for r in usage.records()]
    assert ids == [f"r{i:03d}" for i in range(100 - len(ids), 100)] and 60 <= len(ids) < 100  # the latest, in order
    deleted = [r.getMessage() for r in caplog.records if "deleted its oldest segment" in r.getMessage()]
    assert deleted and "usage_log_max_bytes" in deleted[0] and "(4 record(s)" in deleted[0]

    unbounded = UsageLog(tmp_path / "all.jsonl", max_bytes=0)
    for i in range(100):
        unbounded.append({"meter": "requests", "envelope_id": f"r{i}"}, sku, node.node_id)
    assert unbounded.segments() == [unbounded.path] and len(unbounded.read()) == 100


async def test_a_read_of_the_usage_log_misses_no_segment_closed_while_it_reads(
    setup: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``usage --source local`` reads the log in a worker thread while the loop
    appends. A segment closed meanwhile (``usage.jsonl`` becoming
    ``usage.jsonl.N``) was left out whole: the read had listed the segments
    first and then opened the new, near-empty ``usage.jsonl``. A read is now
    always the log's first lines, in order, whenever the rotation falls."""
    node, _, _, _ = setup
    sku, size = _recorded_sku(setup, tmp_path)

    def fresh_log(name: str) -> tuple[UsageLog, list[str]]:
        usage = UsageLog(tmp_path / name, max_bytes=16 * 4 * size, segments=16)  # 4 records a segment
        written = [f"r{i:03d}" for i in range(10)]  # two closed segments and two lines in the current
        for envelope_id in written:
            usage.append({"meter": "requests", "envelope_id": envelope_id}, sku, node.node_id)
        return usage, written

    def fill_the_current_segment(usage: UsageLog, written: list[str]) -> None:
        """Appends until the current segment is closed and one line is in the next."""
        closed = len(usage.segments())
        while len(usage.segments()) == closed:
            written.append(f"r{len(written):03d}")
            usage.append({"meter": "requests", "envelope_id": written[-1]}, sku, node.node_id)

    # The rotation after the read listed the segments, before it opens the current one.
    usage, written = fresh_log("between.jsonl")
    reader = usage.records()
    assert next(reader)["event"]["envelope_id"] == "r000"
    fill_the_current_segment(usage, written)
    read = ["r000"] + [r["event"]["envelope_id"] for r in reader]
    assert read == written

    # The rotation after the current one is open: its lines are read from the file held.
    usage, written = fresh_log("after.jsonl")
    opened = Path.open

    def open_then_rotate(self: Path, *args: Any, **kwargs: Any) -> Any:
        handle = opened(self, *args, **kwargs)
        if self == usage.path and not rotated:
            rotated.append(self)
            fill_the_current_segment(usage, written)
        return handle

    rotated: list[Path] = []
    monkeypatch.setattr(Path, "open", open_then_rotate)
    read = [r["event"]["envelope_id"] for r in usage.records()]
    assert rotated and read == written[:len(read)] and len(read) >= 10  # a prefix, nothing skipped


async def test_a_place_in_the_usage_log_holds_across_rotation_and_a_torn_line(setup: Any, tmp_path: Path) -> None:
    """The meter outbox reads the log back from a place (segment, offset): the
    segment being written is numbered as it will be once closed, so a place
    taken before a rotation still names the same line after it. A line torn by
    a crash mid-write is ended before the next one is written (before, the
    next event's line was glued to it and both were unreadable)."""
    node, _, _, _ = setup
    sku, size = _recorded_sku(setup, tmp_path)
    usage = UsageLog(tmp_path / "usage.jsonl", max_bytes=16 * 4 * size, segments=16)  # 4 records a segment
    spans = [usage.append({"meter": "requests", "envelope_id": f"r{i:03d}"}, sku, node.node_id) for i in range(10)]
    assert [s.start.segment for s in spans] == [1] * 4 + [2] * 4 + [3] * 2 and spans[-1].end == usage.end()
    assert spans[4].start == LogPosition(2, 0) and spans[5].start == spans[4].end

    def ids_after(position: LogPosition) -> list[str | None]:
        return [r["event"]["envelope_id"] if r else None for _, r in usage.lines_after(position)]

    assert ids_after(spans[6].start) == ["r006", "r007", "r008", "r009"]
    assert [span for span, _ in usage.lines_after(spans[8].start)] == spans[8:]
    assert ids_after(usage.end()) == []
    assert usage.kept_from() == LogPosition(1, 0)

    # A crash mid-write: a line without its newline. A new process ends it before its first line.
    with usage.path.open("ab") as handle:
        handle.write(b'{"event": {"meter": "requ')
    assert ids_after(spans[9].end) == []  # not a line yet
    again = UsageLog(usage.path, max_bytes=usage.max_bytes, segments=16)
    span = again.append({"meter": "requests", "envelope_id": "r010"}, sku, node.node_id)
    assert span.start.segment == 3 and ids_after(spans[9].end) == [None, "r010"]
    assert [r["event"]["envelope_id"] for r in again.records()][-2:] == ["r009", "r010"]

    # The segment being written deleted by hand: the next line starts a segment of its own
    # number, so a place kept in the deleted one names none of its lines.
    again.path.unlink()
    span = again.append({"meter": "requests", "envelope_id": "r011"}, sku, node.node_id)
    assert span.start == LogPosition(4, 0)
    kept_in_the_deleted = LogPosition(3, span.end.offset - 1)
    assert [r["event"]["envelope_id"] if r else None for _, r in again.lines_after(kept_in_the_deleted)] == ["r011"]
    assert [r["event"]["envelope_id"] for r in again.records()][-2:] == ["r007", "r011"]
    for i in (12, 13, 14):  # segment 4 full: the next line closes it ...
        again.append({"meter": "requests", "envelope_id": f"r{i:03d}"}, sku, node.node_id)
    again.path.unlink()  # ... but it is gone by then: nothing to close, no error, a segment of its own
    span = again.append({"meter": "requests", "envelope_id": "r015"}, sku, node.node_id)
    assert span.start == LogPosition(5, 0) and not again.path.with_name("usage.jsonl.4").exists()


async def test_the_usage_log_makes_its_directory_once_and_reads_back_what_it_wrote(
    setup: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append is one open, write and close: the directory is made only when
    it is missing (a mkdir an event was ~40 µs), the line is orjson's (~10x
    json.dumps), and it reads back as written, non-ASCII included."""
    node, shop, _, _ = setup
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    made: list[Path] = []
    mkdir = Path.mkdir

    def counted(self: Path, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("parents"):  # the call made (pathlib retries within it without parents)
            made.append(self)
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", counted)
    usage = UsageLog(tmp_path / "made" / "here" / "usage.jsonl")
    usage.append({"meter": "requests", "envelope_id": "r1", "note": "naïve ✓"}, sku, node.node_id,
                 {"interaction": "r1", "cost_ceiling": None})
    usage.append({"meter": "requests", "envelope_id": "r2"}, sku, None)
    assert usage.path.parent.stat().st_mode & 0o777 == 0o700 and usage.path.stat().st_mode & 0o777 == 0o600
    first, second = usage.read()
    assert first == {"event": {"meter": "requests", "envelope_id": "r1", "note": "naïve ✓"},
                     "sku": sku.to_object(), "consumer_owner": node.node_id, "interaction": "r1"}
    assert second["consumer_owner"] is None and "interaction" not in second
    assert made.count(usage.path.parent) == 1


async def test_a_large_deleted_usage_segment_is_counted_off_the_event_loop(
    setup: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting a deleted segment's records reads all of it (64 MiB by default,
    20-50 ms): on the loop that held every request of the node. Past
    ``_COUNT_INLINE_BYTES`` (here 0) it is counted in the loop's executor; the
    segment is gone at once, the WARNING with its count comes from there."""
    monkeypatch.setattr(usage_log, "_COUNT_INLINE_BYTES", 0)
    node, _, _, _ = setup
    sku, size = _recorded_sku(setup, tmp_path)
    usage = UsageLog(tmp_path / "usage.jsonl", max_bytes=4 * 3 * size, segments=4)  # 3 records a segment
    with caplog.at_level(logging.WARNING, logger="meshnode.commerce"):
        for i in range(20):
            usage.append({"meter": "requests", "envelope_id": f"r{i:03d}"}, sku, node.node_id)
        assert sum(p.stat().st_size for p in usage.segments()) <= usage.max_bytes  # deleted inline

        def deleted() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "deleted its oldest segment" in r.getMessage()]

        await eventually_async(lambda: len(deleted()) >= 2, what="the deleted segments' WARNINGs")
    assert all("(3 record(s)" in r.getMessage() and r.threadName != "MainThread" for r in deleted())


def test_agreements_sign_refuses_an_unwritable_out_before_signing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `sign` registers with the platform: an --out it cannot write must stop it
    # before anything is signed (exit 73, naming the path), not traceback after.
    def no_admin(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("signed although --out cannot be written")

    monkeypatch.setattr(cli_agreements, "_admin", no_admin)
    out = tmp_path / "missing-dir" / "agreement.json"
    args = build_parser().parse_args(["agreements", "sign", "summarizer", "--out", str(out)])
    assert args.handler(args) == 73
    assert f"--out {out}" in capsys.readouterr().err


def test_a_price_on_an_observed_meter_not_produced_is_warned_at_start(
    setup: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node = setup[0]

    class ByTheByte(Agent):
        @offering("dump", price={"model": "per_unit", "currency": "USD", "meter": "bytes_out", "amount_micro": 1})
        async def dump(self, ctx: Context, input: Any) -> Any:
            return "x"

    with caplog.at_level(logging.WARNING):
        _host(node, "bytes", ByTheByte("bytes", AgentSettings()))
    assert "observed meter 'bytes_out'" in caplog.text and "rate nothing" in caplog.text, caplog.text


async def test_a_local_usage_read_rates_the_log_once_for_all_its_pages(
    setup: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``meshnode usage --source local`` reads its answer in pages, and every
    page rated the whole log again (a full log: hundreds of pages of ~30 s).
    Later pages (``as_of`` the first's count) are answered from the first
    page's view; a new first page, another agreement or a deleted oldest
    segment rates anew; the view goes once no page asked for it a while."""
    node, shop, caller, _ = setup
    sku = next(s for s in shop.skus if s.sku == "summarize-text")
    gate = AgreementGate(AgreementStore(tmp_path / "a.json"), approval_surface="https://a.example",
                         gate_free_terms=False, usage=UsageLog(tmp_path / "usage.jsonl"))
    gate.store.add(make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW))

    async def serve(request_id: str, at: int) -> None:
        env = _env(caller, request_id)
        await gate.check(shop, env, "Summarize.Text", at)
        await gate.delivered(shop, env, "Summarize.Text", at + 1)

    await serve("r00", NOW + 1)
    assert gate.usage is not None
    line = gate.usage.path.stat().st_size  # one line's bytes (the ids keep every line this long)
    gate.usage.max_bytes, gate.usage.segment_bytes = 160 * line, 20 * line  # 8 segments of 20 lines
    for i in range(1, 30):
        await serve(f"r{i:02d}", NOW + 1)
    rated: list[int] = []
    rate = UsageLog.rate

    def counted(log: UsageLog, agreements: Any) -> Any:
        lines = rate(log, agreements)
        rated.append(len(lines))
        return lines

    monkeypatch.setattr(UsageLog, "rate", counted)
    methods = agreements_methods._AgreementMethods(cast(Any, SimpleNamespace(node=SimpleNamespace(commerce=gate))))
    call = cast(Any, None)

    async def read_all() -> list[dict[str, Any]]:
        first = await methods.usage({"source": "local", "charges_bytes": 1024}, call)
        charges, following = list(first["charges"]), first["charges_next"]
        while following is not None:
            page = await methods.usage({"source": "local", "charges_bytes": 1024, "charges_offset": following,
                                        "as_of": first["events"]}, call)
            charges += page["charges"]
            following = page["charges_next"]
        return charges

    charges = await read_all()
    assert len(charges) == 30 and rated == [30]  # several pages, one rating
    assert [c["amount_micro"] for c in charges] == [2000] * 30
    assert await read_all() == charges and rated == [30, 30]  # a new read: rated anew, once

    # The log grows between two pages: the later page answers for the first page's lines, from its view.
    first = await methods.usage({"source": "local", "charges_bytes": 1024}, call)
    await serve("r30", NOW + 3)
    later = await methods.usage({"source": "local", "charges_bytes": 1024, "charges_offset": first["charges_next"],
                                 "as_of": first["events"]}, call)
    assert later["events"] == first["events"] == 30 and rated == [30, 30, 30]
    # Another agreement held: the fold may differ from its first line on, so it is rated anew.
    gate.store.add(make_agreement(KeyPair.generate(), seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW))
    await methods.usage({"source": "local", "charges_bytes": 1024, "charges_offset": first["charges_next"],
                         "as_of": first["events"]}, call)
    assert rated == [30, 30, 30, 31]
    # The oldest segment deleted (the log past its bound): rated anew as well.
    first = await methods.usage({"source": "local", "charges_bytes": 1024}, call)
    oldest = gate.usage.segments()[0]
    for i in range(31, 180):
        await serve(f"r{i:02d}", NOW + 5)
    assert gate.usage.segments()[0] != oldest
    await methods.usage({"source": "local", "charges_bytes": 1024, "charges_offset": first["charges_next"],
                         "as_of": first["events"]}, call)
    assert len(rated) == 6
    # Nobody asks for a while: the view (every line) is let go.
    assert methods._local is not None
    methods._local.expires = 0.0
    methods._expire_local()
    assert methods._local is None
