"""The task manager's record and the pure folds that change it (§7.1, §7.3, §7.7, §10.8, §13.5, §19.2).

No I/O and no clock here: the task manager reads a record with its KV
revision, runs one fold, writes the fold's record revision-checked, and only
after that write commits publishes the fold's events and notice. A writer that
loses the race re-reads and runs the fold again, so an event is emitted by
exactly the write that made it true.

The record (KV ``mesh_tasks``, key = task id) — the §7.1 Task object plus
what the platform observed::

    {
      "id", "context_id"?, "requester", "responder", "offering"?,
      "state", "created_at", "updated_at",
      "history": [envelope, ...],        # accepted updates as received, newest last,
                                         # capped (oldest dropped, §16.4)
      "artifacts": [artifact, ...],      # merged by artifact id, later wins
      "budget"?: {revision, deadline?, cost_ceiling?},   # the current (highest) revision
      "output"?: ...,                    # latest payload.output (the way back to a
                                         # streamed result, §11.3 step 6)
      "error"?: {...},                   # latest §12.1 error object the responder sent
      "meta": {
        "first_state"?,                  # when the first update seen was not ``submitted``
        "status_message"?,               # latest payload.message
        "ended_at"?, "terminal_envelope_id"?,
        "cancel_reason"? | "failure_reason"?, "note"?, "unmet_need"?, "dependency"?,
        "attribution"?,                  # failed Tasks: "client" | "provider" (§10.8a)
        "overdue"?, "overdue_at"?, "overdue_lifted_at"?,           # §7.7 central clock
        "completed_late"?, "late"?: {"code": "DEADLINE_EXCEEDED", "deadline", "completed_at"},
        "stranded"?, "stranded_at"?, "stranded_parent"?,           # §10.8a
        "stranded_check"?: "pending" | "done", "stranded_children"?,
        "usage"?: {"envelope_id", "usage": [{meter, quantity}]},   # latest report (§13.5)
        "cost"?: {amount_micro, currency},                         # latest payload.cost
        "rejected_updates"?: [{envelope_id, from, status?, code, message, at}],  # capped
        "history_dropped"?: n            # entries dropped to fit the broker's value limit
      }
    }

Who may say what on ``mesh.task.{id}.update``: the responder moves the state
(any legal §7.3 move, restatements of a non-terminal state as progress, and
artifact deliveries without a status); the requester may only cancel (§7.3
"requester or responder cancels", §10.8 step 2: the canceling party publishes
the canceled update and the task manager records it); either party may revise
the budget (§7.7). An update from anyone else is refused and not recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .task_fold import (
    DEFAULT_HISTORY_CAP,
    REJECTED_CAP,
    Event,
    FoldSettings,
    Outcome,
    Verdict,
    _meta,
)
from .task_fold import Envelope as Envelope
from .task_fold import ManifestOf as ManifestOf
from .task_fold import Record as Record
from .task_sweep import (
    IndexEntry,
    finish_stranded_check,
    flag_stranded,
    index_entry,
    mark_overdue,
    overdue_due,
    stranded_due,
)
from .task_update import apply_update

__all__ = [
    "DEFAULT_HISTORY_CAP",
    "REJECTED_CAP",
    "Event",
    "FoldSettings",
    "IndexEntry",
    "Outcome",
    "Verdict",
    "apply_update",
    "finish_stranded_check",
    "fit_record",
    "flag_stranded",
    "index_entry",
    "mark_overdue",
    "overdue_due",
    "stranded_due",
]


# --- the broker's value limit -------------------------------------------------------------------


def fit_record(record: Record, max_bytes: int, encode: Callable[[Any], bytes]) -> bytes:
    """Encode ``record`` within ``max_bytes``, dropping the oldest history entries
    (counted in ``meta.history_dropped``) until it fits.

    Raises ValueError when even an empty history does not fit.
    """
    data = encode(record)
    if len(data) <= max_bytes:
        return data
    history = record.get("history", [])
    dropped = 0
    while history and len(data) > max_bytes:
        # Drop as many of the oldest entries as cover the excess, then re-measure.
        excess = len(data) - max_bytes
        step = 1
        total = 0
        for entry in history:
            total += len(encode(entry))
            if total >= excess:
                break
            step += 1
        step = min(step, len(history))
        del history[:step]
        dropped += step
        meta = _meta(record)
        meta["history_dropped"] = int(meta.get("history_dropped", 0)) + step
        data = encode(record)
    if len(data) > max_bytes:
        raise ValueError(f"the task record needs {len(data)} bytes; the limit is {max_bytes}")
    return data
