"""What closed windows hand out: per-track accumulators merged by billing row into records.

Groups that map to the same row (node, pod_uid, container, device_uuid) in one window are added
up (integrals, samples, observed time); the peak is the largest of theirs. Integrals are exact
integers in milli-units until the record is built. Each container row is named by its pod's
identity for that window (`identity`); a row without one is counted in `unnamed_records`."""

from __future__ import annotations

from typing import Any

from ...events import Identity
from ..records import BillingRecord, make_record_id
from .identity import Identities
from .state import RowKey, Track
from .stats import AggregateStats

__all__ = ["Output"]

_NAMES: dict[str, Any] = {}


def _names(who: Identity) -> dict[str, Any]:
    return {
        "namespace": who.namespace,
        "pod": who.pod,
        "workload_kind": who.workload_kind,
        "workload": who.workload,
        "labels": who.labels,
    }


class Output:
    """Rows of the windows being closed, merged by billing row; windows ending at or before
    `suppress` (already emitted by an earlier run) are computed but never handed out."""

    __slots__ = ("_identities", "_rows", "_stats", "_suppress", "_w")

    def __init__(
        self, window_ms: int, suppress: int, stats: AggregateStats, identities: Identities
    ) -> None:
        self._identities = identities
        self._w = window_ms
        self._suppress = suppress
        self._stats = stats
        self._rows: dict[RowKey, list[int]] = {}

    def emit(self, tr: Track) -> None:
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
        out = self._rows
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

    def records(self) -> list[BillingRecord]:
        """The merged rows as records, sorted by (window_start, node, pod_uid, container,
        device_uuid); the output is empty afterwards."""
        out = self._rows
        self._rows = {}
        w = self._w
        records = []
        unnamed = 0
        for key in sorted(out):
            ws, node, pod_uid, container, uuid = key
            mem, nvml, smp, lim, smlim, peak, samples, obs = out[key]
            who = self._identities.at(node, pod_uid, ws + w) if pod_uid else None
            if who is None and pod_uid:
                unnamed += 1
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
                    **(_NAMES if who is None else _names(who)),
                )
            )
        self._stats.records += len(records)
        self._stats.unnamed_records += unnamed
        return records
