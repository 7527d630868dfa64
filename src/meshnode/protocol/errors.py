"""The error model (AgentMesh §12): the closed code table and the error object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "ERROR_CODES",
    "LEGACY_CODE_ALIASES",
    "ProtocolError",
    "error_object",
    "is_retryable",
    "normalize_code",
    "shape_error",
]

#: Every code of §12.2 with its retryability.
ERROR_CODES: Mapping[str, bool] = {
    # transport
    "TRANSPORT_TIMEOUT": True,
    "TRANSPORT_NO_RESPONDERS": False,
    "TRANSPORT_PERMISSION_DENIED": False,
    # protocol
    "INVALID_ENVELOPE": False,
    "INVALID_VERSION": False,
    "IDENTITY_MISMATCH": False,
    "INVALID_MANIFEST": False,
    "INVALID_QUERY": False,
    # task
    "TASK_NOT_FOUND": False,
    "TASK_INVALID_TRANSITION": False,
    "TASK_NOT_CANCELABLE": False,
    "TASK_EXPIRED": False,
    # agent
    "AGENT_UNAVAILABLE": True,
    "AGENT_OVERLOADED": True,
    "OFFERING_NOT_FOUND": False,
    "INPUT_INVALID": False,
    "CONTENT_TYPE_NOT_SUPPORTED": False,
    "UNAUTHORIZED": False,
    "SEALING_REQUIRED": False,
    "BUDGET_INSUFFICIENT": False,
    "DEADLINE_UNMEETABLE": False,
    "AGREEMENT_REQUIRED": False,
    "BUDGET_EXHAUSTED": False,
    "DEADLINE_EXCEEDED": False,
    # processing
    "INTERNAL_ERROR": True,
    "DEPENDENCY_FAILED": True,
    "CONTEXT_TOO_LARGE": False,
    "RATE_LIMITED": True,
    # storage
    "NOT_FOUND": False,
    "QUOTA_EXCEEDED": False,
    "PAYLOAD_TOO_LARGE": False,
    "ARTIFACT_GONE": False,
}

#: Codes from earlier drafts accepted on input (§8.5), never emitted.
LEGACY_CODE_ALIASES: Mapping[str, str] = {"SKILL_NOT_FOUND": "OFFERING_NOT_FOUND"}


def normalize_code(code: str) -> str:
    """Map a legacy code to its current name; other codes pass unchanged."""
    return LEGACY_CODE_ALIASES.get(code, code)


def is_retryable(code: str) -> bool:
    """The §12.2 retryability of ``code`` (unknown codes are not retryable)."""
    return ERROR_CODES.get(normalize_code(code), False)


def error_object(
    code: str,
    message: str,
    details: Mapping[str, Any] | None = None,
    retry_after_ms: int | None = None,
) -> dict[str, Any]:
    """Build a §12.1 error object; absent members are omitted, not nulled."""
    code = normalize_code(code)
    obj: dict[str, Any] = {"code": code, "message": message, "retryable": is_retryable(code)}
    if details:
        obj["details"] = dict(details)
    if retry_after_ms is not None:
        obj["retry_after_ms"] = int(retry_after_ms)
    return obj


@dataclass
class ProtocolError(Exception):
    """A refusal or failure that maps onto a §12 error code.

    Raised by the protocol core's validators and by agent handlers; the node
    turns it into a ``failed`` respond carrying :meth:`to_object`.
    """

    code: str
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    retry_after_ms: int | None = None

    def __post_init__(self) -> None:
        self.code = normalize_code(self.code)
        if not self.message:
            self.message = self.code.replace("_", " ").lower()
        super().__init__(f"{self.code}: {self.message}")

    @property
    def retryable(self) -> bool:
        return is_retryable(self.code)

    def to_object(self) -> dict[str, Any]:
        return error_object(self.code, self.message, self.details or None, self.retry_after_ms)


def shape_error(code: str, message: str, reason: StrEnum, member: str) -> ProtocolError:
    """The refusal of a malformed document: ``details.reason`` names the rule it
    broke and ``details.member`` the member at fault (budgets, allowances,
    SKUs and prices, agreements)."""
    return ProtocolError(code, message, {"reason": reason.value, "member": member})
