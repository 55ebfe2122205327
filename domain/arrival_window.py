"""How long an idle engine waits for the rest of a burst of requests before its first step.

Requests that arrive together (a benchmark's c4/c16, an agent's parallel tool calls) reach the engine a few
milliseconds apart: each is parsed, rendered and tokenized on its own. An engine that starts a step as soon as the
first one lands puts only it, or a few, into that prefill step; the rest wait a whole step (tens of milliseconds on
a host-bound prefill) for the next one, so their time to first token doubles. Measured on the CPU with the fake
executor at 70 ms a step (tests/app/test_arrival_window.py): 4 concurrent requests got their first tokens over
three or four steps. The window holds the first step back until the submissions have been quiet for `quiet_s`,
never longer than `max_s` after the first one. It applies only when the engine was idle: with streams running,
a new prompt joins the next step anyway and holding it would stall the others.

Pure policy (no clock of its own): the engine asks `remaining` with its clock's readings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUIET_S = 0.002  # a gap this long between submissions ends the burst (they come ~0.1-1 ms apart within one)
# `ft serve --arrival-window-ms`'s default. NOTE: from the CPU probe in ADR 0021 (scripts/diag/probe_arrival_bursts.py):
# bursts of 4 and 16 gathered whole in most rounds, a lone request pays at most QUIET_S; the H200 A/B is pending
DEFAULT_MAX_MS = 30.0


@dataclass(frozen=True)
class ArrivalWindow:
    """max_s: the longest an idle engine holds its first step after the first submission (0: never waits);
    quiet_s: the gap between submissions that ends a burst earlier. Raises ValueError unless
    0 <= quiet_s and 0 <= max_s, both finite."""

    max_s: float
    quiet_s: float = QUIET_S

    def __post_init__(self) -> None:
        for name in ("max_s", "quiet_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"arrival window {name} must be a finite number of seconds >= 0, got {value!r}")

    def remaining(self, now: float, first: float, last: float) -> float:
        """Seconds still to wait at `now` for a burst whose first submission arrived at `first` and latest at
        `last` (same clock): 0 once it has been quiet for quiet_s, or max_s has passed since `first`."""
        if self.max_s <= 0:
            return 0.0
        return max(0.0, min(last + self.quiet_s, first + self.max_s) - now)
