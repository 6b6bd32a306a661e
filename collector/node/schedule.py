"""When the collector's next scan is due: a fixed schedule that neither drifts nor bunches."""

from __future__ import annotations


class ScanSchedule:
    """Scans `interval_s` apart on a fixed grid, so a scan's own length does not add up.

    Two ways to fall behind, told apart by when a scan starts:

    * the scan before ran long (a slow disk, a busy node): the next starts as soon as it ends,
      and the grid holds, so the node is scanned as often as the scans allow;
    * the process was stopped or the host suspended past a whole interval: the grid restarts
      at the scan that resumes, so the missed scans are not run back to back.
    """

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.due = now

    def start(self, now: float) -> None:
        """A scan starts at `now`."""
        if now - self.due > self.interval_s:
            self.due = now

    def wait(self, now: float) -> float:
        """A scan ended at `now`: seconds until the next one is due, 0 if it already is."""
        self.due += self.interval_s
        return max(0.0, self.due - now)
