"""HAMi's allocation annotation `hami.io/vgpu-devices-allocated`, and its check against the
limits a container's cache file holds.

The scheduler writes, per container of `spec.containers` in order, one entry per device
`UUID,Type,MiB,cores:` and ends each container with `;` (older releases joined containers with
`;` instead, without the last one). A container without devices is an empty entry, so the
position of an entry is the container's index. `cores` 0 means the whole GPU, like 100.

The annotation lives on a pod that a tenant may create: it is parsed as hostile input (bounded,
every field checked), and a value that does not parse is reported, never raised past here.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..events import DeviceLimit

ANNOTATION = "hami.io/vgpu-devices-allocated"
MAX_LENGTH = 64 * 1024  # far beyond any real node (16 GPUs x a few containers)
MiB = 1 << 20


class AllocatedDevice(msgspec.Struct, frozen=True):
    uuid: str
    type: str
    mem_mib: int
    cores: int


Allocation = list[list[AllocatedDevice]]  # per container index


class AllocationError(ValueError):
    """The annotation does not parse; the message says where."""


def _number(text: str, what: str, where: str) -> int:
    # isdigit() also accepts other scripts' digits; HAMi writes ASCII decimal only.
    if not text or not text.isascii() or not text.isdigit() or len(text) > 12:
        raise AllocationError(f"{where}: {what} {text[:20]!r} is not a decimal number")
    return int(text)


def parse(text: str) -> Allocation:
    """The devices of each container, by container index."""
    if len(text) > MAX_LENGTH:
        raise AllocationError(f"annotation is {len(text)} characters, more than {MAX_LENGTH}")
    if not text:
        return []
    parts = text.split(";")
    if text.endswith(";"):
        parts.pop()  # the terminator after the last container, not another container
    out: Allocation = []
    for index, part in enumerate(parts):
        devices: list[AllocatedDevice] = []
        for entry in part.split(":"):
            if not entry:
                continue  # the terminator after each device
            where = f"container {index}"
            fields = entry.split(",")
            if len(fields) != 4:
                raise AllocationError(f"{where}: {entry[:60]!r} is not UUID,Type,MiB,cores")
            uuid, kind, mem, cores = fields
            if not uuid:
                raise AllocationError(f"{where}: empty device UUID")
            devices.append(
                AllocatedDevice(
                    uuid, kind, _number(mem, "MiB", where), _number(cores, "cores", where)
                )
            )
        out.append(devices)
    return out


def encode(allocation: Allocation) -> str:
    """The annotation as HAMi's scheduler writes it (tests, the simulator)."""
    return "".join(
        "".join(f"{d.uuid},{d.type},{d.mem_mib},{d.cores}:" for d in devices) + ";"
        for devices in allocation
    )


def _sm(value: int) -> int:
    return 100 if value in (0, 100) else value


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def mismatch(allocated: Sequence[AllocatedDevice], devices: Sequence[DeviceLimit]) -> str | None:
    """None when the cache file's limits are those the scheduler allocated; else what differs.

    A GPU can be allocated, and listed in the file, more than once (slices of one GPU): per
    uuid, the (memory, SM) limits are compared as multisets, sorted, never by position."""
    # uuid -> [(memory limit in bytes, SM limit as written)], in order of first appearance
    wanted: dict[str, list[tuple[int, int]]] = {}
    for a in allocated:
        wanted.setdefault(a.uuid, []).append((a.mem_mib * MiB, a.cores))
    have: dict[str, list[tuple[int, int]]] = {}
    for d in devices:
        have.setdefault(d.uuid, []).append((d.limit_bytes, d.sm_limit))

    def ordered(limits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return sorted(limits, key=lambda x: (x[0], _sm(x[1])))

    problems: list[str] = []
    for uuid, want in wanted.items():
        got = have.get(uuid)
        if got is None:
            problems.append(f"{uuid} allocated but not in the cache file")
            continue
        if len(got) != len(want):
            problems.append(
                f"{uuid} allocated {_times(len(want))}, in the cache file {_times(len(got))}"
            )
            continue
        for (mem, sm), (a_mem, a_cores) in zip(ordered(got), ordered(want), strict=True):
            if mem != a_mem:
                problems.append(f"{uuid} memory limit {mem} B, allocated {a_mem // MiB} MiB")
            if _sm(sm) != _sm(a_cores):
                problems.append(f"{uuid} SM limit {sm} %, allocated {a_cores} %")
    for uuid in have:
        if uuid not in wanted:
            problems.append(f"{uuid} in the cache file but not allocated")
    return "; ".join(problems) or None
