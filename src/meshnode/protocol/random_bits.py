"""Random 64-bit values from the operating system, fetched a batch at a time.

Every envelope takes fresh randomness for its id (UUIDv7's random tail) and
its trace span, several values per round trip. One ``os.urandom`` call costs
a system call (≈ 0.4 µs here); unpacking 256 values from one 2 KiB read and
handing them out one by one costs ≈ 0.08 µs each. The values are exactly as
random as ``os.urandom``'s: only the number of system calls changes.

A forked child must never hand out its parent's remaining values (two
processes would mint the same ids and spans), so the batch is dropped in
the child at fork.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

__all__ = ["random_u64", "random_hex16", "random_hex32"]

_BATCH = 256
_UNPACK = struct.Struct(f"<{_BATCH}Q").unpack

_values: Iterator[int] = iter(())


def _refill() -> int:
    global _values
    _values = iter(_UNPACK(os.urandom(8 * _BATCH)))
    return next(_values)


def random_u64() -> int:
    """A uniformly random integer in [0, 2**64), from the OS's CSPRNG.

    Safe from any thread: ``next`` on the batch's iterator is one atomic step
    under the GIL, so no value is handed out twice; two threads that find the
    batch empty at once each read a new one, and neither value is reused.
    """
    try:
        return next(_values)
    except StopIteration:
        return _refill()


def random_hex16() -> str:
    """16 lowercase hex digits (64 random bits): a W3C span id."""
    return f"{random_u64():016x}"


def random_hex32() -> str:
    """32 lowercase hex digits (128 random bits): a W3C trace id."""
    return f"{random_u64():016x}{random_u64():016x}"


def _drop_batch_in_child() -> None:
    global _values
    _values = iter(())


os.register_at_fork(after_in_child=_drop_batch_in_child)
