"""Logging refused messages without letting a flood of them flood the log.

Every refusal is counted (by kind, in the service's counters); at most `per_minute` of them are
logged in any minute. What the limit holds back is counted too, and said in one line when the
minute is over, so 50k junk messages cost a handful of log lines, not 50k.
"""

from __future__ import annotations

import logging
import time


class RefusalLog:
    def __init__(self, log: logging.Logger, per_minute: int, period_s: float = 60.0, service: str = "replay"):
        self.log = log
        self.service = service
        self.per_minute = per_minute
        self.period_s = period_s
        self.logged = 0
        self.unlogged = 0
        self._window_start = time.monotonic()
        self._in_window = 0
        self._held_back = 0  # refusals not logged in the current window

    def refused(self, detail: str) -> None:
        self.tick()
        if self._in_window < self.per_minute:
            self._in_window += 1
            self.logged += 1
            self.log.warning("%s: refused a message: %s", self.service, detail)
        else:
            self._held_back += 1
            self.unlogged += 1

    def tick(self) -> None:
        """Start a new window when the period is over, saying how many refusals went unlogged."""
        now = time.monotonic()
        if now - self._window_start < self.period_s:
            return
        if self._held_back:
            self.log.warning(
                "%s: %d more refused messages in the last %.0f s were not logged (see its refusal counters)",
                self.service,
                self._held_back,
                now - self._window_start,
            )
        self._window_start, self._in_window, self._held_back = now, 0, 0
