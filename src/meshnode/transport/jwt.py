"""NATS JWT v2: minting, decoding and verifying the credential chain (AgentMesh §4.8, §18.2).

The reference binding's trust chain is operator → account → user (node), each
link a JWT signed by the nkey above it:

* an **operator** JWT is self-signed by the operator key and names the system
  account;
* an **account** JWT is signed by the operator and carries the account's limits
  (JetStream is only available to an account whose limits enable it);
* a **user** JWT (a node credential) is signed by the account key and carries the
  node's publish/subscribe permissions and a finite expiry.

Wire format, as nats-server reads it: ``base64url(header) "." base64url(claims)
"." base64url(sig)`` (all unpadded), the header is
``{"typ":"JWT","alg":"ed25519-nkey"}`` and the Ed25519 signature covers the
ASCII text of the first two parts joined by ``"."``. ``jti`` is the unpadded
RFC 4648 base32 of SHA-512/256 over the JSON of the standard claims only
(``aud exp iat iss name nbf sub``, in that order, empty ones omitted) — the
convention of the Go ``nats-io/jwt`` v2 library, which the server does not check
but tools display.

Everything here is pure: the clock is always a parameter (epoch seconds).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshnode.protocol.nkeys import KeyPair, Prefix, is_valid_public, verify

__all__ = [
    "JWT_HEADER",
    "NO_LIMIT",
    "UNLIMITED_JETSTREAM",
    "JetStreamLimits",
    "JwtError",
    "ResponsePermission",
    "ServiceExport",
    "ServiceImport",
    "compute_jti",
    "decode_jwt",
    "format_creds",
    "mint_account_jwt",
    "mint_operator_jwt",
    "mint_user_jwt",
    "nats_auth_callbacks",
    "parse_creds",
    "renew_at",
    "verify_jwt",
]

JWT_HEADER: Mapping[str, str] = {"typ": "JWT", "alg": "ed25519-nkey"}

NO_LIMIT = -1
"""The NATS JWT value for "unlimited" in every numeric limit."""

_JWT_VERSION = 2

# Which key role may sign which claim type. The Go library also accepts an
# account signing itself, which we never mint and so never accept.
_ISSUER_ROLE = {"operator": Prefix.OPERATOR, "account": Prefix.OPERATOR, "user": Prefix.ACCOUNT}
_SUBJECT_ROLE = {"operator": Prefix.OPERATOR, "account": Prefix.ACCOUNT, "user": Prefix.USER}

# The fields the jti hash covers, in the Go struct order that fixes their JSON order.
_JTI_FIELDS = ("aud", "exp", "iat", "iss", "name", "nbf", "sub")


class JwtError(ValueError):
    """A token that is malformed, wrongly signed, of the wrong kind, or outside its validity."""


@dataclass(frozen=True, slots=True)
class JetStreamLimits:
    """JetStream limits of an account. Any non-zero storage limit enables JetStream.

    Sizes are bytes; counts are objects; ``NO_LIMIT`` (-1) means unlimited.
    """

    mem_storage: int = NO_LIMIT
    disk_storage: int = NO_LIMIT
    streams: int = NO_LIMIT
    consumer: int = NO_LIMIT

    def claims(self) -> dict[str, int]:
        return {
            "mem_storage": self.mem_storage,
            "disk_storage": self.disk_storage,
            "streams": self.streams,
            "consumer": self.consumer,
        }


UNLIMITED_JETSTREAM = JetStreamLimits()


@dataclass(frozen=True, slots=True)
class ResponsePermission:
    """Lets a user publish to the reply subject of a message it received.

    ``max_msgs`` replies per request, within ``ttl_s`` seconds of receiving it.
    This is how a responder answers a request whose reply subject lies outside
    its publish allow list (another node's private inbox prefix).
    """

    max_msgs: int = 1
    ttl_s: float = 120.0

    def claims(self) -> dict[str, int]:
        # nats-io/jwt stores the TTL as a Go time.Duration: integer nanoseconds.
        return {"max": self.max_msgs, "ttl": round(self.ttl_s * 1_000_000_000)}


@dataclass(frozen=True, slots=True)
class ServiceExport:
    """A subject an account offers other accounts as a request-reply service (§15.2).

    ``response`` is the NATS response type: ``Singleton`` lets the responder
    answer each request once on its reply subject.
    """

    subject: str
    name: str = ""
    response: str = "Singleton"

    def claims(self) -> dict[str, Any]:
        return {
            "name": self.name or self.subject,
            "subject": self.subject,
            "type": "service",
            "response_type": self.response,
        }


@dataclass(frozen=True, slots=True)
class ServiceImport:
    """Another account's exported service, reachable here as ``local_subject`` (§15.2).

    Publishing on ``local_subject`` inside the importing account delivers to
    ``subject`` inside ``account``; the reply finds its way back.
    """

    account: str
    subject: str
    local_subject: str
    name: str = ""

    def claims(self) -> dict[str, Any]:
        return {
            "name": self.name or self.local_subject,
            "account": self.account,
            "subject": self.subject,
            "local_subject": self.local_subject,
            "type": "service",
        }


# --- encoding helpers -------------------------------------------------------


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    if not text.isascii() or "=" in text:
        raise JwtError("JWT segment is not unpadded base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JwtError("JWT segment is not unpadded base64url") from None


def _compact_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _go_json(value: object) -> bytes:
    """JSON as Go's encoding/json writes it: compact, UTF-8, HTML-safe escapes."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text.encode("utf-8")


def compute_jti(claims: Mapping[str, Any]) -> str:
    """The ``jti`` nats-io/jwt v2 derives for ``claims`` (its own ``jti`` is ignored)."""
    standard = {k: claims[k] for k in _JTI_FIELDS if claims.get(k)}
    digest = hashlib.new("sha512_256", _go_json(standard)).digest()
    return base64.b32encode(digest).decode("ascii").rstrip("=")


def _encode(claims: dict[str, Any], signer: KeyPair) -> str:
    claims["iss"] = signer.public_key
    claims.pop("jti", None)
    claims = {"jti": compute_jti(claims), **claims}
    signing_input = f"{_b64url(_compact_json(dict(JWT_HEADER)))}.{_b64url(_compact_json(claims))}"
    signature = signer.sign(signing_input.encode("ascii"))
    return f"{signing_input}.{_b64url(signature)}"


def _check_times(issued_at: int, expires_at: int | None) -> None:
    if isinstance(issued_at, bool) or not isinstance(issued_at, int) or issued_at <= 0:
        raise ValueError("issued_at must be positive epoch seconds")
    if expires_at is not None and (
        isinstance(expires_at, bool) or not isinstance(expires_at, int) or expires_at <= issued_at
    ):
        raise ValueError("expires_at must be epoch seconds after issued_at")


def _base_claims(
    *, subject: str, name: str, issued_at: int, expires_at: int | None
) -> dict[str, Any]:
    claims: dict[str, Any] = {"iat": issued_at, "name": name, "sub": subject}
    if expires_at is not None:
        claims["exp"] = expires_at
    return claims


def _require_key(key: str, role: Prefix, what: str) -> None:
    if not is_valid_public(key, role):
        raise ValueError(f"{what} must be a public {role.name.lower()} nkey")


def _require_signer(signer: KeyPair, role: Prefix, what: str) -> None:
    if signer.role != role:
        raise ValueError(f"{what} must be a {role.name.lower()} key pair, got {signer.role.name.lower()}")


# --- minting ----------------------------------------------------------------


def mint_operator_jwt(
    operator: KeyPair,
    *,
    name: str,
    system_account: str,
    issued_at: int,
    expires_at: int | None = None,
) -> str:
    """A self-signed operator JWT naming ``system_account`` as the system account.

    ``expires_at=None`` mints a JWT without expiry: the operator JWT is the root
    of trust, and an expiring root takes the whole mesh down with it.
    """
    _require_signer(operator, Prefix.OPERATOR, "operator")
    _require_key(system_account, Prefix.ACCOUNT, "system_account")
    _check_times(issued_at, expires_at)
    claims = _base_claims(
        subject=operator.public_key, name=name, issued_at=issued_at, expires_at=expires_at
    )
    claims["nats"] = {"system_account": system_account, "type": "operator", "version": _JWT_VERSION}
    return _encode(claims, operator)


def mint_account_jwt(
    operator: KeyPair,
    account_public: str,
    *,
    name: str,
    issued_at: int,
    expires_at: int | None = None,
    jetstream: JetStreamLimits | None = UNLIMITED_JETSTREAM,
    max_connections: int = NO_LIMIT,
    exports: Sequence[ServiceExport] = (),
    imports: Sequence[ServiceImport] = (),
) -> str:
    """An account JWT signed by ``operator``.

    ``jetstream=None`` leaves JetStream disabled for the account, which the
    system account requires; the default enables it without limits.
    ``exports`` and ``imports`` are the account's cross-account services
    (§15.2); without them its subjects are reachable from no other account.
    """
    _require_signer(operator, Prefix.OPERATOR, "operator")
    _require_key(account_public, Prefix.ACCOUNT, "account_public")
    _check_times(issued_at, expires_at)
    subjects = [e.subject for e in exports]
    for imported in imports:
        _require_key(imported.account, Prefix.ACCOUNT, "import account")
        subjects += [imported.subject, imported.local_subject]
    for subject in subjects:
        if not subject or any(c.isspace() for c in subject):
            raise ValueError(f"invalid export/import subject {subject!r}")
    limits: dict[str, Any] = {
        "subs": NO_LIMIT,
        "data": NO_LIMIT,
        "payload": NO_LIMIT,
        "imports": NO_LIMIT,
        "exports": NO_LIMIT,
        "wildcards": True,
        "conn": max_connections,
        "leaf": NO_LIMIT,
    }
    if jetstream is not None:
        limits.update(jetstream.claims())
    claims = _base_claims(
        subject=account_public, name=name, issued_at=issued_at, expires_at=expires_at
    )
    nats: dict[str, Any] = {"limits": limits, "type": "account", "version": _JWT_VERSION}
    if exports:
        nats["exports"] = [e.claims() for e in exports]
    if imports:
        nats["imports"] = [i.claims() for i in imports]
    claims["nats"] = nats
    return _encode(claims, operator)


def _permission(allow: Sequence[str], deny: Sequence[str]) -> dict[str, list[str]]:
    # An empty permission object means "everything" to nats-server, so an empty
    # allow list has to be spelled as an explicit deny of all subjects.
    if not allow:
        return {"deny": [">"]}
    block: dict[str, list[str]] = {"allow": list(allow)}
    if deny:
        block["deny"] = list(deny)
    return block


def mint_user_jwt(
    account: KeyPair,
    user_public: str,
    *,
    name: str,
    issued_at: int,
    expires_at: int,
    pub_allow: Sequence[str],
    sub_allow: Sequence[str],
    pub_deny: Sequence[str] = (),
    sub_deny: Sequence[str] = (),
    response: ResponsePermission | None = None,
    tags: Sequence[str] = (),
) -> str:
    """A user JWT (a node credential) signed by the ``account`` key.

    ``tags`` become the JWT's ``nats.tags``; the control plane uses them to
    carry the node's operator-attested profile claims (§4.4, §9.7).

    ``expires_at`` is required and must be after ``issued_at`` (§4.8: node
    credentials have a finite expiry). An empty allow list denies everything in
    that direction; it never means "no restriction". The credential is never a
    bearer token: the holder must prove possession of the user key at connect.
    """
    _require_signer(account, Prefix.ACCOUNT, "account")
    _require_key(user_public, Prefix.USER, "user_public")
    if expires_at is None:
        raise ValueError("a node credential must expire (§4.8)")
    _check_times(issued_at, expires_at)
    for subject in (*pub_allow, *sub_allow, *pub_deny, *sub_deny):
        if not isinstance(subject, str) or not subject or any(c.isspace() for c in subject):
            raise ValueError(f"invalid permission subject {subject!r}")
    nats: dict[str, Any] = {
        "pub": _permission(pub_allow, pub_deny),
        "sub": _permission(sub_allow, sub_deny),
    }
    if response is not None:
        nats["resp"] = response.claims()
    if tags:
        nats["tags"] = list(tags)
    nats.update(
        {
            "subs": NO_LIMIT,
            "data": NO_LIMIT,
            "payload": NO_LIMIT,
            "bearer_token": False,
            "type": "user",
            "version": _JWT_VERSION,
        }
    )
    claims = _base_claims(
        subject=user_public, name=name, issued_at=issued_at, expires_at=expires_at
    )
    claims["nats"] = nats
    return _encode(claims, account)


# --- decoding and verification ----------------------------------------------


def _split(token: str) -> tuple[str, str, str]:
    if not isinstance(token, str):
        raise JwtError("a JWT is a string")
    parts = token.strip().split(".")
    if len(parts) != 3 or not all(parts):
        raise JwtError("a JWT has three dot-separated segments")
    return parts[0], parts[1], parts[2]


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise JwtError(f"JWT {what} is not JSON") from None
    if not isinstance(value, dict):
        raise JwtError(f"JWT {what} is not a JSON object")
    return value


def decode_jwt(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a NATS JWT into ``(header, claims)`` without checking its signature.

    Raises JwtError when the token is malformed or its header is not the NATS
    ``ed25519-nkey`` JWT header. Use :func:`verify_jwt` before trusting claims.
    """
    header_b64, claims_b64, _ = _split(token)
    header = _json_object(_b64url_decode(header_b64), "header")
    if str(header.get("typ", "")).upper() != "JWT":
        raise JwtError(f"unsupported JWT type {header.get('typ')!r}")
    if str(header.get("alg", "")).lower() != JWT_HEADER["alg"]:
        raise JwtError(f"unsupported JWT algorithm {header.get('alg')!r}")
    claims = _json_object(_b64url_decode(claims_b64), "claims")
    return header, claims


def verify_jwt(token: str, issuer_public: str, *, now: int | None = None) -> dict[str, Any]:
    """Verify that ``issuer_public`` signed ``token`` and return its claims.

    Checks the signature, that ``iss`` is ``issuer_public``, that the issuer and
    subject keys have the roles the claim type requires (operator → operator,
    operator → account, account → user), and that the version is 2. With
    ``now`` (epoch seconds), also checks ``exp`` and ``nbf`` the way nats-server
    does (a token is still valid in its ``exp`` second). Raises JwtError.
    """
    _, claims = decode_jwt(token)
    header_b64, claims_b64, sig_b64 = _split(token)
    signature = _b64url_decode(sig_b64)
    if claims.get("iss") != issuer_public:
        raise JwtError("JWT was not issued by the expected key")
    nats = claims.get("nats")
    if not isinstance(nats, dict) or nats.get("version") != _JWT_VERSION:
        raise JwtError("not a NATS v2 JWT")
    kind = nats.get("type")
    if kind not in _ISSUER_ROLE:
        raise JwtError(f"unsupported claim type {kind!r}")
    if not verify(
        issuer_public, f"{header_b64}.{claims_b64}".encode("ascii"), signature,
        expect=_ISSUER_ROLE[kind],
    ):
        raise JwtError("JWT signature does not verify")
    subject = claims.get("sub")
    if not is_valid_public(subject, _SUBJECT_ROLE[kind]):
        raise JwtError(f"{kind} JWT subject is not a {_SUBJECT_ROLE[kind].name.lower()} key")
    if kind == "operator" and subject != issuer_public:
        raise JwtError("operator JWT is not self-signed")
    if now is not None:
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if isinstance(exp, int) and exp > 0 and now > exp:
            raise JwtError("JWT has expired")
        if isinstance(nbf, int) and nbf > 0 and now < nbf:
            raise JwtError("JWT is not yet valid")
    return claims


def renew_at(claims: Mapping[str, Any]) -> int:
    """When to renew a credential: two thirds through its own lifetime (§4.8).

    Derived from the credential's ``iat`` and ``exp``, never from a configured
    lifetime, so a credential minted under another policy still gets a
    proportionate deadline. Raises JwtError for a credential without a finite
    lifetime.
    """
    iat, exp = claims.get("iat"), claims.get("exp")
    if not isinstance(iat, int) or not isinstance(exp, int) or isinstance(iat, bool) or exp <= iat:
        raise JwtError("credential has no finite lifetime to renew within")
    return iat + (exp - iat) * 2 // 3


# --- credentials files --------------------------------------------------------

_CREDS_BLOCK = re.compile(
    r"^-{3,}\s*BEGIN ([A-Z ]+?)\s*-{3,}\r?\n\s*([A-Za-z0-9_.=-]+)\s*\r?\n-{3,}\s*END \1\s*-{3,}",
    re.MULTILINE,
)


def format_creds(jwt: str, seed: str) -> str:
    """The standard NATS ``.creds`` text holding a user JWT and its user nkey seed.

    The result holds a secret seed: write it with owner-only permissions.
    """
    _split(jwt)
    if not seed.startswith("SU"):
        raise ValueError("a credentials file carries a user seed (SU...)")
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n"
        "\n"
        "************************* SECRET *************************\n"
        "The seed below proves this node's identity to the mesh.\n"
        "Anyone holding it can connect as this node: keep it private.\n"
        "\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n"
        "\n"
        "**********************************************************\n"
    )


def parse_creds(text: str) -> tuple[str, str]:
    """``(jwt, seed)`` from NATS ``.creds`` text (as written by nsc or :func:`format_creds`)."""
    blocks = dict(_CREDS_BLOCK.findall(text))
    jwt = blocks.get("NATS USER JWT")
    seed = blocks.get("USER NKEY SEED")
    if jwt is None or seed is None:
        raise JwtError("credentials text lacks a user JWT block or a user seed block")
    _split(jwt)
    return jwt, seed


def nats_auth_callbacks(
    jwt_source: Callable[[], str], user: KeyPair
) -> tuple[Callable[[], bytes], Callable[[str], bytes]]:
    """``(user_jwt_cb, signature_cb)`` for ``nats.connect`` from a JWT source and user key.

    nats-py calls both on every (re)connect, so a renewed credential returned by
    ``jwt_source`` is presented on the next reconnect. (nats-py's own creds-file
    support needs the separate ``nkeys`` package; these callbacks do not.)
    """
    if user.role != Prefix.USER:
        raise ValueError("NATS clients authenticate with a user key pair")

    def user_jwt_cb() -> bytes:
        return jwt_source().encode("ascii")

    def signature_cb(nonce: str) -> bytes:
        return base64.b64encode(user.sign(nonce.encode("ascii")))

    return user_jwt_cb, signature_cb
