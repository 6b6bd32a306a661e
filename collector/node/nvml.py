"""The project's NVML boundary: plain data in, no handles out, and never a blocked scan loop.

`NvmlApi` is everything the collector asks NVML; `PynvmlApi` implements it on `pynvml` (untyped,
so every value is converted explicitly here) and `tests/fake_nvml.py` implements it for tests.

`open_nvml` starts NVML once. Where there is no library, no driver, no GPU or no permission it logs
one line and returns None: the collector then runs without device inventory and cross-check.

`NvmlSource.poll` runs one interval's call set (count, every device, every leaf device's
processes) on a daemon worker thread and waits for it at most `timeout_s`. A call that hangs
(a GPU falling off the bus can do that) costs one bounded wait: while the stuck call set is still
running, later polls do not queue behind it, they return a timed-out reading at once. An error
from one call is recorded in the reading under its scope (`device_count`, `device 2`,
`processes MIG-…`) and the rest of the call set still runs.

Every number is range-checked there too, whichever `NvmlApi` produced it. A utilization outside
0-100 % or a process's bytes above its device's memory total is an error of its own scope
(`device 0 utilization`, `memory of processes GPU-…`) and taken as not available (None), as an
N/A from NVML is. A device (or MIG instance) whose memory total is above events.MAX_BYTES or
whose memory used exceeds its total fails its `device N` scope, as if the query had failed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, TypeVar

from ..events import MAX_BYTES

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 2.0
# A device's utilization rate is the percent of the sample period in which a kernel ran, so it
# cannot pass 100 (unlike HAMi's per-process samples, which events.MAX_PERCENT bounds).
MAX_UTILIZATION = 100


# --- plain data crossing the boundary ---------------------------------------------------------


@dataclass(frozen=True)
class NvmlProcess:
    """A process with a context on a device. `used_memory` is None where NVML reports N/A."""

    pid: int  # host pid namespace
    used_memory: int | None


@dataclass(frozen=True)
class NvmlMigDevice:
    index: int  # MIG device index on its parent
    uuid: str  # MIG-…
    name: str
    memory_total: int
    memory_used: int
    parent_uuid: str


@dataclass(frozen=True)
class NvmlDevice:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization_gpu: int | None  # percent; None where NVML does not support it (MIG mode)
    mig_mode: bool
    mig_devices: tuple[NvmlMigDevice, ...] = ()
    utilization_memory: int | None = None  # memory controller busy, percent; None: unsupported

    def leaves(self) -> list[tuple[str, int, int | None]]:
        """(uuid, memory_used, utilization) of what processes run on: the MIG instances of a
        GPU in MIG mode (HAMi's cache files then hold their MIG-… uuids), else the GPU itself."""
        if self.mig_mode:
            return [(m.uuid, m.memory_used, None) for m in self.mig_devices]
        return [(self.uuid, self.memory_used, self.utilization_gpu)]


class NvmlApi(Protocol):
    """What the collector asks NVML. Implementations raise on errors (pynvml.NVMLError and its
    subclasses for the real one); the caller turns every exception into an anomaly."""

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def device_count(self) -> int: ...

    def device(self, index: int) -> NvmlDevice: ...

    def processes(self, uuid: str) -> list[NvmlProcess]:
        """Compute and graphics processes on the GPU or MIG instance `uuid`, one per pid."""
        ...


def merge_processes(*lists: list[NvmlProcess]) -> list[NvmlProcess]:
    """One entry per pid (a process can be listed as compute and as graphics; its memory is the
    same allocation, so take the larger known value, never the sum), sorted by pid."""
    out: dict[int, int | None] = {}
    for procs in lists:
        for p in procs:
            if p.pid not in out:
                out[p.pid] = p.used_memory
            elif p.used_memory is not None:
                prev = out[p.pid]
                out[p.pid] = p.used_memory if prev is None else max(prev, p.used_memory)
    return [NvmlProcess(pid, mem) for pid, mem in sorted(out.items())]


# --- the real implementation ------------------------------------------------------------------


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _mem(value: Any) -> int | None:
    """usedGpuMemory: pynvml maps NVML_VALUE_NOT_AVAILABLE to None; be strict about the rest."""
    if value is None:
        return None
    n = int(value)
    return None if n < 0 or n >= (1 << 64) - 1 else n


class PynvmlApi:
    """NvmlApi on nvidia-ml-py. Handles stay inside: they are looked up by index every interval
    and remembered by uuid for `processes`."""

    def __init__(self) -> None:
        import pynvml  # ImportError: the bindings are missing (open_nvml reports it)

        self._n: Any = pynvml
        self._handles: dict[str, Any] = {}

    def init(self) -> None:
        self._n.nvmlInit()

    def shutdown(self) -> None:
        self._handles.clear()
        self._n.nvmlShutdown()

    def device_count(self) -> int:
        return int(self._n.nvmlDeviceGetCount())

    def _optional(self, fn: Callable[[], T]) -> T | None:
        """A query a device may not support (MIG mode, old drivers): None instead of an error."""
        n = self._n
        try:
            return fn()
        except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound):
            return None

    def device(self, index: int) -> NvmlDevice:
        n = self._n
        h = n.nvmlDeviceGetHandleByIndex(index)
        uuid = _str(n.nvmlDeviceGetUUID(h))
        self._handles[uuid] = h
        mem = n.nvmlDeviceGetMemoryInfo(h)
        rates = self._optional(lambda: n.nvmlDeviceGetUtilizationRates(h))
        util = None if rates is None else int(rates.gpu)
        util_memory = None if rates is None else int(rates.memory)
        mode = self._optional(lambda: int(n.nvmlDeviceGetMigMode(h)[0]))
        mig_mode = mode == int(n.NVML_DEVICE_MIG_ENABLE)
        migs: list[NvmlMigDevice] = []
        if mig_mode:
            for k in range(int(n.nvmlDeviceGetMaxMigDeviceCount(h))):
                try:
                    mh = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
                except n.NVMLError_NotFound:
                    continue  # an unpopulated MIG slot
                mig_uuid = _str(n.nvmlDeviceGetUUID(mh))
                self._handles[mig_uuid] = mh
                mig_mem = n.nvmlDeviceGetMemoryInfo(mh)
                migs.append(
                    NvmlMigDevice(
                        k,
                        mig_uuid,
                        _str(n.nvmlDeviceGetName(mh)),
                        int(mig_mem.total),
                        int(mig_mem.used),
                        uuid,
                    )
                )
        return NvmlDevice(
            index,
            uuid,
            _str(n.nvmlDeviceGetName(h)),
            int(mem.total),
            int(mem.used),
            util,
            mig_mode,
            tuple(migs),
            util_memory,
        )

    def _running(self, h: Any, name: str) -> list[NvmlProcess]:
        n = self._n
        try:
            raw = getattr(n, name)(h)
        except n.NVMLLibraryMismatchError:  # a driver older than the _v3 entry points
            raw = getattr(n, name + "_v2")(h)
        return [NvmlProcess(int(p.pid), _mem(p.usedGpuMemory)) for p in raw]

    def processes(self, uuid: str) -> list[NvmlProcess]:
        n = self._n
        h = self._handles.get(uuid)
        if h is None:
            h = n.nvmlDeviceGetHandleByUUID(uuid)
            self._handles[uuid] = h
        compute = self._running(h, "nvmlDeviceGetComputeRunningProcesses")
        graphics = self._optional(lambda: self._running(h, "nvmlDeviceGetGraphicsRunningProcesses"))
        return merge_processes(compute, graphics or [])


class OutOfRange(ValueError):
    """NVML returned a number no device can have (a wrapped counter, a driver bug)."""


def _is_nvml_error(exc: BaseException) -> bool:
    if isinstance(exc, OutOfRange):  # NVML's own answer, not a bug here: not logged as one
        return True
    try:
        import pynvml
    except ImportError:
        return False
    return isinstance(exc, pynvml.NVMLError | pynvml.NVMLLibraryMismatchError)


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if _is_nvml_error(exc) else f"{type(exc).__name__}: {text}"


def open_nvml(
    api_factory: Callable[[], NvmlApi] = PynvmlApi, *, logger: logging.Logger | None = None
) -> NvmlApi | None:
    """An initialised NvmlApi with at least one GPU, or None after one log line saying why."""
    logger = logger or log
    api: NvmlApi | None = None
    try:
        api = api_factory()
        api.init()
        count = api.device_count()
    except ImportError as exc:
        reason = f"the NVML bindings (nvidia-ml-py) cannot be imported ({exc})"
    except Exception as exc:  # pynvml.NVMLError of any kind: no library, driver, permission
        reason = describe(exc)
        if api is not None:
            with contextlib.suppress(Exception):
                api.shutdown()
    else:
        if count > 0:
            return api
        reason = "no GPU found"
        with contextlib.suppress(Exception):
            api.shutdown()
    logger.warning("NVML unavailable: %s; device inventory and cross-check are off", reason)
    return None


# --- one interval's readings, bounded in time -------------------------------------------------


@dataclass
class NvmlReading:
    """What one interval's call set got. `devices` and `processes` hold what succeeded;
    `errors` maps a scope (`device_count`, `device 2`, `processes GPU-…`) to what failed."""

    count: int | None = None
    devices: dict[int, NvmlDevice] = field(default_factory=dict)
    processes: dict[str, list[NvmlProcess]] = field(default_factory=dict)  # leaf uuid -> procs
    errors: dict[str, str] = field(default_factory=dict)
    unexpected: dict[str, BaseException] = field(default_factory=dict)  # non-NVML (bugs?)


def read_all(api: NvmlApi) -> NvmlReading:
    """The whole call set of one interval; an error in one call spoils only its own scope."""
    reading = NvmlReading()

    def attempt(scope: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:
            reading.errors[scope] = describe(exc)
            if not _is_nvml_error(exc):
                reading.unexpected[scope] = exc
            return None

    count = attempt("device_count", api.device_count)
    if count is None:
        return reading
    reading.count = count
    for i in range(count):
        dev = attempt(f"device {i}", partial(_checked_device, api, i))
        if dev is None:
            continue
        dev = replace(
            dev,
            utilization_gpu=_percent(reading, f"device {i} utilization", dev.utilization_gpu),
            utilization_memory=_percent(
                reading, f"device {i} memory utilization", dev.utilization_memory
            ),
        )
        reading.devices[i] = dev
        totals = {dev.uuid: dev.memory_total} | {m.uuid: m.memory_total for m in dev.mig_devices}
        for uuid, _, _ in dev.leaves():
            procs = attempt(f"processes {uuid}", partial(api.processes, uuid))
            if procs is not None:
                reading.processes[uuid] = _checked_processes(reading, uuid, totals[uuid], procs)
    return reading


def _check_memory(what: str, total: int, used: int) -> None:
    # used <= total <= MAX_BYTES bounds both; a used above the total is a counter gone wrong.
    if not 0 <= total <= MAX_BYTES:
        raise OutOfRange(f"{what} memory total {total} B is out of range 0-{MAX_BYTES} B")
    if not 0 <= used <= total:
        raise OutOfRange(f"{what} memory used {used} B is out of range 0-{total} B (the total)")


def _checked_device(api: NvmlApi, index: int) -> NvmlDevice:
    """api.device(index), raising OutOfRange where its memory (or a MIG instance's) is absurd:
    both numbers are billed and inventoried as they stand, so there is no partial reading."""
    dev = api.device(index)
    _check_memory(dev.uuid, dev.memory_total, dev.memory_used)
    for m in dev.mig_devices:
        _check_memory(m.uuid, m.memory_total, m.memory_used)
    return dev


def _percent(reading: NvmlReading, scope: str, value: int | None) -> int | None:
    if value is None or 0 <= value <= MAX_UTILIZATION:
        return value
    reading.errors[scope] = (
        f"{value} % is out of range 0-{MAX_UTILIZATION} %; taken as not available"
    )
    return None


def _checked_processes(
    reading: NvmlReading, uuid: str, total: int, procs: list[NvmlProcess]
) -> list[NvmlProcess]:
    """The processes, a process's bytes above its device's memory total (itself checked
    against MAX_BYTES) taken as N/A."""
    out: list[NvmlProcess] = []
    bad: list[str] = []
    for p in procs:
        if p.used_memory is not None and not 0 <= p.used_memory <= total:
            bad.append(f"host pid {p.pid} uses {p.used_memory} B")
            p = NvmlProcess(p.pid, None)
        out.append(p)
    if bad:
        reading.errors[f"memory of processes {uuid}"] = (
            f"{', '.join(bad)}: out of range 0-{total} B (the total); taken as not available"
        )
    return out


class _Worker:
    """One daemon thread running submitted calls in order. Daemon, unlike a ThreadPoolExecutor's
    workers, so a call stuck in the driver can never hold up the process's exit."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiter
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(None)


@dataclass
class NvmlStats:
    polls: int = 0
    nvml_timeouts: int = 0  # intervals skipped: the call set did not finish in time
    nvml_errors: int = 0  # intervals with at least one failed call
    last_poll_ms: float = 0.0


@dataclass(frozen=True)
class Poll:
    """One interval's outcome: a reading, or why there is none (`timeout_detail`)."""

    reading: NvmlReading | None
    timeout_detail: str = ""


class NvmlSource:
    """An opened NvmlApi plus the worker that bounds every interval's call set in time."""

    def __init__(
        self,
        api: NvmlApi,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        logger: logging.Logger | None = None,
    ) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.stats = NvmlStats()
        self._log = logger or log
        self._worker = _Worker()
        self._inflight: Future[NvmlReading] | None = None
        self._inflight_since = 0.0
        self._closed = False
        self._logged: set[str] = set()  # scopes whose unexpected error was logged

    @classmethod
    def open(
        cls,
        logger: logging.Logger | None = None,
        *,
        api_factory: Callable[[], NvmlApi] = PynvmlApi,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> NvmlSource | None:
        api = open_nvml(api_factory, logger=logger)
        return None if api is None else cls(api, timeout_s=timeout_s, logger=logger)

    @property
    def busy(self) -> bool:
        """A call set is still running (stuck past its timeout)."""
        return self._inflight is not None and not self._inflight.done()

    def poll(self) -> Poll:
        """This interval's reading, waiting at most `timeout_s` (from the scan thread)."""
        self.stats.polls += 1
        started = time.monotonic()
        if self._inflight is not None and not self._inflight.done():
            # Still stuck in last interval's call set: do not queue behind it, skip at once.
            self.stats.nvml_timeouts += 1
            stuck = started - self._inflight_since
            return Poll(None, f"an NVML call has not returned for {stuck:.1f} s; interval skipped")
        self._inflight = self._worker.submit(lambda: read_all(self.api))
        self._inflight_since = started
        try:
            reading = self._inflight.result(timeout=self.timeout_s)
        except TimeoutError:
            self.stats.nvml_timeouts += 1
            return Poll(
                None, f"NVML calls did not finish within {self.timeout_s:g} s; interval skipped"
            )
        finally:
            self.stats.last_poll_ms = (time.monotonic() - started) * 1000
        if reading.errors:
            self.stats.nvml_errors += 1
        for scope, exc in reading.unexpected.items():
            if scope not in self._logged:  # once while it persists, like the anomaly
                self._log.error("unexpected error from an NVML call (%s)", scope, exc_info=exc)
        self._logged = set(reading.unexpected)
        return Poll(reading)

    def close(self) -> None:
        """Shut NVML down (bounded: skipped while a call is stuck) and stop the worker."""
        if self._closed:
            return
        self._closed = True
        if self._inflight is None or self._inflight.done():
            fut = self._worker.submit(self.api.shutdown)
            with contextlib.suppress(Exception):
                fut.result(timeout=self.timeout_s)
        self._worker.stop()
