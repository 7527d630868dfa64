"""The owner allowance (EXT-8; AgentMesh §7.7, §17.5, §19.3): what an owner lets
their own agent spend.

A budget is what a requester will pay someone else; an allowance is what an
owner lets their own agent burn. It is a signed document (tag
``agentmesh-allowance-v1``, signer ``owner_key``) held by the agent's node,
never sent on the wire: a declared token → money cost model, and per-task,
per-context and per-day ceilings in integer micro-units. The node meters its
agent's spend against it (``floor(tokens × per_1k_tokens_micro / 1000)``) and
enforces it at admission through §7.7's refusal-with-estimate: a
BUDGET_INSUFFICIENT byte-identical to a too-low offer's, or, with
``on_exhausted: ask_owner``, a hold until the owner raises the ceiling.

Precedence: every applicable ceiling applies at once; the binding one is
whichever has the smallest remaining amount (specificity decides what spend a
ceiling covers, never which ceiling wins); an estimate equal to the remaining
amount admits. A document that does not verify fails closed: every ceiling
exhausted, never "no allowance".

Everything here is pure: instants are parameters, the ledger is data the
caller keeps. ``details.reason`` values follow ``conformance/allowance.json``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .budget import Money, budget_insufficient
from .canonical import CanonicalJSONError
from .errors import ProtocolError, shape_error
from .nkeys import KeyPair, is_valid_public
from .signing import sign_object, verify_object
from .timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "ALLOWANCE_TAG",
    "Allowance",
    "AllowanceDecision",
    "AllowanceInvalid",
    "AllowancePolicy",
    "Ceiling",
    "CeilingStanding",
    "CostModel",
    "OnExhausted",
    "Scope",
    "SpendEntry",
    "SpendLedger",
    "Verdict",
    "binding_ceiling",
    "ceiling_applies",
    "day_of",
    "decide",
    "load_allowance",
    "make_allowance",
    "meter_cost",
    "parse_allowance",
    "sign_allowance",
    "verify_allowance",
]

#: EXT-8 §1: the domain tag of an allowance document's signed bytes.
ALLOWANCE_TAG = "agentmesh-allowance-v1"

_CURRENCY = re.compile(r"[A-Z]{3}")


class Scope(StrEnum):
    """A ceiling's scope: a closed enum (an unknown scope is refused, never ignored)."""

    TASK = "task"
    CONTEXT = "context"
    DAY = "day"


class OnExhausted(StrEnum):
    """What the node does when admitting work would cross a ceiling."""

    REFUSE = "refuse"
    ASK_OWNER = "ask_owner"


class AllowanceInvalid(StrEnum):
    """Why an allowance document is refused (``details.reason``); the names of
    ``conformance/allowance.json``'s invalid cases where it has one."""

    NOT_AN_OBJECT = "not_an_object"
    WRONG_VERSION = "wrong_version"
    BAD_AGENT = "bad_agent"
    BAD_OWNER_KEY = "bad_owner_key"
    MISSING_COST_MODEL = "missing_cost_model"
    BAD_COST_MODEL = "bad_cost_model"
    FLOAT_MONEY = "float_money"
    NEGATIVE_AMOUNT = "negative_amount"
    BAD_CURRENCY = "bad_currency"
    MISSING_CEILINGS = "missing_ceilings"
    BAD_CEILING = "bad_ceiling"
    UNKNOWN_SCOPE = "unknown_scope"
    BAD_ON_EXHAUSTED = "bad_on_exhausted"
    BAD_UPDATED_AT = "bad_updated_at"
    MISSING_SIG = "missing_sig"
    #: The signature does not verify against ``owner_key``.
    BAD_SIGNATURE = "bad_signature"
    #: The document governs another agent than the one it was loaded for.
    WRONG_AGENT = "wrong_agent"
    #: Signed by a key that is not the governed agent's owner (a node-side
    #: check, §8.6: only when the caller knows the owner).
    WRONG_OWNER = "wrong_owner"


def _invalid(reason: AllowanceInvalid, member: str, message: str) -> ProtocolError:
    # The same code a malformed budget gets: a money-bearing shape that failed
    # its contract. Local only; an allowance never rides the wire.
    return shape_error("INVALID_ENVELOPE", f"invalid allowance: {message} (EXT-8 §1)", reason, member)


def _micro(value: object, member: str, *, required: AllowanceInvalid) -> int:
    """A non-negative integer of micro-units: never a float, never negative."""
    if type(value) is not int:
        if isinstance(value, float):
            raise _invalid(AllowanceInvalid.FLOAT_MONEY, member, f"{member} must be an integer (§19.3)")
        raise _invalid(required, member, f"{member} is a non-negative integer of micro-units")
    if value < 0:
        raise _invalid(AllowanceInvalid.NEGATIVE_AMOUNT, member, f"{member} must be non-negative")
    return value


@dataclass(frozen=True, slots=True)
class CostModel:
    """The owner's declared conversion of the agent's tokens into money."""

    per_1k_tokens_micro: int
    currency: str

    def cost(self, tokens: int) -> int:
        """:func:`meter_cost` under this model."""
        return meter_cost(tokens, self.per_1k_tokens_micro)

    def money(self, amount_micro: int) -> Money:
        return Money(amount_micro, self.currency)


@dataclass(frozen=True, slots=True)
class Ceiling:
    """One ceiling. ``task_id`` / ``context_id`` narrow it to one Task or context;
    unnarrowed, a task ceiling applies to each Task and a context ceiling to
    each context individually. ``day`` is the UTC day of the metering instant."""

    scope: Scope
    amount_micro: int
    task_id: str | None = None
    context_id: str | None = None


@dataclass(frozen=True, slots=True)
class Allowance:
    """A shape-valid allowance document."""

    agent: str
    owner_key: str
    cost_model: CostModel
    ceilings: tuple[Ceiling, ...]
    on_exhausted: OnExhausted
    updated_at: str
    updated_at_ms: int
    sig: str
    document: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def to_object(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.document))


def _parse_cost_model(raw: object) -> CostModel:
    if raw is None:
        raise _invalid(AllowanceInvalid.MISSING_COST_MODEL, "cost_model", "cost_model is required")
    if not isinstance(raw, Mapping):
        raise _invalid(AllowanceInvalid.BAD_COST_MODEL, "cost_model", "cost_model is an object")
    rate = _micro(
        raw.get("per_1k_tokens_micro"), "cost_model.per_1k_tokens_micro", required=AllowanceInvalid.BAD_COST_MODEL
    )
    currency = raw.get("currency")
    if not (isinstance(currency, str) and _CURRENCY.fullmatch(currency)):
        raise _invalid(AllowanceInvalid.BAD_CURRENCY, "cost_model.currency", "currency is an ISO 4217 code")
    return CostModel(rate, currency)


def _parse_ceiling(raw: object, i: int) -> Ceiling:
    member = f"ceilings[{i}]"
    if not isinstance(raw, Mapping):
        raise _invalid(AllowanceInvalid.BAD_CEILING, member, "a ceiling is an object")
    scope = raw.get("scope")
    if scope not in {s.value for s in Scope}:
        raise _invalid(AllowanceInvalid.UNKNOWN_SCOPE, f"{member}.scope", "scope is one of task, context, day")
    amount = _micro(raw.get("amount_micro"), f"{member}.amount_micro", required=AllowanceInvalid.BAD_CEILING)
    narrowing: dict[str, str | None] = {}
    for name in ("task_id", "context_id"):
        value = raw.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise _invalid(AllowanceInvalid.BAD_CEILING, f"{member}.{name}", f"{name} is a non-empty string")
        narrowing[name] = value
    return Ceiling(Scope(scope), amount, narrowing["task_id"], narrowing["context_id"])


def parse_allowance(doc: object) -> Allowance:
    """Validate an allowance document's shape (EXT-8 §1); the signature is not checked.

    ``v`` the integer 1; ``agent`` and ``owner_key`` public user nkeys;
    ``cost_model`` required, ``{per_1k_tokens_micro, currency}``; ``ceilings``
    a non-empty array of ``{scope, amount_micro, task_id?, context_id?}`` with
    scope in the closed enum and amounts non-negative integers;
    ``on_exhausted`` ``refuse`` or ``ask_owner``; ``updated_at`` RFC 3339;
    ``sig`` present (an unsigned document is never enforced). Raises
    ProtocolError INVALID_ENVELOPE, ``details.reason`` an :class:`AllowanceInvalid`.
    """
    if not isinstance(doc, Mapping):
        raise _invalid(AllowanceInvalid.NOT_AN_OBJECT, "allowance", "an allowance is an object")
    if not (type(doc.get("v")) is int and doc["v"] == 1):
        raise _invalid(AllowanceInvalid.WRONG_VERSION, "v", "v is the integer 1")
    if not is_valid_public(doc.get("agent")):
        raise _invalid(AllowanceInvalid.BAD_AGENT, "agent", "agent is the governed agent's key")
    if not is_valid_public(doc.get("owner_key")):
        raise _invalid(AllowanceInvalid.BAD_OWNER_KEY, "owner_key", "owner_key is the signer's key")
    cost_model = _parse_cost_model(doc.get("cost_model"))
    raw_ceilings = doc.get("ceilings")
    if not isinstance(raw_ceilings, list) or not raw_ceilings:
        raise _invalid(AllowanceInvalid.MISSING_CEILINGS, "ceilings", "ceilings is a non-empty array")
    ceilings = tuple(_parse_ceiling(c, i) for i, c in enumerate(raw_ceilings))
    on_exhausted = doc.get("on_exhausted")
    if on_exhausted not in {o.value for o in OnExhausted}:
        raise _invalid(AllowanceInvalid.BAD_ON_EXHAUSTED, "on_exhausted", "on_exhausted is refuse or ask_owner")
    updated_at = doc.get("updated_at")
    updated_us = try_parse_rfc3339(updated_at)
    if updated_us is None or not isinstance(updated_at, str):
        raise _invalid(AllowanceInvalid.BAD_UPDATED_AT, "updated_at", "updated_at is an RFC 3339 date-time")
    sig = doc.get("sig")
    if not (isinstance(sig, str) and sig):
        raise _invalid(AllowanceInvalid.MISSING_SIG, "sig", "an unsigned allowance is never enforced")
    return Allowance(
        doc["agent"], doc["owner_key"], cost_model, ceilings, OnExhausted(on_exhausted),
        updated_at, updated_us // 1000, sig, copy.deepcopy(dict(doc)),
    )


def verify_allowance(doc: object, *, agent: str | None = None, owner: str | None = None) -> Allowance:
    """Shape (:func:`parse_allowance`), then the signature against the
    document's ``owner_key`` under ``agentmesh-allowance-v1``; with ``agent``,
    the document must govern that agent (one document per agent); with
    ``owner``, it must be signed by that key (the agent's owner, §8.6, as
    the caller knows it; EXT-8 itself only binds the signature to
    ``owner_key``, so this is the caller's choice to make).

    Raises INVALID_ENVELOPE for a shape fault, IDENTITY_MISMATCH
    (``bad_signature`` / ``wrong_agent`` / ``wrong_owner``) otherwise. A
    caller enforcing the document fails closed on any raise
    (:func:`load_allowance`).
    """
    allowance = parse_allowance(doc)
    assert isinstance(doc, Mapping)
    try:
        verified = verify_object(doc, ALLOWANCE_TAG, allowance.owner_key)
    except CanonicalJSONError:
        verified = False
    if not verified:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            "the allowance's signature does not verify against owner_key (EXT-8 §1)",
            {"reason": AllowanceInvalid.BAD_SIGNATURE.value},
        )
    if agent is not None and allowance.agent != agent:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            f"the allowance governs {allowance.agent}, not {agent}",
            {"reason": AllowanceInvalid.WRONG_AGENT.value},
        )
    if owner is not None and allowance.owner_key != owner:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            f"the allowance is signed by {allowance.owner_key}, which is not the agent's owner {owner} (§8.6)",
            {"reason": AllowanceInvalid.WRONG_OWNER.value, "member": "owner_key",
             "owner_key": allowance.owner_key, "owner": owner},
        )
    return allowance


def sign_allowance(document: Mapping[str, Any], owner: KeyPair) -> dict[str, Any]:
    """Sign an allowance with the owner key: ``owner_key`` is set to the key's
    public key (the signer is the owner by definition), any old ``sig``
    replaced; the result is validated (raises ProtocolError when malformed)."""
    unsigned = {k: v for k, v in document.items() if k != "sig"}
    unsigned["owner_key"] = owner.public_key
    signed = dict(unsigned, sig=sign_object(unsigned, ALLOWANCE_TAG, owner))
    parse_allowance(signed)
    return signed


def make_allowance(
    owner: KeyPair,
    *,
    agent: str,
    cost_model: CostModel,
    ceilings: Iterable[Ceiling],
    on_exhausted: OnExhausted | str = OnExhausted.REFUSE,
    updated_at_ms: int,
) -> dict[str, Any]:
    """Build and sign an allowance document (owner tooling: ``allowance set``)."""
    items: list[dict[str, Any]] = []
    for c in ceilings:
        item: dict[str, Any] = {"scope": c.scope.value, "amount_micro": c.amount_micro}
        if c.task_id is not None:
            item["task_id"] = c.task_id
        if c.context_id is not None:
            item["context_id"] = c.context_id
        items.append(item)
    doc = {
        "v": 1,
        "agent": agent,
        "owner_key": owner.public_key,
        "cost_model": {"per_1k_tokens_micro": cost_model.per_1k_tokens_micro, "currency": cost_model.currency},
        "ceilings": items,
        "on_exhausted": str(OnExhausted(on_exhausted)),
        "updated_at": format_ts(updated_at_ms),
    }
    return sign_allowance(doc, owner)


# --- metering ---------------------------------------------------------------------


def meter_cost(tokens: int, per_1k_tokens_micro: int) -> int:
    """EXT-8 §2: ``floor(tokens × per_1k_tokens_micro / 1000)``, integers only.

    Floor, pinned: the node never charges a partial micro-unit against the
    owner's ceiling, and two nodes metering the same invocation agree.
    """
    if type(tokens) is not int or tokens < 0:
        raise ValueError("tokens is a non-negative integer")
    if type(per_1k_tokens_micro) is not int or per_1k_tokens_micro < 0:
        raise ValueError("per_1k_tokens_micro is a non-negative integer")
    return tokens * per_1k_tokens_micro // 1000


def day_of(at_ms: int) -> str:
    """The UTC calendar day of an instant, ``YYYY-MM-DD`` (the day ceiling's key)."""
    return f"{_dt.datetime.fromtimestamp(at_ms // 1000, tz=_dt.UTC):%Y-%m-%d}"


@dataclass(frozen=True, slots=True)
class SpendEntry:
    """One metered invocation, accounted to its Task, its context and its UTC day."""

    task_id: str
    context_id: str | None
    day: str
    cost_micro: int
    at_ms: int
    tokens: int | None = None

    def to_object(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"task_id": self.task_id}
        if self.context_id is not None:
            obj["context_id"] = self.context_id
        obj["day"] = self.day
        if self.tokens is not None:
            obj["tokens"] = self.tokens
        obj["cost_micro"] = self.cost_micro
        obj["at"] = format_ts(self.at_ms)
        return obj


@dataclass
class SpendLedger:
    """The node's record of its agent's metered spend and the per-scope sums
    the ceilings are enforced against. Survives a replaced document: raising
    a ceiling does not forgive the morning's spend."""

    entries: list[SpendEntry] = field(default_factory=list)
    by_task: dict[str, int] = field(default_factory=dict)
    by_context: dict[str, int] = field(default_factory=dict)
    by_day: dict[str, int] = field(default_factory=dict)

    @property
    def total_micro(self) -> int:
        return sum(e.cost_micro for e in self.entries)

    def record(
        self,
        *,
        task_id: str,
        context_id: str | None,
        at_ms: int,
        cost_micro: int | None = None,
        tokens: int | None = None,
        cost_model: CostModel | None = None,
    ) -> SpendEntry:
        """Account one invocation: money directly (``cost_micro``), or
        ``tokens`` converted through ``cost_model`` (money wins when both)."""
        if cost_micro is None:
            if tokens is None or cost_model is None:
                raise ValueError("record cost_micro, or tokens with a cost_model")
            cost_micro = cost_model.cost(tokens)
        elif type(cost_micro) is not int or cost_micro < 0:
            raise ValueError("cost_micro is a non-negative integer")
        entry = SpendEntry(task_id, context_id, day_of(at_ms), cost_micro, at_ms, tokens)
        self.entries.append(entry)
        self.by_task[task_id] = self.by_task.get(task_id, 0) + cost_micro
        if context_id is not None:
            self.by_context[context_id] = self.by_context.get(context_id, 0) + cost_micro
        self.by_day[entry.day] = self.by_day.get(entry.day, 0) + cost_micro
        return entry

    def spent(self, ceiling: Ceiling, *, task_id: str | None, context_id: str | None, now_ms: int) -> int:
        """The spend already accounted to ``ceiling``'s scope for this work."""
        if ceiling.scope is Scope.TASK:
            return self.by_task.get(task_id, 0) if task_id is not None else 0
        if ceiling.scope is Scope.CONTEXT:
            return self.by_context.get(context_id, 0) if context_id is not None else 0
        return self.by_day.get(day_of(now_ms), 0)


# --- precedence and admission --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CeilingStanding:
    """A ceiling with the spend accounted against it for one piece of work."""

    ceiling: Ceiling
    spent_micro: int

    @property
    def scope(self) -> Scope:
        return self.ceiling.scope

    @property
    def remaining_micro(self) -> int:
        return max(0, self.ceiling.amount_micro - self.spent_micro)


def ceiling_applies(ceiling: Ceiling, *, task_id: str | None, context_id: str | None) -> bool:
    """Whether ``ceiling`` constrains work in this Task and context.

    Task: always, unless narrowed to another Task. Context: a narrowed one only
    inside its context; an unnarrowed one to each context, so only to work
    that has one. Day: always.
    """
    if ceiling.scope is Scope.TASK:
        return ceiling.task_id is None or ceiling.task_id == task_id
    if ceiling.scope is Scope.CONTEXT:
        if ceiling.context_id is not None:
            return ceiling.context_id == context_id
        return context_id is not None
    return True


_SPECIFICITY = {Scope.TASK: 0, Scope.CONTEXT: 1, Scope.DAY: 2}


def binding_ceiling(standings: Iterable[CeilingStanding]) -> CeilingStanding | None:
    """The applicable ceiling with the smallest remaining amount; on a tie the
    more specific one (task, context, day) and then the first declared, so the
    answer is deterministic. None when nothing applies."""
    best: CeilingStanding | None = None
    for s in standings:
        if best is None or (s.remaining_micro, _SPECIFICITY[s.scope]) < (
            best.remaining_micro,
            _SPECIFICITY[best.scope],
        ):
            best = s
    return best


class Verdict(StrEnum):
    """The admission outcome."""

    ADMIT = "admit"
    #: Refuse now with BUDGET_INSUFFICIENT carrying the estimate.
    REFUSE = "refuse"
    #: Hold the work unstarted and ask the owner; refuse the same way if they decline.
    ASK_OWNER = "ask_owner"


@dataclass(frozen=True, slots=True)
class AllowanceDecision:
    """An admission decision: the verdict, the estimate judged, and the
    binding ceiling (None when none applied, or when failing closed)."""

    verdict: Verdict
    estimate: Money
    binding: CeilingStanding | None = None

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT

    def refusal(self) -> ProtocolError:
        """The refusal: budget.json's BUDGET_INSUFFICIENT shape, deliberately
        indistinguishable on the wire from a too-low offer's."""
        return budget_insufficient(self.estimate, "the work would exceed the owner's allowance")


def decide(
    standings: Iterable[CeilingStanding],
    estimate: Money,
    on_exhausted: OnExhausted = OnExhausted.REFUSE,
) -> AllowanceDecision:
    """Admit when the estimate fits the binding ceiling (equality admits: "would
    exceed" is strict); otherwise refuse or ask the owner, per ``on_exhausted``."""
    binding = binding_ceiling(standings)
    if binding is None or estimate.amount_micro <= binding.remaining_micro:
        return AllowanceDecision(Verdict.ADMIT, estimate, binding)
    verdict = Verdict.ASK_OWNER if on_exhausted is OnExhausted.ASK_OWNER else Verdict.REFUSE
    return AllowanceDecision(verdict, estimate, binding)


@dataclass(frozen=True, slots=True)
class AllowancePolicy:
    """The allowance as a node holds it: a verified document, or the fail-closed
    state (``allowance`` None, ``error`` set) that refuses all new spend until a
    valid document replaces it. Fallbacks read best-effort from a broken
    document keep its ``on_exhausted`` and its cost model for quoting."""

    allowance: Allowance | None
    error: ProtocolError | None = None
    fallback_on_exhausted: OnExhausted = OnExhausted.REFUSE
    fallback_cost_model: CostModel | None = None

    @property
    def valid(self) -> bool:
        return self.allowance is not None

    @property
    def on_exhausted(self) -> OnExhausted:
        return self.allowance.on_exhausted if self.allowance is not None else self.fallback_on_exhausted

    @property
    def cost_model(self) -> CostModel | None:
        return self.allowance.cost_model if self.allowance is not None else self.fallback_cost_model

    def standings(
        self, ledger: SpendLedger, *, task_id: str | None, context_id: str | None, now_ms: int
    ) -> list[CeilingStanding]:
        """The applicable ceilings with their spend, in declaration order."""
        if self.allowance is None:
            return []
        return [
            CeilingStanding(c, ledger.spent(c, task_id=task_id, context_id=context_id, now_ms=now_ms))
            for c in self.allowance.ceilings
            if ceiling_applies(c, task_id=task_id, context_id=context_id)
        ]

    def headroom(
        self, ledger: SpendLedger, *, task_id: str | None, context_id: str | None, now_ms: int
    ) -> int | None:
        """What may still be spent on this work before a ceiling is crossed (the
        binding ceiling's remaining amount): the mid-task check after each
        metered invocation. 0 when failing closed; None when nothing applies."""
        if self.allowance is None:
            return 0
        binding = binding_ceiling(self.standings(ledger, task_id=task_id, context_id=context_id, now_ms=now_ms))
        return None if binding is None else binding.remaining_micro

    def admit(
        self,
        ledger: SpendLedger,
        *,
        estimate_micro: int,
        task_id: str | None,
        context_id: str | None,
        now_ms: int,
        currency: str | None = None,
    ) -> AllowanceDecision:
        """The admission decision for work estimated at ``estimate_micro`` (in the
        cost model's currency; ``currency`` when no cost model is readable).

        Failing closed, every ceiling is exhausted: nothing is admitted, not
        even a zero estimate, and no binding is reported (no arithmetic from an
        unverified document is trusted).
        """
        model = self.cost_model
        unit = model.currency if model is not None else currency
        if unit is None:
            raise ValueError("no cost model is readable; pass the estimate's currency")
        estimate = Money(estimate_micro, unit)
        if self.allowance is None:
            verdict = Verdict.ASK_OWNER if self.on_exhausted is OnExhausted.ASK_OWNER else Verdict.REFUSE
            return AllowanceDecision(verdict, estimate, None)
        standings = self.standings(ledger, task_id=task_id, context_id=context_id, now_ms=now_ms)
        return decide(standings, estimate, self.allowance.on_exhausted)


def load_allowance(doc: object, *, agent: str | None = None, owner: str | None = None) -> AllowancePolicy:
    """Load a document for enforcement; never raises. A document that fails
    (:func:`verify_allowance`, with ``agent`` and ``owner``) yields the
    fail-closed policy with the error."""
    try:
        return AllowancePolicy(verify_allowance(doc, agent=agent, owner=owner))
    except ProtocolError as exc:
        fallback = OnExhausted.REFUSE
        model: CostModel | None = None
        if isinstance(doc, Mapping):
            if doc.get("on_exhausted") == OnExhausted.ASK_OWNER.value:
                fallback = OnExhausted.ASK_OWNER
            try:
                model = _parse_cost_model(doc.get("cost_model"))
            except ProtocolError:
                model = None
        return AllowancePolicy(None, exc, fallback, model)
