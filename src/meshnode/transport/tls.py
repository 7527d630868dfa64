"""TLS contexts for the mesh's listeners (NATS, control plane) and their clients.

The embedded mesh serves TLS from one PEM certificate and key
(``[mesh.embedded] tls_cert``/``tls_key``) on both its NATS listener and its
control plane; clients verify it with the system trust store or a CA bundle
(``[mesh] ca_file``). The embedded node itself connects to its own broker by
*pinning* its own certificate: it knows exactly which certificate it serves,
which is a stronger check than a hostname, and works for a self-signed one.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["client_context", "pinned_context", "server_context"]


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side context serving ``cert`` (PEM chain) with ``key``; TLS 1.2 or later.

    Raises ValueError naming the file when either cannot be loaded.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert} with key {key}: {exc}") from exc
    return context


def client_context(ca_file: Path | None = None) -> ssl.SSLContext:
    """A client context verifying the server (hostname included) against the system
    trust store, or against ``ca_file`` (PEM) when given."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA file {ca_file}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def pinned_context(cert: Path) -> ssl.SSLContext:
    """A client context that accepts exactly the certificate (chain) in ``cert``.

    Used by the embedded node for its own broker: the leaf itself is the trust
    anchor (``VERIFY_X509_PARTIAL_CHAIN``), so no hostname check is needed.
    """
    context = client_context(cert)
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context
