"""Commerce (AgentMesh §19.1, §19.4–§19.6, §12.2): SKUs, prices, agreements, rating.

What an agent sells is a **SKU**: what it covers, what it costs (one of five
closed price shapes rated against a named meter, §13.5) and who bills for it.
The SKU's **digest** (SHA-256 over ``agentmesh-sku-v1\\n`` + its canonical
JSON) is the identity of the terms: one moved micro-unit moves it. An
**agreement** is the consumer owner's signature binding their account to a
SKU at one digest; admission refuses paid work without one
(AGREEMENT_REQUIRED). **Rating** folds meter events × the agreed price into
charges: a pure function of its inputs, integer arithmetic only, so replaying
the same events gives the same charges to the micro-unit.

Everything here is pure: no clock (instants are parameters), no I/O, no
registry. Callers resolve the requester's owner, hold the agreement store and
route events; this module judges and computes. Refusal and shape-error
``details.reason`` values follow ``conformance/commerce.json`` where the
fixture names a rule.

The work is split by job: :mod:`.price` (the price shapes), :mod:`.sku`
(SKUs and their digest), :mod:`.agreement` (agreements and the admission
check), :mod:`.rating` (the charge fold) and :mod:`.memo` (parsing the
documents that repeat once). Import from here.
"""

from __future__ import annotations

from .agreement import (
    AGREEMENT_TAG,
    Agreement,
    AgreementInvalid,
    AgreementRecord,
    Evidence,
    agreement_applies,
    agreement_required,
    approval_url,
    check_agreement,
    find_agreement,
    make_agreement,
    parse_agreement,
    sign_agreement,
    verify_agreement,
)
from .memo import ParsedOnce
from .price import (
    CommerceInvalid,
    Included,
    Period,
    Price,
    PriceModel,
    Tier,
    admission_estimate,
    check_price_within_ceiling,
    parse_price,
)
from .rating import (
    Charge,
    ChargeOutcome,
    Rater,
    ledger_totals,
    package_charge,
    per_unit_charge,
    period_key,
    rate_events,
    rate_stream,
    tiered_charge,
)
from .sku import (
    SKU_DIGEST_TAG,
    SKU_ID_PATTERN,
    Provider,
    Sku,
    parse_sku,
    parse_skus,
    public_sku,
    sku_digest,
    sku_for,
)

__all__ = [
    "admission_estimate",
    "check_price_within_ceiling",
    "AGREEMENT_TAG",
    "SKU_DIGEST_TAG",
    "SKU_ID_PATTERN",
    "Agreement",
    "AgreementInvalid",
    "AgreementRecord",
    "Charge",
    "ChargeOutcome",
    "CommerceInvalid",
    "Evidence",
    "Included",
    "ParsedOnce",
    "Period",
    "Price",
    "PriceModel",
    "Provider",
    "Rater",
    "Sku",
    "Tier",
    "agreement_applies",
    "agreement_required",
    "approval_url",
    "check_agreement",
    "find_agreement",
    "make_agreement",
    "package_charge",
    "parse_agreement",
    "parse_price",
    "parse_sku",
    "parse_skus",
    "per_unit_charge",
    "period_key",
    "public_sku",
    "ledger_totals",
    "rate_events",
    "rate_stream",
    "sign_agreement",
    "sku_digest",
    "sku_for",
    "tiered_charge",
    "verify_agreement",
]
