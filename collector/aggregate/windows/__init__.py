"""The pure aggregation core: usage events -> tumbling windows -> billing records.

No I/O, no clock, no asyncio: the same calls give the same records, live or in a replay.

One concept a module:

* `settings`: `WindowSettings` and shared time constants; `stats`: `AggregateStats`.
* `progress`: event-time progress per source (watermark, next offsets, future events).
* `incarnations`: collector incarnations, de-duplication and supersession.
* `state`: the per-container `Track`, its `Device`s and timeline entries.
* `apply`: in-order application of events (samples, ends, presence, identity).
* `runs`: Kubernetes' running intervals (`ContainerRun`), the gate on billed presence.
* `integrate`: integrating live values over time, expiry at `max_gap_ms`.
* `late`: the late policy (counted, never corrected).
* `close`: closing a track's windows; `output`: merging tracks' windows into records.
* `identity`: pod identities (namespace, pod, workload, labels) on the event-time timeline.
* `inventory`: the GPUs' model and memory from the nodes' NVML inventories (allocation).
* `checkpoint`: restart offsets; `gauges`: current values for OTLP.
* `aggregator`: the `Aggregator` facade that wires them.

Model
-----
A **usage key** is (node, inc, cid, pid, hostpid, device); every `UsageRow` (in a `UsageSample`
or in a heartbeat's `ContainerState.rows`) is an absolute sample of its key at the event's `ts`.
The value holds until the next sample of the key, an end of the key, or `max_gap_ms` after its own
ts, whichever comes first. Time between that cap and the next event that restates or ends the key
is *unobserved*: not billed, and counted (per key, in key-milliseconds) in `stats.unobserved_ms`.
A key that is never heard of again adds nothing. Ends, presence and identity: see `apply`.

A **group** (node, inc, cid, device) is billed as the row (node, pod_uid, container,
device_uuid) from the container's identity, which is part of the event-time timeline like
everything else. Rows at a time when the container is not named, or of a device index its table
does not list, are counted in `stats.unattributed_rows` and ignored: a consumer that starts
mid-stream converges at the next heartbeat. The name is dropped at `ContainerGone` and after
`2 x max_gap_ms` without any event of the container (so a forgotten container costs no memory);
presence counts only while named. Groups that map to the same row in one window are added up
(integrals, samples, observed time); the peak is the largest of theirs, which is exact when they
do not overlap in time - see the incarnation rule (`incarnations`).

**Node rows**: each `DeviceUsageRow` of a `NodeDeviceSample` (the node collector's NVML view) is
an absolute sample of the node-level key (node, inc, device uuid), held like a usage key: until
the next sample of the key or `max_gap_ms` after its own ts. It is ended by a newer incarnation
like a container, never by `ContainerGone`. The machinery is the container one: the node of an
incarnation is a pseudo-container that every node sample names (no `ContainerAppeared`), with one
key per device uuid and no presence or limits; after a newer incarnation ended it, its later rows
count as unattributed. It is billed as the row (node, pod_uid "", container "", device_uuid):
`memory_byte_seconds` = ∫ `unaccounted_bytes` dt (NVML memory of processes no cache file accounts
for), `nvml_memory_byte_seconds` = ∫ `memory_used` dt (the whole device), `sm_percent_seconds` =
∫ `utilization` dt (device-wide), both limit integrals 0, `peak_memory_bytes` = the largest
`unaccounted_bytes` in effect for a positive time, `observed_seconds` = the time the key was
live, `samples` = its rows in the window. The empty pod_uid sorts a node's rows before its
containers'. Node rows have no gauges.

`samples` counts the (attributed, not late) usage rows whose ts lies in the window.

Windows
-------
Tumbling windows `[k*window_ms, (k+1)*window_ms)` aligned to the epoch, closed when the
watermark (`progress`) passes their end. Until then each container keeps the events since the
last closed end, applied at close in (ts, seq) order (`close`). Late events: `late`. Duplicates:
`incarnations`. Layout anomalies count for the watermark and de-duplication only; device
inventories: `inventory`. Restart: `checkpoint`.
"""

from ..records import Gauge
from .aggregator import Aggregator
from .incarnations import DEDUP_WINDOW
from .settings import WindowSettings
from .stats import AggregateStats

__all__ = [
    "DEDUP_WINDOW",
    "AggregateStats",
    "Aggregator",
    "Gauge",
    "WindowSettings",
]
