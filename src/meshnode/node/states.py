"""The states a hosted agent goes through (admin ``Status``: each agent's ``state``)."""

from __future__ import annotations

import enum

__all__ = ["AgentState"]


class AgentState(enum.StrEnum):
    """A hosted agent's life: ``starting`` until ``on_start`` returned, then
    ``running``; ``retrying`` between attempts while its ``on_start`` raises
    :class:`~meshnode.agent.NotReady`; ``failed`` when it did not start;
    ``stopped`` once unhosted.

    A :class:`~enum.StrEnum`, so it compares equal to (and serialises as) its
    value: what the admin API has always shown.
    """

    STARTING = "starting"
    RUNNING = "running"
    RETRYING = "retrying"
    FAILED = "failed"
    STOPPED = "stopped"
