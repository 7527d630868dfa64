"""Pure mappings between A2A v1.0 (ProtoJSON) and the mesh: cards, parts, states.

The part mapping (documented in the README):

- **Which offering.** ``message.metadata.skill`` names the skill (= offering
  id); without it, an agent with exactly one advertised offering gets that one.
- **Input.** One ``data`` part → the offering's input is that JSON value. Text
  parts (joined with newlines) → the input is the text, or ``{"text": text}``
  when the offering's input schema is an object with a ``text`` property. No
  parts → no input. File parts, and data mixed with text, are refused
  (InvalidParams): nothing is fetched on a caller's say-so. A data part's
  whole-number floats become integers where the offering's input schema says
  ``integer`` (A2A's protobuf Struct sends every number as a double).
- **Output.** A string output → one artifact with a text part; any other JSON
  value → one artifact with a data part; its integers are rendered as
  integers on the wire (:func:`ints_as_sent`), not as doubles. Stream chunks → artifact updates of
  one artifact, appended in order.
- **States.** submitted, working, input_required, auth_required, completed,
  canceled and rejected map one to one; exhausted and failed → FAILED, whose
  status message carries only the stable code in ``metadata[uri].code``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from meshnode.protocol.a2a_extension import EXTENSION_URI, format_duration

__all__ = [
    "FAILED_STATES",
    "PartsRefused",
    "TERMINAL_A2A",
    "agent_card",
    "agent_message",
    "input_from_parts",
    "integers_by_schema",
    "ints_as_sent",
    "output_artifact",
    "project_security",
    "select_offering",
    "state_of",
]

_STATES = {
    "submitted": "TASK_STATE_SUBMITTED",
    "working": "TASK_STATE_WORKING",
    "input_required": "TASK_STATE_INPUT_REQUIRED",
    "auth_required": "TASK_STATE_AUTH_REQUIRED",
    "completed": "TASK_STATE_COMPLETED",
    "failed": "TASK_STATE_FAILED",
    "canceled": "TASK_STATE_CANCELED",
    "rejected": "TASK_STATE_REJECTED",
    "exhausted": "TASK_STATE_FAILED",
}
FAILED_STATES = frozenset({"failed", "exhausted"})
TERMINAL_A2A = frozenset(
    {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"}
)
#: States after which a blocking SendMessage answers: terminal, or waiting on the caller.
INTERRUPTED_A2A = frozenset({"TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"})


def state_of(mesh_status: str) -> str:
    """The A2A TaskState name of a mesh task status."""
    return _STATES.get(mesh_status, "TASK_STATE_WORKING")


class PartsRefused(ValueError):
    """A message whose parts the bridge does not map (the message says why)."""


def select_offering(
    offerings: Mapping[str, Any], advertised: Sequence[str], metadata: Mapping[str, Any] | None
) -> str:
    """The offering a message selects: ``metadata.skill``, or the single advertised one."""
    skill = (metadata or {}).get("skill")
    if skill is not None:
        if not isinstance(skill, str) or skill not in offerings:
            raise PartsRefused(f"metadata.skill names no skill of this agent: {skill!r}")
        return skill
    if len(advertised) == 1:
        return advertised[0]
    raise PartsRefused(
        "this agent has several skills: name one in message.metadata.skill "
        f"({', '.join(advertised)})"
    )


def _wants_text_object(schema: Mapping[str, Any] | None) -> bool:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        return False
    props = schema.get("properties")
    return isinstance(props, Mapping) and "text" in props


def input_from_parts(parts: Sequence[Mapping[str, Any]], input_schema: Mapping[str, Any] | None) -> Any:
    """The offering input a message's parts (ProtoJSON) carry; see the module docstring."""
    texts: list[str] = []
    data: list[Any] = []
    for part in parts:
        if "text" in part:
            texts.append(str(part["text"]))
        elif "data" in part:
            data.append(part["data"])
        elif "url" in part or "raw" in part:
            raise PartsRefused("file parts are not bridged: send the content as a data or text part")
        else:
            raise PartsRefused("a part carries no text, data, url or raw content")
    if data and texts:
        raise PartsRefused("a message carries either one data part or text parts, not both")
    if len(data) > 1:
        raise PartsRefused("a message carries at most one data part")
    if data:
        return integers_by_schema(data[0], input_schema)
    if not texts:
        return None
    text = "\n".join(texts)
    return {"text": text} if _wants_text_object(input_schema) else text


def _admits_integer(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def integers_by_schema(value: Any, schema: Mapping[str, Any] | None) -> Any:
    """``value`` with each whole-number float made an int where ``schema`` says
    ``integer`` there (``type``, ``properties``, ``additionalProperties``,
    ``items``, ``prefixItems``, and the branches of ``allOf``/``anyOf``/``oneOf``).

    A2A carries a data part as a protobuf Struct, whose numbers are doubles: the
    official SDK sends ``{"to": 2}`` as ``{"to": 2.0}``. JSON Schema counts 2.0
    as an integer, Python does not; the offering's schema says which it meant.
    Nothing else is changed (2.5 stays 2.5 and then fails validation)."""
    if not isinstance(schema, Mapping):
        return value
    for key in ("allOf", "anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                value = integers_by_schema(value, branch)
    if isinstance(value, float) and value.is_integer() and _admits_integer(schema):
        return int(value)
    if isinstance(value, dict):
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        extra = schema.get("additionalProperties")
        return {
            k: integers_by_schema(v, props.get(k, extra if isinstance(extra, Mapping) else None))
            for k, v in value.items()
        }
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items")
        return [
            integers_by_schema(v, prefix[i] if i < len(prefix) else items if isinstance(items, Mapping) else None)
            for i, v in enumerate(value)
        ]
    return value


def ints_as_sent(rendered: Any, original: Any) -> Any:
    """``rendered`` (a value after a protobuf Struct round trip, every number a
    double) with each number that was an int in ``original`` an int again, so
    an agent's integer output leaves as ``2``, not ``2.0``."""
    if isinstance(rendered, float) and type(original) is int and rendered == original:
        return original
    if isinstance(rendered, dict) and isinstance(original, Mapping):
        return {k: ints_as_sent(v, original.get(k)) for k, v in rendered.items()}
    if isinstance(rendered, list) and isinstance(original, list) and len(rendered) == len(original):
        return [ints_as_sent(v, o) for v, o in zip(rendered, original, strict=True)]
    return rendered


def _part(value: Any) -> dict[str, Any]:
    return {"text": value} if isinstance(value, str) else {"data": value}


def output_artifact(output: Any, *, artifact_id: str = "output") -> dict[str, Any] | None:
    """The artifact carrying a mesh output, or None when there is none."""
    if output is None:
        return None
    return {"artifactId": artifact_id, "name": "output", "parts": [_part(output)]}


def chunk_part(chunk: Any) -> dict[str, Any]:
    return _part(chunk)


def agent_message(
    text: str, *, task_id: str, context_id: str, metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A status message from the agent (ProtoJSON)."""
    msg: dict[str, Any] = {
        "messageId": str(uuid.uuid4()),
        "role": "ROLE_AGENT",
        "taskId": task_id,
        "contextId": context_id,
        "parts": [{"text": text}],
    }
    if metadata:
        msg["metadata"] = dict(metadata)
    return msg


def coded_message(code: str, *, task_id: str, context_id: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A status message carrying a stable code (and, for the mesh limits, details)."""
    ext: dict[str, Any] = {"code": code}
    if details is not None:
        ext["details"] = dict(details)
    return agent_message(code, task_id=task_id, context_id=context_id, metadata={EXTENSION_URI: ext})


# --- the Agent Card ---------------------------------------------------------------

_OPENAPI_TO_A2A = {
    "apiKey": "apiKeySecurityScheme",
    "http": "httpAuthSecurityScheme",
    "oauth2": "oauth2SecurityScheme",
    "openIdConnect": "openIdConnectSecurityScheme",
    "mutualTLS": "mtlsSecurityScheme",
}


def _scheme(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = _OPENAPI_TO_A2A.get(str(entry.get("type")))
    if kind is None:
        return None
    body: dict[str, Any] = {}
    if isinstance(entry.get("description"), str):
        body["description"] = entry["description"]
    t = entry["type"]
    if t == "apiKey":
        body["location"] = str(entry.get("in", ""))
        body["name"] = str(entry.get("name", ""))
    elif t == "http":
        body["scheme"] = str(entry.get("scheme", ""))
        if isinstance(entry.get("bearerFormat"), str):
            body["bearerFormat"] = entry["bearerFormat"]
    elif t == "oauth2":
        if isinstance(entry.get("flows"), Mapping):
            body["flows"] = dict(entry["flows"])
    elif t == "openIdConnect":
        body["openIdConnectUrl"] = str(entry.get("openIdConnectUrl", ""))
    return {kind: body}


def project_security(public: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """§8.12: ``transport: "http"`` schemes → (securitySchemes, securityRequirements),
    one requirement per scheme (alternatives). A mesh-identity scheme is never
    projected; an agent with none emits neither member."""
    access = public.get("access")
    schemes = access.get("schemes") if isinstance(access, Mapping) else None
    out: dict[str, Any] = {}
    requirements: list[dict[str, Any]] = []
    for entry in schemes if isinstance(schemes, list) else []:
        if not isinstance(entry, Mapping) or entry.get("transport") != "http":
            continue
        scheme_id = entry.get("id")
        projected = _scheme(entry)
        if not isinstance(scheme_id, str) or projected is None:
            continue
        out[scheme_id] = projected
        requirements.append({"schemes": {scheme_id: {"list": []}}})
    return out, requirements


def _extension_params(
    retention_s: float, application: str | None, issuer_key: str | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"idempotencyRetention": format_duration(round(retention_s))}
    if application:
        params["application"] = application
    if issuer_key:
        params["issuerKey"] = issuer_key
    return params


def agent_card(
    manifest: Mapping[str, Any],
    *,
    public: Mapping[str, Any],
    url: str,
    idempotency_retention_s: float,
    streaming: bool = True,
    application: str | None = None,
    issuer_key: str | None = None,
) -> dict[str, Any]:
    """The A2A v1.0 Agent Card (ProtoJSON) of a hosted agent, from its manifest:
    advertised offerings as skills, modes, the §8.12 projection, and the mesh
    extension declaration.

    ``application`` and ``issuer_key`` (the nkey that signs run reports) are
    published in the declaration's params beside ``idempotencyRetention``, so a
    calling meshnode knows the audience to address and the key to verify
    reports with without per-peer configuration. A caller that wants the key
    pinned rather than read from the card sets it in its own peer config."""
    advertised = public.get("offerings")
    advertised_ids = set(advertised) if isinstance(advertised, list) else None
    skills: list[dict[str, Any]] = []
    for offering in manifest.get("offerings", []):
        oid = offering.get("id")
        if advertised_ids is not None and oid not in advertised_ids:
            continue
        skill: dict[str, Any] = {
            "id": oid,
            "name": offering.get("name") or oid,
            "description": offering.get("description") or "",
            "tags": list(offering.get("tags") or [oid]),
        }
        if offering.get("input_modes"):
            skill["inputModes"] = list(offering["input_modes"])
        if offering.get("output_modes"):
            skill["outputModes"] = list(offering["output_modes"])
        skills.append(skill)
    card: dict[str, Any] = {
        "name": manifest.get("name") or "agent",
        "description": public.get("description") or manifest.get("description") or "",
        "version": manifest.get("version") or "0.0.0",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "capabilities": {
            "streaming": streaming,
            "pushNotifications": False,
            "extensions": [
                {
                    "uri": EXTENSION_URI,
                    "description": "AGBoss mesh: call chains, budgets, deadlines, signed run reports",
                    "required": False,
                    "params": _extension_params(
                        idempotency_retention_s, application, issuer_key
                    ),
                }
            ],
        },
        "defaultInputModes": list(manifest.get("default_input_modes") or ["application/json", "text/plain"]),
        "defaultOutputModes": list(manifest.get("default_output_modes") or ["application/json", "text/plain"]),
        "skills": skills,
    }
    provider = manifest.get("provider")
    if isinstance(provider, Mapping) and provider.get("organization") and provider.get("url"):
        card["provider"] = {"organization": provider["organization"], "url": provider["url"]}
    schemes, requirements = project_security(public)
    if schemes:
        card["securitySchemes"] = schemes
        card["securityRequirements"] = requirements
    return card
