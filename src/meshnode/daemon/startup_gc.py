"""The cyclic garbage collector and the node's start-up world: built without
full collections, then frozen.

A start builds the node's long-lived objects at a steady rate (every agent's
manifest, guard, subscriptions, jobs), and CPython runs a full collection each
time the objects that survived into the oldest generation have grown by a
quarter. Each full collection walks every tracked object, so a start pays a
geometric series of them: 17 full collections, 6.4 s of the daemon's ~37 s of
CPU, while 10,000 agents started (measured with ``gc.callbacks``); with them
deferred the daemon's CPU fell from 3.7 to 3.2 ms per agent. The young
generations still run, so short-lived cycles are freed as before; what they
promote waits for the one full collection at the end of a successful
start, before the node reports itself serving.

After that collection what is alive is the node's long-lived world, and it is
frozen (:func:`gc.freeze`): later full collections walk only what was made
since. Without it every full collection walked the whole world again and held
the loop for as long: at 10,000 agents, 1.1 s, once every 80-95 s while the
node served ~1,900 local round trips a second (measured with ``gc.callbacks``;
each one stalled every agent's requests and heartbeats for that second).
Frozen objects are still freed by reference counting; what the collector no
longer reclaims is a reference cycle among them, which in practice is an
agent hosted from the start and removed at runtime (its handlers, jobs and
subscriptions refer to one another). That memory stays until the next start;
an agent added at runtime is not frozen and is reclaimed as before.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

__all__ = ["start_up_heap"]

log = logging.getLogger("meshnode.daemon")

#: A threshold the oldest generation's counter never reaches in a start.
_NEVER = 1 << 30


@contextlib.contextmanager
def start_up_heap() -> Iterator[None]:
    """Within the block, the collector runs only its young generations. On the way
    out its thresholds are restored however the block ends; when it ended
    normally (the node is about to serve), one full collection runs and what
    survives it is frozen. A failed or cancelled start goes straight on to
    shutting down, which must stay prompt."""
    young, middle, oldest = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, oldest)
    if gc.isenabled():
        started = time.perf_counter()
        freed = gc.collect()
        gc.freeze()
        log.debug("start-up: one full garbage collection, %d objects freed in %.0f ms; %d objects frozen",
                  freed, (time.perf_counter() - started) * 1000, gc.get_freeze_count())
