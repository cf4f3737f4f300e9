"""Rate-limited server logs: a fault that repeats (every accept failing once file descriptors run
out, say) logs a few lines and then a count, instead of flooding the disk with thousands of
tracebacks a second.

`RateLimitFilter` lets through at most ``burst`` records of one kind (same logger, message
template and exception type) per ``window`` seconds; the first record of the next window that
passes carries a note of how many were dropped.
"""

from __future__ import annotations

import logging
import time

SERVER_LOGGERS = ("uvicorn.error", "asyncio")  # where the server's (and the event loop's) errors are logged


class RateLimitFilter(logging.Filter):
    """At most ``burst`` records of one kind per ``window`` seconds (see the module docstring)."""

    def __init__(self, burst: int = 10, window: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.burst = burst
        self.window = window
        self.clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [window start, records passed, records dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg), exc_type)
        now = self.clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] >= self.window:
            dropped = state[2] if state is not None else 0
            self._kinds[kind] = [now, 1, 0]
            if len(self._kinds) > 1000:  # many kinds (messages formatted before logging): forget the old ones
                self._kinds = {kind: self._kinds[kind]}
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this in the last {self.window:.0f} s were not logged]"
            return True
        if state[1] < self.burst:
            state[1] += 1
            return True
        state[2] += 1
        return False


def limit_server_logs(burst: int = 10, window: float = 10.0) -> None:
    """Put one `RateLimitFilter` on the server's loggers (once per process)."""
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter(burst, window))
