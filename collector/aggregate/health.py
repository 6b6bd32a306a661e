"""The aggregator's `/healthz` (its StatefulSet's probes): 200 while its input loop turns.

Both input loops (local log, Kafka) come round at least every second or so, idle or not, and call
`Liveness.beat`; so does the Kafka replica's wait for its first assignment (a replica on standby,
with no partition, may wait there for good). A loop stuck longer than `stale_after_s` (a hung
broker call, a wedged transaction) answers 503 and the kubelet restarts the pod; start-up
(waiting for the broker, at most `start_timeout_s`, then for the group's checkpoint), before the
first turn, counts as alive for `start_grace_s`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..transport.http import TEXT, Answer, HttpServer


@dataclass
class Liveness:
    last_beat: float = field(default_factory=time.monotonic)
    beats: int = 0

    def beat(self) -> None:
        self.last_beat = time.monotonic()
        self.beats += 1


class HealthServer(HttpServer):
    def __init__(
        self,
        host: str,
        port: int,
        liveness: Liveness,
        *,
        stale_after_s: float,
        start_grace_s: float = 0.0,
    ) -> None:
        super().__init__(host, port, {"/healthz": self._healthz})
        self.liveness = liveness
        self.stale_after_s = stale_after_s
        self.start_grace_s = start_grace_s

    async def _healthz(self, accept: str) -> Answer:
        age = time.monotonic() - self.liveness.last_beat
        limit = (
            self.stale_after_s
            if self.liveness.beats
            else max(self.stale_after_s, self.start_grace_s)
        )
        status = "200 OK" if age <= limit else "503 Service Unavailable"
        return (
            status,
            TEXT,
            f"input loop turned {age:.1f} s ago ({self.liveness.beats} turns)\n".encode(),
        )
