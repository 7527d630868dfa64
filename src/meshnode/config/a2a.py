"""The ``[a2a]`` tables: the bridge, its peers and its issuers (see :mod:`meshnode.config`)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    WithJsonSchema,
    field_validator,
)
from pydantic.functional_validators import BeforeValidator

# The extension's pure core (no SDK): config checks a key's form when it is read.
from meshnode.protocol.a2a_extension import parse_verify_key

from .sections import _FORBID
from .values import (
    _AGENT_NAME,
    Duration,
    OptionalHttpUrl,
    _choice,
    _choice_schema,
    _Problems,
    _toml_key,
    _url,
)

__all__ = [
    "A2AConfig",
    "A2APeerConfig",
]


_USD_DECIMAL = re.compile(r"\d+(?:\.\d+)?")


def _usd_decimal(value: object) -> str:
    # Money is a decimal string in the mesh extension, never a float: a TOML
    # float (0.1) would already have lost the amount it was meant to be.
    if isinstance(value, str) and _USD_DECIMAL.fullmatch(value.strip()):
        return value.strip()
    raise ValueError(f'expected a USD amount as a decimal string like "0.05", got {value!r}')


def _optional_verify_key(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected an Ed25519 public key string, got {value!r}")
    parse_verify_key(value)  # raises ValueError naming the accepted forms
    return value.strip()


class A2APeerConfig(BaseModel):
    """``[a2a.peers.<name>]``: an external A2A agent hosted agents may call as ``a2a:<name>``."""

    model_config = _FORBID

    url: Annotated[str, BeforeValidator(_url(("http", "https"), "A2A agent card or base")),
                   WithJsonSchema({"type": "string"})]
    """The peer's Agent Card URL (``…/agent-card.json``) or its base URL (the card is
    then read from ``/.well-known/agent-card.json`` below it)."""
    contract_price: Annotated[str, BeforeValidator(_usd_decimal), WithJsonSchema({"type": "string"})]
    """What one completed call costs at least, in USD (``"0.05"``): the charge is
    max(verified reported spend, contract_price)."""
    audience: str | None = None
    """The peer's application name for the envelope's ``audience``; default from its
    card (the extension's ``params.application``, else the card's name)."""
    issuer_key: Annotated[str | None, BeforeValidator(_optional_verify_key),
                          WithJsonSchema({"type": "string"})] = None
    """The Ed25519 key that signs the peer's run reports (``U…`` nkey or base64url);
    default from its card (the extension's ``params.issuerKey``)."""
    timeout: Duration = timedelta(seconds=30)
    """How long one HTTP attempt may take before it counts as ambiguous."""
    card_ttl: Duration = timedelta(minutes=10)
    """How long a fetched Agent Card is reused before it is read again."""



_LISTEN = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")


_LISTEN_FD = re.compile(r"fd://(?P<fd>\d{1,9})")


def listen_fd(listen: str) -> int | None:
    """The descriptor number of a ``listen = "fd://N"`` address, None for ``"host:port"``."""
    m = _LISTEN_FD.fullmatch(listen.strip())
    return int(m.group("fd")) if m is not None else None


def _listen_address(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        m = _LISTEN.fullmatch(value.strip())
        if m is not None and int(m.group("port")) <= 65535:
            return value.strip()
        if listen_fd(value) is not None:
            return value.strip()
    raise ValueError(
        'expected "host:port" (e.g. "127.0.0.1:8700" or "[::1]:8700") or "fd://N" (a listening socket '
        f"passed as file descriptor N), got {value!r}"
    )


def _verify_key_text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("expected an Ed25519 public key as a string")
    parse_verify_key(value)  # raises ValueError naming the accepted forms
    return value.strip()


class A2AIssuerConfig(BaseModel):
    """``[a2a.issuers.<name>]``: a caller application whose signed envelopes are
    trusted (its budget and deadline bind the work, its origin is the execution's)."""

    model_config = _FORBID

    key: Annotated[str, BeforeValidator(_verify_key_text), WithJsonSchema({"type": "string"})]
    """The issuer's Ed25519 public key: a user nkey (``U...``) or 32 bytes in base64url."""


class A2AConfig(BaseModel):
    """``[a2a]``: the A2A bridge. Inbound serving is off unless ``listen`` is set."""

    model_config = _FORBID

    listen: Annotated[
        str | None, BeforeValidator(_listen_address), WithJsonSchema({"type": "string"})
    ] = None
    """Address the A2A HTTP server binds (``"127.0.0.1:8700"``), or ``"fd://N"``: the
    listening TCP socket a supervisor passed as file descriptor N (a systemd socket
    unit's first is 3). Unset = not served."""
    public_url: OptionalHttpUrl = None
    """Base URL the Agent Cards advertise; defaults to ``http://<listen>``."""
    application: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """This application's name: the audience envelopes must name and the issuer
    of run reports. Defaults to ``[node] name``."""
    expose: list[str] = Field(default_factory=list)
    """Hosted agents (names of ``[agents.<name>]`` tables) served over A2A."""
    max_mesh_hops: Annotated[int, Field(ge=1, le=64)] = 8
    """A call chain this long is refused (REJECTED, ``limit.hops``)."""
    idempotency_retention: Duration = timedelta(hours=24)
    """How long a caller's messageId maps to its task (card ``idempotencyRetention``)."""
    clock_skew: Duration = timedelta(seconds=30)
    """How far two applications' clocks may disagree: an envelope issued this
    far in the future counts, and an ``expiresIn`` may exceed the seed's PT60S
    replay window by as much, never more."""
    send_wait: Duration = timedelta(seconds=30)
    """How long a blocking SendMessage waits for a terminal state before it
    answers with the task as it stands (GetTask follows it up)."""
    task_timeout: Duration = timedelta(minutes=10)
    """The longest a bridged task is followed when the caller set no deadline."""
    allow_issuers: list[str] | None = None
    """Issuers whose signatures are trusted. Unset: exactly the configured
    ``[a2a.issuers]``. A list: the names or nkey ids listed; ``"*"`` admits
    every configured issuer and every mesh agent id (nkey) issuer."""
    issuers: dict[str, A2AIssuerConfig] = Field(default_factory=dict)
    signing: Annotated[
        Literal["agent", "node", "none"],
        _choice("agent", "node", "none", fold_case=True),
        _choice_schema("agent", "node", "none"),
    ] = "agent"
    """Who signs outbound envelopes: ``agent`` — the calling agent's key, issuer its id
    (verifiable from the id itself); ``node`` — the node key, issuer ``application``
    (the peer configures the node's public key for it); ``none`` — an unsecured claim."""
    peers: dict[str, A2APeerConfig] = Field(default_factory=dict)
    """External A2A agents by local name (``[a-z0-9][a-z0-9_-]{0,63}``)."""

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_names(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        problems = [
            (f"a2a.peers.{_toml_key(str(name))}",
             "peer name must match [a-z0-9][a-z0-9_-]{0,63} (lower-case letters, digits, '_' and '-')")
            for name in value
            if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name)
        ]
        if problems:
            raise _Problems(problems)
        return value


