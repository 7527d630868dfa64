"""The owner allowance on the node (EXT-8; §7.7, §17.5, §19.3): held, metered, enforced.

The pure rules are :mod:`meshnode.protocol.allowance`; this module is the
node's side of them:

* :class:`SpendStore` persists the metered spend (SQLite, 0600, in the data
  directory) so a restart forgives nothing: the day's spend is still the day's.
* :class:`AllowanceKeeper` holds each agent's document (set by the owner
  through the admin socket, stored 0600 atomically in ``allowances/``, or
  named by ``[agents.X] allowance_file``), meters what the agent reports, and
  enforces it:

  - at admission (:meth:`AllowanceKeeper.admit`, in the §7.7/§22 slot): an
    estimate over the binding (smallest-remaining) ceiling is refused
    BUDGET_INSUFFICIENT with the estimate, before any work; with
    ``on_exhausted: ask_owner`` the request is accepted but held unstarted
    (a Task paused in ``input_required``) until the owner raises the ceiling
    or declines (then it ends refused, BUDGET_INSUFFICIENT);
  - mid-task (:meth:`AllowanceKeeper.report`, from ``ctx.report_usage`` and
    from ``payload.usage`` reports): spend that crosses a ceiling stops the
    work with BUDGET_EXHAUSTED (``refuse``) or pauses its Task (``ask_owner``,
    §7.7's pause) until the owner raises the ceiling.

  Every crossing emits ``mesh.event.agent.allowance_exceeded`` as the agent
  (the platform observes; it never blocks).

Whose signature counts (§8.6, EXT-8 §1, the fixture's README): EXT-8 binds
the signature to the document's own ``owner_key`` and nothing more, but the
allowance is the *owner's* ceiling on their own agent ("it guards the owner's
money"; "cross-agent allowances do not exist: constraining someone else's
agent is a contract, not a config"), and the fixture casts the signer as the
governed agent's owner. The node knows that owner: the manifest's ``owner``
when it names one and carries the ``owner_attestation`` §8.6 requires, else
the hosting node's key (§8.6 default ownership, which is what the registry
records). So a document whose ``owner_key`` is another key is refused
(IDENTITY_MISMATCH, ``wrong_owner``, naming both keys) and, loaded from a
file, fails closed. Since that refuses what EXT-8 alone would accept (an
owner who signs with a personal key the manifest does not name),
``[agents.X] allowance_any_owner = true`` turns the check off for that
agent, and the refusal says so.

A ``meshnode reload`` re-reads every ``allowance_file``
(:meth:`AllowanceKeeper.reload`): a changed file governs at once, a file
removed from the configuration no longer does, and a missing or invalid one
fails closed exactly as at start, logged naming the file (and, as at start,
a valid stored document governs over an invalid file); held work re-checks
against the result.

Why "crossing" is strict (spend > amount) mid-task: the node only learns of
spend after the fact, and the fixture's rule is that spending exactly what is
left is within the allowance (equality admits), so a report landing exactly
on a ceiling lets the work finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sqlite3
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.agent import OfferingSpec
from meshnode.node.private_db import prepare_private_db, tighten_side_files
from meshnode.protocol.allowance import (
    AllowanceInvalid,
    AllowancePolicy,
    Ceiling,
    CeilingStanding,
    OnExhausted,
    Scope,
    SpendEntry,
    SpendLedger,
    Verdict,
    binding_ceiling,
    day_of,
    load_allowance,
    verify_allowance,
)
from meshnode.protocol.budget import Money, budget_exhausted_error, budget_insufficient
from meshnode.protocol.envelope import child_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import is_meter_name
from meshnode.protocol.protections import sender_body
from meshnode.protocol.timeutil import format_ts
from meshnode.transport.files import write_private_file

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.tasks import ResponderTask

# A fail-closed document has no ceilings to report; this stands in for "all of them".
_FAIL_CLOSED = Ceiling(Scope.DAY, 0)

#: The currency of a quote when no cost model is readable at all (a document
#: too broken to read one): the refusal still needs a Money shape.
_FALLBACK_CURRENCY = "USD"

__all__ = [
    "ANY_OWNER_KEY",
    "EVENT_DOMAIN",
    "EVENT_TYPE",
    "AllowanceKeeper",
    "Hold",
    "SpendStore",
    "agent_owner",
    "describe_refusal",
    "estimate_of",
    "tokens_of_usage",
]

log = logging.getLogger("meshnode.allowance")

#: EXT-8 §3: the platform-visible flag, published as the governed agent.
EVENT_DOMAIN = "agent"
EVENT_TYPE = "allowance_exceeded"

#: Spend rows older than this many UTC days are not loaded at start (the day
#: ceiling needs today only; task and context sums need recent work).
_KEEP_DAYS = 35

#: Admission holds awaiting their handler's start, at most this many.
_PENDING_CAP = 10_000

#: The ``[agents.X]`` key that accepts documents signed by any owner key.
ANY_OWNER_KEY = "allowance_any_owner"


def agent_owner(hosted: HostedAgent) -> str:
    """The agent's owner as this node knows it (§8.6): the manifest's ``owner``
    when it is the hosting node or comes with an ``owner_attestation`` (the
    registry verifies it before storing), else the hosting node's key."""
    manifest = hosted.manifest
    owner = manifest.get("owner") if isinstance(manifest, Mapping) else None
    node_id = hosted.node.node_id
    if isinstance(owner, str) and (owner == node_id or isinstance(manifest.get("owner_attestation"), Mapping)):
        return owner
    return node_id


def tokens_of_usage(usage: Sequence[Mapping[str, Any]]) -> int:
    """The tokens in a §13.5 usage report: the sum of the quantities of its
    token meters (a meter name containing ``token``: ``tokens``,
    ``tokens_in``, ``tokens_out``, ...). The cost model converts tokens only."""
    total = 0
    for entry in usage:
        meter, quantity = entry.get("meter"), entry.get("quantity")
        if is_meter_name(meter) and "token" in str(meter) and type(quantity) is int and quantity >= 0:
            total += quantity
    return total


def estimate_of(spec: OfferingSpec, handler_input: Any, envelope: Mapping[str, Any]) -> dict[str, int]:
    """The offering's admission estimate as ``{"tokens": N}`` or ``{"cost_micro": N}``.

    ``@offering(allowance_estimate=...)`` declares it (a mapping, or a callable
    of the input returning one); undeclared, it is the sender text's length
    in characters / 4, rounded up, in tokens (the usual rough token count).
    Raises ValueError naming the declaration when it is malformed.
    """
    declared = spec.allowance_estimate
    if callable(declared):
        declared = declared(handler_input)
    if declared is None:
        body = sender_body(envelope)
        text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), default=str) if body is not None else ""
        return {"tokens": math.ceil(len(text) / 4)}
    if isinstance(declared, Mapping):
        for key in ("cost_micro", "tokens"):
            value = declared.get(key)
            if value is not None:
                if type(value) is not int or value < 0:
                    break
                return {key: value}
    raise ValueError(
        f"offering {spec.id!r}: allowance_estimate must be {{'tokens': N}} or {{'cost_micro': N}} "
        "with N a non-negative integer (or a callable of the input returning one)"
    )


class SpendStore:
    """The metered spend, one row per metered invocation, in SQLite (0600)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        prepare_private_db(path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # One small insert per usage report, on the event loop: no fsync per
        # commit (WAL + NORMAL loses at most the last rows on a power cut).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS spend (agent TEXT NOT NULL, task_id TEXT NOT NULL, context_id TEXT,"
            " day TEXT NOT NULL, tokens INTEGER, cost_micro INTEGER NOT NULL, at_ms INTEGER NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS spend_agent_day ON spend (agent, day)")
        tighten_side_files(path)

    def record(self, agent: str, entry: SpendEntry) -> None:
        self._db.execute(
            "INSERT INTO spend (agent, task_id, context_id, day, tokens, cost_micro, at_ms) VALUES (?,?,?,?,?,?,?)",
            (agent, entry.task_id, entry.context_id, entry.day, entry.tokens, entry.cost_micro, entry.at_ms),
        )

    def ledger(self, agent: str, now_ms: int) -> SpendLedger:
        """The agent's recent spend as the pure core's ledger."""
        since = day_of(now_ms - _KEEP_DAYS * 86_400_000)
        ledger = SpendLedger()
        rows = self._db.execute(
            "SELECT task_id, context_id, tokens, cost_micro, at_ms FROM spend WHERE agent = ? AND day >= ?"
            " ORDER BY rowid",
            (agent, since),
        )
        for task_id, context_id, tokens, cost_micro, at_ms in rows:
            ledger.record(task_id=task_id, context_id=context_id, at_ms=at_ms, cost_micro=cost_micro, tokens=tokens)
        return ledger

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.close()


@dataclass
class Hold:
    """Work held for the owner (``ask_owner``): at admission (unstarted) or
    mid-task (paused). Resolved True when a raised allowance lets it go on,
    False when the owner declines."""

    agent: str
    task_id: str
    context_id: str | None
    stage: str  # "admission" | "mid_task"
    estimate_micro: int
    since_ms: int
    scope: str | None
    waiter: asyncio.Future[bool] = field(repr=False)

    def to_object(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task_id": self.task_id, "stage": self.stage, "since": format_ts(self.since_ms),
                               "estimate_micro": self.estimate_micro}
        if self.context_id is not None:
            out["context_id"] = self.context_id
        if self.scope is not None:
            out["scope"] = self.scope
        return out


@dataclass
class _Held:
    """One agent's document as loaded, with where it came from."""

    policy: AllowancePolicy
    source: str
    errors: list[str] = field(default_factory=list)


def describe_refusal(exc: ProtocolError) -> str:
    """An allowance refusal in one line: the message, the member at fault and
    ``details.reason`` (``bad_signature``, ``wrong_owner``, ...)."""
    member = exc.details.get("member") if isinstance(exc.details, Mapping) else None
    reason = exc.details.get("reason") if isinstance(exc.details, Mapping) else None
    where = f" (member {member})" if member else ""
    return f"{exc.message}{where}" + (f" [{reason}]" if reason else "")


def _with_hint(exc: ProtocolError, agent_name: str) -> ProtocolError:
    """A ``wrong_owner`` refusal with the configurable path that accepts it."""
    if not (isinstance(exc.details, Mapping) and exc.details.get("reason") == AllowanceInvalid.WRONG_OWNER.value):
        return exc
    return ProtocolError(
        exc.code,
        f"{exc.message}; to accept allowances signed by another key, set [agents.{agent_name}] {ANY_OWNER_KEY} = true",
        dict(exc.details),
    )


class AllowanceKeeper:
    """Each hosted agent's allowance: document, spend, holds (module docstring)."""

    def __init__(
        self,
        directory: Path,
        spend: SpendStore,
        *,
        configured: Mapping[str, Path] | None = None,
        any_owner: Collection[str] = (),
        now_ms: Callable[[], int],
    ) -> None:
        #: Where ``allowance set`` keeps documents: ``<directory>/<agent id>.json``.
        self.directory = directory
        self.spend = spend
        #: ``[agents.X] allowance_file`` by agent name.
        self.configured: dict[str, Path] = dict(configured or {})
        #: Agent names whose documents may be signed by any owner key
        #: (``[agents.X] allowance_any_owner``; module docstring).
        self.any_owner: frozenset[str] = frozenset(any_owner)
        self.now_ms = now_ms
        self._held: dict[str, _Held | None] = {}
        self._ledgers: dict[str, SpendLedger] = {}
        # Cumulative token reports per (agent, task): a later report supersedes
        # an earlier one (§13.5), so only the growth is new spend.
        self._reported: dict[tuple[str, str], int] = {}
        # The key a request's spend is accounted under, fixed at its first
        # report: its Task's id, or the request id while it has none (a bare
        # request that opens a Task later keeps its spend in one place).
        self._keys: dict[tuple[str, str], str] = {}
        self.holds: dict[str, dict[str, Hold]] = {}
        # Admission holds waiting for their handler to start, by request id.
        self._pending: dict[tuple[str, str], Hold] = {}

    # -- documents ---------------------------------------------------------------

    def _stored_path(self, agent_id: str) -> Path:
        return self.directory / f"{agent_id}.json"

    def required_owner(self, hosted: HostedAgent) -> str | None:
        """The key an allowance of ``hosted`` must be signed by, or None when
        ``allowance_any_owner`` accepts any (module docstring)."""
        return None if hosted.name in self.any_owner else agent_owner(hosted)

    def _load_file(self, path: Path, hosted: HostedAgent, what: str) -> tuple[AllowancePolicy | None, str | None]:
        agent_id = hosted.agent_id
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            if what == "stored":
                return None, None
            return load_allowance(None, agent=agent_id), f"{what} {path}: no such file"
        except (OSError, ValueError) as exc:
            return load_allowance(None, agent=agent_id), f"{what} {path}: not readable JSON ({exc})"
        policy = load_allowance(doc, agent=agent_id, owner=self.required_owner(hosted))
        if policy.error is not None:
            return policy, f"{what} {path}: {describe_refusal(_with_hint(policy.error, hosted.name))}"
        return policy, None

    def held(self, hosted: HostedAgent) -> _Held | None:
        """The document that governs ``hosted`` now: of the stored one (``allowance
        set``) and the configured file, the valid one with the latest
        ``updated_at``; when neither verifies, the fail-closed policy (every
        ceiling exhausted) naming the file at fault; None when there is none."""
        agent_id = hosted.agent_id
        if agent_id in self._held:
            return self._held[agent_id]
        candidates: list[tuple[AllowancePolicy, str]] = []
        errors: list[str] = []
        stored = self._stored_path(agent_id)
        configured = self.configured.get(hosted.name)
        for path, what in ((stored, "stored"), (configured, "allowance_file")):
            if path is None:
                continue
            policy, error = self._load_file(path, hosted, what)
            if error is not None:
                errors.append(error)
                log.error("%s: the allowance fails closed (every ceiling exhausted): %s", hosted.name, error)
            if policy is not None:
                candidates.append((policy, f"{what} {path}"))
        valid = [(p, s) for p, s in candidates if p.allowance is not None]
        result: _Held | None
        if valid:
            policy, source = max(valid, key=lambda c: c[0].allowance.updated_at_ms if c[0].allowance else 0)
            result = _Held(policy, source, errors)
        elif candidates:
            result = _Held(candidates[0][0], candidates[0][1], errors)
        else:
            result = None
        self._held[agent_id] = result
        return result

    def policy(self, hosted: HostedAgent) -> AllowancePolicy | None:
        held = self.held(hosted)
        return held.policy if held is not None else None

    def set(self, hosted: HostedAgent, document: Mapping[str, Any]) -> _Held:
        """Keep ``document`` (verified: for this agent, signed by its owner
        unless ``allowance_any_owner``) as the stored allowance and let held
        work re-check. Raises ProtocolError naming the member at fault, or the
        signature / agent / owner mismatch (``details.reason``)."""
        try:
            verify_allowance(document, agent=hosted.agent_id, owner=self.required_owner(hosted))
        except ProtocolError as exc:
            raise _with_hint(exc, hosted.name) from None
        path = self._stored_path(hosted.agent_id)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_file(path, json.dumps(dict(document), indent=2) + "\n", replace=True)
        self._held.pop(hosted.agent_id, None)
        held = self.held(hosted)
        assert held is not None
        self._wake(hosted.agent_id)
        return held

    def reload(self, agents: Iterable[HostedAgent], *, configured: Mapping[str, Path],
               any_owner: Collection[str]) -> dict[str, dict[str, Any]]:
        """Take a reloaded configuration's ``allowance_file`` and
        ``allowance_any_owner`` keys: every agent's document is read again (a
        missing or invalid file fails closed and is logged naming it, as at
        start) and its held work re-checks. Returns, per agent name that has
        an allowance, ``{source, valid, errors}``."""
        self.configured = dict(configured)
        self.any_owner = frozenset(any_owner)
        out: dict[str, dict[str, Any]] = {}
        for hosted in agents:
            self._held.pop(hosted.agent_id, None)
            held = self.held(hosted)
            self._wake(hosted.agent_id)
            if held is not None:
                out[hosted.name] = {"source": held.source, "valid": held.policy.valid, "errors": list(held.errors)}
        return out

    def clear(self, hosted: HostedAgent) -> bool:
        """Remove the stored document (a configured file stays in force). True
        when there was one. Held work re-checks: with no allowance it goes on."""
        path = self._stored_path(hosted.agent_id)
        try:
            path.unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        self._held.pop(hosted.agent_id, None)
        self._wake(hosted.agent_id)
        return existed

    def decline(self, hosted: HostedAgent, task_id: str | None = None) -> list[str]:
        """The owner declines held work (all of the agent's, or one Task): it
        ends refused with BUDGET_INSUFFICIENT. Returns the task ids declined."""
        declined: list[str] = []
        for hold in list(self.holds.get(hosted.agent_id, {}).values()):
            if task_id is None or hold.task_id == task_id:
                if not hold.waiter.done():
                    hold.waiter.set_result(False)
                declined.append(hold.task_id)
        return declined

    def _wake(self, agent_id: str) -> None:
        for hold in self.holds.get(agent_id, {}).values():
            if not hold.waiter.done():
                hold.waiter.set_result(True)

    # -- spend ----------------------------------------------------------------------

    def ledger(self, hosted: HostedAgent) -> SpendLedger:
        ledger = self._ledgers.get(hosted.agent_id)
        if ledger is None:
            ledger = self._ledgers[hosted.agent_id] = self.spend.ledger(hosted.agent_id, self.now_ms())
        return ledger

    def _record(self, hosted: HostedAgent, task_id: str, context_id: str | None, *,
                tokens: int | None, cost_micro: int | None) -> SpendEntry | None:
        policy = self.policy(hosted)
        if policy is None:
            return None
        model = policy.cost_model
        if cost_micro is None and model is None:
            # Tokens and no readable cost model (a broken document): nothing to
            # convert with. Fail closed still refuses new work.
            return None
        entry = self.ledger(hosted).record(
            task_id=task_id, context_id=context_id, at_ms=self.now_ms(),
            cost_micro=cost_micro, tokens=tokens, cost_model=model,
        )
        try:
            self.spend.record(hosted.agent_id, entry)
        except sqlite3.Error as exc:
            # The books are kept in memory regardless; a lost row is logged, never a refusal.
            log.error("%s: spend not persisted: %s", self.spend.path, exc)
        return entry

    # -- admission ------------------------------------------------------------------

    async def admit(
        self, hosted: HostedAgent, env: Mapping[str, Any], spec: OfferingSpec, handler_input: Any
    ) -> None:
        """The §7.7 admission check under the agent's allowance (no document:
        nothing to check). Raises BUDGET_INSUFFICIENT with the estimate, or
        marks the request held for the owner (``ask_owner``), which
        :meth:`before_handler` then waits on."""
        policy = self.policy(hosted)
        if policy is None:
            return
        try:
            estimate = estimate_of(spec, handler_input, env)
        except ValueError as exc:
            hosted.agent.log.error("%s", exc)
            raise ProtocolError("INTERNAL_ERROR", "the agent's allowance estimate is malformed") from None
        model = policy.cost_model
        estimate_micro = estimate["cost_micro"] if "cost_micro" in estimate else (
            model.cost(estimate["tokens"]) if model is not None else 0
        )
        context_id = env.get("context_id") if isinstance(env.get("context_id"), str) else None
        now = self.now_ms()
        decision = policy.admit(self.ledger(hosted), estimate_micro=estimate_micro, task_id=None,
                                context_id=context_id, now_ms=now, currency=_FALLBACK_CURRENCY)
        if decision.admitted:
            return
        binding = decision.binding
        outcome = "held" if decision.verdict is Verdict.ASK_OWNER else "refused"
        await self._emit(hosted, env, stage="admission", outcome=outcome, policy=policy,
                         binding=binding, estimate=decision.estimate, task_id=None, context_id=context_id)
        if decision.verdict is Verdict.REFUSE:
            hosted.counters["allowance.refused"] += 1
            raise decision.refusal()
        loop = asyncio.get_running_loop()
        self._pending[(hosted.agent_id, str(env["id"]))] = Hold(
            hosted.agent_id, "", context_id, "admission", estimate_micro, now,
            binding.scope.value if binding is not None else None, loop.create_future(),
        )
        if len(self._pending) > _PENDING_CAP:
            # A held request refused later in admission (busy, the agent's own
            # hook) never reaches its handler: bounded, oldest first.
            self._pending.pop(next(iter(self._pending)))

    async def before_handler(self, hosted: HostedAgent, env: Mapping[str, Any],
                             open_task: Callable[[], Awaitable[ResponderTask]]) -> None:
        """Right before the handler of an accepted request: a request held at
        admission waits here, unstarted, in a Task paused ``input_required``
        (BUDGET_EXHAUSTED: nothing spent, the estimate to finish), until the
        owner raises the ceiling enough (then ``working`` and the handler runs)
        or declines (BUDGET_INSUFFICIENT with the estimate; the Task ends
        ``exhausted``)."""
        hold = self._pending.pop((hosted.agent_id, str(env["id"])), None)
        if hold is None:
            return
        task = await open_task()
        hold.task_id = task.task_id
        context_id = hold.context_id

        def fits() -> bool:
            policy = self.policy(hosted)
            if policy is None:
                return True
            return policy.admit(self.ledger(hosted), estimate_micro=hold.estimate_micro, task_id=task.task_id,
                                context_id=context_id, now_ms=self.now_ms(), currency=_FALLBACK_CURRENCY).admitted

        await self._pause(hosted, task, hold, fits, spent_micro=0)

    async def _pause(self, hosted: HostedAgent, task: ResponderTask, hold: Hold,
                     fits: Callable[[], bool], *, spent_micro: int) -> None:
        policy = self.policy(hosted)
        currency = policy.cost_model.currency if policy is not None and policy.cost_model is not None else _FALLBACK_CURRENCY
        spent, to_finish = Money(spent_micro, currency), Money(hold.estimate_micro, currency)
        agent_holds = self.holds.setdefault(hosted.agent_id, {})
        agent_holds[task.task_id] = hold
        hosted.counters["allowance.held"] += 1
        try:
            await task._send("input_required", error=budget_exhausted_error(spent, to_finish),
                             message="held: the owner's allowance is exhausted; waiting for the owner to raise it",
                             extra={"spent": spent.to_object()})
            while True:
                raised = await hold.waiter
                if not raised:
                    refusal = budget_insufficient(to_finish, "the owner declined to raise the allowance")
                    # The Task ends here (the handler never resumes); the
                    # raise unwinds the handler, whose failure then finds the
                    # Task already terminal.
                    await task._send("exhausted", error=refusal.to_object())
                    raise refusal
                if fits():
                    break
                hold.waiter = asyncio.get_running_loop().create_future()
            await task._send("working", message="the owner raised the allowance")
        finally:
            agent_holds.pop(task.task_id, None)

    # -- mid-task metering ------------------------------------------------------------

    async def report(
        self,
        hosted: HostedAgent,
        env: Mapping[str, Any],
        task: ResponderTask | None,
        open_task: Callable[[], Awaitable[ResponderTask]] | None,
        *,
        tokens: int | None = None,
        cost_micro: int | None = None,
        cumulative_tokens: int | None = None,
    ) -> None:
        """Meter usage the agent reports for the request ``env`` (its Task when
        it has one) and enforce the ceilings it crosses: raise BUDGET_EXHAUSTED
        (``refuse``) or pause the Task until the owner raises the allowance
        (``ask_owner``). ``cumulative_tokens`` is a ``payload.usage`` report's
        token total: only its growth since the last report is new spend."""
        policy = self.policy(hosted)
        if policy is None:
            return
        task_id = self._work_key(hosted, env, task)
        context_id = env.get("context_id") if isinstance(env.get("context_id"), str) else None
        if cumulative_tokens is not None:
            key = (hosted.agent_id, task_id)
            before = self._reported.get(key, 0)
            self._reported[key] = max(before, cumulative_tokens)
            if len(self._reported) > 10_000:
                self._reported.pop(next(iter(self._reported)))
            tokens = max(0, cumulative_tokens - before)
            if tokens == 0:
                return
        if tokens is None and cost_micro is None:
            return
        self._record(hosted, task_id, context_id, tokens=tokens, cost_micro=cost_micro)
        crossed = self._crossed(hosted, policy, task_id, context_id)
        if crossed is None:
            return
        currency = policy.cost_model.currency if policy.cost_model is not None else _FALLBACK_CURRENCY
        await self._emit(hosted, env, stage="mid_task",
                         outcome="paused" if policy.on_exhausted is OnExhausted.ASK_OWNER else "stopped",
                         policy=policy, binding=crossed if policy.valid else None, estimate=None,
                         task_id=task_id, context_id=context_id)
        if policy.on_exhausted is OnExhausted.REFUSE:
            hosted.counters["allowance.stopped"] += 1
            task_spent = self.ledger(hosted).by_task.get(task_id, 0)
            raise ProtocolError(
                "BUDGET_EXHAUSTED",
                "the owner's allowance was reached mid-work; the work stopped",
                {"spent": Money(task_spent, currency).to_object(),
                 "estimate_to_finish": Money(0, currency).to_object()},
            )
        if task is None:
            assert open_task is not None
            task = await open_task()
        hold = Hold(hosted.agent_id, task.task_id, context_id, "mid_task", 0, self.now_ms(),
                    crossed.scope.value if policy.valid else None, asyncio.get_running_loop().create_future())

        def fits() -> bool:
            now_policy = self.policy(hosted)
            return now_policy is None or self._crossed(hosted, now_policy, task_id, context_id) is None

        await self._pause(hosted, task, hold, fits, spent_micro=self.ledger(hosted).by_task.get(task_id, 0))

    def _work_key(self, hosted: HostedAgent, env: Mapping[str, Any], task: ResponderTask | None) -> str:
        request = (hosted.agent_id, str(env["id"]))
        key = self._keys.get(request)
        if key is None:
            key = self._keys[request] = task.task_id if task is not None else request[1]
            if len(self._keys) > 10_000:
                self._keys.pop(next(iter(self._keys)))
        return key

    def _crossed(self, hosted: HostedAgent, policy: AllowancePolicy, task_id: str,
                 context_id: str | None) -> CeilingStanding | None:
        """The applicable ceiling the spend went past (the one with the least
        remaining among those), or None. Failing closed, every one is crossed:
        a placeholder standing is returned."""
        if not policy.valid:
            assert policy.error is not None
            return CeilingStanding(_FAIL_CLOSED, 0)
        standings = policy.standings(self.ledger(hosted), task_id=task_id, context_id=context_id,
                                     now_ms=self.now_ms())
        over = [s for s in standings if s.spent_micro > s.ceiling.amount_micro]
        return binding_ceiling(over)

    # -- the platform's view ----------------------------------------------------------

    async def _emit(self, hosted: HostedAgent, env: Mapping[str, Any], *, stage: str, outcome: str,
                    policy: AllowancePolicy, binding: CeilingStanding | None, estimate: Money | None,
                    task_id: str | None, context_id: str | None) -> None:
        """``mesh.event.agent.allowance_exceeded`` as the agent: a flag for the
        platform's rollups, never a gate (a failed publish is logged only)."""
        data: dict[str, Any] = {
            "agent": hosted.agent_id,
            "stage": stage,
            "outcome": outcome,
            "on_exhausted": policy.on_exhausted.value,
            "valid": policy.valid,
            "at": format_ts(self.now_ms()),
        }
        if policy.allowance is not None:
            data["owner_key"] = policy.allowance.owner_key
        if binding is not None and policy.valid:
            data["ceiling"] = {"scope": binding.scope.value, "amount_micro": binding.ceiling.amount_micro,
                               "spent_micro": binding.spent_micro, "remaining_micro": binding.remaining_micro}
        if estimate is not None:
            data["estimate"] = estimate.to_object()
        if task_id is not None:
            data["task_id"] = task_id
        if context_id is not None:
            data["context_id"] = context_id
        trace = env.get("trace")
        try:
            await hosted.node.emit(hosted, EVENT_DOMAIN, EVENT_TYPE, data,
                                   trace=child_trace(trace if isinstance(trace, Mapping) else None))
        except Exception as exc:  # a flag, never a gate: rate-limited, disconnected, ...
            hosted.agent.log.warning("allowance_exceeded not published: %s: %s", type(exc).__name__, exc)

    def show(self, hosted: HostedAgent) -> dict[str, Any]:
        """The document, the spend so far and what remains, and held work."""
        held = self.held(hosted)
        now = self.now_ms()
        today = day_of(now)
        ledger = self.ledger(hosted)
        out: dict[str, Any] = {"agent": hosted.name, "agent_id": hosted.agent_id, "set": held is not None,
                               "owner": agent_owner(hosted), "any_owner": hosted.name in self.any_owner}
        recent_tasks = dict(list(ledger.by_task.items())[-20:])
        recent_contexts = dict(list(ledger.by_context.items())[-20:])
        out["spend"] = {"day": today, "today_micro": ledger.by_day.get(today, 0),
                        "by_task": recent_tasks, "by_context": recent_contexts}
        out["held"] = [h.to_object() for h in self.holds.get(hosted.agent_id, {}).values()]
        if held is None:
            return out
        policy = held.policy
        out["source"] = held.source
        out["valid"] = policy.valid
        out["on_exhausted"] = policy.on_exhausted.value
        out["errors"] = list(held.errors)
        if policy.error is not None:
            out["error"] = describe_refusal(policy.error)
        allowance = policy.allowance
        if allowance is None:
            return out
        out["document"] = allowance.to_object()
        out["currency"] = allowance.cost_model.currency
        ceilings: list[dict[str, Any]] = []
        for c in allowance.ceilings:
            item: dict[str, Any] = {"scope": c.scope.value, "amount_micro": c.amount_micro}
            spent: int | None = None
            if c.scope is Scope.DAY:
                spent = ledger.by_day.get(today, 0)
                item["day"] = today
            elif c.task_id is not None:
                item["task_id"] = c.task_id
                spent = ledger.by_task.get(c.task_id, 0)
            elif c.context_id is not None:
                item["context_id"] = c.context_id
                spent = ledger.by_context.get(c.context_id, 0)
            else:
                # Unnarrowed: each Task / context has its own; the largest spend so far.
                sums = ledger.by_task if c.scope is Scope.TASK else ledger.by_context
                item["each"] = True
                spent = max(sums.values(), default=0)
            item["spent_micro"] = spent
            item["remaining_micro"] = max(0, c.amount_micro - spent)
            ceilings.append(item)
        out["ceilings"] = ceilings
        return out

    def close(self) -> None:
        for holds in self.holds.values():
            for hold in holds.values():
                if not hold.waiter.done():
                    hold.waiter.cancel()
        self.spend.close()

