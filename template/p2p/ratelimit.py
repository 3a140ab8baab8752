"""Per-peer sliding-window rate limits for the RPC handlers a neuron serves to whoever can reach its host.

One small class shared by every handler (the publication RPC, the averager's join and state-download handlers), so
that each states its allowance in calls per minute and a flood from one peer never costs more than that.

On failure: nothing raises at call time; :meth:`RateLimiter.allow` answers False and the handler refuses the call.
Memory stays bounded: keys whose window has emptied are dropped once more than :attr:`RateLimiter.MAX_KEYS` are held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RateLimiter"]


class RateLimiter:
    """At most ``per_minute`` calls per key in any sliding 60 s window; forgets idle keys so memory stays bounded."""

    WINDOW_S = 60.0
    MAX_KEYS = 1024

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        if per_minute < 1:
            raise ValueError("the per-minute allowance must be >= 1")
        self.per_minute, self.clock = per_minute, clock
        self._calls: dict[str, deque[float]] = {}

    def allow(self, key: str) -> bool:
        now = self.clock()
        calls = self._calls.setdefault(key, deque())
        while calls and calls[0] <= now - self.WINDOW_S:
            calls.popleft()
        allowed = len(calls) < self.per_minute
        if allowed:
            calls.append(now)
        if len(self._calls) > self.MAX_KEYS:  # many distinct callers: drop the ones whose window has emptied
            self._calls = {k: v for k, v in self._calls.items() if v and v[-1] > now - self.WINDOW_S}
        return allowed
