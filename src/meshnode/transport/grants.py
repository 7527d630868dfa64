"""What a node's own credential lets it do, read from the JWT it connects with (§14.3).

meshnode mints its own nodes' credentials (:mod:`.permissions`) and knows what
they grant. A node on a mesh it did not build holds whatever that mesh's
operator minted, e.g. §14.3's example: the shared reply prefix ``_INBOX.>``
rather than meshnode's private ``_INBOX_{node_id}.>``, and both registration
subjects. Rather than guess, the node reads the ``nats.pub`` / ``nats.sub``
blocks of its own user JWT and picks what they allow: the reply prefix it
passes to the NATS client, and the registration subject(s) it may use.

The reading follows nats-server's rules: an absent or empty permission block
allows everything; an ``allow`` list allows only what it covers; ``deny``
removes what it covers. A subscription with wildcards is allowed when an
allow pattern covers it as a whole (``_INBOX.>`` covers ``_INBOX.>`` but
``_INBOX.*`` does not). Response permissions (``resp``) are not publish grants
and are ignored here.

Pure: no I/O; decoding is :func:`meshnode.transport.jwt.decode_jwt`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .permissions import LEGACY_INBOX_PREFIX, REGISTER_UNBOUND, node_inbox_prefix

__all__ = [
    "Grants",
    "InboxChoice",
    "PatternSet",
    "check_inbox_prefix",
    "choose_inbox_prefix",
    "covers",
    "register_subjects",
]


def covers(pattern: str, subject: str) -> bool:
    """Whether NATS ``pattern`` matches every subject ``subject`` can (itself a pattern).

    ``*`` matches one token (a literal or ``*``), ``>`` one or more trailing
    tokens (anything from there, ``>`` included); a literal matches itself only.
    """
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if i >= len(s):
            return False
        if token == ">":
            return True
        if s[i] == ">":
            return False
        if token != "*" and (s[i] == "*" or token != s[i]):
            return False
    return len(p) == len(s)


class PatternSet:
    """Many NATS patterns, asked "does any of them cover this subject?" at once.

    The answer is exactly ``any(covers(p, subject) for p in patterns)``, found
    by walking a token trie instead of trying every pattern: a node credential
    lists a dozen grants per hosted agent, so at 1,000 agents the scan was
    ~15,000 pattern matches per check, and the node checks a grant for every
    agent it hosts (issue #21: 4.6 s of CPU in a 1,000-agent start).
    """

    __slots__ = ("_root", "patterns")

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        # token -> child node; the key None marks "a pattern ends here".
        self._root: dict[str | None, Any] = {}
        for pattern in self.patterns:
            node = self._root
            for token in pattern.split("."):
                node = node.setdefault(token, {})
            node[None] = True

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __iter__(self) -> Iterator[str]:
        return iter(self.patterns)

    def covers(self, subject: str) -> bool:
        """Whether some pattern of the set covers ``subject`` (see :func:`covers`)."""
        tokens = subject.split(".")
        frontier = [self._root]
        for token in tokens:
            following: list[dict[str | None, Any]] = []
            for node in frontier:
                if ">" in node:
                    return True  # ">" covers this token and everything after it
                if token == ">":
                    continue  # only a ">" of the pattern covers a ">" of the subject
                star = node.get("*")
                if star is not None:
                    following.append(star)  # "*" covers a literal or a "*"
                if token != "*":
                    literal = node.get(token)
                    if literal is not None:
                        following.append(literal)
            if not following:
                return False
            frontier = following
        return any(None in node for node in frontier)


@dataclass(frozen=True, slots=True)
class _Direction:
    #: None: no allow list (everything not denied is allowed).
    allow: PatternSet | None
    deny: PatternSet

    @classmethod
    def from_claim(cls, block: object) -> _Direction:
        if not isinstance(block, Mapping):
            return cls(None, PatternSet(()))
        allow, deny = block.get("allow"), block.get("deny")
        allowed = tuple(s for s in allow if isinstance(s, str)) if isinstance(allow, list) else ()
        denied = tuple(s for s in deny if isinstance(s, str)) if isinstance(deny, list) else ()
        return cls(PatternSet(allowed) if allowed else None, PatternSet(denied))

    def permits(self, subject: str) -> bool:
        if self.deny.covers(subject):
            return False
        return self.allow is None or self.allow.covers(subject)


@dataclass(frozen=True, slots=True)
class Grants:
    """The publish and subscribe permissions of one user JWT."""

    pub: _Direction
    sub: _Direction

    @classmethod
    def from_claims(cls, claims: Mapping[str, Any]) -> Grants:
        """From decoded user-JWT claims (``nats.pub`` / ``nats.sub``)."""
        nats = claims.get("nats")
        nats = nats if isinstance(nats, Mapping) else {}
        return cls(_Direction.from_claim(nats.get("pub")), _Direction.from_claim(nats.get("sub")))

    @classmethod
    def unrestricted(cls) -> Grants:
        """No credential (a plain nats-server without auth): everything is allowed."""
        return cls(_Direction(None, PatternSet(())), _Direction(None, PatternSet(())))

    def can_publish(self, subject: str) -> bool:
        return self.pub.permits(subject)

    def can_subscribe(self, subject: str) -> bool:
        return self.sub.permits(subject)

    def reply_prefixes(self) -> list[str]:
        """Every literal prefix ``P`` whose ``P.>`` the subscribe allow list covers
        with a ``P.>`` grant of its own (candidates for a reply prefix), in JWT order."""
        found: list[str] = []
        for pattern in self.sub.allow or ():
            head, _, last = pattern.rpartition(".")
            literal = bool(head) and not any(t in ("*", ">") for t in head.split("."))
            if last == ">" and literal and self.can_subscribe(pattern):
                found.append(head)
        return found


@dataclass(frozen=True, slots=True)
class InboxChoice:
    """The reply prefix a node passes to its NATS client, and why it was chosen."""

    prefix: str
    #: ``private`` (``_INBOX_{node}``), ``shared`` (``_INBOX``, §14.3's example),
    #: ``configured`` (``[mesh] inbox_prefix``), ``granted`` (another prefix the
    #: credential grants) or ``ungranted`` (none granted: replies will not arrive).
    source: str


def check_inbox_prefix(prefix: str) -> str:
    """``prefix`` if it can prefix reply subjects (tokens, no wildcards), else ValueError."""
    tokens = prefix.split(".")
    if not prefix or any(not t or t in ("*", ">") or any(c.isspace() for c in t) for t in tokens):
        raise ValueError(f"an inbox prefix is dot-separated tokens without wildcards, got {prefix!r}")
    return prefix


def choose_inbox_prefix(grants: Grants, node_id: str, configured: str | None = None) -> InboxChoice:
    """The reply prefix to connect with.

    ``configured`` (``[mesh] inbox_prefix``) wins. Otherwise the node's private
    prefix when the credential grants it (every credential meshnode mints), then
    the shared ``_INBOX`` of §14.3's example, then the first other ``P.>`` the
    credential grants. With none granted the private prefix is kept and the
    source says ``ungranted``: the caller warns, since no reply will arrive.
    """
    if configured:
        return InboxChoice(check_inbox_prefix(configured), "configured")
    private = node_inbox_prefix(node_id)
    if grants.can_subscribe(f"{private}.>"):
        return InboxChoice(private, "private")
    if grants.can_subscribe(f"{LEGACY_INBOX_PREFIX}.>"):
        return InboxChoice(LEGACY_INBOX_PREFIX, "shared")
    others = grants.reply_prefixes()
    if others:
        return InboxChoice(others[0], "granted")
    return InboxChoice(private, "ungranted")


def register_subjects(grants: Grants, bound: str) -> Sequence[str]:
    """The registration subjects to try, in order (§14.1: both forms are accepted).

    The connection-bound ``bound`` first when granted; then the untokenized
    ``mesh.registry.register`` when granted (tried after a bound attempt nobody
    listens to, or alone when the bound one is not granted). When neither
    is granted the bound one alone, so the refusal is seen where it happens.
    """
    found = [s for s in (bound, REGISTER_UNBOUND) if grants.can_publish(s)]
    return found or [bound]
