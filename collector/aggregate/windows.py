"""The pure aggregation core: usage events -> tumbling windows -> billing records.

No I/O, no clock, no asyncio: the same calls give the same records, live or in a replay.

Model
-----
* A **usage key** is (node, inc, cid, pid, hostpid, device); every `UsageRow` (in a
  `UsageSample` or in a heartbeat's `ContainerState.rows`) is an absolute sample of its key at the
  event's `ts`. The value holds until the next sample of the key, an end of the key, or
  `max_gap_ms` after its own ts, whichever comes first. Time between that cap and the next
  event that restates or ends the key is *unobserved*: not billed, and counted (per key, in
  key-milliseconds) in `stats.unobserved_ms`. A key that is never heard of again adds nothing.
* Ends: `ProcessExited` ends every key of (cid, pid, hostpid); `ContainerGone` ends every key
  and the presence of the container; a heartbeat that restates a container without a key the
  aggregator holds ends that key at the heartbeat's ts (the exit was missed).
* **Presence** of a container (node, inc, cid) is refreshed by every event of that cid
  (appeared, sample, limits, process events, heartbeat state; not layout anomalies), capped at
  `max_gap_ms` after the last one, and ended by `ContainerGone`. Limits are billed while present.
* A **group** (node, inc, cid, device) is billed as the row (node, pod_uid, container,
  device_uuid) from the container's identity, which is part of the event-time timeline like
  everything else: `ContainerAppeared` or a heartbeat's `ContainerState` names the container
  and gives its device table (UUIDs, limits); `LimitsChanged` replaces the table. Rows at a time
  when the container is not named, or of a device index its table does not list, are counted in
  `stats.unattributed_rows` and ignored: a consumer that starts mid-stream converges at the next
  heartbeat. The name is dropped at `ContainerGone` and after `2 x max_gap_ms` without any event
  of the container (so a forgotten container costs no memory); presence counts only while named.
  Groups that map to the same row in one window are added up (integrals, samples, observed
  time); the peak is the largest of theirs, which is exact when they do not overlap in time -
  see the incarnation rule below.
* **Incarnations**: a collector restart starts a new `inc` on the same node, and the old one never
  says goodbye. Without a rule its values would be billed for another `max_gap_ms` next to the new
  incarnation's restated ones. So the first event of a newer incarnation (one whose first event
  time is later) ends every container of the older ones of that node at that time.
* **Node rows**: each `DeviceUsageRow` of a `NodeDeviceSample` (the node collector's NVML view)
  is an absolute sample of the node-level key (node, inc, device uuid), held like a usage key:
  until the next sample of the key or `max_gap_ms` after its own ts. It is ended by a newer
  incarnation like a container, never by `ContainerGone`. The machinery is the container one:
  the node of an incarnation is a pseudo-container that every node sample names (no
  `ContainerAppeared`), with one key per device uuid and no presence or limits; after a newer
  incarnation ended it, its later rows count as unattributed. It is billed as the row
  (node, pod_uid "", container "", device_uuid): `memory_byte_seconds` = ∫ `unaccounted_bytes` dt
  (NVML memory of processes no cache file accounts for), `nvml_memory_byte_seconds` = ∫
  `memory_used` dt (the whole device), `sm_percent_seconds` = ∫ `utilization` dt (device-wide),
  both limit integrals 0, `peak_memory_bytes` = the largest `unaccounted_bytes` in effect for a
  positive time, `observed_seconds` = the time the key was live, `samples` = its rows in the
  window. The empty pod_uid sorts a node's rows before its containers'. Node rows have no gauges.

Integration is exact integer arithmetic in byte-milliseconds and percent-milliseconds, split at
window edges; records divide by 1000 only when they are built. `peak_memory_bytes` is the largest
per-group sum of `total` that was in effect for a positive time in the window. `samples` counts
the (attributed, not late) usage rows whose ts lies in the window.

Windows, watermark, order
-------------------------
Tumbling windows `[k*window_ms, (k+1)*window_ms)` aligned to the epoch. The watermark is the
minimum over the sources seen (Kafka partitions) of their largest event ts, minus `lateness_ms`;
`advance()` closes every window whose end is at or below it. Until then each container keeps the
events since the last closed end, and at close they are applied sorted by (ts, seq) - seq is the
collector's own order, so events that arrive out of order but within the lateness give exactly
the records they would have given in order, and so do splits of a batch. Nothing depends on
when `advance()` is called, so a replay that batches its input differently from the live run
gives the same records.

Late policy (counted, never corrected)
--------------------------------------
An event whose ts is before the end of the last window this instance closed is **late**. It is
counted in `stats.late_events`, and for each of its usage rows the part of the row's interval
that fell into closed windows, `min(closed_end - ts, max_gap_ms)`, is added to
`stats.late_ms_dropped`. Closed windows are never revised: there are no correction records and
`revision` is always 0 (the field is kept for evolution). The event still takes effect from the
closed end onward, so the following windows are right: a late sample replaces a key's value
unless a newer sample or an end of that key (or of its process or container) is already known,
and it keeps its own ts for the `max_gap_ms` cap; a late end ends only keys sampled before it;
a late event refreshes presence only if it is newer than the last event seen.

Duplicates
----------
(node, inc, seq) identifies an event. Per (node, inc) the aggregator keeps the highest seq seen
and the set of seqs above `highest - DEDUP_WINDOW` (10 000). An event seen before is dropped and
counted in `stats.duplicates`; so is an event more than `DEDUP_WINDOW` sequence numbers behind the
newest of its incarnation (that far behind it is a redelivery, not reordering). The state of an
incarnation is forgotten once a newer one exists, it has no containers left, and its last event
is more than max_gap + lateness + one window behind the closed end; a redelivery after that is
no longer recognised (it is then late, or an event of a container that is not named).

Layout anomalies and device inventories count for the watermark and de-duplication only.

Future events: with `record_ts_ms` (the transport's record time) given, an event whose ts is more
than `max_skew_ms` after it is dropped and counted in `stats.future_events`. It is a comparison of
two recorded times, never the wall clock, so a replay decides exactly as the live run did.

Restart (exactly once)
----------------------
`needed_offsets()` gives, per source, the earliest offset whose event is still needed to rebuild
the open windows: pending events, the samples behind every live key, the events behind each
container's identity, limits and presence. A new `Aggregator(emitted_until_ms=E)` fed from those
offsets recomputes the windows ending at or before E and suppresses them. One node's events are
assumed to stay in one source (the node is the Kafka key). Late events are classified against
this instance's own closed end, so a restart can classify a late event differently; in-time
input gives the same records.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from operator import itemgetter
from typing import Final, TypeAlias

import msgspec

from ..events import (
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceLimit,
    Event,
    Heartbeat,
    LimitsChanged,
    NodeDeviceSample,
    ProcessExited,
    ProcessStarted,
    UsageRow,
    UsageSample,
)
from .records import BillingRecord, Gauge, make_record_id

__all__ = [
    "DEDUP_WINDOW",
    "AggregateStats",
    "Aggregator",
    "Gauge",
    "WindowSettings",
]

DEDUP_WINDOW: Final = 10_000
# A container's name is kept this many max_gap after its last event (until ContainerGone at
# most), so a collector that stalls and resumes with changed rows only is still attributed
# without waiting for its next heartbeat.
_RETAIN_GAPS: Final = 2
_NEVER: Final = 1 << 62
# The cid of a node's pseudo-container (its NodeDeviceSample rows): outside the range of any
# integer a decoded event can carry (msgpack: [-2**63, 2**64)), so no container can be it.
_NODE_CID: Final = -(1 << 64)


class WindowSettings(msgspec.Struct, frozen=True):
    window_ms: int = 60_000  # tumbling, aligned to the unix epoch
    lateness_ms: int = 10_000  # allowed lateness
    max_gap_ms: int = 90_000  # default 3 x heartbeat (heartbeat default 30 s)
    max_skew_ms: int = 300_000  # an event this far ahead of its record timestamp is dropped

    def __post_init__(self) -> None:
        if self.window_ms <= 0:
            raise ValueError(f"window_ms must be > 0, got {self.window_ms}")
        if self.lateness_ms < 0:
            raise ValueError(f"lateness_ms must be >= 0, got {self.lateness_ms}")
        if self.max_gap_ms <= 0:
            raise ValueError(f"max_gap_ms must be > 0, got {self.max_gap_ms}")
        if self.max_skew_ms < 0:
            raise ValueError(f"max_skew_ms must be >= 0, got {self.max_skew_ms}")


class AggregateStats(msgspec.Struct):
    events: int = 0  # every add()
    duplicates: int = 0
    late_events: int = 0
    late_ms_dropped: int = 0  # key-milliseconds of late rows that fell into closed windows
    future_events: int = 0
    unattributed_rows: int = 0
    unobserved_ms: int = 0  # key-milliseconds beyond max_gap before the key was heard of again
    records: int = 0


class _Supersede:
    """Timeline marker: a newer incarnation of the collector on this node started here."""

    __slots__ = ()


_SUPERSEDE: Final = _Supersede()

_Payload: TypeAlias = (
    UsageSample
    | ContainerState
    | ContainerAppeared
    | ContainerGone
    | ProcessStarted
    | ProcessExited
    | LimitsChanged
    | NodeDeviceSample
    | _Supersede
)
# (effective ts, event ts, seq, arrival, payload, offset). The effective ts differs from the event
# ts only for a late event (it is then the closed end). The first four are unique, so sorting
# never compares payloads. Offset -1: synthetic, nothing to re-read.
_Entry: TypeAlias = tuple[int, int, int, int, _Payload, int]
_Key: TypeAlias = tuple[int, int, int]  # (pid, hostpid, device)
_RowKey: TypeAlias = tuple[int, str, str, str, str]  # (window start, node, pod_uid, ctr, uuid)

_effective = itemgetter(0)


class _Incarnation:
    """One collector incarnation (node, inc): de-duplication state and its event-time span.

    Per incarnation the highest seq seen and the set of seqs above `highest - DEDUP_WINDOW`."""

    __slots__ = ("first_ts", "hwm", "last_ts", "seqs")

    def __init__(self) -> None:
        self.hwm = -1
        self.seqs: set[int] = set()
        self.first_ts = _NEVER
        self.last_ts = -_NEVER

    def prune(self) -> None:
        low = self.hwm - DEDUP_WINDOW
        self.seqs = {s for s in self.seqs if s > low}

    def seen_before(self, seq: int) -> bool:
        """For a seq at or below the highest one (the caller handles the common case)."""
        if seq <= self.hwm - DEDUP_WINDOW or seq in self.seqs:
            return True
        self.seqs.add(seq)
        return False


class _Device:
    """One device of a container: its table entry, the live sums over its keys, and what the
    window being accumulated has of it (integrals in milli-units)."""

    __slots__ = (
        "cov",
        "limit",
        "lim",
        "mem",
        "monitor",
        "nkeys",
        "nvml",
        "peak",
        "samples",
        "sm",
        "sm_limit",
        "smlim",
        "smp",
        "total",
        "uuid",
    )

    def __init__(self) -> None:
        self.uuid: str | None = None  # None: not in the container's current device table
        self.limit = 0
        self.sm_limit = 0
        self.total = 0  # sums over the live keys
        self.monitor = 0
        self.sm = 0
        self.nkeys = 0
        self.mem = 0  # window accumulators
        self.nvml = 0
        self.smp = 0
        self.lim = 0
        self.smlim = 0
        self.peak = 0
        self.samples = 0
        self.cov = 0  # time with a live key (the observed time of a node row)

    def has_window(self) -> bool:
        return bool(self.mem or self.nvml or self.smp or self.lim or self.smlim or self.samples)

    def reset_window(self) -> None:
        self.mem = self.nvml = self.smp = self.lim = self.smlim = self.peak = self.samples = 0
        self.cov = 0


class _Track:
    """Everything about one container (node, inc, cid): the state at the last closed end (the
    anchor), events not yet integrated, and the window being accumulated. The node's own rows
    are the pseudo-container (node, inc, _NODE_CID), whose device index stands for a UUID."""

    __slots__ = (
        "alive",
        "container",
        "cur",
        "cut",
        "devs",
        "ended",
        "expired",
        "gone_ts",
        "ident_off",
        "inc",
        "keys",
        "last_ts",
        "limits_off",
        "limits_ts",
        "next_exp",
        "nkeys",
        "node",
        "obs",
        "pending",
        "pod_uid",
        "pres_off",
        "source",
        "uuids",
        "win",
    )

    def __init__(self, node: str, inc: int, cid: int, source: int, cur: int) -> None:
        self.node = node
        self.inc = inc
        self.source = source
        self.pod_uid: str | None = None  # None while the container is not named
        self.container = ""
        self.ident_off = 0
        self.devs: dict[int, _Device] = {}
        self.limits_ts: int | None = None
        self.limits_off = 0
        # live usage: key -> [total, monitor, sm_util, sample ts, offset]
        self.keys: dict[_Key, list[int]] = {}
        self.nkeys = 0
        self.next_exp = _NEVER  # lower bound of the earliest key expiry
        self.expired: dict[_Key, int] = {}  # key past its cap -> its sample ts
        # end ts of keys and of (pid, hostpid): only late events consult them
        self.ended: dict[tuple[int, ...], int] = {}
        self.alive = False  # an event was seen and no ContainerGone after it
        self.last_ts = -_NEVER
        self.gone_ts: int | None = None
        self.pres_off = 0
        self.cut: int | None = None  # where a newer incarnation ended this one
        self.pending: list[_Entry] = []
        self.cur = cur  # integrated up to here
        self.win: int | None = None  # start of the window being accumulated
        self.obs = 0  # presence in that window
        # the node pseudo-container only (else None): device uuid -> its index in devs and keys
        self.uuids: dict[str, int] | None = {} if cid == _NODE_CID else None


class Aggregator:
    """Integrates events into billing records; see the module docstring for the semantics."""

    def __init__(self, settings: WindowSettings, *, emitted_until_ms: int = 0) -> None:
        self.settings = settings
        self.stats = AggregateStats()
        self._w = settings.window_ms
        self._lateness = settings.lateness_ms
        self._gap = settings.max_gap_ms
        self._skew = settings.max_skew_ms
        self._suppress = emitted_until_ms
        self._closed: int | None = None
        self._tracks: dict[tuple[str, int, int], _Track] = {}
        self._incs: dict[tuple[str, int], _Incarnation] = {}
        self._node_incs: dict[str, dict[int, _Incarnation]] = {}
        # per source: [next offset, largest event ts (-_NEVER until one counts)]
        self._src: dict[int, list[int]] = {}
        self._arrival = 0
        self._out: dict[_RowKey, list[int]] = {}

    @property
    def emitted_until_ms(self) -> int:
        """End of the last closed window (at least the `emitted_until_ms` it started with)."""
        closed = self._closed
        return self._suppress if closed is None or closed < self._suppress else closed

    # --- input ---------------------------------------------------------------------------

    def add(
        self,
        node: str,
        event: Event,
        *,
        source: int = 0,
        offset: int = 0,
        record_ts_ms: int | None = None,
    ) -> None:
        stats = self.stats
        stats.events += 1
        src = self._src.get(source)
        if src is None:
            src = self._src[source] = [offset + 1, -_NEVER]
        elif offset >= src[0]:
            src[0] = offset + 1
        ts = event.ts
        if record_ts_ms is not None and ts > record_ts_ms + self._skew:
            stats.future_events += 1
            return
        inc = event.inc
        incarnation = self._incs.get((node, inc))
        if incarnation is None:
            incarnation = self._incs[(node, inc)] = _Incarnation()
            self._node_incs.setdefault(node, {})[inc] = incarnation
        seq = event.seq
        if seq > incarnation.hwm:
            incarnation.hwm = seq
            seqs = incarnation.seqs
            seqs.add(seq)
            if len(seqs) > 2 * DEDUP_WINDOW:
                incarnation.prune()
        elif incarnation.seen_before(seq):
            stats.duplicates += 1
            return
        if ts < incarnation.first_ts:
            incarnation.first_ts = ts
        if ts > incarnation.last_ts:
            incarnation.last_ts = ts
        if ts > src[1]:
            src[1] = ts
        closed = self._closed
        eff = ts if closed is None or ts >= closed else closed
        self._arrival += 1
        rows = 0
        if isinstance(event, UsageSample):
            tr = self._tracks.get((node, inc, event.cid))
            if tr is None:
                tr = self._track(node, inc, event.cid, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
            rows = len(event.rows)
        elif isinstance(event, Heartbeat):
            for state in event.containers:
                tr = self._track(node, inc, state.cid, source)
                tr.pending.append((eff, ts, seq, self._arrival, state, offset))
                rows += len(state.rows)
        elif isinstance(
            event,
            ContainerAppeared | ContainerGone | ProcessStarted | ProcessExited | LimitsChanged,
        ):
            tr = self._track(node, inc, event.cid, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
        elif isinstance(event, NodeDeviceSample):
            tr = self._track(node, inc, _NODE_CID, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
            rows = len(event.rows)
        # LayoutAnomaly, DeviceInventory: counted above, nothing to integrate.
        if eff != ts:
            assert closed is not None
            stats.late_events += 1
            stats.late_ms_dropped += rows * min(closed - ts, self._gap)

    def _track(self, node: str, inc: int, cid: int, source: int) -> _Track:
        tr = self._tracks.get((node, inc, cid))
        if tr is None:
            closed = self._closed
            tr = _Track(node, inc, cid, source, -_NEVER if closed is None else closed)
            self._tracks[(node, inc, cid)] = tr
        return tr

    # --- closing windows -----------------------------------------------------------------

    def advance(self) -> list[BillingRecord]:
        """Close every window whose end is at or below the watermark; records sorted by
        (window_start, node, pod_uid, container, device_uuid)."""
        tops = [top for _, top in self._src.values() if top != -_NEVER]
        if not tops:
            return []
        wm = min(tops) - self._lateness
        target = wm - wm % self._w
        if self._closed is not None and target <= self._closed:
            return []
        return self._close(target)

    def flush(self) -> list[BillingRecord]:
        """Close everything (for --drain): every value runs to its next change or its cap."""
        tops = [top for _, top in self._src.values() if top != -_NEVER]
        if not tops:
            return []
        end = max(tops) + self._gap
        target = -(-end // self._w) * self._w
        if self._closed is not None and target <= self._closed:
            return []
        return self._close(target)

    def _close(self, target: int) -> list[BillingRecord]:
        for tr in self._tracks.values():
            self._run(tr, target)
        self._closed = target
        self._prune(target)
        return self._records()

    def _run(self, tr: _Track, target: int) -> None:
        """Apply this container's due events in order and integrate it up to `target`."""
        self._maybe_supersede(tr, target)
        pending = tr.pending
        if pending:
            pending.sort()
            i = bisect_left(pending, target, key=_effective)
            if i == len(pending):
                tr.pending = []
            else:
                tr.pending = pending[i:]
                del pending[i:]
            w = self._w
            retain = _RETAIN_GAPS * self._gap
            cur = tr.cur
            for e in pending:
                t = e[0]
                if t > cur:
                    self._integrate(tr, cur, t)
                    cur = t
                if e[1] != t:
                    self._apply_late(tr, e)
                    continue
                if tr.pod_uid is not None and t >= tr.last_ts + retain:
                    self._forget(tr)  # silent for too long: wait for a restatement
                ws = t - t % w
                if ws != tr.win:
                    self._roll(tr, ws)
                p = e[4]
                off = e[5]
                if isinstance(p, UsageSample):
                    tr.alive = True
                    tr.last_ts = t
                    tr.pres_off = off
                    self._rows(tr, p.rows, t, off)
                elif isinstance(p, ContainerState):
                    self._state(tr, p, t, off)
                elif isinstance(p, ContainerGone | _Supersede):
                    self._gone(tr, t)
                elif isinstance(p, NodeDeviceSample):
                    self._node_rows(tr, p, t, off, late=False)
                else:
                    tr.alive = True
                    tr.last_ts = t
                    tr.pres_off = off
                    if isinstance(p, ProcessExited):
                        self._end_process(tr, p.pid, p.hostpid, t)
                    elif isinstance(p, ContainerAppeared):
                        self._learn(tr, p.pod_uid, p.container, p.devices, t, off)
                    elif isinstance(p, LimitsChanged):
                        self._set_limits(tr, p.devices, t, off)
            tr.cur = cur
        self._integrate(tr, tr.cur, target)
        if tr.next_exp <= target:
            self._expire(tr, target)
        self._emit(tr)
        tr.win = None
        tr.cur = target

    def _maybe_supersede(self, tr: _Track, target: int) -> None:
        incs = self._node_incs.get(tr.node)
        if incs is None or len(incs) < 2:
            return
        mine = incs.get(tr.inc)
        if mine is None:
            return
        cut = _NEVER
        for other in incs.values():
            if mine.first_ts < other.first_ts < cut:
                cut = other.first_ts
        if cut >= target or (tr.cut is not None and tr.cut <= cut):
            return
        tr.cut = cut
        closed = self._closed
        eff = cut if closed is None or cut >= closed else closed
        self._arrival += 1
        tr.pending.append((eff, cut, -1, self._arrival, _SUPERSEDE, -1))

    def _integrate(self, tr: _Track, a: int, b: int) -> None:
        """Accumulate [a, b), during which only expiries change the values."""
        w = self._w
        gap = self._gap
        devs = tr.devs.values()
        while a < b:
            # presence counts only while the container is named (it is billed by name)
            pres_end = tr.last_ts + gap if tr.alive and tr.pod_uid is not None else a
            if not tr.nkeys and pres_end <= a:
                return
            ws = a - a % w
            if ws != tr.win:
                self._roll(tr, ws)
            c = ws + w
            if b < c:
                c = b
            if tr.next_exp < c:
                e = self._expire(tr, a)
                if e < c:
                    c = e
            dt = c - a
            pdt = 0
            if pres_end > a:
                pdt = (c if c < pres_end else pres_end) - a
                tr.obs += pdt
            for d in devs:
                if pdt:
                    d.lim += d.limit * pdt
                    d.smlim += d.sm_limit * pdt
                if d.nkeys:
                    total = d.total
                    d.mem += total * dt
                    d.nvml += d.monitor * dt
                    d.smp += d.sm * dt
                    d.cov += dt
                    if total > d.peak:
                        d.peak = total
            a = c

    def _expire(self, tr: _Track, t: int) -> int:
        """End the keys whose cap is at or before `t`; return the next expiry (exact)."""
        gap = self._gap
        nxt = _NEVER
        gone: list[_Key] = []
        for k, v in tr.keys.items():
            exp = v[3] + gap
            if exp <= t:
                gone.append(k)
            elif exp < nxt:
                nxt = exp
        for k in gone:
            tr.expired[k] = tr.keys[k][3]
            self._drop_key(tr, k)
        tr.next_exp = nxt
        return nxt

    def _roll(self, tr: _Track, ws: int) -> None:
        self._emit(tr)
        tr.win = ws

    def _emit(self, tr: _Track) -> None:
        """Hand what `tr` accumulated in its window to the output, merged by billing row. Also
        called mid-window, before the container's name or device table changes."""
        ws = tr.win
        if ws is None:
            return
        obs = tr.obs
        tr.obs = 0
        pod_uid = tr.pod_uid
        wanted = pod_uid is not None and ws + self._w > self._suppress
        per_device = tr.uuids is not None  # a node row is observed while its key is live
        out = self._out
        for d in tr.devs.values():
            if per_device:
                obs = d.cov
            if wanted and d.uuid is not None and (obs or d.has_window()):
                assert pod_uid is not None
                key = (ws, tr.node, pod_uid, tr.container, d.uuid)
                row = out.get(key)
                if row is None:
                    out[key] = [d.mem, d.nvml, d.smp, d.lim, d.smlim, d.peak, d.samples, obs]
                else:
                    row[0] += d.mem
                    row[1] += d.nvml
                    row[2] += d.smp
                    row[3] += d.lim
                    row[4] += d.smlim
                    row[5] = max(row[5], d.peak)
                    row[6] += d.samples
                    row[7] += obs
            d.reset_window()

    def _records(self) -> list[BillingRecord]:
        out = self._out
        self._out = {}
        w = self._w
        records = []
        for key in sorted(out):
            ws, node, pod_uid, container, uuid = key
            mem, nvml, smp, lim, smlim, peak, samples, obs = out[key]
            records.append(
                BillingRecord(
                    window_start_ms=ws,
                    window_end_ms=ws + w,
                    node=node,
                    pod_uid=pod_uid,
                    container=container,
                    device_uuid=uuid,
                    memory_byte_seconds=mem / 1000,
                    memory_limit_byte_seconds=lim / 1000,
                    nvml_memory_byte_seconds=nvml / 1000,
                    sm_percent_seconds=smp / 1000,
                    sm_limit_percent_seconds=smlim / 1000,
                    peak_memory_bytes=peak,
                    observed_seconds=obs / 1000,
                    samples=samples,
                    record_id=make_record_id(ws, node, pod_uid, container, uuid, 0),
                )
            )
        self.stats.records += len(records)
        return records

    def _prune(self, closed: int) -> None:
        gap = self._gap
        retain = _RETAIN_GAPS * gap
        live_incs: set[tuple[str, int]] = set()
        drop: list[tuple[str, int, int]] = []
        for key, tr in self._tracks.items():
            if tr.ended:
                tr.ended = {k: t for k, t in tr.ended.items() if t > closed - gap}
            # Dropping a track must not change any record, whenever advance() is called: what is
            # dropped is what a new track would be (no name, nothing live or pending).
            if (
                tr.pending
                or tr.nkeys
                or (tr.alive and tr.last_ts + gap > closed)
                or (tr.pod_uid is not None and tr.last_ts + retain > closed)
            ):
                live_incs.add((tr.node, tr.inc))
            else:
                drop.append(key)
        for key in drop:
            del self._tracks[key]
        # An older incarnation is forgotten (with its de-duplication state) once it has no
        # containers and its last event is well behind the closed end.
        horizon = closed - gap - self._lateness - self._w
        for node, incs in self._node_incs.items():
            if len(incs) > 1:
                newest = max(incs, key=lambda i: (incs[i].first_ts, i))
                for inc in [i for i in incs if i != newest and (node, i) not in live_incs]:
                    if incs[inc].last_ts < horizon:
                        del incs[inc]
                        del self._incs[(node, inc)]

    # --- applying events in order ----------------------------------------------------------

    def _rows(self, tr: _Track, rows: list[UsageRow], t: int, off: int) -> None:
        """Samples at `t` (the hot path: no allocation for a key that is already live)."""
        if tr.pod_uid is None:
            self.stats.unattributed_rows += len(rows)
            return
        devs = tr.devs
        keys = tr.keys
        exp = t + self._gap
        for r in rows:
            dev = r.device
            d = devs.get(dev)
            if d is None or d.uuid is None:
                self.stats.unattributed_rows += 1
                continue
            k = (r.pid, r.hostpid, dev)
            total = r.total
            mon = r.monitor
            sm = r.sm_util
            v = keys.get(k)
            if v is None:
                keys[k] = [total, mon, sm, t, off]
                d.total += total
                d.monitor += mon
                d.sm += sm
                d.nkeys += 1
                tr.nkeys += 1
                if exp < tr.next_exp:
                    tr.next_exp = exp
                if tr.expired:
                    self._unexpire(tr, k, t)
            else:
                d.total += total - v[0]
                d.monitor += mon - v[1]
                d.sm += sm - v[2]
                v[0] = total
                v[1] = mon
                v[2] = sm
                v[3] = t
                v[4] = off
            d.samples += 1

    def _node_rows(
        self, tr: _Track, sample: NodeDeviceSample, t: int, off: int, *, late: bool
    ) -> None:
        """A node sample names the node's pseudo-container (pod_uid and container empty) and
        states one key per device UUID, held as the process row (0, 0, index) of that device:
        total = unaccounted bytes, monitor = NVML memory used, sm_util = device utilisation.
        Once a newer incarnation ended it, nothing names it again."""
        uuids = tr.uuids
        assert uuids is not None
        if tr.pod_uid is None:
            if tr.gone_ts is not None:
                self.stats.unattributed_rows += len(sample.rows)
                return
            tr.pod_uid = ""
        if t > tr.last_ts:
            tr.last_ts = t  # only for forgetting the track; a node has no presence (alive)
        devs = tr.devs
        rows = []
        for r in sample.rows:
            i = uuids.get(r.uuid)
            if i is None:
                i = uuids[r.uuid] = len(uuids)
                devs[i] = _Device()
            devs[i].uuid = r.uuid
            rows.append(
                UsageRow(0, 0, i, r.unaccounted_bytes, 0, 0, 0, r.memory_used, r.utilization)
            )
        if late:
            self._late_rows(tr, rows, t, off)
        else:
            self._rows(tr, rows, t, off)

    def _state(self, tr: _Track, state: ContainerState, t: int, off: int) -> None:
        tr.alive = True
        tr.last_ts = t
        tr.pres_off = off
        self._learn(tr, state.pod_uid, state.container, state.devices, t, off)
        self._rows(tr, state.rows, t, off)
        if tr.keys or tr.expired:
            stated = {(r.pid, r.hostpid, r.device) for r in state.rows}
            for k in [k for k in tr.keys if k not in stated]:
                self._drop_key(tr, k)
                tr.ended[k] = t
            for k in [k for k in tr.expired if k not in stated]:
                self._unexpire(tr, k, t)

    def _end_process(self, tr: _Track, pid: int, hostpid: int, t: int) -> None:
        for dev in tr.devs:
            k = (pid, hostpid, dev)
            if k in tr.keys:
                self._drop_key(tr, k)
            if k in tr.expired:
                self._unexpire(tr, k, t)
        tr.ended[(pid, hostpid)] = t

    def _gone(self, tr: _Track, t: int) -> None:
        tr.keys.clear()
        for d in tr.devs.values():
            d.total = d.monitor = d.sm = d.nkeys = 0
        tr.nkeys = 0
        tr.next_exp = _NEVER
        for k in list(tr.expired):
            self._unexpire(tr, k, t)
        tr.alive = False
        if tr.gone_ts is None or t > tr.gone_ts:
            tr.gone_ts = t
        self._forget(tr)

    def _learn(
        self, tr: _Track, pod_uid: str, container: str, devices: list[DeviceLimit], t: int, off: int
    ) -> None:
        if tr.pod_uid is not None and (tr.pod_uid, tr.container) != (pod_uid, container):
            self._emit(tr)  # what was accumulated belongs to the old name
        tr.pod_uid = pod_uid
        tr.container = container
        tr.ident_off = off
        self._set_limits(tr, devices, t, off)

    def _forget(self, tr: _Track) -> None:
        """Drop the name and device table; the window so far is handed out under them first."""
        self._emit(tr)
        tr.pod_uid = None
        tr.container = ""
        for d in tr.devs.values():
            d.uuid = None
            d.limit = d.sm_limit = 0
        tr.limits_ts = None

    def _set_limits(self, tr: _Track, devices: list[DeviceLimit], t: int, off: int) -> None:
        """The device list of an appeared/heartbeat/limits event is the whole table."""
        table = {x.index: x for x in devices}
        devs = tr.devs
        for i, d in devs.items():
            if d.uuid is not None and (i not in table or table[i].uuid != d.uuid):
                self._emit(tr)  # a device leaves the table: hand out its window so far
                break
        for i, d in devs.items():
            if i not in table:
                d.uuid = None
                d.limit = d.sm_limit = 0
        for i, x in table.items():
            dev = devs.get(i)
            if dev is None:
                dev = devs[i] = _Device()
            dev.uuid = x.uuid
            dev.limit = x.limit_bytes
            dev.sm_limit = x.sm_limit
        tr.limits_ts = t
        tr.limits_off = off

    def _drop_key(self, tr: _Track, k: _Key) -> None:
        v = tr.keys.pop(k)
        d = tr.devs[k[2]]
        d.total -= v[0]
        d.monitor -= v[1]
        d.sm -= v[2]
        d.nkeys -= 1
        tr.nkeys -= 1

    def _unexpire(self, tr: _Track, k: _Key, t: int) -> None:
        """`k` was restated or ended at `t`: the time since its cap was unobserved."""
        sample_ts = tr.expired.pop(k, None)
        if sample_ts is not None:
            self.stats.unobserved_ms += max(0, t - sample_ts - self._gap)

    # --- applying late events ------------------------------------------------------------

    def _apply_late(self, tr: _Track, e: _Entry) -> None:
        """A late event, applied at the closed end but judged by its own ts (module docstring)."""
        ts = e[1]
        p = e[4]
        off = e[5]
        if isinstance(p, ContainerGone | _Supersede):
            self._end_late(tr, ts, lambda k: True)
            if tr.last_ts < ts:
                tr.alive = False
                self._forget(tr)
            if tr.gone_ts is None or ts > tr.gone_ts:
                tr.gone_ts = ts
            return
        if isinstance(p, NodeDeviceSample):
            self._node_rows(tr, p, ts, off, late=True)
            return
        if ts > tr.last_ts and (tr.gone_ts is None or ts > tr.gone_ts):
            tr.alive = True
            tr.last_ts = ts
            tr.pres_off = off
        if isinstance(p, UsageSample):
            self._late_rows(tr, p.rows, ts, off)
        elif isinstance(p, ContainerState):
            self._late_identity(tr, p.pod_uid, p.container, p.devices, ts, off)
            self._late_rows(tr, p.rows, ts, off)
            stated = {(r.pid, r.hostpid, r.device) for r in p.rows}
            self._end_late(tr, ts, lambda k: k not in stated)
        elif isinstance(p, ProcessExited):
            proc = (p.pid, p.hostpid)
            self._end_late(tr, ts, lambda k: k[:2] == proc)
            if tr.ended.get(proc, -_NEVER) < ts:
                tr.ended[proc] = ts
        elif isinstance(p, ContainerAppeared):
            self._late_identity(tr, p.pod_uid, p.container, p.devices, ts, off)
        elif isinstance(p, LimitsChanged) and (tr.limits_ts is None or ts > tr.limits_ts):
            self._set_limits(tr, p.devices, ts, off)

    def _late_identity(
        self,
        tr: _Track,
        pod_uid: str,
        container: str,
        devices: list[DeviceLimit],
        ts: int,
        off: int,
    ) -> None:
        if tr.gone_ts is not None and tr.gone_ts >= ts:
            return
        if tr.pod_uid is None:
            self._learn(tr, pod_uid, container, devices, ts, off)
        elif tr.limits_ts is None or ts > tr.limits_ts:
            self._set_limits(tr, devices, ts, off)

    def _end_late(self, tr: _Track, ts: int, which: Callable[[_Key], bool]) -> None:
        """End the keys selected by `which` that were sampled before `ts`."""
        for k in [k for k, v in tr.keys.items() if v[3] < ts and which(k)]:
            self._drop_key(tr, k)
            if tr.ended.get(k, -_NEVER) < ts:
                tr.ended[k] = ts
        for k in [k for k, s in tr.expired.items() if s < ts and which(k)]:
            self._unexpire(tr, k, ts)

    def _late_rows(self, tr: _Track, rows: list[UsageRow], ts: int, off: int) -> None:
        if tr.pod_uid is None:
            self.stats.unattributed_rows += len(rows)
            return
        gone = -_NEVER if tr.gone_ts is None else tr.gone_ts
        ended = tr.ended
        for r in rows:
            d = tr.devs.get(r.device)
            if d is None or d.uuid is None:
                self.stats.unattributed_rows += 1
                continue
            k = (r.pid, r.hostpid, r.device)
            v = tr.keys.get(k)
            if v is not None and v[3] >= ts:
                continue  # a newer sample is in effect
            if tr.expired.get(k, -_NEVER) >= ts or gone >= ts:
                continue
            if ended.get(k, -_NEVER) >= ts or ended.get(k[:2], -_NEVER) >= ts:
                continue
            if v is not None:
                self._drop_key(tr, k)
            elif tr.expired:
                self._unexpire(tr, k, ts)
            tr.keys[k] = [r.total, r.monitor, r.sm_util, ts, off]
            d.total += r.total
            d.monitor += r.monitor
            d.sm += r.sm_util
            d.nkeys += 1
            tr.nkeys += 1
            # The cap counts from the sample's own ts; _integrate expires it on its first step.
            if ts + self._gap < tr.next_exp:
                tr.next_exp = ts + self._gap

    # --- checkpoints and gauges ----------------------------------------------------------

    def needed_offsets(self) -> dict[int, int]:
        """Per source: the earliest offset still needed to rebuild the open windows, or the
        offset after the last one added when nothing is."""
        need: dict[int, int] = {}
        closed = self._closed
        gap = self._gap
        for tr in self._tracks.values():
            m = _NEVER
            for e in tr.pending:
                if 0 <= e[5] < m:
                    m = e[5]
            for v in tr.keys.values():
                if v[4] < m:
                    m = v[4]
            if tr.uuids is not None:
                pass  # the node: every sample names it, so its keys and pending events are all
            elif tr.pod_uid is not None:
                # the last event too: it decides when the name is forgotten
                m = min(m, tr.ident_off, tr.limits_off, tr.pres_off)
            elif tr.alive and (closed is None or tr.last_ts + gap > closed) and tr.pres_off < m:
                m = tr.pres_off
            if m < need.get(tr.source, _NEVER):
                need[tr.source] = m
        return {src: min(need.get(src, s[0]), s[0]) for src, s in sorted(self._src.items())}

    def gauges(self) -> list[Gauge]:
        """Current values per container billing row, as of the newest event time of its source
        (events not yet integrated included; late ones judged by their own ts, roughly). Node
        rows have no gauges."""
        gap = self._gap
        rows: dict[tuple[str, str, str, str], list[int]] = {}
        for tr in self._tracks.values():
            if tr.uuids is not None:
                continue
            now = self._src[tr.source][1]
            ident = None if tr.pod_uid is None else (tr.pod_uid, tr.container)
            table = {i: (d.uuid, d.limit) for i, d in tr.devs.items() if d.uuid is not None}
            limits_ts = -_NEVER if tr.limits_ts is None else tr.limits_ts
            keys = {k: (v[0], v[1], v[2], v[3]) for k, v in tr.keys.items()}
            alive = tr.alive
            last = tr.last_ts
            for e in sorted(tr.pending):
                ts = e[1]
                p = e[4]
                if isinstance(p, ContainerGone | _Supersede):
                    keys = {k: v for k, v in keys.items() if v[3] > ts}
                    if last <= ts:
                        alive = False
                        ident = None
                    continue
                if ts >= last:
                    alive = True
                    last = ts
                if isinstance(p, ContainerAppeared | ContainerState):
                    ident = (p.pod_uid, p.container)
                if isinstance(p, ContainerAppeared | ContainerState | LimitsChanged) and (
                    ts >= limits_ts
                ):
                    table = {x.index: (x.uuid, x.limit_bytes) for x in p.devices}
                    limits_ts = ts
                if isinstance(p, UsageSample | ContainerState):
                    for r in p.rows:
                        k = (r.pid, r.hostpid, r.device)
                        old = keys.get(k)
                        if old is None or old[3] <= ts:
                            keys[k] = (r.total, r.monitor, r.sm_util, ts)
                if isinstance(p, ContainerState):
                    stated = {(r.pid, r.hostpid, r.device) for r in p.rows}
                    keys = {k: v for k, v in keys.items() if k in stated or v[3] > ts}
                elif isinstance(p, ProcessExited):
                    proc = (p.pid, p.hostpid)
                    keys = {k: v for k, v in keys.items() if k[:2] != proc or v[3] > ts}
            if ident is None:
                continue
            present = alive and last + gap > now
            usage: dict[int, list[int]] = {}
            for k, v in keys.items():
                if v[3] + gap > now:
                    u = usage.setdefault(k[2], [0, 0, 0])
                    u[0] += v[0]
                    u[1] += v[1]
                    u[2] += v[2]
            for dev in set(usage) | (set(table) if present else set()):
                if dev not in table:
                    continue
                uuid, limit = table[dev]
                u = usage.get(dev, [0, 0, 0])
                g = rows.setdefault((tr.node, ident[0], ident[1], uuid), [0, 0, 0, 0])
                g[0] += u[0]
                g[1] = max(g[1], limit if present else 0)
                g[2] += u[2]
                g[3] += u[1]
        return [
            Gauge(
                node=node,
                pod_uid=pod_uid,
                container=container,
                device_uuid=uuid,
                memory_used_bytes=g[0],
                memory_limit_bytes=g[1],
                sm_percent=g[2],
                nvml_memory_bytes=g[3],
            )
            for (node, pod_uid, container, uuid), g in sorted(rows.items())
        ]
