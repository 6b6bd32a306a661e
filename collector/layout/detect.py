"""Which layout a file is, from its header, its size and its content.

HAMi-core never refuses a file of another version and files only grow, so neither the version
fields nor the size alone are proof. Each rule below names what it checks; a new layout adds its
declaration in `declarations.py` and one rule here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from .declarations import MAGIC, MAX_DEVICES, MAX_PROCS, V0A, V0B, V11, V11_INTERIM, V12, Layout
from .snapshot import Anomaly

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> bytes, short at end of file

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_UUID_PREFIXES = (b"GPU-", b"MIG-")

# Enough header to decide every rule (the largest `procs` offset of any layout).
HEADER_BYTES = max(lay.procs for lay in (V0A, V0B, V11, V11_INTERIM, V12))


@dataclass(frozen=True)
class Detection:
    layout: Layout | None
    initialized: bool
    major: int | None
    minor: int | None
    anomalies: list[Anomaly]


def _u32(buf: bytes, off: int) -> int | None:
    return _U32.unpack_from(buf, off)[0] if len(buf) >= off + 4 else None


def _proc_num(layout: Layout, read_at: ReadAt) -> int | None:
    raw = read_at(layout.proc_num, 4)
    return _I32.unpack(raw)[0] if len(raw) == 4 else None


def _proc_num_ok(layout: Layout, read_at: ReadAt) -> bool:
    """True when proc_num is in range, or lies beyond the end of a truncated file."""
    n = _proc_num(layout, read_at)
    return n is None or 0 <= n <= MAX_PROCS


def _devices_plausible(layout: Layout, header: bytes) -> bool:
    if len(header) < layout.uuids + 4:
        return False
    n = _U64.unpack_from(header, layout.device_num)[0]
    if n > MAX_DEVICES:
        return False
    return n == 0 or header[layout.uuids : layout.uuids + 4] in _UUID_PREFIXES


def _interim_sem_plausible(header: bytes) -> bool:
    # In v1.1-interim bytes 56..87 are `sem_postinit`; its value word is 0 or 1.
    value = _u32(header, V11_INTERIM.device_num - 32)
    return value is not None and value <= 1


def _detect_v0(size: int, read_at: ReadAt) -> tuple[Layout | None, list[Anomaly]]:
    for layout in (V0B, V0A):
        if size >= layout.region_size and _proc_num_ok(layout, read_at):
            return layout, []
    if size < V0A.region_size:
        detail = f"unversioned (v0) header but {size} bytes, below the smallest v0 layout"
        return None, [Anomaly("truncated", detail)]
    return None, [Anomaly("unknown_version", "unversioned (v0) header; no v0 layout's checks pass")]


def _detect_v11(size: int, header: bytes, read_at: ReadAt) -> tuple[Layout | None, list[Anomaly]]:
    plain = _devices_plausible(V11, header) and _proc_num_ok(V11, read_at)
    interim = (
        _interim_sem_plausible(header)
        and _devices_plausible(V11_INTERIM, header)
        and _proc_num_ok(V11_INTERIM, read_at)
    )
    if plain and interim:
        # A reading that shows a device (device_num > 0, checked above to have a GPU-/MIG-
        # uuid at its offset) beats one that does not, even in a truncated file or one a later
        # library grew; with a device in neither (or in both: hostile) the size decides.
        plain_dev = _U64.unpack_from(header, V11.device_num)[0] > 0
        interim_dev = _U64.unpack_from(header, V11_INTERIM.device_num)[0] > 0
        interim = interim_dev if plain_dev != interim_dev else size >= V11_INTERIM.file_size
        plain = not interim
    if interim:
        detail = "says 1.1 but has the v1.1-interim layout (HAMi v2.8.1)"
        return V11_INTERIM, [Anomaly("mislabelled_layout", detail)]
    if plain:
        return V11, []
    detail = "says 1.1 but the content matches neither v1.1 nor v1.1-interim"
    return None, [Anomaly("unknown_version", detail)]


def detect(size: int, header: bytes, read_at: ReadAt) -> Detection:
    magic = _I32.unpack_from(header, 0)[0] if len(header) >= 4 else None
    if size < 12 or len(header) < 12 or magic != MAGIC:
        # The flag's value is not quoted: it could be the first bytes of anything.
        detail = f"initialized_flag is not {MAGIC}" if magic is not None else "empty"
        return Detection(None, False, None, None, [Anomaly("not_initialized", detail)])
    major = _u32(header, 4)
    minor = _u32(header, 8)
    if major == 0:
        # v0 has no version fields: offset 4 is `sm_init_flag` (normally 0).
        layout, anomalies = _detect_v0(size, read_at)
        return Detection(layout, True, None, None, anomalies)
    if major == 1 and minor == 1:
        layout, anomalies = _detect_v11(size, header, read_at)
        return Detection(layout, True, major, minor, anomalies)
    if major == 1 and minor == 2:
        return Detection(V12, True, major, minor, [])
    if major == 1 and minor is not None and minor > 2 and size >= V12.region_size:
        detail = f"version 1.{minor} is newer than 1.2; read with the v1.2 layout"
        return Detection(V12, True, major, minor, [Anomaly("future_minor", detail)])
    # Versions are quoted only when they could be one (a detail quotes nothing else).
    plausible = major is not None and minor is not None and major < 256 and minor < 256
    detail = (
        f"version {major}.{minor} is not a known layout"
        if plausible
        else "the version fields hold no known version"
    )
    return Detection(None, True, major, minor, [Anomaly("unknown_version", detail)])
