"""``async with`` for the transport's long-running pieces, written once.

The embedded broker, the cluster and the control plane are each started and
stopped explicitly (``await x.start()`` / ``await x.stop()``) or used as
``async with x:``, which starts on entry and stops on exit, however the block
ends.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncService"]


class AsyncService:
    """Mixin: ``async with`` over :meth:`start` and :meth:`stop`."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
