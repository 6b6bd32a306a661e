"""HAMi-core's shared-region structs, one ctypes declaration per layout.

Every offset and size the project uses is derived from these declarations by the C ABI
rules ctypes applies (natural alignment, x86-64/aarch64 LP64), never typed in by hand.
Field names follow HAMi-core's C source (`multiprocess_memory_limit.h`).
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass, field

MAGIC = 19920718
MAX_DEVICES = 16  # CUDA_DEVICE_MAX_COUNT
MAX_PROCS = 1024  # SHARED_REGION_MAX_PROCESS_NUM
UUID_LEN = 96

u32 = C.c_uint32
i32 = C.c_int32
u64 = C.c_uint64
size_t = C.c_uint64


class SemT(C.Structure):
    """glibc `sem_t` on x86-64 and aarch64: 32 bytes, 8-byte aligned."""

    _fields_ = [("value", u32), ("nwaiters", u32), ("_opaque", u64 * 3)]


class DeviceMemoryV0(C.Structure):
    _fields_ = [
        ("context_size", u64),
        ("module_size", u64),
        ("data_size", u64),
        ("offset", u64),
        ("total", u64),
    ]


class DeviceMemoryV1(C.Structure):
    _fields_ = [*DeviceMemoryV0._fields_, ("unused", u64 * 3)]


class DeviceUtilV0(C.Structure):
    _fields_ = [("dec_util", u64), ("enc_util", u64), ("sm_util", u64)]


class DeviceUtilV1(C.Structure):
    _fields_ = [*DeviceUtilV0._fields_, ("unused", u64 * 3)]


Uuid = C.c_char * UUID_LEN


# --- process slots (shrreg_proc_slot_t) ---------------------------------------------------


class SlotV0a(C.Structure):
    _fields_ = [
        ("pid", i32),
        ("hostpid", i32),
        ("used", DeviceMemoryV0 * MAX_DEVICES),
        ("monitorused", u64 * MAX_DEVICES),
        ("status", i32),
    ]


class SlotV0b(C.Structure):
    _fields_ = [
        ("pid", i32),
        ("hostpid", i32),
        ("used", DeviceMemoryV0 * MAX_DEVICES),
        ("monitorused", u64 * MAX_DEVICES),
        ("device_util", DeviceUtilV0 * MAX_DEVICES),
        ("status", i32),
    ]


class SlotV11(C.Structure):
    _fields_ = [
        ("pid", i32),
        ("hostpid", i32),
        ("used", DeviceMemoryV1 * MAX_DEVICES),
        ("monitorused", u64 * MAX_DEVICES),
        ("device_util", DeviceUtilV1 * MAX_DEVICES),
        ("status", i32),
        ("unused", u64 * 3),
    ]


class SlotV11Interim(C.Structure):
    _fields_ = [
        ("pid", i32),
        ("hostpid", i32),
        ("seqlock", u64),
        ("used", DeviceMemoryV1 * MAX_DEVICES),
        ("monitorused", u64 * MAX_DEVICES),
        ("device_util", DeviceUtilV1 * MAX_DEVICES),
        ("status", i32),
        ("unused", u64 * 2),
    ]


class SlotV12(C.Structure):
    _fields_ = [
        ("pid", i32),
        ("hostpid", i32),
        ("used", DeviceMemoryV1 * MAX_DEVICES),
        ("monitorused", u64 * MAX_DEVICES),
        ("device_util", DeviceUtilV1 * MAX_DEVICES),
        ("status", i32),
        ("seqlock", u64),
        ("unused", u64 * 2),
    ]


# --- regions (shared_region_t) ------------------------------------------------------------


class RegionV0a(C.Structure):
    _fields_ = [
        ("initialized_flag", i32),
        ("sm_init_flag", i32),
        ("owner_pid", size_t),
        ("sem", SemT),
        ("num", u64),
        ("uuids", Uuid * MAX_DEVICES),
        ("limit", u64 * MAX_DEVICES),
        ("sm_limit", u64 * MAX_DEVICES),
        ("procs", SlotV0a * MAX_PROCS),
        ("proc_num", i32),
        ("utilization_switch", i32),
        ("recent_kernel", i32),
        ("priority", i32),
    ]


class RegionV0b(C.Structure):
    _fields_ = [
        ("initialized_flag", i32),
        ("sm_init_flag", i32),
        ("owner_pid", size_t),
        ("sem", SemT),
        ("num", u64),
        ("uuids", Uuid * MAX_DEVICES),
        ("limit", u64 * MAX_DEVICES),
        ("sm_limit", u64 * MAX_DEVICES),
        ("procs", SlotV0b * MAX_PROCS),
        ("proc_num", i32),
        ("utilization_switch", i32),
        ("recent_kernel", i32),
        ("priority", i32),
    ]


class RegionV11(C.Structure):
    _fields_ = [
        ("initialized_flag", i32),
        ("major_version", u32),
        ("minor_version", u32),
        ("sm_init_flag", i32),
        ("owner_pid", size_t),
        ("sem", SemT),
        ("device_num", u64),
        ("uuids", Uuid * MAX_DEVICES),
        ("limit", u64 * MAX_DEVICES),
        ("sm_limit", u64 * MAX_DEVICES),
        ("procs", SlotV11 * MAX_PROCS),
        ("proc_num", i32),
        ("utilization_switch", i32),
        ("recent_kernel", i32),
        ("priority", i32),
        ("last_kernel_time", u64),
        ("unused", u64 * 4),
    ]


class RegionV11Interim(C.Structure):
    _fields_ = [
        ("initialized_flag", i32),
        ("major_version", u32),
        ("minor_version", u32),
        ("sm_init_flag", i32),
        ("owner_pid", size_t),
        ("sem", SemT),
        ("sem_postinit", SemT),
        ("device_num", u64),
        ("uuids", Uuid * MAX_DEVICES),
        ("limit", u64 * MAX_DEVICES),
        ("sm_limit", u64 * MAX_DEVICES),
        ("procs", SlotV11Interim * MAX_PROCS),
        ("proc_num", i32),
        ("utilization_switch", i32),
        ("recent_kernel", i32),
        ("priority", i32),
        ("last_kernel_time", u64),
        ("unused", u64 * 4),
    ]


class RegionV12(C.Structure):
    _fields_ = [
        ("initialized_flag", i32),
        ("major_version", u32),
        ("minor_version", u32),
        ("sm_init_flag", i32),
        ("owner_pid", size_t),
        ("sem", SemT),
        ("device_num", u64),
        ("uuids", Uuid * MAX_DEVICES),
        ("limit", u64 * MAX_DEVICES),
        ("sm_limit", u64 * MAX_DEVICES),
        ("procs", SlotV12 * MAX_PROCS),
        ("proc_num", i32),
        ("utilization_switch", i32),
        ("recent_kernel", i32),
        ("priority", i32),
        ("last_kernel_time", u64),
        ("sem_postinit", SemT),
    ]


# --- derived geometry ---------------------------------------------------------------------


def _offset(struct: type[C.Structure], name: str) -> int | None:
    desc = getattr(struct, name, None)
    return None if desc is None else int(desc.offset)


@dataclass(frozen=True)
class Layout:
    """One layout: its declaration plus everything derived from it."""

    name: str
    version: tuple[int, int] | None  # (major, minor) as stored; None for v0 (no version fields)
    region: type[C.Structure]
    slot: type[C.Structure]
    device_memory: type[C.Structure]
    device_util: type[C.Structure] | None
    # Derived in __post_init__ from the declarations above.
    region_size: int = field(init=False)
    slot_size: int = field(init=False)
    procs: int = field(init=False)
    device_num: int = field(init=False)
    uuids: int = field(init=False)
    limit: int = field(init=False)
    sm_limit: int = field(init=False)
    proc_num: int = field(init=False)
    utilization_switch: int = field(init=False)
    recent_kernel: int = field(init=False)
    priority: int = field(init=False)
    last_kernel_time: int | None = field(init=False)
    slot_used: int = field(init=False)
    slot_monitorused: int = field(init=False)
    slot_device_util: int | None = field(init=False)
    slot_status: int = field(init=False)
    slot_seqlock: int | None = field(init=False)
    dm_words: int = field(init=False)
    du_words: int = field(init=False)

    def __post_init__(self) -> None:
        r, s = self.region, self.slot
        num_field = "device_num" if hasattr(r, "device_num") else "num"
        derived: dict[str, int | None] = {
            "region_size": C.sizeof(r),
            "slot_size": C.sizeof(s),
            "procs": _offset(r, "procs"),
            "device_num": _offset(r, num_field),
            "uuids": _offset(r, "uuids"),
            "limit": _offset(r, "limit"),
            "sm_limit": _offset(r, "sm_limit"),
            "proc_num": _offset(r, "proc_num"),
            "utilization_switch": _offset(r, "utilization_switch"),
            "recent_kernel": _offset(r, "recent_kernel"),
            "priority": _offset(r, "priority"),
            "last_kernel_time": _offset(r, "last_kernel_time"),
            "slot_used": _offset(s, "used"),
            "slot_monitorused": _offset(s, "monitorused"),
            "slot_device_util": _offset(s, "device_util"),
            "slot_status": _offset(s, "status"),
            "slot_seqlock": _offset(s, "seqlock"),
            "dm_words": C.sizeof(self.device_memory) // 8,
            "du_words": 0 if self.device_util is None else C.sizeof(self.device_util) // 8,
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)

    @property
    def file_size(self) -> int:
        """Size of a file as HAMi-core creates it: sizeof(region) + 1."""
        return self.region_size + 1

    def slot_offset(self, index: int) -> int:
        return self.procs + index * self.slot_size


V0A = Layout("v0a", None, RegionV0a, SlotV0a, DeviceMemoryV0, None)
V0B = Layout("v0b", None, RegionV0b, SlotV0b, DeviceMemoryV0, DeviceUtilV0)
V11 = Layout("v1.1", (1, 1), RegionV11, SlotV11, DeviceMemoryV1, DeviceUtilV1)
V11_INTERIM = Layout(
    "v1.1-interim", (1, 1), RegionV11Interim, SlotV11Interim, DeviceMemoryV1, DeviceUtilV1
)
V12 = Layout("v1.2", (1, 2), RegionV12, SlotV12, DeviceMemoryV1, DeviceUtilV1)

LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (V0A, V0B, V11, V11_INTERIM, V12)}
