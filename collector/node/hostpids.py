"""What `host_proc` judged of each slot, kept across restarts of the collector.

A slot judged dead (its host pid gone, its counters frozen since) stays dead whatever `/proc`
says later, and a slot billed under a gone host pid (its counters moved: a restarted
container's process took it over) stays billed while idle (`diff.drop_dead_hosts`). Both rest
on what earlier scans saw. Kept in memory only, a restarted collector judged every slot afresh:
a dead slot whose host pid the host had meanwhile given to another process was billed again,
and an idle process on a taken-over slot was judged dead at the second scan.

So the judgements of the files present are written to `host-pids.json` in the collector's log
folder (its own, never the root) whenever they change, replaced whole (a temporary file
renamed), and a new incarnation starts each file it finds again, the same (path, device,
inode), from them. A file that cannot be read or decoded starts every file afresh, with one
warning, as before; one that cannot be written is one warning until a write succeeds again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from ..events import UsageRow
from .diff import FileState, ProcKey
from .writer_faults import FileKey

log = logging.getLogger(__name__)

FILE_NAME = "host-pids.json"


class Slot(msgspec.Struct, array_like=True, frozen=True):
    pid: int
    hostpid: int
    rows: list[UsageRow]  # the counters first seen with its host pid gone ([]: vouched for)


class Judged(msgspec.Struct, frozen=True):
    path: str
    dev: int
    ino: int
    slots: list[Slot]  # every slot seen with its host pid gone (`FileState.dead_rows`)
    dead: list[ProcKey]
    vouched: list[ProcKey]
    moving: list[ProcKey]


_decoder = msgspec.json.Decoder(list[Judged])


class HostPidMemory:
    def __init__(self, folder: Path) -> None:
        self._path = folder / FILE_NAME
        self._earlier = self._load()
        self._written: bytes | None = None
        self._failing = False

    def _load(self) -> dict[FileKey, Judged]:
        try:
            files = _decoder.decode(self._path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning(
                "%s cannot be used (%s): every slot is judged afresh",
                self._path,
                " ".join(str(exc).split())[:200],
            )
            return {}
        return {(j.path, j.dev, j.ino): j for j in files}

    def seed(self, key: FileKey, st: FileState) -> None:
        """Start the state of a file found again from what the last incarnation judged."""
        j = self._earlier.pop(key, None)
        if j is None:
            return
        st.dead_rows = {(s.pid, s.hostpid): s.rows for s in j.slots}
        seen = st.dead_rows.keys()
        st.dead = {k for k in j.dead if k in seen}
        st.vouched = {k for k in j.vouched if k in seen}
        st.moving = {k for k in j.moving if k in seen}

    def save(self, files: dict[FileKey, FileState]) -> None:
        """Write the judgements of `files` if they changed since the last write."""
        judged = [
            Judged(
                key[0],
                key[1],
                key[2],
                # A vouched-for slot's rows are its last read (never compared while it is
                # vouched for): left out, or every scan of a busy process rewrote the file.
                [
                    Slot(k[0], k[1], [] if k in st.vouched else rows)
                    for k, rows in sorted(st.dead_rows.items())
                ],
                sorted(st.dead),
                sorted(st.vouched),
                sorted(st.moving),
            )
            for key, st in sorted((k, st) for k, st in files.items() if st.dead_rows)
        ]
        data = msgspec.json.encode(judged)
        if data == self._written:
            return
        temporary = self._path.with_name(FILE_NAME + ".tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, self._path)
        except OSError as exc:
            if not self._failing:
                log.warning(
                    "cannot write %s (%s): a restart would judge every slot afresh",
                    self._path,
                    exc.strerror,
                )
            self._failing = True
            return
        if self._failing:
            log.info("%s written again", self._path)
        self._failing = False
        self._written = data
