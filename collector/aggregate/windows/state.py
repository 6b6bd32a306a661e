"""The state the aggregator keeps per container (a track) and per device of it, and the shape of
the timeline entries a track holds until its window closes."""

from __future__ import annotations

from operator import itemgetter
from typing import Final, TypeAlias

from ...events import (
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    ContainerState,
    LimitsChanged,
    NodeDeviceSample,
    ProcessExited,
    ProcessStarted,
    UsageSample,
)
from . import packed
from .settings import NEVER

__all__ = [
    "HISTORY_GAPS",
    "NODE_CID",
    "SUPERSEDE",
    "Device",
    "Entry",
    "Key",
    "Payload",
    "RowKey",
    "Supersede",
    "Track",
    "effective",
    "unpacked",
]

# The cid of a node's pseudo-container (its NodeDeviceSample rows): outside the range of any
# integer a decoded event can carry (msgpack: [-2**63, 2**64)), so no container can be it.
NODE_CID: Final = -(1 << 64)


class Supersede:
    """Timeline marker: a newer incarnation of the collector on this node started here."""

    __slots__ = ()


SUPERSEDE: Final = Supersede()

# A UsageSample is held as the message bytes it came in when `packed.checked` accepted them,
# else decoded.
Payload: TypeAlias = (
    bytes
    | UsageSample
    | ContainerState
    | ContainerAppeared
    | ContainerGone
    | ProcessStarted
    | ProcessExited
    | LimitsChanged
    | NodeDeviceSample
    | ContainerRun
    | Supersede
)
# (effective ts, event ts, seq, arrival, payload, offset). The effective ts differs from the event
# ts only for a late event (it is then the closed end); a ContainerRun's event ts is its place
# on the timeline, moved later only as far as the windows that may close (`runs`). The first
# four are unique, so sorting never compares payloads. Offset -1: synthetic, nothing to re-read.
Entry: TypeAlias = tuple[int, int, int, int, Payload, int]
Key: TypeAlias = tuple[int, int, int]  # (pid, hostpid, device)
RowKey: TypeAlias = tuple[int, str, str, str, str]  # (window start, node, pod_uid, ctr, uuid)

effective = itemgetter(0)


def unpacked(p: Payload) -> Payload:
    """The payload with a sample held as bytes decoded."""
    return packed.sample(p) if isinstance(p, bytes) else p


# How far back (in max_gap) a track keeps the entries it applied, for the late accounting.
HISTORY_GAPS: Final = 2


class Device:
    """One device of a container: its table entry, the live sums over its keys, and what the
    window being accumulated has of it (integrals in milli-units)."""

    __slots__ = (
        "cov",
        "imem",
        "ipres",
        "ishares",
        "ivs",
        "limit",
        "lim",
        "mem",
        "monitor",
        "nkeys",
        "nvml",
        "peak",
        "pmem",
        "pres",
        "psm",
        "samples",
        "shares",
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
        # allocation: present ms under the current limits, and per (sm_limit, limit) pair
        # the present ms settled so far in the window (see `settle`)
        self.pres = 0
        self.shares: dict[tuple[int, int], int] = {}
        # reserved-but-idle: the same for the present time with no SM activity on the device
        # (no live key, or every key at sm_util 0), and the memory integral of that present
        # time
        self.ipres = 0
        self.ishares: dict[tuple[int, int], int] = {}
        self.imem = 0
        # the usage policy's share: the memory and SM integrals of the present time alone (a
        # container Kubernetes says is not running holds memory without being allocated it)
        self.pmem = 0
        self.psm = 0
        self.ivs: list[list[int]] = []  # node rows only: the [a, b) intervals of `cov`

    def settle(self) -> None:
        """Book the present time under the current limits (before they change, and at emit)."""
        if self.pres:
            key = (self.sm_limit, self.limit)
            self.shares[key] = self.shares.get(key, 0) + self.pres
            self.pres = 0
            if self.ipres:
                self.ishares[key] = self.ishares.get(key, 0) + self.ipres
                self.ipres = 0

    def has_window(self) -> bool:
        return bool(self.mem or self.nvml or self.smp or self.lim or self.smlim or self.samples)

    def holds_nothing(self) -> bool:
        """No live key and nothing of an open window: what a new `Device` would be, but its
        table entry."""
        return not (
            self.nkeys
            or self.has_window()
            or self.cov
            or self.ivs
            or self.peak
            or self.pres
            or self.shares
        )

    def reset_window(self) -> None:
        self.mem = self.nvml = self.smp = self.lim = self.smlim = self.peak = self.samples = 0
        self.cov = self.pres = self.ipres = self.imem = self.pmem = self.psm = 0
        self.shares = {}
        self.ishares = {}
        self.ivs = []


class Track:
    """Everything about one container (node, inc, cid): the state at the last closed end (the
    anchor), events not yet integrated, and the window being accumulated. The node's own rows
    are the pseudo-container (node, inc, NODE_CID), whose device index stands for a UUID."""

    __slots__ = (
        "alive",
        "container",
        "cur",
        "cut",
        "devs",
        "ended",
        "expired",
        "ended_off",
        "gone_off",
        "gone_ts",
        "hist",
        "ident_off",
        "inc",
        "ivs",
        "keys",
        "last_ts",
        "layout",
        "limits_off",
        "limits_ts",
        "next_exp",
        "nkeys",
        "node",
        "obs",
        "pending",
        "pod_uid",
        "pres_off",
        "run",
        "run_off",
        "run_seq",
        "run_ts",
        "slices",
        "source",
        "stated",
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
        self.devs: dict[int, Device] = {}
        self.limits_ts: int | None = None
        self.limits_off = 0
        self.slices = False  # the table lists a UUID at several indices (`Integrator.integrate`)
        # live usage: key -> [total, monitor, sm_util, sample ts, offset]
        self.keys: dict[Key, list[int]] = {}
        # the last in-bounds sample's rows: (pid, hostpid, device, Device, value list) (apply)
        self.layout: list[tuple[int, int, int, Device, list[int]]] | None = None
        self.nkeys = 0
        self.next_exp = NEVER  # lower bound of the earliest key expiry
        self.expired: dict[Key, int] = {}  # key past its cap -> its sample ts
        # end ts of keys and of (pid, hostpid): only late events consult them
        self.ended: dict[tuple[int, ...], int] = {}
        self.ended_off: dict[tuple[int, ...], int] = {}  # and the offsets of those ends
        self.alive = False  # an event was seen and no ContainerGone after it
        self.last_ts = -NEVER
        self.gone_ts: int | None = None
        self.gone_off = -1
        self.pres_off = 0
        # (ts, seq) of the last heartbeat state applied in order: it restated or ended every key
        self.stated = (-NEVER, 0)
        # Kubernetes' running gate (runs): None until a ContainerRun or a restatement sets it
        self.run: bool | None = None
        self.run_seq = -1
        self.run_off = -1
        self.run_ts = -NEVER  # the newest ContainerRun's time: how long the gate is kept (`_prune`)
        self.cut: int | None = None  # where a newer incarnation ended this one
        self.pending: list[Entry] = []
        # applied entries of the last HISTORY_GAPS x max_gap: only late events consult them
        self.hist: list[Entry] = []
        self.cur = cur  # integrated up to here
        self.win: int | None = None  # start of the window being accumulated
        self.obs = 0  # presence in that window
        self.ivs: list[list[int]] = []  # ... as [a, b) intervals (a GPU's observed time)
        # the node pseudo-container only (else None): device uuid -> its index in devs and keys
        self.uuids: dict[str, int] | None = {} if cid == NODE_CID else None
