"""The node credential of a node that joined someone else's mesh (§4.8).

Renewal needs no NATS connection and no valid credential: the authority is
the node key and the agents' keys. So the node renews *before* connecting
whenever the stored credential is due (two thirds of its own life) or already
lapsed — a laptop asleep for a month heals itself on start — and whenever its
roster changed. The stored credential is kept in the data dir (0600) together
with the roster it was minted for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshnode.config import Config
from meshnode.control_plane import (
    ControlPlaneClient,
    ControlPlaneUnreachable,
    CredentialGrant,
    CredentialRefused,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.subjects import agent_inbox
from meshnode.transport.files import write_private_file
from meshnode.transport.grants import Grants
from meshnode.transport.jwt import decode_jwt, renew_at
from meshnode.transport.permissions import STARTER_TAG, grants_revision
from meshnode.transport.tls import client_context

__all__ = [
    "CREDENTIAL_FILE",
    "CredentialUnavailable",
    "obtain_credential",
    "request_credential_patiently",
    "store_credential",
    "stored_trust_attestation",
]

log = logging.getLogger("meshnode.credentials")

#: How long a credential request waits out the control plane's rate limit before
#: the refusal is reported: a whole window of the default limit (30 requests per
#: node key per 60 s) and a margin.
RATE_LIMIT_PATIENCE_S = 75.0


async def request_credential_patiently(
    client: ControlPlaneClient,
    node_key: KeyPair,
    agent_keys: Sequence[KeyPair],
    *,
    patience_s: float = RATE_LIMIT_PATIENCE_S,
) -> CredentialGrant:
    """``client.request_credential``, waiting out the control plane's rate limit.

    Every roster change needs a credential for the new roster, so a script
    adding and removing agents on a joined node can ask more often than the
    control plane's per-node limit allows (``[control_plane] node_rate_limit``).
    A 429 names when to ask again (``retry_after_ms``); this waits that long and
    asks again, as long as the waits fit in ``patience_s``. Any other refusal,
    and a 429 past the patience, is raised as it came.
    """
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await client.request_credential(node_key, agent_keys)
        except CredentialRefused as exc:
            if exc.status != 429 or exc.retry_after_ms is None:
                raise
            wait_s = max(0.0, exc.retry_after_ms / 1000)
            if time.monotonic() + wait_s > deadline:
                raise
            log.info(
                "the control plane limits this node's credential requests (%s); asking again in %.1f s",
                exc.error, wait_s,
            )
            await asyncio.sleep(wait_s)

CREDENTIAL_FILE = "credential.json"


class CredentialUnavailable(RuntimeError):
    """No usable credential: nothing stored that is still valid, and no renewal."""


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("jwt"), str) else None


def store_credential(
    data_dir: Path, jwt: str, roster: list[str], trust_attestation: dict[str, Any] | None = None
) -> None:
    """Write the credential (and the §9.7 attestation issued with it) atomically, mode
    0600 (no window of wider permissions)."""
    # Which grants this version mints: a later version renews what an earlier stored.
    record: dict[str, Any] = {"jwt": jwt, "roster": sorted(roster), "grants": grants_revision()}
    if trust_attestation is not None:
        record["trust_attestation"] = trust_attestation
    write_private_file(data_dir / CREDENTIAL_FILE, json.dumps(record), replace=True)


def stored_trust_attestation(data_dir: Path) -> dict[str, Any] | None:
    """The attestation stored with the current credential, if the mesh issued one."""
    stored = _load(data_dir / CREDENTIAL_FILE)
    attestation = stored.get("trust_attestation") if stored else None
    return attestation if isinstance(attestation, dict) else None


def _is_starter(claims: dict[str, Any] | None) -> bool:
    """Whether ``claims`` are an invite's starter credential (grants nothing: never connect with it)."""
    nats = claims.get("nats") if claims else None
    tags = nats.get("tags") if isinstance(nats, dict) else None
    return isinstance(tags, list) and any(
        isinstance(t, str) and t.lower() == STARTER_TAG for t in tags
    )


def _not_covered(claims: dict[str, Any], roster: list[str]) -> list[str]:
    """The agents of ``roster`` whose inbox the credential's grants do not let the
    node subscribe to (a service-role credential's wildcards cover them all)."""
    grants = Grants.from_claims(claims)
    return [agent for agent in roster if not grants.can_subscribe(agent_inbox(agent))]


def _claims(jwt: str) -> dict[str, Any] | None:
    try:
        return decode_jwt(jwt)[1]
    except Exception:
        return None


async def obtain_credential(
    config: Config, data_dir: Path, node_key: KeyPair, agent_keys: list[KeyPair], *, covering: bool = False,
    renew: bool = False,
) -> str:
    """The JWT to connect with: the stored one while it is fresh, covers the
    roster and was stored under this version's grants (:func:`grants_revision`),
    else a renewed one from the control plane, else (when the control plane
    cannot be reached) the stored one as long as it has not expired.

    ``covering`` is for a roster change: the stored credential stands in only
    if its grants cover every agent of the roster. An agent added while the control
    plane was away was otherwise hosted, registered and shown running under a
    credential that does not name it: the broker refused its subscriptions and
    it heard nothing. It raises :class:`CredentialUnavailable` instead, and the
    change is refused with a "try again".

    ``renew`` is an operator's ``meshnode renew``: a new credential from the
    control plane even while the stored one is fresh (its grants may predate
    the mesh's), and CredentialUnavailable rather than the stored one when
    the control plane does not answer (nothing was renewed: say so).
    """
    roster = sorted(k.public_key for k in agent_keys)
    unreachable: ControlPlaneUnreachable | None = None
    stored = _load(data_dir / CREDENTIAL_FILE)
    now = time.time()
    stored_claims = _claims(stored["jwt"]) if stored else None
    fresh = (
        stored is not None
        and stored_claims is not None
        and stored_claims.get("sub") == node_key.public_key
        and sorted(stored.get("roster") or []) == roster
        and now < renew_at(stored_claims)
        and not _is_starter(stored_claims)
    )
    if fresh and stored is not None and not renew:
        # Stored by a version that minted other grants (an upgrade): renewed
        # now, or (control plane away) used as it is until it lapses. Without
        # a control plane there is nothing to renew from: used as it is.
        if stored.get("grants") == grants_revision() or not config.mesh.control_plane:
            return str(stored["jwt"])
        log.info("the stored node credential predates this version's grants: renewing it now")
    if config.mesh.control_plane:
        ca_file = config.mesh.ca_file
        client = ControlPlaneClient(
            str(config.mesh.control_plane),
            ssl_context=client_context(ca_file) if ca_file is not None else None,
        )
        try:
            grant = await request_credential_patiently(client, node_key, agent_keys)
        except CredentialRefused as exc:
            # Refusal is how revocation reaches a node: say so plainly.
            advice = (
                f"; it limits each node to [control_plane] node_rate_limit requests per rate_window, "
                f"and still did after {RATE_LIMIT_PATIENCE_S:g} s of waiting"
                if exc.status == 429 else ""
            )
            raise CredentialUnavailable(
                f"the control plane refused a credential ({exc.status} {exc.code or 'refused'}): {exc.error}{advice}"
            ) from exc
        except ControlPlaneUnreachable as exc:
            if renew:
                raise CredentialUnavailable(
                    f"the control plane did not answer ({exc}); the node credential in force stays "
                    "until it is due (check [mesh] control_plane)"
                ) from exc
            log.warning("control plane unreachable (%s); trying the stored credential", exc)
            unreachable = exc
        else:
            store_credential(data_dir, grant.jwt, roster, grant.trust_attestation)
            log.info("node credential renewed; expires %s", time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(grant.expires_at)))
            return grant.jwt
    if _is_starter(stored_claims):
        raise CredentialUnavailable(
            "this node holds only its invite's starter credential, which grants nothing on the "
            "mesh: the first start needs the control plane ([mesh] control_plane) to issue the "
            "node's credential; check that it is reachable"
        )
    if stored is not None and stored_claims is not None and now < float(stored_claims.get("exp", 0)):
        missing = _not_covered(stored_claims, roster) if covering and unreachable is not None else []
        if missing:
            raise CredentialUnavailable(
                f"the control plane did not answer ({unreachable}), and the stored node credential does not "
                f"cover {len(missing)} of the roster's agents ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): the broker would refuse their subscriptions; "
                "check [mesh] control_plane"
            )
        log.warning("using the stored credential (expires %s)", stored_claims.get("exp"))
        return str(stored["jwt"])
    raise CredentialUnavailable(
        "no usable node credential: the stored one is missing or expired and the control "
        "plane could not renew it (check [mesh] control_plane)"
    )
