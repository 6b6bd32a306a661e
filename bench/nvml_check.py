"""One look at a real GPU node: NVML's inventory and per-process memory beside the cache files.

Run once on a GPU node (as the collector would run: host pid namespace, the cache-file root
mounted) to see whether NVML's host pids and bytes line up with HAMi's `used.total` and
`monitorused`, and what the cross-check would report:

    .venv/bin/python bench/nvml_check.py [--root /usr/local/vgpu/containers] [--host-proc /proc]
        [--timeout 2] [--tolerance-bytes 67108864] [--tolerance-ratio 0.05]

Prints (1) the inventory, (2) per GPU / MIG instance every process NVML lists and every live
cache-file process on it, side by side, (3) the events `CrossCheck` emits for this state (drift
and unaccounted processes are shown at once here, without the confirmation intervals).
Without NVML (no library, driver, GPU or permission) it says so in one line and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.events import SCHEMA_VERSION, DeviceInventory, Event, LayoutAnomaly  # noqa: E402
from collector.layout.reader import read_snapshot  # noqa: E402
from collector.node.crosscheck import CrossCheck, DriftTolerance, inventory_of  # noqa: E402
from collector.node.diff import FileState, diff  # noqa: E402
from collector.node.discover import Discovery  # noqa: E402
from collector.node.nvml import NvmlProcess, NvmlSource  # noqa: E402

MiB = 1 << 20


def mib(n: int | None) -> str:
    return "N/A" if n is None else f"{n / MiB:.1f}"


class _Stamp:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, cls: type[Any], **fields: Any) -> Any:
        self.seq += 1
        return cls(v=SCHEMA_VERSION, inc=0, seq=self.seq - 1, ts=0, **fields)


def read_files(root: Path, host_proc: str | None) -> list[FileState]:
    found, skipped = Discovery(root).scan()
    for s in skipped:
        print(f"  skipped {s.path}: {s.reason}")
    states: list[FileState] = []
    stamp = _Stamp()
    for i, f in enumerate(found):
        st = FileState(i, f.pod_uid, f.container, f.path)
        try:
            snap = read_snapshot(f.path)
        except OSError as exc:
            print(f"  cannot read {f.path}: {exc.strerror}")
            continue
        diff(st, snap, stamp, host_proc=host_proc)
        layout = snap.layout or "?"
        print(f"  [{st.cid}] {f.pod_uid}_{f.container} {layout} {Path(f.path).name}")
        for a in snap.anomalies:
            print(f"      anomaly {a.kind}: {a.detail}")
        states.append(st)
    return states


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=Path("/usr/local/vgpu/containers"))
    p.add_argument("--host-proc", help="the host's /proc: drop slots whose host pid is gone")
    p.add_argument("--timeout", type=float, default=2.0, help="bound of one NVML call set (s)")
    p.add_argument("--tolerance-bytes", type=int, default=64 * MiB)
    p.add_argument("--tolerance-ratio", type=float, default=0.05)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="nvml_check: %(message)s")

    source = NvmlSource.open(timeout_s=args.timeout)  # logs the one line when unavailable
    if source is None:
        return 1
    try:
        poll = source.poll()
        if poll.reading is None:
            print(f"nvml_check: {poll.timeout_detail}", file=sys.stderr)
            return 1
        reading = poll.reading
        print(f"NVML: {reading.count} GPU(s), call set took {source.stats.last_poll_ms:.1f} ms")
        for scope, err in sorted(reading.errors.items()):
            print(f"  NVML error, {scope}: {err}")

        print("\ninventory")
        devices = [reading.devices[i] for i in sorted(reading.devices)]
        for g in inventory_of(devices):
            kind = f"MIG of {g.parent_uuid}" if g.parent_uuid else ("MIG on" if g.mig_mode else "")
            print(f"  {g.index:>2} {g.uuid} {g.name!r} {mib(g.memory_total)} MiB {kind}")

        print(f"\ncache files under {args.root}")
        files = read_files(args.root, args.host_proc)

        print("\nper device: NVML process | cache-file process (used.total, monitorused), MiB")
        for d in devices:
            for uuid, used, util in d.leaves():
                util_s = "-" if util is None else f"{util} %"
                print(f"  {uuid}: memory used {mib(used)} MiB, utilization {util_s}")
                if uuid not in reading.processes:
                    print("    (processes not readable this interval)")
                    continue
                nvml: dict[int, NvmlProcess] = {q.pid: q for q in reading.processes[uuid]}
                cache: dict[int, list[str]] = {}
                for st in files:
                    for dev in st.devices:
                        if dev.uuid != uuid:
                            continue
                        for pid, hostpid in sorted(st.procs):
                            row = st.rows.get((pid, hostpid, dev.index))
                            total = row.total if row else 0
                            monitor = row.monitor if row else 0
                            cache.setdefault(hostpid, []).append(
                                f"[{st.cid}] {st.container} pid {pid} dev {dev.index}: "
                                f"{mib(total)}, {mib(monitor)}"
                            )
                for hostpid in sorted(nvml.keys() | cache.keys()):
                    left = f"{mib(nvml[hostpid].used_memory)}" if hostpid in nvml else "-"
                    right = "; ".join(cache.get(hostpid, [])) or "-"
                    print(f"    host pid {hostpid:>8}  NVML {left:>10} | {right}")

        print("\nwhat the cross-check reports for this state")
        check = CrossCheck(
            source,
            tolerance=DriftTolerance(args.tolerance_bytes, args.tolerance_ratio),
            confirm=1,
        )
        events: list[Event] = check.check(0, files, _Stamp())
        for e in events:
            if isinstance(e, LayoutAnomaly):
                print(f"  {e.anomaly} (cid {e.cid}): {e.detail}")
            elif isinstance(e, DeviceInventory):
                print(f"  DeviceInventory: {len(e.devices)} entries (as listed above)")
            else:
                print(f"  {type(e).__name__}: {e}")
        print(f"\nNVML polls {source.stats.polls}, timeouts {source.stats.nvml_timeouts}")
    finally:
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
