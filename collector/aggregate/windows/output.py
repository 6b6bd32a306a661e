"""What closed windows hand out: per-track accumulators merged by billing row into records,
and per GPU the fair-share allocation of its observed time (`allocate`).

Groups that map to the same row (node, pod_uid, container, device_uuid) in one window are added
up (integrals, samples, observed time, present time per limits); the peak is the largest of
theirs. A container whose device table lists one UUID at several indices holds each of those
slices (their limits, shares and usage add up, and the peak is of their summed use:
`integrate`), but is present on that GPU once: its observed time counts once per row.
Integrals are exact integers in milli-units until the record is built. Each container row is
named by its pod's identity for that window (`identity`); a row without one is counted in
`unnamed_records`.

A GPU (node, device_uuid) is observed in a window while a named container that lists it is
present or its node row has a live key: the union of those intervals. It gets one `gpu` and one
`idle` record per window it was observed in."""

from __future__ import annotations

from typing import Any

from ...events import Identity
from ..records import (
    RECORD_VERSION,
    BillingRecord,
    in_bounds,
    make_record_id,
    record_order,
    seconds,
)
from .allocate import Policy, allocated_ms, fit, idle_part, observed_ms, used_ms
from .identity import Identities
from .inventory import Inventory
from .state import RowKey, Track
from .stats import AggregateStats

__all__ = ["Output"]

GpuKey = tuple[int, str, str]  # (window start, node, device uuid)

_NAMES: dict[str, Any] = {}


def _names(who: Identity) -> dict[str, Any]:
    return {
        "namespace": who.namespace,
        "pod": who.pod,
        "workload_kind": who.workload_kind,
        "workload": who.workload,
        "labels": who.labels,
    }


class _Row:
    __slots__ = (
        "imem",
        "ishares",
        "lim",
        "mem",
        "nvml",
        "obs",
        "peak",
        "pmem",
        "psm",
        "samples",
        "shares",
        "sm",
        "smlim",
    )

    def __init__(self) -> None:
        self.mem = self.nvml = self.sm = self.lim = self.smlim = 0
        self.peak = self.samples = self.obs = self.imem = self.pmem = self.psm = 0
        self.shares: dict[tuple[int, int], int] = {}
        self.ishares: dict[tuple[int, int], int] = {}  # the SM-idle part of `shares`


class Output:
    """Rows of the windows being closed, merged by billing row; windows ending at or before
    `suppress` (already emitted by an earlier run) are computed but never handed out."""

    __slots__ = ("_gpus", "_identities", "_inv", "_policy", "_rows", "_stats", "_suppress", "_w")

    def __init__(
        self,
        window_ms: int,
        suppress: int,
        stats: AggregateStats,
        identities: Identities,
        policy: Policy = "max",
        inventory: Inventory | None = None,
    ) -> None:
        self._identities = identities
        self._w = window_ms
        self._suppress = suppress
        self._stats = stats
        self._policy: Policy = policy
        self._inv = inventory
        self._rows: dict[RowKey, _Row] = {}
        self._gpus: dict[GpuKey, list[list[int]]] = {}  # observed intervals

    def emit(self, tr: Track) -> None:
        """Hand what `tr` accumulated in its window to the output, merged by billing row. Also
        called mid-window, before the container's name or device table changes."""
        ws = tr.win
        if ws is None:
            return
        obs = tr.obs
        ivs = tr.ivs
        tr.obs = 0
        tr.ivs = []
        pod_uid = tr.pod_uid
        wanted = pod_uid is not None and ws + self._w > self._suppress
        per_device = tr.uuids is not None  # a node row is observed while its key is live
        out = self._rows
        gpus = self._gpus
        counted: set[RowKey] = set()  # the track's presence counts once per row
        for d in tr.devs.values():
            if per_device:
                obs = d.cov
                ivs = d.ivs
            d.settle()
            if wanted and d.uuid is not None and (obs or d.has_window()):
                assert pod_uid is not None
                key = (ws, tr.node, pod_uid, tr.container, d.uuid)
                row = out.get(key)
                if row is None:
                    row = out[key] = _Row()
                row.mem += d.mem
                row.nvml += d.nvml
                row.sm += d.smp
                row.lim += d.lim
                row.smlim += d.smlim
                if d.peak > row.peak:
                    row.peak = d.peak
                row.samples += d.samples
                if key not in counted:  # one UUID at two indices is still one GPU's time
                    counted.add(key)
                    row.obs += obs
                    if ivs:
                        gpus.setdefault((ws, tr.node, d.uuid), []).extend(ivs)
                shares = row.shares
                for lk, ms in d.shares.items():
                    shares[lk] = shares.get(lk, 0) + ms
                ishares = row.ishares
                for lk, ms in d.ishares.items():
                    ishares[lk] = ishares.get(lk, 0) + ms
                row.imem += d.imem
                row.pmem += d.pmem
                row.psm += d.psm
            d.reset_window()

    def records(self) -> list[BillingRecord]:
        """The merged rows as records, sorted by `record_order`; the output is empty after."""
        out = self._rows
        gpus = self._gpus
        self._rows = {}
        self._gpus = {}
        by_gpu: dict[GpuKey, list[RowKey]] = {}
        for key in out:
            by_gpu.setdefault((key[0], key[1], key[4]), []).append(key)
        records = []
        for gk in sorted(by_gpu.keys() | gpus.keys()):
            records.extend(self._gpu(gk, sorted(by_gpu.get(gk, ())), out, gpus.get(gk, [])))
        records.sort(key=record_order)
        kept = [r for r in records if in_bounds(r)]
        # Bounded inputs cannot add up past the bounds; such a record is refused, never sent.
        self._stats.refused_records += len(records) - len(kept)
        self._stats.records += len(kept)
        return kept

    def _gpu(
        self, gk: GpuKey, keys: list[RowKey], out: dict[RowKey, _Row], ivs: list[list[int]]
    ) -> list[BillingRecord]:
        """The records of one GPU in one window: its rows, then its gpu and idle records."""
        ws, node, uuid = gk
        we = ws + self._w
        info = None if self._inv is None else self._inv.lookup(node, uuid, ws, we)
        model, memory = info if info is not None else ("", 0)
        observed = observed_ms(ivs)
        policy = self._policy
        if memory <= 0 and policy in ("memory", "max"):
            self._stats.allocation_fallbacks += 1
        ctrs = [k for k in keys if k[2]]  # node rows (empty pod_uid) are allocated nothing
        used_raw = [used_ms(out[k].sm, out[k].mem, memory) for k in ctrs]
        used, _ = fit(used_raw, observed)  # (flags nothing: see the README)
        if policy == "usage":
            # the used time while present: not while Kubernetes says it does not run
            raw = [used_ms(out[k].psm, out[k].pmem, memory) for k in ctrs]
            alloc, over = fit(raw, observed)
            idle_raw = [used_ms(0, out[k].imem, memory) for k in ctrs]
        else:
            raw = [allocated_ms(policy, out[k].shares, memory) for k in ctrs]
            alloc, over = fit(raw, observed)
            idle_raw = [allocated_ms(policy, out[k].ishares, memory) for k in ctrs]
        reserved_idle = idle_part(alloc, idle_raw, raw)
        if over:
            self._stats.overcommitted += 1
        share = {
            k: (a, u, ri) for k, a, u, ri in zip(ctrs, alloc, used, reserved_idle, strict=True)
        }
        records = []
        for key in keys:
            _, _, pod_uid, container, _ = key
            r = out[key]
            a, u, ri = share.get(key, (0, 0, 0))
            who = self._identities.at(node, pod_uid, we) if pod_uid else None
            if who is None and pod_uid:
                self._stats.unnamed_records += 1
            records.append(
                BillingRecord(
                    window_start_ms=ws,
                    window_end_ms=we,
                    node=node,
                    pod_uid=pod_uid,
                    container=container,
                    device_uuid=uuid,
                    memory_byte_seconds=seconds(r.mem),
                    memory_limit_byte_seconds=seconds(r.lim),
                    nvml_memory_byte_seconds=seconds(r.nvml),
                    sm_percent_seconds=seconds(r.sm),
                    sm_limit_percent_seconds=seconds(r.smlim),
                    peak_memory_bytes=r.peak,
                    observed_seconds=seconds(r.obs),
                    samples=r.samples,
                    record_id=make_record_id(
                        ws, node, pod_uid, container, uuid, 0, window_ms=self._w
                    ),
                    kind="container" if pod_uid else "node",
                    gpu_model=model,
                    gpu_memory_bytes=memory,
                    allocated_gpu_seconds=seconds(a),
                    used_gpu_seconds=seconds(u),
                    reserved_idle_gpu_seconds=seconds(ri),
                    overcommitted=over and bool(pod_uid),
                    version=RECORD_VERSION,
                    **(_NAMES if who is None else _names(who)),
                )
            )
        sa = sum(alloc)
        su = sum(used)
        for kind, obs, a, u, ri in (
            ("gpu", observed, sa, su, sum(reserved_idle)),
            ("idle", 0, observed - sa, observed - su, 0),
        ):
            records.append(
                BillingRecord(
                    window_start_ms=ws,
                    window_end_ms=we,
                    node=node,
                    pod_uid="",
                    container="",
                    device_uuid=uuid,
                    memory_byte_seconds=seconds(0),
                    memory_limit_byte_seconds=seconds(0),
                    nvml_memory_byte_seconds=seconds(0),
                    sm_percent_seconds=seconds(0),
                    sm_limit_percent_seconds=seconds(0),
                    peak_memory_bytes=0,
                    observed_seconds=seconds(obs),
                    samples=0,
                    record_id=make_record_id(ws, node, "", "", uuid, 0, kind, self._w),
                    kind=kind,
                    gpu_model=model,
                    gpu_memory_bytes=memory,
                    allocated_gpu_seconds=seconds(a),
                    used_gpu_seconds=seconds(u),
                    reserved_idle_gpu_seconds=seconds(ri),
                    overcommitted=over,
                    version=RECORD_VERSION,
                )
            )
        return records
