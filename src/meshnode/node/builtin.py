"""Agents built into meshnode, provided through the same plugin path as any other."""

from __future__ import annotations

from collections.abc import Callable

from meshnode.agent import Agent
from meshnode.plugins import hookimpl

__all__ = ["CLI_AGENT_NAME", "BuiltinAgents", "CliAgent"]

#: The local name of the identity the ``meshnode call`` command speaks as.
CLI_AGENT_NAME = "cli"


class CliAgent(Agent):
    """The node's command-line identity: the sender of ``meshnode call`` requests.

    It offers nothing; it exists so a person at the terminal has a signed,
    vouched identity whose answers come back to an inbox this node holds.
    """

    description = "The command-line identity of this node's operator."
    version = "0.1.0"
    capabilities = ()
    visibility = "private"
    public = {"description": "The operator of this node, calling from the command line."}


class BuiltinAgents:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("builtin:cli", CliAgent)
