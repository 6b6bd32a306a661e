"""The event schema: the one declaration of what the collector sends and the aggregator reads.

msgpack on the wire, array-like structs (field names are not sent), an integer tag per kind.
Every message starts with its tag and the schema version. Evolution is append-only: new fields
go at the end with a default, new kinds get a new tag; a tag or a field is never reused.
`schemas/events.schema.json` is generated from these types (`hami-usage schema`).

Identity and order: `inc` is the collector's incarnation (random at start-up) and `seq` counts
its messages from 0, so (node, inc, seq) is a deterministic id for de-duplication. `ts` is the
sample time in unix milliseconds (event time). A container is referred to by `cid`, a small
number the collector assigns per incarnation; `ContainerAppeared` and every `Heartbeat` state
what it stands for, so a consumer that starts anywhere converges within one heartbeat.
Values are absolute, never increments: a duplicate or a replay is harmless.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

import msgspec

from .layout.declarations import MAX_DEVICES, UUID_LEN
from .settings_check import MAX_PATH

SCHEMA_VERSION = 1
# What msgspec's schemas are written in (`prefixItems`, `$defs`): said in every published schema,
# since a validator that assumes an older draft silently ignores `prefixItems`.
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# The range of every byte count and percentage an event carries. No GPU has 2**48 bytes
# (256 TiB), and NVML's samples exceed 100 % only momentarily, never a hundredfold; a counter
# beyond these wrapped below zero or is bytes a tenant wrote. The reader turns such counters
# into anomalies, and the aggregator refuses them from any producer.
MAX_BYTES = (1 << 48) - 1
MAX_PERCENT = 10_000

# The longest string of each kind an event carries, from where it comes: a Kubernetes name is at
# most 253 characters (a label value 63, a label key 317 with its prefix), a cache folder's name
# (pod UID, '_', container) at most 255 bytes, NAME_MAX; an NVML UUID or device name at most 96
# bytes, and a cache file's UUID field 96 bytes, shown with what is not printable ASCII escaped
# (`\xff`: 4 characters a byte, since tenants write it); a path at most 4096 (PATH_MAX; a path or
# an anomaly's detail is given 4 characters a byte too). No collector sends a longer one; a value
# beyond these is refused as undecodable. Unbounded, one event with a megabyte name made its
# billing record too large for the billing topic, which stopped the aggregator at every restart.
MAX_NAME = 255  # the node name a message is keyed by is held to it too (intake)
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
# A pod UID is never empty: a container record keyed by an empty one is its GPU's node row.
PodUid = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Word = Annotated[str, msgspec.Meta(max_length=64)]  # a layout, an anomaly's kind, a reason
Nvml = Annotated[str, msgspec.Meta(max_length=UUID_LEN)]  # a UUID or a name NVML gives
MAX_CACHE_UUID = 4 * UUID_LEN
CacheUuid = Annotated[str, msgspec.Meta(max_length=MAX_CACHE_UUID)]  # a cache file's UUID, shown
PathText = Annotated[str, msgspec.Meta(max_length=4 * MAX_PATH)]
LabelKey = Annotated[str, msgspec.Meta(max_length=317)]
LabelValue = Annotated[str, msgspec.Meta(max_length=63)]
# The labels a pod's identity carries: the collector copies those of its pod_labels and
# namespace_labels settings, at most this many keys in all. Unbounded, one PodIdentity of 2 400
# labels, each key and value within its bound, made every record of the pod 5.4 MB as JSON.
MAX_LABELS = 64
Labels = Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=MAX_LABELS)]
# The GPUs a node's NVML lists, MIG instances included (16 GPUs of 7 instances each, with their
# parents, are 128). Unbounded, one sample of 40 000 rows cost the aggregator 16 s.
MAX_NODE_DEVICES = 256
# A container's devices: a cache file holds at most MAX_DEVICES (one LimitsChanged of 50 000
# devices kept as many for the container's life, and each later sample cost 10 ms).
Devices = Annotated[list["DeviceLimit"], msgspec.Meta(max_length=MAX_DEVICES)]

# Every struct below is gc=False: events are plain trees of numbers and strings that can never
# take part in a reference cycle, and at hundreds of thousands per second the cycle collector
# walking them cost the aggregator about a quarter of its time.


class DeviceLimit(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A container's entitlement on one device (index into the cache file's device table)."""

    index: int
    uuid: CacheUuid
    limit_bytes: int
    sm_limit: int


class UsageRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Absolute usage of one process on one device: the key is (cid, pid, hostpid, device)."""

    pid: int
    hostpid: int
    device: int
    total: int
    context: int
    module: int
    data: int
    monitor: int  # bytes NVML reports for the process (`monitorused`)
    sm_util: int  # percent, sampled


class ContainerState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Everything live about one container, restated by each heartbeat."""

    cid: int
    pod_uid: PodUid
    container: Name
    layout: Word
    devices: Devices
    rows: list[UsageRow]
    # Whether Kubernetes has the container running, as the collector last said in a
    # `ContainerRun` (None: it has said nothing, so presence is not gated by it).
    running: bool | None = None


class Identity(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Who a pod UID is, from the API server: namespace, name, the owning workload (`Deployment`,
    `StatefulSet`, `DaemonSet`, `CronJob`, `Job`, `ReplicaSet`, ... ; `Pod` for a bare pod) and
    the allowlisted namespace and pod labels (a pod label wins over a namespace label of the
    same key)."""

    pod_uid: PodUid
    namespace: Name
    pod: Name
    workload_kind: Name
    workload: Name
    labels: Labels = {}


class _Base(msgspec.Struct, array_like=True, frozen=True, gc=False, tag_field="kind"):
    v: int
    inc: int
    seq: int
    ts: int


class ContainerAppeared(_Base, tag=1, frozen=True):
    cid: int
    pod_uid: PodUid
    container: Name
    path: PathText
    layout: Word
    devices: Devices


class ContainerGone(_Base, tag=2, frozen=True):
    cid: int


class ProcessStarted(_Base, tag=3, frozen=True):
    cid: int
    pid: int
    hostpid: int


class ProcessExited(_Base, tag=4, frozen=True):
    cid: int
    pid: int
    hostpid: int


class UsageSample(_Base, tag=5, frozen=True):
    """Rows whose values changed since the last scan (absolute values)."""

    cid: int
    rows: list[UsageRow]


class LimitsChanged(_Base, tag=6, frozen=True):
    cid: int
    devices: Devices


class LayoutAnomaly(_Base, tag=7, frozen=True):
    """A reader anomaly (see the inspect contract) or a collector one (`stale_process`,
    `unreadable`, `skipped_path`, `large_directory`, `stuck_seqlock`, `orphaned_slot`,
    `shared_slot`, `stale_utilization`, ...). cid is -1 when the file is not a tracked
    container."""

    cid: int
    path: PathText
    anomaly: Word
    detail: PathText
    slot: int | None = None
    device: int | None = None
    value: int | None = None


class Heartbeat(_Base, tag=8, frozen=True):
    """Restates live containers. A node's heartbeat is split into parts of bounded size;
    `part` counts from 0 to `parts - 1`. `interval_ms` is the heartbeat period. `dropped`:
    events this incarnation could not store (so they left seq gaps); `log_blocked`: episodes in
    which its local log refused events (disk full, I/O error or its size bound)."""

    interval_ms: int
    part: int
    parts: int
    containers: list[ContainerState]
    scan_ms: float = 0.0
    files: int = 0
    spool_depth: int = 0
    dropped: int = 0
    log_blocked: int = 0
    # The identities of the pods of `containers` that are known, restated like the containers.
    pods: list[Identity] = []


class GpuInfo(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One physical GPU (or MIG instance) as NVML sees it on the node."""

    index: int
    uuid: Nvml
    name: Nvml
    memory_total: int
    mig_mode: bool
    parent_uuid: Nvml = ""  # for a MIG instance: the GPU it lives on


class DeviceUsageRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Whole-device usage from NVML, and the part of it no cache file accounts for."""

    uuid: Nvml
    memory_used: int
    utilization: int  # percent, device-wide
    unaccounted_bytes: int  # NVML per-process memory of processes no cache file knows


class DeviceInventory(_Base, tag=9, frozen=True):
    """The node's GPUs, at start and whenever they change."""

    devices: Annotated[list[GpuInfo], msgspec.Meta(max_length=MAX_NODE_DEVICES)]


class NodeDeviceSample(_Base, tag=10, frozen=True):
    """Node-level device usage each interval, so unaccounted use can be billed to the node."""

    rows: Annotated[list[DeviceUsageRow], msgspec.Meta(max_length=MAX_NODE_DEVICES)]


class PodIdentity(_Base, tag=11, frozen=True):
    """A pod's identity, when it becomes known or changes (and restated in heartbeats). It is
    kept after the pod is deleted while a container of it is still there."""

    identity: Identity


class CollectorStarted(_Base, tag=12, frozen=True):
    """The first event of each collector incarnation: who it is, so that two collectors sending
    under one node name can be told apart and named (the aggregator bills only the newest)."""

    host: Name  # the host name the collector runs on
    pid: int
    log: PathText  # its local log (spool) directory


class ContainerRun(_Base, tag=13, frozen=True):
    """From `at` (unix ms) container `cid` is running, or not, as Kubernetes recorded it: a
    run's `state.running.startedAt`, its `finishedAt` (or `lastState.terminated.finishedAt` for a
    restart the pod watch missed), the time the watch saw the pod deleted; after a deletion, the
    scan's time when the file's last live process ends or a new one starts. Its limits and
    allocation are billed only while it runs; `at` is not after `ts`, and the aggregator clamps
    it to no earlier than `ts - lateness` (and counts that). `reason`: `started`, `finished`,
    `restart_missed`, `deleted`, `processes`."""

    cid: int
    running: bool
    at: int
    reason: Word


Event = (
    ContainerAppeared
    | ContainerGone
    | ProcessStarted
    | ProcessExited
    | UsageSample
    | LimitsChanged
    | LayoutAnomaly
    | Heartbeat
    | DeviceInventory
    | NodeDeviceSample
    | PodIdentity
    | CollectorStarted
    | ContainerRun
)
EVENT_TYPES: tuple[type[Any], ...] = (
    ContainerAppeared,
    ContainerGone,
    ProcessStarted,
    ProcessExited,
    UsageSample,
    LimitsChanged,
    LayoutAnomaly,
    Heartbeat,
    DeviceInventory,
    NodeDeviceSample,
    PodIdentity,
    CollectorStarted,
    ContainerRun,
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(Event)


class UnknownSchemaVersion(ValueError):
    pass


def too_deep() -> msgspec.DecodeError:
    """What a value nested about a thousand levels deep is: msgspec raises RecursionError for
    it (a kilobyte of bytes anyone who can produce to the topic can send), and an undecodable
    message must be counted like any other, not end the process that reads it."""
    return msgspec.DecodeError("nested too deeply")


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(payload: bytes) -> Event:
    """Decode one message. Raises msgspec.DecodeError for undecodable bytes and
    UnknownSchemaVersion for a version this code does not know."""
    try:
        event = _decoder.decode(payload)
    except RecursionError:
        raise too_deep() from None
    except msgspec.ValidationError:
        # A newer version may add kinds (tags) or change fields this code cannot validate:
        # still say which version it is rather than only that it does not fit.
        version = _peek_version(payload)
        if version is not None and version > SCHEMA_VERSION:
            raise UnknownSchemaVersion(f"schema version {version} > {SCHEMA_VERSION}") from None
        raise
    if event.v > SCHEMA_VERSION:
        raise UnknownSchemaVersion(f"schema version {event.v} > {SCHEMA_VERSION}")
    return event


def _peek_version(payload: bytes) -> int | None:
    """The `v` of a message that is a msgpack array [tag, v, ...], else None."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(raw, list) and len(raw) >= 2 and type(raw[1]) is int:
        return raw[1]
    return None


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of the event union (written to schemas/ by `hami-usage schema`)."""
    schema: dict[str, Any] = msgspec.json.schema(Event)
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["title"] = "hami.usage.v1 events"
    schema["description"] = (__doc__ or "").strip()
    schema["x-schema-version"] = SCHEMA_VERSION
    _name_positions(schema["$defs"])
    return schema


def _name_positions(defs: dict[str, Any]) -> None:
    """Array-like structs are positional: give each position its field name (`title`) and
    list the names in order (`x-fields`), so a reader in any language can build objects."""
    structs: dict[str, type[msgspec.Struct]] = {}
    pending: list[Any] = list(EVENT_TYPES)
    while pending:
        tp = pending.pop()
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            if tp.__name__ in structs:
                continue
            structs[tp.__name__] = tp
            pending += [f.type for f in msgspec.structs.fields(tp)]
        else:
            pending += list(typing.get_args(tp))
    for name, definition in defs.items():
        cls = structs.get(name)
        if cls is None or "prefixItems" not in definition:
            continue
        names = list(cls.__struct_fields__)
        if cls.__struct_config__.tag is not None:
            names.insert(0, "kind")
        definition["x-fields"] = names
        for item, field_name in zip(definition["prefixItems"], names, strict=True):
            item["title"] = field_name
