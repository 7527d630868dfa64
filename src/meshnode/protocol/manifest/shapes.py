"""Shape predicates and the INVALID_MANIFEST error every manifest check shares.

Untrusted JSON is judged here member by member; nothing in this module knows
which member it is looking at beyond the ``path`` it is handed for the error.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..errors import ProtocolError

_SUBJECT_TOKEN = re.compile(r"[\x21-\x7e]+")


def _invalid(field_path: str, message: str) -> ProtocolError:
    return ProtocolError("INVALID_MANIFEST", f"{field_path}: {message}", {"field": field_path})



# ── small shape predicates ──────────────────────────────────────────────────


def _one_of(value: object, choices: Collection[str]) -> bool:
    """Membership for untrusted JSON: only a string can be one of a vocabulary."""
    return isinstance(value, str) and value in choices


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_nonblank(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _whole(value: object) -> int | None:
    """An integer JSON number (an integral double counts, as a JS peer sends it)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _is_non_negative_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _require_list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _invalid(path, "must be an array")
    return value


def _require_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(path, "must be an object")
    return value


def _check_strings(value: object, path: str, *, nonblank: bool = True) -> list[str]:
    items = _require_list(value, path)
    for i, item in enumerate(items):
        if not (_is_nonblank(item) if nonblank else _is_text(item)):
            raise _invalid(f"{path}[{i}]", "must be a non-empty string")
    return items


def _check_optional(
    obj: Mapping[str, Any], key: str, path: str, ok: Callable[[object], bool], what: str
) -> None:
    if key in obj and not ok(obj[key]):
        raise _invalid(f"{path}.{key}" if path else key, f"must be {what}")


def _is_concrete_subject(value: object) -> bool:
    if not isinstance(value, str) or not value:
        return False
    return all(
        _SUBJECT_TOKEN.fullmatch(token) is not None and "*" not in token and ">" not in token
        for token in value.split(".")
    )


def _is_x25519_public(value: object) -> bool:
    """An X25519 public key as the SDKs publish it: 32 bytes, base64url (or base64)."""
    if not isinstance(value, str) or not value.isascii() or not value or value.strip() != value:
        return False
    padded = value + "=" * (-len(value) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        try:
            raw = decode(padded)
        except (binascii.Error, ValueError):
            continue
        if len(raw) == 32 and re.fullmatch(r"[A-Za-z0-9_+/=-]+", value):
            return True
    return False
