"""The credential control plane: enrolment, renewal and revocation of node credentials.

AgentMesh §4.8 requires node credentials to expire and renewal to work without
the transport: a node whose credential lapsed cannot reach anything over NATS,
so it renews over a separate channel — this small HTTP/1.1 service, run beside
the embedded mesh, holding the account signing key that never leaves the host.

Wire contract (WIRE-NOTES, "Credential renewal"; §18.10):

``POST /v1/node-credential``
    Body ``{node_id, ts, node_sig, agents: [{id, sig}]}``. ``ts`` is unix
    seconds; ``node_sig`` is standard base64 of the node key's Ed25519
    signature over ``mesh-node-cred-v1:{ts}:{node_id}:{sorted agent ids joined
    by ","}``; each agent ``sig`` is the agent key's signature over
    ``mesh-node-agent-v1:{ts}:{node_id}:{agent_id}``. Authority to renew is
    possession of the node key and of every hosted agent's key, never the
    credential being renewed, which may long have expired.
    ``200 {jwt, node_id, agents, expires_at, mesh: {name, protocol,
    nats_endpoints, endpoints}}`` (``endpoints`` repeats ``nats_endpoints`` for
    clients of the other implementations, which read that name). Any other
    status carries ``{error, code?}``.
    ``mesh.inbox_prefix`` is the reply prefix the credential may subscribe
    under (``_INBOX_{node_id}`` for a meshnode node, ``_INBOX`` for an SDK agent).
``POST /v1/bootstrap``
    The AgentMesh SDKs' first credential. Body ``{token, agent_id}``: a
    single-use ``am_…`` token from ``meshnode mesh token`` and the agent's
    public key. Mints a node key for that one agent and records an ``sdk``
    enrolment; ``200 {jwt, seed, creds, node_id, agent_id, label, expires_at
    (RFC 3339), renew_url, trust_attestation, mesh: {name, protocol,
    endpoints, nats_endpoints, inbox_prefix}}``. Renewal afterwards is
    ``POST /v1/node-credential`` with that node key and agent (roster fixed).
``GET /v1/mesh``
    ``200 {name, protocol, nats_endpoints, control_plane, inbox_prefixes}``:
    public, no secrets.

Refusal is the revocation mechanism (§4.8): a retired node, or a roster with a
retired or paused agent, is refused its next renewal (403 with ``code``
``node_retired``, ``node_unknown``, ``agent_terminated`` or ``agent_paused``).
A credential already issued stays usable until its own expiry, and
:meth:`ControlPlaneServer.retire_node` says so, with the date.

Enrolment state lives in ``<state_dir>/nodes.json`` (owner-only, replaced
atomically, read-modify-write under an advisory lock so a CLI process and the
daemon can both change it). It is re-read for every request, so a retirement
made by another process takes effect on the next renewal.

An invite is a standard NATS credentials file (:func:`write_invite`) with the
mesh's addresses in ``#`` comment lines outside the BEGIN/END blocks, which
NATS tools skip.

The package splits along those jobs: :mod:`.wire` (limits, errors, the signed
request), :mod:`.state` (``nodes.json``), :mod:`.invites`, :mod:`.enrolment`
(enrolment and minting, no HTTP), :mod:`.http` and :mod:`.server` (the
listener), :mod:`.client`.
"""

from __future__ import annotations

from .client import ControlPlaneClient, CredentialGrant, MeshInfo
from .enrolment import CredentialIssuer, Enrolment
from .invites import Invite, InviteBundle, parse_invite, read_invite, write_invite
from .server import ControlPlaneServer
from .state import EnrolledNode, EnrolmentToken
from .wire import (
    AGENT_SIG_TAG,
    DEFAULT_PORT,
    MAX_REQUEST_BODY,
    MAX_REQUEST_HEAD,
    MAX_ROSTER,
    NODE_SIG_TAG,
    PROTOCOL_VERSION,
    REVOCATION_CODES,
    ControlPlaneBadResponse,
    ControlPlaneError,
    ControlPlaneStateError,
    ControlPlaneUnreachable,
    CredentialRefused,
    CredentialRequestError,
    InviteError,
    agent_signing_input,
    node_credential_request,
    node_signing_input,
    verify_node_credential_request,
)

__all__ = [
    "AGENT_SIG_TAG",
    "DEFAULT_PORT",
    "MAX_REQUEST_BODY",
    "MAX_REQUEST_HEAD",
    "MAX_ROSTER",
    "NODE_SIG_TAG",
    "PROTOCOL_VERSION",
    "REVOCATION_CODES",
    "ControlPlaneBadResponse",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlPlaneServer",
    "ControlPlaneStateError",
    "ControlPlaneUnreachable",
    "CredentialIssuer",
    "CredentialGrant",
    "CredentialRefused",
    "CredentialRequestError",
    "EnrolledNode",
    "Enrolment",
    "EnrolmentToken",
    "Invite",
    "InviteBundle",
    "InviteError",
    "MeshInfo",
    "agent_signing_input",
    "node_credential_request",
    "node_signing_input",
    "parse_invite",
    "read_invite",
    "verify_node_credential_request",
    "write_invite",
]
