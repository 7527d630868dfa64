"""Per-sender sliding-window rate limits (AgentMesh §16.1, §16.3, §10.14).

Keyed by the verified ``from``. Default: 60 requests per sliding 60 seconds.
Memory is bounded twice over: each key keeps at most ``limit`` timestamps,
and the number of keys is capped (least recently seen evicted first), so a
flood of fresh identities cannot grow the table without bound.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = ["RateDecision", "SlidingWindowLimiter"]


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_ms: int = 0


class SlidingWindowLimiter:
    """``limit`` events per ``window_ms`` per key; the clock is passed in."""

    def __init__(self, limit: int = 60, window_ms: int = 60_000, max_keys: int = 100_000) -> None:
        if limit < 1 or window_ms < 1 or max_keys < 1:
            raise ValueError("rate limit, window and key capacity must be positive")
        self.limit = limit
        self.window_ms = window_ms
        self.max_keys = max_keys
        self._events: OrderedDict[str, deque[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._events)

    def check(self, key: str, now_ms: int) -> RateDecision:
        """Count one event for ``key`` if allowed; say when to retry if not."""
        events = self._events.get(key)
        if events is None:
            events = deque()
            self._events[key] = events
            if len(self._events) > self.max_keys:
                self._events.popitem(last=False)
        else:
            self._events.move_to_end(key)
        horizon = now_ms - self.window_ms
        while events and events[0] <= horizon:
            events.popleft()
        if len(events) >= self.limit:
            return RateDecision(False, max(1, events[0] - horizon))
        events.append(now_ms)
        return RateDecision(True)

    def sweep(self, now_ms: int) -> None:
        """Drop keys whose events have all aged out (lazy eviction, §16.3)."""
        horizon = now_ms - self.window_ms
        for key in [k for k, ev in self._events.items() if not ev or ev[-1] <= horizon]:
            del self._events[key]
