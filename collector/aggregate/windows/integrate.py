"""Time on a track's timeline: integrating its live values over [a, b), split at window edges
and at the `max_gap_ms` cap of each key.

Integration is exact integer arithmetic in byte-milliseconds and percent-milliseconds, split at
window edges; records divide by 1000 only when they are built. `peak_memory_bytes` is the
largest per-group sum of `total` that was in effect for a positive time in the window. Time
between a key's cap and the next event that restates or ends it is *unobserved*: not billed,
and counted (per key, in key-milliseconds) in `stats.unobserved_ms`.
"""

from __future__ import annotations

from collections.abc import Iterable

from .output import Output
from .settings import NEVER, RETAIN_GAPS, WindowSettings
from .state import Device, Key, Track
from .stats import AggregateStats

__all__ = ["Integrator"]


class Integrator:
    """The settings, counters and output every timeline step needs, and the steps that move a
    track's time forward."""

    __slots__ = ("gap", "output", "retain", "stats", "w")

    def __init__(self, settings: WindowSettings, stats: AggregateStats, output: Output) -> None:
        self.w = settings.window_ms
        self.gap = settings.max_gap_ms
        self.retain = RETAIN_GAPS * settings.max_gap_ms
        self.stats = stats
        self.output = output

    def integrate(self, tr: Track, a: int, b: int) -> None:
        """Accumulate [a, b), during which only expiries change the values."""
        w = self.w
        gap = self.gap
        devs = tr.devs.values()
        node = tr.uuids is not None
        while a < b:
            # presence counts only while the container is named (it is billed by name) and
            # not while Kubernetes says it does not run (runs)
            present = tr.alive and tr.pod_uid is not None and tr.run is not False
            pres_end = tr.last_ts + gap if present else a
            if not tr.nkeys and pres_end <= a:
                return
            ws = a - a % w
            if ws != tr.win:
                self.roll(tr, ws)
            c = ws + w
            if b < c:
                c = b
            if tr.next_exp < c:
                e = self.expire(tr, a)
                if e < c:
                    c = e
            dt = c - a
            pdt = 0
            if pres_end > a:
                pdt = (c if c < pres_end else pres_end) - a
                tr.obs += pdt
                ivs = tr.ivs
                if ivs and ivs[-1][1] == a:
                    ivs[-1][1] = a + pdt
                else:
                    ivs.append([a, a + pdt])
            # (the slices of one UUID are one GPU: idle while none of them is busy)
            busy = _busy(devs) if tr.slices else None
            for d in devs:
                gpu_sm = d.sm if busy is None or d.uuid is None else busy[d.uuid]
                if pdt:
                    d.lim += d.limit * pdt
                    d.smlim += d.sm_limit * pdt
                    d.pres += pdt
                    if not gpu_sm:  # reserved but idle: no SM activity, or no live key
                        d.ipres += pdt
                if d.nkeys:
                    total = d.total
                    sm = d.sm
                    d.mem += total * dt
                    d.nvml += d.monitor * dt
                    d.smp += sm * dt
                    d.cov += dt
                    if pdt:
                        d.pmem += total * pdt
                        d.psm += sm * pdt
                        if not gpu_sm:
                            d.imem += total * pdt
                    if total > d.peak:
                        d.peak = total
                    if node:
                        div = d.ivs
                        if div and div[-1][1] == a:
                            div[-1][1] = c
                        else:
                            div.append([a, c])
            if tr.slices:
                _slice_peaks(devs)
            a = c

    def expire(self, tr: Track, t: int) -> int:
        """End the keys whose cap is at or before `t`; return the next expiry (exact)."""
        gap = self.gap
        nxt = NEVER
        gone: list[Key] = []
        for k, v in tr.keys.items():
            exp = v[3] + gap
            if exp <= t:
                gone.append(k)
            elif exp < nxt:
                nxt = exp
        for k in gone:
            tr.expired[k] = tr.keys[k][3]
            self.drop_key(tr, k)
        tr.next_exp = nxt
        return nxt

    def roll(self, tr: Track, ws: int) -> None:
        self.output.emit(tr)
        tr.win = ws

    def drop_key(self, tr: Track, k: Key) -> None:
        v = tr.keys.pop(k)
        tr.layout = None  # it may hold k's value list
        d = tr.devs[k[2]]
        d.total -= v[0]
        d.monitor -= v[1]
        d.sm -= v[2]
        d.nkeys -= 1
        tr.nkeys -= 1

    def unexpire(self, tr: Track, k: Key, t: int) -> None:
        """`k` was restated or ended at `t`: the time since its cap was unobserved."""
        sample_ts = tr.expired.pop(k, None)
        if sample_ts is not None:
            self.stats.unobserved_ms += max(0, t - sample_ts - self.gap)


def _slice_peaks(devs: Iterable[Device]) -> None:
    """The slices of one UUID are one record: its peak is their summed use, so each slice's
    peak is taken up to the sum (the record's is the largest of its slices')."""
    sums: dict[str, int] = {}
    for d in devs:
        if d.nkeys and d.uuid is not None:
            sums[d.uuid] = sums.get(d.uuid, 0) + d.total
    for d in devs:
        total = sums.get(d.uuid) if d.uuid is not None else None
        if total is not None and total > d.peak:
            d.peak = total


def _busy(devs: Iterable[Device]) -> dict[str, int]:
    """Per UUID, the SM activity of its slices with a live key."""
    out: dict[str, int] = {}
    for d in devs:
        if d.uuid is not None:
            out[d.uuid] = out.get(d.uuid, 0) + (d.sm if d.nkeys else 0)
    return out
