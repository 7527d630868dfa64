"""A plugin's ``sys.exit()`` ends the call it was made in, never the daemon.

``SystemExit`` is not an ``Exception``: raised in an asyncio task it passes
every ``except Exception`` and leaves the event loop itself, and with it every
agent the daemon hosts (``meshnode run`` then exits 70, see
:mod:`meshnode.cli.daemon`). A plugin author calls ``sys.exit()`` by mistake
(a script's habit, a library that exits on a bad argument), so wherever the
node runs plugin code the ``SystemExit`` becomes :class:`PluginExited`, an
ordinary exception that fails that one call:

* inside :func:`meshnode.node.looplag.running_for` (a handler, ``on_start``,
  ``on_event``, ``on_stop``), where the node's usual failure handling takes it
  (a request answered ``INTERNAL_ERROR``, an agent failed, an event counted
  failed);
* in a task that plugin code made (counted by :mod:`.tasktally`), through
  :func:`contained`: the task ends with :class:`PluginExited` and the daemon
  logs it at once, naming the agent.

What stays uncovered: a task made outside any of those, in a context of its
own (``create_task(..., context=contextvars.Context())``) or from another
thread. Its ``SystemExit`` still ends the daemon, with 70 and a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["PluginExited", "contained", "exited"]

log = logging.getLogger("meshnode.node")

_T = TypeVar("_T")


class PluginExited(Exception):
    """A plugin's code called ``sys.exit()``: the call it was in fails, the daemon goes on."""

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        #: The status the plugin passed to ``sys.exit``.
        self.code = code


def exited(what: str, exc: SystemExit) -> PluginExited:
    """The :class:`PluginExited` for ``what`` (e.g. "on_start") having raised ``exc``."""
    return PluginExited(
        f"{what} called sys.exit({exc.code!r}); a plugin cannot end the daemon (raise an exception instead)",
        exc.code,
    )


async def contained(coro: Coroutine[Any, Any, _T], agent: str) -> _T:
    """Run ``coro`` (a task agent ``agent``'s code made) with its ``SystemExit``
    turned into :class:`PluginExited`, logged here: nobody may ever await the task."""
    try:
        return await coro
    except SystemExit as exc:
        failure = exited(f"a task of agent {agent}", exc)
        log.error("%s; the task ended", failure, exc_info=exc)
        raise failure from exc
