"""Invites: a NATS credentials file carrying the mesh's addresses in comment lines."""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix
from meshnode.transport.files import write_private_file
from meshnode.transport.jwt import JwtError, decode_jwt, format_creds, parse_creds
from meshnode.transport.permissions import node_inbox_prefix

from .wire import (
    _CONTROL_CHARS,
    _HTTP_SCHEMES,
    _INVITE_COMMENT,
    _MAX_INVITE_BYTES,
    _NATS_SCHEMES,
    _NODE_NAME,
    InviteError,
)

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

# --- invites -----------------------------------------------------------------------


class InviteBundle(NamedTuple):
    """What :meth:`ControlPlaneServer.invite` hands out: a new node identity and
    its starter credential. ``node_seed`` is the node's secret key."""

    node_name: str
    node_seed: str
    jwt: str

    @property
    def node_id(self) -> str:
        return KeyPair.from_seed(self.node_seed).public_key

    def __repr__(self) -> str:
        return f"InviteBundle(node_name={self.node_name!r}, node_id={self.node_id!r})"


@dataclass(frozen=True, slots=True)
class Invite:
    """A parsed invite (or plain NATS credentials) file.

    ``nats_urls``, ``control_plane_url`` and ``name`` are None when the file
    carries no meshnode comment lines (a plain ``.creds`` file).
    """

    node_seed: str = field(repr=False)
    jwt: str = field(repr=False)
    nats_urls: tuple[str, ...] | None
    control_plane_url: str | None
    name: str | None

    @property
    def node_key(self) -> KeyPair:
        return KeyPair.from_seed(self.node_seed)

    @property
    def node_id(self) -> str:
        return self.node_key.public_key


def _check_url(url: object, schemes: frozenset[str], what: str) -> str:
    if not isinstance(url, str) or not url or _CONTROL_CHARS.search(url) or any(
        c.isspace() for c in url
    ):
        raise ValueError(f"{what} {url!r} is not a URL")
    # Keeps the comment lines of an invite from looking like a creds block to
    # the line-oriented parsers of the NATS clients.
    if "--" in url or "BEGIN" in url.upper() or "," in url:
        raise ValueError(f"{what} {url!r} holds characters an invite cannot carry")
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"{what} {url!r} must be {'/'.join(sorted(schemes))}://host[:port]")
    return url


def _check_node_name(name: object) -> str:
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name) or "--" in name:
        raise ValueError(
            f"node name {name!r} must be 1-63 of A-Z a-z 0-9 . _ @ - (no '--'), "
            "starting with a letter or digit"
        )
    return name


def write_invite(
    path: str | os.PathLike[str],
    bundle: InviteBundle,
    nats_urls: Sequence[str],
    control_plane_url: str | None,
    *,
    overwrite: bool = False,
) -> None:
    """Write ``bundle`` as a NATS credentials file with the mesh's addresses in comments.

    The file is owner-only (0600) from the moment it exists. Without
    ``overwrite`` an existing file is left alone: FileExistsError.
    """
    name = _check_node_name(bundle.node_name)
    urls = [_check_url(u, _NATS_SCHEMES, "NATS URL") for u in nats_urls]
    lines = [
        f"# meshnode invite for node {name}. This is a standard NATS credentials file",
        "# (any NATS client can load it); the meshnode lines say where the mesh is.",
        "# It holds the node's secret key: hand it over privately, keep it 0600.",
        "# meshnode-invite: 1",
        f"# meshnode-node-name: {name}",
        f"# meshnode-node-id: {bundle.node_id}",
        *(f"# meshnode-nats: {url}" for url in urls),
        # The reply prefix this node's credentials allow: a NATS client must
        # connect with inbox_prefix set to it (replies elsewhere are refused).
        f"# meshnode-inbox-prefix: {node_inbox_prefix(bundle.node_id)}",
    ]
    if control_plane_url is not None:
        lines.append(
            "# meshnode-control-plane: "
            + _check_url(control_plane_url, _HTTP_SCHEMES, "control-plane URL")
        )
    text = "\n".join(lines) + "\n\n" + format_creds(bundle.jwt, bundle.node_seed)
    write_private_file(Path(path), text, replace=overwrite)


def parse_invite(text: str) -> Invite:
    """Parse invite text, or a plain NATS ``.creds`` text (then URLs and name are None).

    Raises InviteError when the credential blocks are missing, the seed is not
    a user seed, the JWT is not for that seed's key, or a meshnode line is
    malformed.
    """
    try:
        jwt, seed = parse_creds(text)
        node_key = KeyPair.from_seed(seed)
        _, claims = decode_jwt(jwt)
    except (JwtError, NkeyError) as exc:
        raise InviteError(f"not a usable credentials file: {exc}") from None
    if node_key.role != Prefix.USER:
        raise InviteError("the credentials file does not hold a user seed")
    if claims.get("sub") != node_key.public_key:
        raise InviteError("the credential in the file was not issued to the file's key")

    nats_urls: list[str] = []
    control_plane: str | None = None
    name: str | None = None
    for line in text.splitlines():
        match = _INVITE_COMMENT.match(line)
        if match is None:
            continue
        key, value = match.groups()
        try:
            if key == "nats":
                nats_urls += [
                    _check_url(u, _NATS_SCHEMES, "NATS URL") for u in re.split(r"[\s,]+", value)
                ]
            elif key == "control-plane":
                if control_plane is not None:
                    raise ValueError("two control-plane lines")
                control_plane = _check_url(value, _HTTP_SCHEMES, "control-plane URL")
            elif key == "node-name":
                name = _check_node_name(value)
            elif key == "node-id" and value != node_key.public_key:
                raise ValueError("node-id line does not match the seed")
            # Other keys are ignored: later versions may add lines.
        except ValueError as exc:
            raise InviteError(f"invalid meshnode-{key} line: {exc}") from None
    return Invite(
        node_seed=seed,
        jwt=jwt,
        nats_urls=tuple(nats_urls) if nats_urls else None,
        control_plane_url=control_plane,
        name=name,
    )


def read_invite(path: str | os.PathLike[str]) -> Invite:
    """Read an invite or plain credentials file; see :func:`parse_invite`."""
    with open(path, "rb") as handle:
        mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
        raw = handle.read(_MAX_INVITE_BYTES + 1)
    if len(raw) > _MAX_INVITE_BYTES:
        raise InviteError(f"{path} is larger than any credentials file")
    if mode & 0o077:
        log.warning(
            "%s is readable by other users (mode %o): treat the node key in it as exposed",
            path, mode,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InviteError(f"{path} is not text") from None
    return parse_invite(text)
