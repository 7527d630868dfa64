"""The Unix-socket admin API: wire protocol, server and client.

:mod:`.protocol` documents the wire format (one JSON object per line,
varlink-style replies, stable error names, access levels); :mod:`.server`
serves a :class:`MethodRegistry`; :mod:`.client` is what the CLI uses.
"""

from .client import (
    AdminClient,
    AdminClientError,
    AdminConnectionError,
    AdminTimeout,
    ApiMismatch,
    DaemonNotRunning,
    ProtocolViolation,
    call_sync,
    exit_code_for,
)
from .protocol import (
    API_VERSION,
    PRODUCT,
    AdminError,
    Conflict,
    InternalError,
    InvalidParameter,
    InvalidRequest,
    Level,
    MethodNotFound,
    NotFound,
    NotReady,
    PermissionDenied,
    Refused,
)
from .server import (
    AdminServer,
    AdminSocketError,
    CallContext,
    MethodRegistry,
    PeerCredentials,
    SocketInUse,
    param,
)

__all__ = [
    "API_VERSION",
    "PRODUCT",
    "AdminClient",
    "AdminClientError",
    "AdminConnectionError",
    "AdminError",
    "AdminServer",
    "AdminSocketError",
    "AdminTimeout",
    "ApiMismatch",
    "CallContext",
    "Conflict",
    "DaemonNotRunning",
    "InternalError",
    "InvalidParameter",
    "InvalidRequest",
    "Level",
    "MethodNotFound",
    "MethodRegistry",
    "NotFound",
    "NotReady",
    "PeerCredentials",
    "PermissionDenied",
    "ProtocolViolation",
    "Refused",
    "SocketInUse",
    "call_sync",
    "exit_code_for",
    "param",
]
