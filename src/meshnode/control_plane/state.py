"""Enrolment state: the nodes and agents the control plane knows, in ``nodes.json``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshnode.protocol.attestations import TRUST_TIERS
from meshnode.protocol.nkeys import Prefix, is_valid_public
from meshnode.transport.embedded import (
    DEFAULT_TENANT,
    check_tenant_name,
)
from meshnode.transport.files import read_private_file, write_private_file

if sys.platform != "win32":
    import fcntl


from .wire import _LOCK_FILE, _STATE_FILE, _STATE_VERSION, ControlPlaneStateError

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

# --- enrolment state ----------------------------------------------------------------


AgentStatus = Literal["active", "paused", "retired"]


@dataclass(frozen=True, slots=True)
class EnrolledNode:
    """A node the control plane knows. Times are unix seconds."""

    node_id: str
    name: str
    enrolled_at: int
    retired_at: int | None = None
    credential_expires_at: int | None = None
    """Latest expiry of any credential issued to the node (invite included)."""
    last_issued_at: int | None = None
    trust_tier: str = "standard"
    """The operator-attested tier (§9.7) carried in every credential issued to the node."""
    tenant: str = DEFAULT_TENANT
    """The tenant (NATS account, §15) whose account signs the node's credentials."""
    profile: str = "node"
    """``node`` (a meshnode node) or ``sdk`` (one SDK agent, enrolled by a token)."""
    agent_id: str | None = None
    """The one agent of an ``sdk`` enrolment; None for a ``node`` enrolment."""
    invite_expires_at: int | None = None
    """An invited node not yet started: its first credential is refused after this
    (``invite_expired``); None once it got one, or when invites do not expire."""

    @property
    def retired(self) -> bool:
        return self.retired_at is not None

    def invite_expired(self, now: int) -> bool:
        """Invited, never started, and past the invite's validity."""
        return self.invite_expires_at is not None and now > self.invite_expires_at

    def state(self, now: int) -> str:
        """``retired``, ``expired`` (its invite was not used in time), ``invited``
        (not started yet) or ``active``."""
        if self.retired:
            return "retired"
        if self.invite_expires_at is not None:
            return "expired" if self.invite_expired(now) else "invited"
        return "active"


@dataclass(frozen=True, slots=True)
class EnrolmentToken:
    """A single-use ``am_…`` enrolment token, known by its SHA-256 only. Unix seconds."""

    digest: str
    name: str
    created_at: int
    expires_at: int
    trust_tier: str = "standard"
    tenant: str = DEFAULT_TENANT
    used_at: int | None = None
    node_id: str | None = None
    """The node key the token was exchanged for (set with ``used_at``)."""
    revoked_at: int | None = None

    def state(self, now: int) -> str:
        """``pending``, ``used``, ``revoked`` or ``expired``."""
        if self.used_at is not None:
            return "used"
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if now >= self.expires_at else "pending"


@dataclass(slots=True)
class _AgentRecord:
    status: AgentStatus = "active"
    changed_at: int | None = None
    credential_expires_at: int | None = None


@dataclass(slots=True)
class _State:
    nodes: dict[str, EnrolledNode] = field(default_factory=dict)
    agents: dict[str, _AgentRecord] = field(default_factory=dict)
    tokens: dict[str, EnrolmentToken] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": _STATE_VERSION,
                "tokens": {
                    digest: {
                        "name": t.name,
                        "created_at": t.created_at,
                        "expires_at": t.expires_at,
                        "trust_tier": t.trust_tier,
                        "tenant": t.tenant,
                        "used_at": t.used_at,
                        "node_id": t.node_id,
                        "revoked_at": t.revoked_at,
                    }
                    for digest, t in self.tokens.items()
                },
                "nodes": {
                    node_id: {
                        "name": n.name,
                        "enrolled_at": n.enrolled_at,
                        "retired_at": n.retired_at,
                        "credential_expires_at": n.credential_expires_at,
                        "last_issued_at": n.last_issued_at,
                        "invite_expires_at": n.invite_expires_at,
                        "trust_tier": n.trust_tier,
                        "tenant": n.tenant,
                        "profile": n.profile,
                        "agent_id": n.agent_id,
                    }
                    for node_id, n in self.nodes.items()
                },
                "agents": {
                    agent_id: {
                        "status": a.status,
                        "changed_at": a.changed_at,
                        "credential_expires_at": a.credential_expires_at,
                    }
                    for agent_id, a in self.agents.items()
                },
            },
            indent=2,
            sort_keys=True,
        ) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> _State:
        def bad(why: str) -> ControlPlaneStateError:
            return ControlPlaneStateError(f"{where}: {why}")

        def opt_int(record: Mapping[str, Any], key: str) -> int | None:
            value = record.get(key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(f"{key} must be an integer or null")
            return value

        try:
            data = json.loads(text)
        except ValueError as exc:
            raise bad(f"not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != _STATE_VERSION:
            raise bad(f"not a version {_STATE_VERSION} enrolment state")
        nodes, agents = data.get("nodes", {}), data.get("agents", {})
        if not isinstance(nodes, dict) or not isinstance(agents, dict):
            raise bad("nodes and agents must be objects")
        state = cls()
        for node_id, record in nodes.items():
            if not is_valid_public(node_id, Prefix.USER) or not isinstance(record, dict):
                raise bad(f"bad node entry {node_id!r}")
            name, enrolled_at = record.get("name"), opt_int(record, "enrolled_at")
            if not isinstance(name, str) or enrolled_at is None:
                raise bad(f"node {node_id} lacks a name or enrolled_at")
            # Absent in state written before tiers existed: those nodes were standard.
            tier = record.get("trust_tier", "standard")
            if tier not in TRUST_TIERS:
                raise bad(f"node {node_id} has unknown trust_tier {tier!r}")
            # Absent in state written before tenants existed: the mesh's own account.
            tenant = record.get("tenant", DEFAULT_TENANT)
            try:
                check_tenant_name(tenant)
            except ValueError as exc:
                raise bad(f"node {node_id}: {exc}") from None
            # Absent in state written before profiles existed: meshnode nodes.
            profile = record.get("profile", "node")
            agent = record.get("agent_id")
            if profile not in ("node", "sdk"):
                raise bad(f"node {node_id} has unknown profile {profile!r}")
            if (profile == "sdk") != is_valid_public(agent, Prefix.USER):
                raise bad(f"node {node_id}: agent_id must be an agent key exactly for profile sdk")
            state.nodes[node_id] = EnrolledNode(
                node_id,
                name,
                enrolled_at,
                opt_int(record, "retired_at"),
                opt_int(record, "credential_expires_at"),
                opt_int(record, "last_issued_at"),
                tier,
                tenant,
                profile,
                agent if profile == "sdk" else None,
                # Absent in state written before invites expired: no deadline.
                opt_int(record, "invite_expires_at"),
            )
        tokens = data.get("tokens", {})
        if not isinstance(tokens, dict):
            raise bad("tokens must be an object")
        for digest, record in tokens.items():
            if not isinstance(record, dict) or not isinstance(record.get("name"), str):
                raise bad(f"bad token entry {digest!r}")
            created, expires = opt_int(record, "created_at"), opt_int(record, "expires_at")
            used_by = record.get("node_id")
            if created is None or expires is None or not (
                used_by is None or is_valid_public(used_by, Prefix.USER)
            ):
                raise bad(f"token {record['name']!r} lacks created_at/expires_at or has a bad node_id")
            tier = record.get("trust_tier", "standard")
            if tier not in TRUST_TIERS:
                raise bad(f"token {record['name']!r} has unknown trust_tier {tier!r}")
            state.tokens[digest] = EnrolmentToken(
                digest, record["name"], created, expires, tier,
                record.get("tenant", DEFAULT_TENANT), opt_int(record, "used_at"), used_by,
                opt_int(record, "revoked_at"),
            )
        for agent_id, record in agents.items():
            if not is_valid_public(agent_id, Prefix.USER) or not isinstance(record, dict):
                raise bad(f"bad agent entry {agent_id!r}")
            status = record.get("status")
            if status not in ("active", "paused", "retired"):
                raise bad(f"agent {agent_id} has unknown status {status!r}")
            state.agents[agent_id] = _AgentRecord(
                status, opt_int(record, "changed_at"), opt_int(record, "credential_expires_at")
            )
        return state


class _EnrolmentStore:
    """``nodes.json``: changed under an exclusive advisory lock; read again by
    :meth:`load`, and by :meth:`current` whenever the file changed."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / _STATE_FILE
        # (what stat said of the file, this process's write count) -> the state parsed from it.
        self._parsed: tuple[tuple[int, ...], _State] | None = None
        self._writes = 0

    def current(self) -> _State:
        """The state, for reading only: the caller must not change it.

        The registry asks on every registration whether the agent was retired
        and what tier its node has; reading and checking the whole file each
        time was ~5 % of the daemon's CPU while 10,000 agents registered. It is
        parsed again when ``stat`` says the file is another (every write
        replaces it, so its inode changes), changed (size, mtime, ctime) or
        changed mode (so :func:`read_private_file` restricts a loosened file as
        before), and after any write by this process.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return _State()
        except OSError:
            return self.load()  # raises, naming the file
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, self._writes)
        parsed = self._parsed
        if parsed is not None and parsed[0] == seen:
            return parsed[1]
        # Changed between the stat and the read: the next stat differs, so it is read again then.
        state = self.load()
        self._parsed = (seen, state)
        return state

    def load(self) -> _State:
        try:
            text = read_private_file(self.path)
        except FileNotFoundError:
            return _State()
        except (OSError, UnicodeDecodeError) as exc:
            raise ControlPlaneStateError(f"cannot read {self.path}: {exc}") from None
        return _State.from_json(text, self.path)

    @contextlib.contextmanager
    def update(self) -> Iterator[_State]:
        """Yield the current state; write it back if the block exits normally."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if sys.platform != "win32":
                fcntl.flock(fd, fcntl.LOCK_EX)
            state = self.load()
            yield state
            self._writes += 1  # before the write: a failed one must not leave a stale read behind
            write_private_file(self.path, state.to_json(), replace=True)
        finally:
            os.close(fd)  # closing releases the lock
