"""The agent manifest at registration (AgentMesh §8, with §4.4, §6.2, §8.6, §9.7).

:func:`validate_registration` is what the registry runs on intake: it refuses
a manifest that fails the schema (``INVALID_MANIFEST``, with ``details.field``
naming the member at fault), a registration whose ``from`` is not the
manifest's ``id`` (``IDENTITY_MISMATCH``), and one whose vouch or owner
attestation does not hold (``UNAUTHORIZED``, see :mod:`.attestations`). It
returns the manifest to store, normalized:

* legacy names (``skills``, ``skill_details``) are read and only the new names
  are emitted (§8.5);
* declarations that must be *dropped rather than served* when unreadable are
  dropped: an offering's ``reporting`` (§8.5.2), ``data_use`` (§8.10),
  ``compliance`` (§8.11), and ``public.access`` (§8.12, also when it carries
  anything secret-shaped);
* server-controlled members are set by the registry, never taken from the
  registrant: ``owner`` (defaults to the node), ``visibility`` (defaults to
  public), ``sandbox``, ``endpoints`` (stamped from ``endpoint``), and the
  public block's ``offering_details`` / default modes (§8.7);
* ``sealing`` is derived per §8.9 when the operator did not declare one.

Everything here is pure: the clock is ``now_ms`` and nothing is read or written.

The work is split by job: :mod:`.registration` runs intake in order,
:mod:`.shapes` holds the predicates every check shares, :mod:`.declarations`
reads the drop-when-unreadable declarations, :mod:`.access` the §8.12 block,
and :mod:`.public_block` the §8.7 storefront. Import from here.
"""

from __future__ import annotations

from .access import ACCESS_ADMISSION_POLICIES
from .declarations import DATA_USE_PROMISES, REPORTING_LEVELS, parse_cadence_ms
from .public_block import clamp_for_sandbox, describe_document, materialize_public_block
from .registration import (
    INTERACTION_STYLES,
    SEALING_POSTURES,
    VISIBILITIES,
    RegistrationResult,
    check_registration,
    derive_sealing,
    validate_registration,
)

__all__ = [
    "ACCESS_ADMISSION_POLICIES",
    "DATA_USE_PROMISES",
    "INTERACTION_STYLES",
    "REPORTING_LEVELS",
    "SEALING_POSTURES",
    "VISIBILITIES",
    "RegistrationResult",
    "check_registration",
    "clamp_for_sandbox",
    "derive_sealing",
    "describe_document",
    "materialize_public_block",
    "parse_cadence_ms",
    "validate_registration",
]
