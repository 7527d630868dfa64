"""Agents built into meshnode, provided through the same plugin path as any other."""

from __future__ import annotations

from collections.abc import Callable

from meshnode.agent import Agent
from meshnode.plugins import hookimpl

__all__ = ["BRIDGE_AGENT_NAME", "CLI_AGENT_NAME", "A2ABridgeAgent", "BuiltinAgents", "CliAgent"]

#: The local name of the identity the ``meshnode call`` command speaks as.
CLI_AGENT_NAME = "cli"
#: The local name of the identity the A2A bridge sends its mesh requests as.
BRIDGE_AGENT_NAME = "a2a-bridge"


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


class A2ABridgeAgent(Agent):
    """The A2A bridge's identity: the sender of the mesh requests that A2A
    callers' messages become, and the signer of the bridge's run reports.

    It offers nothing; its requests enter hosted agents through the same
    inbound pipeline (and the same admission) as every other sender's.
    """

    description = "The A2A bridge of this node: A2A callers' requests arrive from it."
    version = "0.1.0"
    capabilities = ()
    visibility = "private"
    public = {"description": "Requests from A2A callers, bridged by this node."}


class BuiltinAgents:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("builtin:cli", CliAgent)
        register("builtin:a2a-bridge", A2ABridgeAgent)
