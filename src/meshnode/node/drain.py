"""The bounded drain of an agent's broker buffer into the node inbox (§16.4, §18.6).

One pass: read the stream's last sequence (the bound), fetch from the durable
pull consumer ``inbox_{agent}`` up to that sequence, commit the batch to the
inbox (one transaction), ack it, then dispatch what is new through the same
pipeline as live traffic, judged with the mailbox window and without an
accept. Anything past the bound is the live subscription's and is left alone.

Passes run on every reconnect (from the client's connection events) and
periodically (jittered per agent); they never overlap (one job per agent),
and a failed pass is logged once and never stops the next one or the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from meshnode.node.inbox import InboxUnwritable
from meshnode.node.periodic import FailureDigest, PeriodicJob
from meshnode.node.pipeline import Path
from meshnode.protocol import subjects
from meshnode.transport.errors import NotFound
from meshnode.transport.jetstream import StoredMessage

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.inbox import InboxStore
    from meshnode.node.runtime import Node
    from meshnode.transport.jetstream import MailboxBuffer

__all__ = ["DEFER_S", "FULL_CHECKS_PER_S", "PASSES_AT_ONCE", "DrainStats", "InboxDrain", "failure_digest", "pass_slots"]

#: Node-wide budget of unconditional idle checks (JetStream calls per second).
FULL_CHECKS_PER_S = 1.0
#: A buffered copy whose live handler still runs is handed back for DEFER_FIRST_S, then twice
#: as long at each delivery, up to DEFER_S. The purge stops at a copy that is out, so while one
#: is away the buffer only fills: a flat second, found by a soak of 20 KB requests, let the
#: live mail of that second fill a busy agent's buffer, and mail sent during a reconnect then
#: found it full. Most live handlers settle within the inbox's write-behind window (50 ms).
DEFER_FIRST_S = 0.1
DEFER_S = 1.0
#: How long after a pass that found the broker's copies lagging the live mail it looks again.
STORE_LAG_S = 0.1
#: Settled copies a pass lets the broker forget with one purge instead of an ack each. A purge
#: that cuts into a message block costs nats-server a rewrite of it, so not one per batch: at
#: 128 the broker spent more than the acks it saved, at 512 less (issue #21's drain A/B).
#: Never more than half the consumer's max_ack_pending, which unacked copies count against.
PURGE_EVERY = 512
#: The share of the buffer's bound (messages or bytes) that live mail since the last pass may
#: fill before a pass runs early to make room, and that the settled copies of one pass may
#: hold before it purges them (besides every PURGE_EVERY copies). The buffer refuses new mail
#: when full, and mail sent while the node is briefly away (a reconnect) has only the buffer:
#: at half, a busy agent's buffer of large messages was found full at a reconnect and that
#: mail was lost. A quarter keeps three quarters free for the gap.
ROOM_SHARE = 4

log = logging.getLogger("meshnode.drain")

#: Copies a pass reads by sequence, at most, to settle the ones a lost connection left out.
REPAIR_MAX = 64
#: After reads by sequence kept failing, how long before a pass tries again.
REPAIR_RETRY_S = 60.0
#: Purges, or reads by sequence, failing in a row before the log says so (and repair rests).
FAILURES_TO_WARN = 3

#: Drain passes reading the broker at once, node-wide (see :func:`pass_slots`).
PASSES_AT_ONCE = 8
#: A failed pass is tried again this soon (doubling up to the interval), not a
#: whole interval later: the mail it could not reach waited for it.
RETRY_S = 5.0


def defer_delay(deliveries: int) -> float:
    """How long a copy whose live handler still runs is handed back for, at its
    ``deliveries``-th delivery: DEFER_FIRST_S, doubling up to DEFER_S (a long
    handler costs one re-read a second, not ten)."""
    return min(DEFER_S, DEFER_FIRST_S * 2.0 ** max(0, deliveries - 1))


def pass_slots() -> asyncio.Semaphore:
    """The node's bound on drain passes that read the broker at the same time.

    Every agent's first pass runs right after its registration, so a node
    starting 10,000 agents had hundreds of passes asking JetStream at once
    while the registry created mailboxes: half of them timed out (5,225 of
    10,000) and waited a whole interval. Passes of different agents gain
    nothing from running side by side beyond a few; bounded, they queue in the
    node instead of in the broker. (Dispatching the rows a pass committed is
    not bounded by it.)
    """
    return asyncio.Semaphore(PASSES_AT_ONCE)


class Copy(Protocol):
    """A buffered copy as a pass handles it: a consumer's delivery, or one read by sequence."""

    @property
    def data(self) -> bytes: ...

    @property
    def sequence(self) -> int: ...

    @property
    def deliveries(self) -> int: ...

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...


class ReadCopy:
    """A copy read straight from the buffer by sequence (see InboxDrain._repair).

    No consumer delivered it in this pass, so there is nothing to ack or hand
    back: its delivery, out with a connection that is gone, comes back after
    the ack wait, or is dropped by the purge that takes it.
    """

    __slots__ = ("_stored",)

    def __init__(self, stored: StoredMessage) -> None:
        self._stored = stored

    @property
    def data(self) -> bytes:
        return self._stored.data

    @property
    def sequence(self) -> int:
        return self._stored.seq

    @property
    def deliveries(self) -> int:
        return 1

    async def ack(self) -> None:
        return None

    async def nak(self, delay: float | None = None) -> None:
        return None


class FailureRun:
    """Failures of one kind in a row (a success ends the run). A failure now and
    then is a reply lost in a reconnect; a grant the credential lacks fails every
    time, and the reply to a refused subject never comes either, so the two look
    alike one at a time: only a run of FAILURES_TO_WARN is worth a warning."""

    __slots__ = ("length", "_warned")

    def __init__(self) -> None:
        self.length = 0
        self._warned = False

    def failed(self) -> bool:
        """Count one failure; True the first time a run reaches FAILURES_TO_WARN (warn now)."""
        self.length += 1
        warn = self.length >= FAILURES_TO_WARN and not self._warned
        self._warned = self._warned or warn
        return warn

    def succeeded(self) -> None:
        self.length = 0


def failure_digest() -> FailureDigest:
    """The node's digest of drain failures: a few lines for any number of agents."""
    return FailureDigest("drains", log)


@dataclass
class DrainStats:
    passes: int = 0
    fetched: int = 0
    committed: int = 0
    duplicates: int = 0
    beyond_bound: int = 0
    dispatched: int = 0
    last_bound: int = 0
    last_error: str | None = None
    running: bool = False
    deferred: int = 0  # copies left in the broker while their live handler ran
    repaired: int = 0  # copies read by sequence: their delivery was out with a lost connection
    repair_failures: int = 0
    idle_skips: int = 0  # passes that found the buffer unchanged since it was settled
    quiet_skips: int = 0  # periodic passes skipped without a broker call (no mail seen since)
    purged_through: int = 0  # the last stream sequence removed from the broker buffer
    purge_failures: int = 0
    room_passes: int = 0  # passes run early: live mail had filled a quarter of the buffer's bound
    history: list[dict[str, Any]] = field(default_factory=list)


class InboxDrain:
    """Drains one agent's ``MESH_INBOX_{agent}`` into the node inbox."""

    def __init__(
        self,
        node: Node,
        hosted: HostedAgent,
        store: InboxStore,
        *,
        interval_s: float = 60.0,
        batch: int = 128,
        fetch_timeout_s: float = 0.5,
        dispatch_concurrency: int = 16,
        full_every: int = 10,
        slots: asyncio.Semaphore | None = None,
        digest: FailureDigest | None = None,
    ) -> None:
        self.node = node
        self.hosted = hosted
        self.store = store
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.dispatch_concurrency = dispatch_concurrency
        self.stats = DrainStats()
        self.interval_s = interval_s
        self._pass_lock = asyncio.Lock()
        self._slots = slots
        # The buffer's last sequence when a pass last found nothing left to do:
        # while it is unchanged an idle pass costs one JetStream call, not four.
        self._settled_through: int | None = None
        # Whether the buffer may hold something no pass has seen: set at start,
        # on reconnect and whenever the live subscription receives mail (the
        # buffer captures that very subject, so it grew too). A periodic pass
        # while it is clear costs nothing; every ``full_every``-th one still
        # reads the buffer's last sequence, in case something slipped past.
        self._maybe_new = True
        self.full_every = full_every
        self._quiet_passes = 0
        # Live mail since the last pass, against a ROOM_SHARE of the buffer's
        # bound (known from the first pass on; 0: unbounded): see note_live_mail.
        self._live_msgs = 0
        self._live_bytes = 0
        self._room_msgs = 0
        self._room_bytes = 0
        self._room_asked = False
        # The stream sequences this pass settled (committed: the broker may
        # forget them), the settled copies not yet acked or purged, how far the
        # pass may purge, and the deliveries it hands back at its end (with the
        # redelivery delay).
        self._settled: set[int] = set()
        self._unreleased: list[Copy] = []
        # How many of ``_unreleased`` (from its start) the last release sorted
        # out and kept, and ``purged_through`` then: while no purge moved it,
        # the next release only looks at the copies settled since.
        self._kept = 0
        self._kept_gone = -1
        self._through = 0
        self._purge_every = PURGE_EVERY
        # Bytes of the copies settled since the last purge, and the share of the
        # buffer's bound in bytes at which the pass purges them (0: by count only).
        self._unpurged_bytes = 0
        self._purge_bytes = 0
        self._acking_all = False  # the purge was refused this pass: ack instead
        self._repair_not_before = 0.0  # loop time; set after reads by sequence kept failing
        self._purge_failures = FailureRun()
        self._repair_failures = FailureRun()
        self._hand_back: list[tuple[Copy, float | None]] = []
        self.job = PeriodicJob(
            f"drain:{hosted.name}",
            self._periodic_pass,
            interval_s,
            jitter=0.5,  # spread N agents' passes over the interval
            # Start-up passes matter (mail waited while we were away) but N agents
            # must not all hit JetStream in the same instant: spread them over ~2 s.
            first_delay=random.uniform(0.0, min(2.0, interval_s)),
            logger=log,
            retry_s=min(RETRY_S, interval_s),
            digest=digest,
        )

    def start(self) -> None:
        self.job.start()

    def trigger(self) -> None:
        """Run a pass soon (reconnect); never two at once."""
        self._maybe_new = True
        self.job.trigger()

    async def run_now(self) -> None:
        """A pass now that reads the broker (``meshnode drain``): never the quiet
        skip, which takes the live path's word that nothing arrived."""
        self._maybe_new = True
        await self.job.run_once()

    def _full_every(self) -> int:
        """How many periodic passes apart the unconditional checks are: at least
        ``full_every``, and further apart on a node with so many agents that
        their checks together would exceed FULL_CHECKS_PER_S (the node-wide
        idle broker load then stays flat as the roster grows)."""
        agents = len(getattr(self.node, "drains", ()))
        interval = max(1.0, self.interval_s)
        return max(self.full_every, math.ceil(agents / (FULL_CHECKS_PER_S * interval)))

    def note_live_mail(self, size: int = 0) -> None:
        """The live subscription received mail (``size`` bytes): the buffer captured it too.

        Only a pass purges the copies the live path handled, and the buffer
        refuses new mail at its bound (discard-new, issue #22.4). With a pass
        only every ``interval_s``, a busy agent's buffer filled up with handled
        copies, and mail sent during a gap (a reconnect, a restart) found it
        full and was not kept. Once the live mail since the last pass reaches
        a ROOM_SHARE of the bound, in messages or in bytes, a pass runs now.
        """
        self._maybe_new = True
        self._live_msgs += 1
        self._live_bytes += size
        if not self._room_asked and (
            (self._room_msgs and self._live_msgs >= self._room_msgs)
            or (self._room_bytes and self._live_bytes >= self._room_bytes)
        ):
            # The count goes on until the pass takes it (it compares it with the
            # copies it finds); asked once until then.
            self._room_asked = True
            self.stats.room_passes += 1
            self.job.trigger()

    async def _periodic_pass(self) -> None:
        """The job's pass (§16.4 "periodically"): skipped without a broker call
        while nothing can have reached the buffer since the last settled pass."""
        if not self._maybe_new and self._settled_through is not None and self._quiet_passes + 1 < self._full_every():
            self._quiet_passes += 1
            self.stats.quiet_skips += 1
            return
        self._quiet_passes = 0
        # Cleared before the pass reads its bound: mail arriving during the pass
        # sets it again and the next pass looks.
        self._maybe_new = False
        try:
            await self.run_pass()
        except BaseException:
            self._maybe_new = True
            raise

    def status(self) -> dict[str, Any]:
        """This drain's counters and health, for ``meshnode status``."""
        st = self.stats
        return {
            "passes": st.passes,
            "fetched": st.fetched,
            "committed": st.committed,
            "duplicates": st.duplicates,
            "beyond_bound": st.beyond_bound,
            "dispatched": st.dispatched,
            "deferred": st.deferred,
            "last_bound": st.last_bound,
            "idle_skips": st.idle_skips,
            "quiet_skips": st.quiet_skips,
            "purged_through": st.purged_through,
            "purge_failures": st.purge_failures,
            "room_passes": st.room_passes,
            "repaired": st.repaired,
            "running": st.running,
            "failing": self.job.failing,
            "last_error": self.job.last_error,
        }

    async def stop(self) -> None:
        await self.job.stop()

    async def run_pass(self) -> None:
        # The job never overlaps itself; the lock also covers run_pass called directly.
        async with self._pass_lock:
            self.stats.running = True
            self.stats.passes += 1
            try:
                async with self._slots if self._slots is not None else contextlib.nullcontext():
                    await self._drain()
                await self.dispatch_pending()
            except Exception as exc:
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                self.stats.running = False

    async def _drain(self) -> None:
        if self.store.fault is not None:
            # Take nothing from the broker while the inbox cannot hold it (disk
            # full, read-only): it is safe where it is, and every fetch spends a
            # delivery. A tiny real write says when the inbox takes writes again;
            # until then this raises and the pass counts as failing (§16.4).
            await self.store.probe()
        agent = self.hosted.agent_id
        buffer = self.node.connection.jetstream.mailbox(
            subjects.agent_inbox(agent),
            subjects.inbox_stream_name(agent),
            subjects.inbox_consumer_name(agent),
        )
        # Counted from here: copies of mail arriving from now on lie past this pass's bound.
        live, self._live_msgs, self._live_bytes = self._live_msgs, 0, 0
        self._room_asked = False
        info = await buffer.state()
        if info is None:
            return  # no buffer (sandbox, or not registered yet)
        self._room_msgs, self._room_bytes = info.max_msgs // ROOM_SHARE, info.max_bytes // ROOM_SHARE
        if live and info.last_seq - self.stats.purged_through < live:
            # The broker stores its copy a moment after it delivers the live
            # message: a pass asked for by the live path can find fewer copies
            # than it came for. Look again shortly, or that room is made only
            # after another room share of mail, when the buffer may be full.
            asyncio.get_running_loop().call_later(STORE_LAG_S, self.trigger)
        if info.max_age_s:
            # §22.3: the mailbox window never exceeds the retention actually configured.
            self.hosted.clamp_mailbox_window(int(info.max_age_s * 1000))
        bound = info.last_seq
        self.stats.last_bound = bound
        if bound == 0 or info.messages == 0 or bound == self._settled_through:
            self._settled_through = bound
            self.stats.idle_skips += 1
            return
        psub = await buffer.reader()
        try:
            # Ask only for what can lie inside the bound, so the live path's mail
            # is not even fetched; redeliveries of an interrupted pass come first.
            consumer_state = await psub.consumer_info()
            if not consumer_state.num_pending and not consumer_state.num_ack_pending:
                self._settled_through = bound
                await self._purge(buffer, bound)
                return  # an idle pass: nothing buffered that we have not acked
            floor = consumer_state.delivered_stream_seq
            self._settled, self._unreleased, self._hand_back = set(), [], []
            self._kept, self._kept_gone = 0, -1
            self._acking_all = False
            max_out = consumer_state.max_ack_pending
            self._purge_every = max(1, min(PURGE_EVERY, max_out // 2)) if max_out else PURGE_EVERY
            # Large messages fill the buffer's bytes long before PURGE_EVERY copies:
            # a pass over a full buffer of 20 KB requests purged only at its end,
            # and the buffer stayed full while it ran.
            self._purge_bytes, self._unpurged_bytes = self._room_bytes, 0
            # Make room as the pass goes: what is settled is committed (§16.4),
            # so the buffer may drop it. Everything the consumer had acked when
            # the pass began (or the buffer no longer holds), then each next
            # sequence this pass settled; not the ack floor read now, which can
            # lag the acks just sent. Copies still out (deferred while their
            # live handler runs, redeliveries not yet due) stop it there: a busy
            # agent always has some, and used to get no purge at all until it
            # had none.
            self._through = max(consumer_state.ack_floor_stream_seq, info.first_seq - 1)
            while True:
                want = min(self.batch, max(1, bound - floor))
                if max_out:
                    # Never ask for more than the consumer may have out unacked:
                    # nats-server holds such a pull request open for the rest (the
                    # fetch then waits out its timeout) and ends later ones.
                    want = max(1, min(want, max_out - len(self._unreleased) - len(self._hand_back)))
                msgs = await psub.fetch(want, timeout=self.fetch_timeout_s)  # [] on timeout
                if not msgs:
                    break
                top = max(m.sequence for m in msgs)
                if top <= bound:
                    within, beyond = msgs, []
                else:
                    within = [m for m in msgs if m.sequence <= bound]
                    beyond = [m for m in msgs if m.sequence > bound]
                try:
                    await self._commit(within)
                    await self._release(buffer)
                except InboxUnwritable:
                    # Not committed, so not acked: hand the batch straight back
                    # (redelivered on the pass after the inbox recovers, not
                    # after ack_wait) and fail this pass.
                    for m in msgs:
                        with contextlib.suppress(Exception):
                            await m.nak()
                    raise
                floor = max(floor, top)
                if beyond:
                    # Past the bound belongs to the live path: hand it back untouched.
                    self.stats.beyond_bound += len(beyond)
                    self._hand_back.extend((m, None) for m in beyond)
                    break
            await self._release(buffer, final=True)
            if self._through < bound:
                await self._repair(buffer, bound)
            if self._through >= bound:
                self._settled_through = bound
        finally:
            # Settled but neither acked nor purged (an error cut the pass short):
            # acked now where the connection still takes it; else redelivered
            # after the ack wait and judged duplicates then.
            unreleased, self._unreleased = self._unreleased, []
            for copy in unreleased:
                with contextlib.suppress(Exception):
                    await copy.ack()
            # Handed back only now, after the purge: nats-server drops a
            # redelivery queued before a purge of the stream, and the copy then
            # waits out the whole ack wait instead of coming back on the next pass.
            hand_back, self._hand_back = self._hand_back, []
            for copy, delay in hand_back:
                with contextlib.suppress(Exception):
                    await copy.nak(delay=delay)
            try:
                await psub.unsubscribe()
            except Exception:
                pass

    async def _release(self, buffer: MailboxBuffer, *, final: bool = False) -> None:
        """Let the broker forget what this pass has settled so far.

        The contiguous run of settled copies is purged rather than acked one
        by one: one JetStream call per PURGE_EVERY copies instead of an ack
        each, most of what a re-read copy cost, and nats-server drops purged
        messages from the consumer's pending acks (its ack floor moves past
        them). Until that purge the run's copies stay unacked (they count
        against max_ack_pending, hence the bound). A copy past a gap (a
        deferred one still out) cannot be purged without the gap, so it is
        acked at once; so is everything once a purge was refused.
        """
        through = self._through
        while through + 1 in self._settled:
            through += 1
        self._through = through
        gone = self.stats.purged_through
        due = final or through - gone >= self._purge_every or (
            0 < self._purge_bytes <= self._unpurged_bytes
        )
        if through > gone and due and not self._acking_all:
            await self._purge(buffer, through)
            self._unpurged_bytes = 0
            gone = self.stats.purged_through
            self._acking_all = gone < through
        later = not (final or self._acking_all)
        unreleased = self._unreleased
        # Kept copies lie in (gone, through] of the release that kept them; with
        # no purge since, they still do (``through`` only grows). Re-sorting
        # them on every batch cost ~3 µs per re-read copy at 512 to a purge.
        start = self._kept if later and gone == self._kept_gone else 0
        new = unreleased[start:]
        if later:
            keep = [m for m in new if gone < m.sequence <= through]
            ack = [m for m in new if m.sequence > through and m.sequence > gone]
        else:
            keep, ack = [], [m for m in new if m.sequence > gone]
        # Should an ack raise, the pass's end acks everything still listed.
        unreleased[start:] = keep + ack
        for m in ack:
            await m.ack()
        del unreleased[start + len(keep):]  # the next purge takes the rest
        self._kept, self._kept_gone = len(unreleased), gone

    async def _repair(self, buffer: MailboxBuffer, bound: int) -> None:
        """Settle, by reading them by sequence, the copies that stop the purge
        short of ``bound`` without being out with a live handler.

        Such a copy was delivered to this node and then neither acked nor handed
        back, its delivery gone with a connection that was cut (a roster change
        re-presents the credential); or it was handed back by an earlier pass and
        a later pass's purge dropped the redelivery that queued. The consumer then
        holds it for the whole ack wait (30 s) before delivering it again, and the
        purge cannot pass it: in ``benchmarks burst`` the buffer filled within the
        second and refused the mail of the next reconnect, which was lost. Read
        here by sequence, each is judged as a delivery is (committed when new,
        settled when seen); a copy whose live handler runs still stops the purge.
        (Sparing the copies handed back lately, to let them come back by
        themselves, lost as much mail as before in the same run.)
        """
        loop = asyncio.get_running_loop()
        if loop.time() < self._repair_not_before:
            return
        out = {m.sequence for m, _ in self._hand_back}  # handed back by this pass: their handlers run
        js = self.node.connection.jetstream
        read: list[Copy] = []
        seq = self._through + 1
        while seq <= bound and len(read) < REPAIR_MAX and seq not in out:
            if seq not in self._settled:
                try:
                    read.append(ReadCopy(await js.message(buffer.stream, seq=seq)))
                except NotFound:
                    self._settled.add(seq)  # gone already (purged or expired): nothing to keep
                except Exception as exc:
                    # A reply lost in a reconnect, or a credential minted before the
                    # read grant (refused every time, and only then given a rest): the
                    # copy comes back after the ack wait instead.
                    self.stats.repair_failures += 1
                    if self._repair_failures.failed():
                        log.warning(
                            "agent %s: cannot read its mailbox %s by sequence (%s, %d times in a row); "
                            "a copy left out by a lost connection then holds up the purge for the ack "
                            "wait. A node credential grants $JS.API.STREAM.MSG.GET on its agents' "
                            "mailboxes: renew it (meshnode renew) if it is older than that grant",
                            self.hosted.agent_id, buffer.stream, exc, self._repair_failures.length,
                        )
                    if self._repair_failures.length >= FAILURES_TO_WARN:
                        self._repair_not_before = loop.time() + REPAIR_RETRY_S
                    break
                else:
                    self._repair_failures.succeeded()
            seq += 1
        if read:
            self.stats.repaired += len(read)
            await self._commit(read)
        await self._release(buffer, final=True)

    async def _purge(self, buffer: MailboxBuffer, bound: int) -> None:
        # Everything through ``bound`` is committed to the node inbox: drop it
        # from the broker, which refuses new mail once the buffer is full
        # (discard-new, issue #22.4). A failure costs only room, never mail;
        # a run of them is logged once (FailureRun).
        try:
            await buffer.purge_through(bound)
        except Exception as exc:
            self.stats.purge_failures += 1
            if self._purge_failures.failed():
                log.warning(
                    "agent %s: cannot purge its drained mailbox %s (%s, %d times in a row); it fills "
                    "with handled mail and then refuses new offline mail until max_age. A node "
                    "credential grants $JS.API.STREAM.PURGE on its agents' mailboxes: renew it "
                    "(meshnode renew) if it is older than that grant",
                    self.hosted.agent_id, buffer.stream, exc, self._purge_failures.length,
                )
        else:
            self._purge_failures.succeeded()
            self.stats.purged_through = bound

    async def _commit(self, msgs: Sequence[Copy]) -> None:
        """Commit a batch to the inbox; what it settles is released by _release."""
        if not msgs:
            return
        self.stats.fetched += len(msgs)
        items: list[tuple[str, str, str, bytes, int | None]] = []
        item_msgs: list[Copy] = []
        unreadable = []
        refused_live = getattr(self.hosted, "refused_bytes", {})
        for m in msgs:
            if refused_live and hashlib.sha256(m.data).digest() in refused_live:
                continue  # the live path already refused these exact bytes: ack, don't re-judge
            try:
                obj = orjson.loads(m.data)
                sender, msg_id, kind = obj["from"], obj["id"], obj["type"]
                if not (isinstance(sender, str) and isinstance(msg_id, str) and isinstance(kind, str)):
                    raise TypeError("not an envelope")
            except Exception:
                unreadable.append(m)
                continue
            items.append((sender, msg_id, kind, m.data, m.sequence))
            item_msgs.append(m)
        if unreadable:
            self.hosted.signal("mailbox.unreadable", None, f"{len(unreadable)} buffered message(s) are not envelopes")
        fresh = await self.store.accept_batch(self.hosted.agent_id, items, self.node.now_ms())
        # Copies whose live handler runs right now stay in the broker (neither
        # acked nor dispatched): a crash before it settles must still find them.
        deferred = {id(m) for m, f in zip(item_msgs, fresh, strict=True) if f is None}
        # Durable now: only after the commit may the broker forget (§16.4, D.3 #3).
        for m in msgs:
            if id(m) not in deferred:
                self._settled.add(m.sequence)
                self._unreleased.append(m)
                self._unpurged_bytes += len(m.data)
            else:
                # Handed back (at the end of the pass) for a later pass, not after
                # the whole ack wait: a process killed meanwhile finds it on its
                # start-up pass.
                self._hand_back.append((m, defer_delay(m.deliveries)))
        new = sum(1 for f in fresh if f)
        self.stats.committed += new
        self.stats.deferred += len(deferred)
        self.stats.duplicates += len(fresh) - new - len(deferred)

    async def dispatch_pending(self) -> None:
        """Hand committed rows to the pipeline, at most once each."""
        semaphore = asyncio.Semaphore(self.dispatch_concurrency)
        while True:
            rows = await self.store.pending_rows(self.hosted.agent_id, 256)
            if not rows:
                return

            async def one(row: Any) -> None:
                async with semaphore:
                    # Claimed one by one as each enters the pipeline, and marked
                    # started inline right before its handler (or an answer) —
                    # HostedAgent._mark_started: a crash keeps only rows that
                    # really started as interrupted; merely claimed ones run once
                    # after the restart (InboxStore.recover_interrupted).
                    if not await self.store.start_row(row, self.node.now_ms()):
                        return
                    self.stats.dispatched += 1
                    try:
                        outcome = await self.hosted.receive(
                            row.envelope, source=Path.MAILBOX, inbox_id=row.inbox_id, wait=True
                        )
                    finally:
                        self.store.unclaim(row.agent, row.sender, row.msg_id)
                    # Not before its answer reached the broker (see set_state).
                    await self.store.set_state(
                        row.inbox_id, outcome, self.node.now_ms(), durable=False, after_answers=True
                    )

            await asyncio.gather(*(one(r) for r in rows))
