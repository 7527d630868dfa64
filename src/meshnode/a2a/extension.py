"""The AGBoss mesh extension's pure core, by its gateway-side name.

The code lives in :mod:`meshnode.protocol.a2a_extension` (beside the protocol
core, so the node and config need not import the gateway). This module
re-exports what the daemon's wiring imports from here.
"""

from __future__ import annotations

from meshnode.protocol.a2a_extension import EXTENSION_URI, IssuerTrust, parse_verify_key

__all__ = ["EXTENSION_URI", "IssuerTrust", "parse_verify_key"]
