"""The §8.7 public block: checked at intake, rebuilt by the registry, served by describe.

Also the §8.6 sandbox clamp, which narrows what a stored manifest lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..json_copy import copy_json
from .access import _readable_access
from .declarations import _drop_unreadable_declarations
from .shapes import (
    _check_optional,
    _check_strings,
    _invalid,
    _is_nonblank,
    _is_text,
    _one_of,
    _require_list,
    _require_object,
)

__all__ = ["clamp_for_sandbox", "describe_document", "materialize_public_block"]

_UI_AUDIENCES = frozenset({"public", "client", "operator"})
_UI_ACCESS = frozenset({"open", "authenticated"})

#: §8.7: what the registry builds and a registrant may never supply.
_REGISTRY_MATERIALIZED = ("offering_details", "default_input_modes", "default_output_modes")
#: §8.7: the offering members copied into the storefront (``examples`` is not).
_PUBLIC_OFFERING_MEMBERS = (
    "id",
    "name",
    "description",
    "tags",
    "input_modes",
    "output_modes",
    "input_schema",
    "output_schema",
    "streaming",
    "estimated_duration_ms",
    "needs",
    "delivers",
    "reporting",
)
#: Members outside the public block that a stranger reads pre-admission
#: (§8.7: name, works_with, sealing; §8.10/§8.11: data_use, compliance; the
#: five questions of §3.3.1 answer "who" with the owner and "how" with
#: interaction).
_DESCRIBE_TRAVELLERS = (
    "name",
    "owner",
    "interaction",
    "sealing",
    "works_with",
    "data_use",
    "compliance",
)


# ── §8.7 the public block: checked at intake ────────────────────────────────


def _check_uis(uis: object, offering_ids: set[str]) -> None:
    for i, entry in enumerate(_require_list(uis, "public.uis")):
        path = f"public.uis[{i}]"
        obj = _require_object(entry, path)
        url = obj.get("url")
        if not isinstance(url, str) or urlsplit(url).scheme != "https" or not urlsplit(url).netloc:
            raise _invalid(f"{path}.url", "is required: an https URL")
        if not _is_nonblank(obj.get("label")):
            raise _invalid(f"{path}.label", "is required: a non-empty string")
        _check_optional(obj, "purpose", path, _is_text, "a string")
        _check_optional(obj, "kind", path, _is_text, "a string")
        _check_optional(obj, "audience", path, lambda v: _one_of(v, _UI_AUDIENCES), "public, client or operator")
        _check_optional(obj, "access", path, lambda v: _one_of(v, _UI_ACCESS), "open or authenticated")
        _check_optional(obj, "offering", path, lambda v: _one_of(v, offering_ids), "a declared offering id")


def _check_links(links: object) -> None:
    for i, entry in enumerate(_require_list(links, "public.links")):
        path = f"public.links[{i}]"
        obj = _require_object(entry, path)
        if not _is_nonblank(obj.get("handle")):
            raise _invalid(f"{path}.handle", "is required: a non-empty string")
        _check_optional(obj, "rel", path, _is_text, "a string")


def _check_public(manifest: dict[str, Any], dropped: list[str]) -> None:
    if "public" not in manifest:
        return
    public = dict(_require_object(manifest["public"], "public"))
    for member in ("description", "admission"):
        _check_optional(public, member, "public", _is_text, "a string")
    for member in ("offerings", "example_queries"):
        if member in public:
            _check_strings(public[member], f"public.{member}")
    if "links" in public:
        _check_links(public["links"])
    if "skus" in public:
        for i, sku in enumerate(_require_list(public["skus"], "public.skus")):
            _require_object(sku, f"public.skus[{i}]")
    if "uis" in public:
        _check_uis(public["uis"], {o["id"] for o in manifest["offerings"]})
    if "access" in public:
        access = _readable_access(public["access"])
        if access is None:
            del public["access"]
            dropped.append("public.access")
        else:
            public["access"] = access
    _drop_unreadable_declarations(public, "public.", dropped)
    manifest["public"] = public


# ── §8.7 the public block: rebuilt by the registry ──────────────────────────


def _public_offering(offering: Mapping[str, Any]) -> dict[str, Any]:
    return {
        member: copy_json(offering[member])
        for member in _PUBLIC_OFFERING_MEMBERS
        if member in offering
    }


def materialize_public_block(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` whose public block is rebuilt by the registry (§8.7).

    Registrant-supplied ``offering_details``, ``default_input_modes`` and
    ``default_output_modes`` are discarded. ``public.offerings`` keeps only
    advertised ids that name a declared offering (first occurrence, in
    order); ``offering_details`` is copied from those offerings (without
    ``examples``); the default modes are copied from the card level. A
    manifest without a public block gets none.
    """
    out = dict(manifest)
    public = manifest.get("public")
    if not isinstance(public, Mapping):
        return out
    block = {
        k: copy_json(v)
        for k, v in public.items()
        if k not in _REGISTRY_MATERIALIZED and k not in ("skills", "skill_details")
    }
    declared: dict[str, Mapping[str, Any]] = {}
    for offering in manifest.get("offerings") or ():
        if isinstance(offering, Mapping) and isinstance(offering.get("id"), str):
            declared.setdefault(offering["id"], offering)
    advertised = block.get("offerings")
    if isinstance(advertised, list):
        kept = list(dict.fromkeys(i for i in advertised if isinstance(i, str) and i in declared))
        block["offerings"] = kept
        block["offering_details"] = [_public_offering(declared[i]) for i in kept]
    for member in ("default_input_modes", "default_output_modes"):
        if isinstance(manifest.get(member), list):
            block[member] = copy_json(manifest[member])
    out["public"] = block
    return out


# ── §8.6 sandbox clamp, §10.14 describe ─────────────────────────────────────


def clamp_for_sandbox(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with visibility clamped to at most ``unlisted`` (§8.6, §9.7).

    Sandbox-attested registrations are never listed openly: ``public`` (or an
    absent visibility, which means public) becomes ``unlisted``; ``unlisted``
    and ``private`` stand.
    """
    out = dict(manifest)
    if out.get("visibility", "public") not in ("unlisted", "private"):
        out["visibility"] = "unlisted"
    return out


def describe_document(
    manifest: Mapping[str, Any], *, card: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The §10.14 describe response for a stored manifest.

    ``agent_id``; the registrar-signed ``card`` when the agent holds a handle;
    the public block verbatim under ``public``; and the members that travel
    with the storefront pre-admission (§8.7 name, works_with, sealing; §8.10
    data_use; §8.11 compliance; the owner and interaction that answer the
    five questions, §3.3.1). Absent parts are omitted, never nulled. Served
    from declared bytes: nothing here consults the agent.
    """
    doc: dict[str, Any] = {"agent_id": manifest["id"]}
    if card is not None:
        doc["card"] = copy_json(dict(card))
    for member in _DESCRIBE_TRAVELLERS:
        if member in manifest and manifest[member] is not None:
            doc[member] = copy_json(manifest[member])
    public = manifest.get("public")
    if isinstance(public, Mapping):
        doc["public"] = copy_json(dict(public))
    return doc
