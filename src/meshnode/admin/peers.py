"""Who is on the other end of an admin connection: ``SO_PEERCRED`` and the
peer's groups, read from the socket (used by :mod:`.server` to pick each
connection's access level)."""

from __future__ import annotations

import os
import pwd
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PeerCredentials", "PeerCredentialsFn", "peer_in_group", "so_peercred"]


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The kernel's word on who is at the other end of a connection."""

    pid: int
    uid: int
    gid: int
    #: Supplementary groups of the peer process at connect time (SO_PEERGROUPS), if known.
    groups: tuple[int, ...] = ()


#: Looks up a connected socket's peer; the default is :func:`so_peercred`.
PeerCredentialsFn = Callable[[socket.socket], PeerCredentials]

_UCRED = struct.Struct("3i")


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer process's supplementary groups as the kernel recorded them at
    ``connect()`` — what ``newgrp``/``sg``/``setgroups`` actually granted it,
    not what the user database says. Empty when the kernel cannot say."""
    size = 64 * 4
    for _ in range(4):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == 34 and size < 65536 * 4:  # ERANGE: more groups than the buffer holds
                size *= 8
                continue
            return ()
        count = len(raw) // 4
        return struct.unpack(f"{count}I", raw[: count * 4])
    return ()


def so_peercred(sock: socket.socket) -> PeerCredentials:
    """The peer's credentials via ``SO_PEERCRED`` (Linux), captured at ``connect()``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=_peer_groups(sock))


def peer_in_group(uid: int, gid: int, group_gid: int) -> bool:
    """Whether a peer (``uid``, primary ``gid``) belongs to ``group_gid``.

    ``SO_PEERCRED`` only reports the primary gid, so supplementary membership
    comes from the user database (``os.getgrouplist``). May block on NSS
    (LDAP, sssd): call it off the event loop.
    """
    if gid == group_gid:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    try:
        return group_gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except OSError:
        return False
