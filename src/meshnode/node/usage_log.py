"""The node's usage log: every meter event of a priced offering, one JSON line each (§13.5, §19.6).

``usage.jsonl`` in the data directory is the durable record of what this node
sold: written before an event is queued for the mesh, replayed by ``meshnode
usage --source local``, and the journal the meter outbox republishes from
(:mod:`meshnode.node.meter_outbox`). A place in it is a :class:`LogPosition`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import orjson

from meshnode.protocol.budget import parse_money
from meshnode.protocol.commerce import (
    Agreement,
    AgreementRecord,
    Charge,
    ParsedOnce,
    Rater,
    parse_sku,
    verify_agreement,
)
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.protocol.commerce import Sku

__all__ = ["USAGE_LOG_MAX_BYTES", "USAGE_LOG_SEGMENTS", "LogPosition", "LogSpan", "UsageLog", "rating_context_of"]

log = logging.getLogger("meshnode.commerce")


class LogPosition(NamedTuple):
    """A place in the usage log, between two lines: the segment's number and a
    byte offset into it. A closed segment ``usage.jsonl.N`` has number N; the
    one being written has the number it gets when it is closed (the newest
    closed one's plus one), so a position stays true across a rotation.
    Positions order as the lines do."""

    segment: int
    offset: int


class LogSpan(NamedTuple):
    """Where one line lies: from ``start`` (its first byte) to ``end`` (after its newline)."""

    start: LogPosition
    end: LogPosition


def rating_context_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """The ``rating`` context of a usage-log line's event, as it was published
    with it (:func:`meshnode.node.commerce.rating_context`): the line keeps its
    SKU, owner, agreement, ceiling and interaction beside the event."""
    context: dict[str, Any] = {"sku": record.get("sku"), "consumer_owner": record.get("consumer_owner")}
    for name in ("agreement", "cost_ceiling", "interaction"):
        if record.get(name) is not None:
            context[name] = record[name]
    return context


def _record_of(line: str | bytes) -> dict[str, Any] | None:
    """A usage-log line's record, None for a line that is none (torn by a
    crash, or not an event's). orjson first; what it refuses and ``json``
    wrote (a 65-bit integer, the writer's fallback) through ``json``."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            record = json.loads(line)
        except ValueError:
            return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), dict) else None


#: ``[commerce] usage_log_max_bytes``'s default: what the usage log keeps, all segments together.
USAGE_LOG_MAX_BYTES = 1024**3
#: The log is cut into this many segments of the bound: the oldest goes whole.
USAGE_LOG_SEGMENTS = 16
#: A deleted usage-log segment up to this size is counted inline (under a millisecond).
_COUNT_INLINE_BYTES = 1 << 20


class UsageLog:
    """The meter events of priced offerings this node recorded, in ``path`` (JSON lines).

    Each line is ``{"event": <§13.5 meter event>, "sku": <the SKU as declared
    when the event happened>, "consumer_owner": <resolved at admission>}``, plus
    the request's ``cost_ceiling`` (§19.3) and ``interaction`` (the request
    envelope id the ceiling binds) when it carried a budget, and the
    ``agreement`` that admitted it, so a replay rates
    each event under the terms current at its ts, whatever the agent declares
    now. Recorded: one observed ``requests`` event per completed request of an
    offering a SKU covers, one declared event per meter the handler reported
    (``ctx.report_usage``), and one refusal event (quantity 0, ``refused:
    true``) per AGREEMENT_REQUIRED.

    Bounded by ``max_bytes`` (``[commerce] usage_log_max_bytes``; 0: never
    trimmed): a line is ~1.5 KB, and a node serving 300 priced calls a second
    wrote ~1 MB a second, for ever. ``path`` is the segment being written; at a
    sixteenth of the bound it becomes ``path.N`` (N counting up) and a new one
    starts; past the bound the oldest segments are deleted, each logged with
    what it held. :meth:`records` reads the segments kept, oldest first.

    The meter outbox's journal: :meth:`append` says where each line lies
    (:class:`LogSpan`), and :meth:`lines_after` reads the lines from a place on.
    """

    def __init__(self, path: Path, *, max_bytes: int = USAGE_LOG_MAX_BYTES,
                 segments: int = USAGE_LOG_SEGMENTS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.segment_bytes = max(1, max_bytes // max(1, segments)) if max_bytes > 0 else 0
        self._written: int | None = None  # the current segment's size, once known
        self._current_no: int | None = None  # the number the current segment gets when closed

    def append(self, event: Mapping[str, Any], sku: Sku, consumer_owner: str | None,
               context: Mapping[str, Any] | None = None) -> LogSpan:
        """Write one line; returns where it lies."""
        # Serialized at once and not kept: the SKU's document goes as it is, uncopied.
        record: dict[str, Any] = {"event": event if isinstance(event, dict) else dict(event),
                                  "sku": sku.document if isinstance(sku.document, dict) else dict(sku.document),
                                  "consumer_owner": consumer_owner}
        for name in ("cost_ceiling", "interaction", "agreement"):
            if context is not None and context.get(name) is not None:
                record[name] = context[name]
        try:
            data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)  # ~10x json.dumps; a line each event
        except TypeError:  # what orjson refuses (a non-string key, a 65-bit integer): as before
            data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._written is None:
            self._written = self._size_ending_a_line()
        if self.segment_bytes and self._written and self._written + len(data) > self.segment_bytes:
            self._rotate()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        except FileNotFoundError:  # its directory is not there (yet): made once, not per event
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            start = os.fstat(fd).st_size
            if start < self._written:
                # Deleted or truncated by hand meanwhile: a new segment, numbered
                # on, so no place kept in the old one names a line of this one.
                self._current_no = self.current_number() + 1
            os.write(fd, data)
        finally:
            os.close(fd)
        self._written = start + len(data)  # O_APPEND, and this is the one writer
        number = self.current_number()
        return LogSpan(LogPosition(number, start), LogPosition(number, self._written))

    def _size_ending_a_line(self) -> int:
        """The current segment's size, once its last line is whole: a line
        torn by a crash mid-write is ended with a newline first (read back, it
        is skipped), or the next line written would be glued to it and lost
        with it."""
        try:
            with self.path.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                if size == 0:
                    return 0
                handle.seek(size - 1)
                if handle.read(1) == b"\n":
                    return size
        except FileNotFoundError:
            return 0
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
        return size + 1

    def current_number(self) -> int:
        """The number the segment being written gets when it is closed."""
        if self._current_no is None:
            rotated = self._rotated()
            self._current_no = rotated[-1][0] + 1 if rotated else 1
        return self._current_no

    def end(self) -> LogPosition:
        """The position after the last line written."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        return LogPosition(self.current_number(), size)

    def kept_from(self) -> LogPosition:
        """The position of the first line kept: lines before it were trimmed."""
        rotated = self._rotated()
        return LogPosition(rotated[0][0] if rotated else self.current_number(), 0)

    def lines_after(self, position: LogPosition) -> Iterator[tuple[LogSpan, dict[str, Any] | None]]:
        """Each whole line from ``position`` on, in order, with where it lies:
        the record, or None for a line that is not one (torn by a crash). The
        segment being written ends at its last newline: what follows is a line
        still being written. Lines of segments trimmed since are not there.

        For the writer's own thread (the event loop): a rotation while this is
        read would be missed, and none happens between two of its steps."""
        current = self.current_number()
        for number, segment in [*self._rotated(), (current, self.path)]:
            if number < position.segment:
                continue
            offset = position.offset if number == position.segment else 0
            try:
                handle = segment.open("rb")
            except FileNotFoundError:
                continue
            with handle:
                handle.seek(offset)
                for raw in handle:
                    if not raw.endswith(b"\n") and number == current:
                        return  # being written: the end of the log for now (a closed one was torn)
                    span = LogSpan(LogPosition(number, offset), LogPosition(number, offset + len(raw)))
                    offset += len(raw)
                    yield span, _record_of(raw)

    def segments(self) -> list[Path]:
        """The segments kept, oldest first: ``path.1``, ``path.2``, ..., then ``path``."""
        return [p for _, p in self._rotated()] + ([self.path] if self.path.exists() else [])

    def _rotated(self) -> list[tuple[int, Path]]:
        """The closed segments ``path.N`` with their N, oldest first."""
        rotated = []
        for candidate in self.path.parent.glob(f"{self.path.name}.*"):
            suffix = candidate.name[len(self.path.name) + 1:]
            if suffix.isdigit():
                rotated.append((int(suffix), candidate))
        return sorted(rotated)

    def _rotate(self) -> None:
        """Close the current segment (``path`` becomes ``path.N``) and delete
        the oldest until the rest and a full new segment fit ``max_bytes``."""
        rotated = self._rotated()
        number = self.current_number()
        closed = self.path.with_name(f"{self.path.name}.{number}")
        self._written = 0
        self._current_no = number + 1
        try:
            os.replace(self.path, closed)
        except FileNotFoundError:  # deleted by hand meanwhile: nothing to close
            return
        kept = [p for _, p in rotated] + [closed]
        total = sum(p.stat().st_size for p in kept)
        for oldest in kept[:-1]:
            if total + self.segment_bytes <= self.max_bytes:  # room for the segment now begun
                break
            size = oldest.stat().st_size
            f = oldest.open("rb")  # still readable once unlinked: counted after, maybe off the loop
            oldest.unlink()
            total -= size
            self._report_deleted(f, oldest.name, size)

    def _report_deleted(self, f: BinaryIO, name: str, size: int) -> None:
        """Log a deleted segment with its record count. Counting reads the
        whole segment (64 MiB by default, 20-50 ms): inside a running event
        loop a segment over :data:`_COUNT_INLINE_BYTES` is counted in its
        default executor, so the loop (every request of the node) never waits
        for it."""

        def count_and_warn() -> None:
            try:
                with f:
                    lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                held = f"{lines} record(s)"
            except OSError as exc:
                held = f"records not counted: {exc}"
            log.warning("usage log: deleted its oldest segment %s (%s, %d bytes) to stay within "
                        "[commerce] usage_log_max_bytes (%d); the mesh's ledger rates what MESH_METERING keeps",
                        name, held, size, self.max_bytes)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or size <= _COUNT_INLINE_BYTES:
            count_and_warn()
        else:
            loop.run_in_executor(None, count_and_warn)

    @staticmethod
    def _lines(path: Path) -> Iterator[str]:
        try:
            with path.open(encoding="utf-8") as f:
                yield from f
        except FileNotFoundError:  # deleted meanwhile (trimmed)
            return

    def records(self) -> Iterator[dict[str, Any]]:
        """Every readable record of the segments kept, in order, one at a time
        (a torn last line is skipped).

        Safe beside a writer in another thread: what it yields is always the
        log's first lines, whole segments then the current one up to where it
        was read, even when a segment is closed meanwhile (``path`` becoming
        ``path.N`` between a listing and the open of ``path`` would otherwise
        leave out all of ``path.N``). A segment trimmed before it is read is
        left out, as trimmed."""
        read_upto = 0  # the N of the last closed segment read
        while True:
            unread = [(n, p) for n, p in self._rotated() if n > read_upto]
            for n, segment in unread:
                yield from self._parsed(self._lines(segment))
                read_upto = n
            if unread:
                continue  # one more may have been closed while these were read
            try:
                current = self.path.open(encoding="utf-8")
            except FileNotFoundError:
                return
            with current:
                # Closed between the listing and the open: the file held is a
                # newer one, and the closed segment's lines come first. (Closed
                # after the open, it is the file held; read from its name.)
                if any(n > read_upto for n, _ in self._rotated()):
                    continue
                # Read to its end: a rotation meanwhile only stops its growth.
                yield from self._parsed(current)
                return

    @staticmethod
    def _parsed(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        for line in lines:
            record = _record_of(line)
            if record is not None:
                yield record

    def read(self) -> list[dict[str, Any]]:
        """Every readable record, in order (:meth:`records` as a list)."""
        return list(self.records())

    def rate(self, agreements: Iterable[Agreement | AgreementRecord]) -> list[Charge]:
        """The §19.6 fold of the recorded events × the agreements: a fresh
        :class:`~meshnode.protocol.commerce.Rater`, so the same log and
        agreements always give the same charges to the micro-unit. A request's
        ``cost_ceiling`` clamps what its events are charged together. The
        agreement that admitted a request (from this store or the platform's)
        is kept on its line and counts too, once its signature verifies."""
        rater = Rater(list(agreements))
        carried: set[str] = set()
        charges: list[Charge] = []
        # The same few SKUs and agreements, line after line: each parsed (and
        # its signature checked) once, as the rating service's fold does.
        agreement_of, sku_of = ParsedOnce(verify_agreement), ParsedOnce(parse_sku)
        for record in self.records():
            document = record.get("agreement")
            if document is not None:
                try:
                    held = agreement_of(document)
                except ProtocolError:
                    held = None
                if held is not None and held.sig not in carried:
                    carried.add(held.sig)
                    rater.agreements.append(held)
            try:
                sku = sku_of(record.get("sku"))
                ceiling = parse_money(record["cost_ceiling"]) if "cost_ceiling" in record else None
            except ProtocolError:
                continue
            owner = record.get("consumer_owner")
            interaction = record.get("interaction")
            charge = rater.rate(
                record["event"], sku=sku, consumer_owner=owner if isinstance(owner, str) else None,
                ceiling=ceiling, interaction=interaction if isinstance(interaction, str) else None,
            )
            if charge is not None:
                charges.append(charge)
        return charges
