"""What the aggregator counts instead of billing: every event it drops or cannot attribute."""

from __future__ import annotations

import msgspec

__all__ = ["OUTPUT_COUNTS", "AggregateStats"]


class AggregateStats(msgspec.Struct):
    events: int = 0  # every add()
    duplicates: int = 0
    late_events: int = 0
    late_ms_dropped: int = 0  # key-ms late rows would have held in closed windows (see late)
    late_ms_overbilled: int = 0  # key-ms closed windows billed after a late end (see late)
    future_events: int = 0
    unattributed_rows: int = 0
    refused_values: int = 0  # rows, limits, times beyond what a device or clock can have
    unobserved_ms: int = 0  # key-milliseconds beyond max_gap before the key was heard of again
    heartbeat_over_gap: int = 0  # heartbeats whose interval_ms exceeds max_gap_ms
    records: int = 0
    unnamed_records: int = 0  # container records without a pod identity (namespace empty)
    overcommitted: int = 0  # GPU-windows whose shares were scaled down to the observed time
    allocation_fallbacks: int = 0  # GPU-windows of the memory or max policy without inventory
    node_conflicts: int = 0  # pairs of collectors live at once under one node name
    overlapping_events: int = 0  # events of the older of such a pair, not billed
    refused_records: int = 0  # a number beyond records.RECORD_MAX: never built
    presence_clamped: int = 0  # ends of a run moved later to what could still change (runs)
    presence_clamped_ms: int = 0  # ... and the container-ms they bill beyond Kubernetes' end


# What `Output` counts of the records it hands out: windows past the emitted end only, so a
# window closed again (a partition read again from its checkpoint) never adds to them.
OUTPUT_COUNTS = frozenset(
    {"records", "unnamed_records", "overcommitted", "allocation_fallbacks", "refused_records"}
)
