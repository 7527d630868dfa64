"""``@offering`` marks handlers, never the agent's lifecycle hooks: a decorator
left above ``on_start`` (a method inserted between it and its handler) made
on_start the handler of ``chat`` in the shell agent, and every call failed."""

from __future__ import annotations

import pytest
from meshnode_shell import ShellAgent

from meshnode.agent import Agent, Context, offering


@pytest.mark.parametrize("hook", ["on_start", "on_stop", "on_event"])
def test_a_lifecycle_hook_cannot_be_an_offering(hook: str) -> None:
    async def method(self: Agent, ctx: Context) -> None:
        return None

    method.__name__ = hook
    with pytest.raises(TypeError, match=rf"@offering\('chat'\) decorates {hook}\(\), the agent's lifecycle hook"):
        offering("chat")(method)


def test_the_shell_agents_chat_is_its_handler() -> None:
    assert {spec.id: spec.handler_name for spec in ShellAgent.offerings().values()} == {"chat": "chat"}
