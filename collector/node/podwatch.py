"""Source: the pods of this node from the Kubernetes API server (list + watch).

`kubernetes_asyncio` does the talking: configuration (in-cluster service account or a
kubeconfig, with its token refresh, exec plugins and client certificates), TLS, and building
each request from its typed parameters. This module follows the list/watch protocol itself:

* list `/api/v1/pods?fieldSelector=spec.nodeName=<node>` in pages (`limit`, `continue`), then
  watch from the list's `resourceVersion` with `allowWatchBookmarks`, a server-side
  `timeoutSeconds`, and re-watch from the last version seen (an event's or a BOOKMARK's) when the
  server ends the stream;
* `410 Gone` (as a status, or as an ERROR event in the stream) means that version is too old:
  list again at once;
* any other failure (refused or dropped connection, a 5xx, a malformed line) is retried with
  tenacity's exponential back-off with jitter, `429 Too Many Requests` after its `Retry-After`;
  401/403 the same, with one clear log line per episode and a counter; nothing is raised out of
  `run()` but cancellation.

The library's own `Watch` helper is not used: it deserialises every event into the generated
model (the cost of a watch on a busy node) and retries a 410 with the same stale version. The
response is read as it streams and only the needed fields are decoded (`pods.py`).

What the watch learns is published as `view`: pod UID -> `PodView`, replaced whole on each
change so that the scan thread can read it without a lock. A deleted pod stays in the view,
marked deleted, for `keep_deleted_s`: its containers may still be running and billed.

A pod's identity also depends on objects that are not watched (its ReplicaSet or Job, its
namespace), read with `get` and cached. A long-running pod gets no event when one of those
changes or a failed get would now succeed, so every `refresh_s` the identity of each live pod is
resolved again from its kept metadata: an entry still fresh is a cache hit, an expired one costs
one get for all the pods that share it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import aiohttp
import msgspec
from aiohttp import ClientResponse
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_base, wait_exponential, wait_random

from ..events import Identity
from ..settings_check import shown
from . import allocation
from .pods import (
    ObjectMeta,
    OwnerReference,
    Pod,
    PodView,
    event_decoder,
    object_decoder,
    pod_decoder,
    pod_list_decoder,
    status_decoder,
)

log = logging.getLogger(__name__)

MAX_LINE = 16 * 1024 * 1024  # one watch event; the API server's own limit is about 3 MiB
# Owner and namespace gets at once (each owner or namespace is read once however many pods
# ask): a node's pods resolve in about one request's time, without a burst on the API server.
LOOKUPS_IN_FLIGHT: Final = 8


@dataclass(frozen=True)
class KubeSettings:
    kubeconfig: str | None = None  # None: the in-cluster service account
    pod_labels: tuple[str, ...] = ()
    namespace_labels: tuple[str, ...] = ()
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 300.0  # a longer Retry-After is cut to this
    watch_timeout_s: int = 300  # timeoutSeconds of one watch request
    request_timeout_s: float = 10.0  # a list page or a get
    page_size: int = 500
    owner_ttl_s: float = 3600.0  # a resolved ReplicaSet/Job owner is asked again after this
    namespace_ttl_s: float = 300.0  # namespace labels are read again after this
    retry_failed_s: float = 60.0  # a failed owner or namespace get is asked again after this
    # Identities of live pods are resolved again this often, so that an expired owner or
    # namespace entry is read again without waiting for an event of the pod. Between expiries a
    # pass is cache lookups only.
    refresh_s: float = 10.0
    keep_deleted_s: float = 600.0
    # The stream is read at most this often (0: as data comes). The scan reads the view once
    # per interval anyway; not reading the socket in between lets a busy node's updates arrive
    # in one read instead of waking the loop once each.
    batch_s: float = 0.5


@dataclass
class WatchStats:
    lists: int = 0
    relists: int = 0  # 410 Gone
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    errors: int = 0  # every failed request or dropped stream, all kinds
    auth_errors: int = 0  # 401/403
    throttled: int = 0  # 429
    owner_lookups: int = 0
    owner_errors: int = 0
    connected: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {message}".strip())
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class MalformedResponse(Exception):
    pass


class ShortWatch(Exception):
    """A watch the server ended within `SHORT_WATCH_S` without a single event or bookmark (a
    proxy that closes streams, a server shedding load), or whose fresh list's version is gone
    at once: retried with back-off, as client-go's reflector does, not at once for ever."""


# A watch asks for `watch_timeout_s` (at least 1 s): one that ends sooner with nothing in it
# was not a watch.
SHORT_WATCH_S: Final = 1.0


class CredentialsUnavailable(Exception):
    """The client could not load its credentials for a request (an exec plugin that failed):
    retried like a refusal, since the next load may succeed."""


RETRYABLE = (
    ApiError,
    CredentialsUnavailable,
    MalformedResponse,
    ShortWatch,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    OSError,
    msgspec.DecodeError,
)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date, or garbage: the back-off decides


async def _raw(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> ClientResponse:
    """Call a generated API method for its raw response (`_preload_content=False`): the body
    is decoded here, and a non-2xx status is not raised by the library."""
    from kubernetes_asyncio.config import ConfigException

    try:
        resp: ClientResponse = await call(*args, _preload_content=False, **kwargs)
    except ConfigException as exc:  # raised by the credentials' refresh, before any request
        raise CredentialsUnavailable(" ".join(str(exc).split())) from None
    return resp


async def _failure(resp: ClientResponse) -> ApiError | Gone:
    body = await resp.read()
    message = resp.reason or ""
    try:
        status = status_decoder.decode(body)
        message = status.message or status.reason or message
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    if resp.status == 410:
        return Gone(message)
    return ApiError(resp.status, message[:200], _retry_after(resp.headers))


class _Wait(wait_base):
    """Retry-After when the server gave one, else exponential back-off with jitter."""

    def __init__(self, settings: KubeSettings) -> None:
        self.cap = settings.retry_after_max_s
        initial, cap = settings.backoff_initial_s, settings.backoff_max_s
        self.backoff = wait_exponential(multiplier=initial, max=cap) + wait_random(0, initial)

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, ApiError) and exc.retry_after is not None:
            return min(exc.retry_after, self.cap)
        return float(self.backoff(retry_state))


def describe(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return f"HTTP {exc}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


class Owners:
    """Workload of a pod: its controller, one level further for a ReplicaSet (its Deployment)
    and a Job (its CronJob), read with `get` and cached by the owner's UID. When the get fails
    (no RBAC, a deleted ReplicaSet) a ReplicaSet falls back to the naming convention
    `<deployment>-<pod-template-hash>`, a Job stays a Job; the fallback is retried after
    `retry_failed_s`. A failed get of an owner resolved before keeps what it resolved to: a
    transient error on the periodic re-read does not turn a CronJob's pod into a Job's."""

    def __init__(
        self, api: Any, settings: KubeSettings, stats: WatchStats, limit: asyncio.Semaphore
    ) -> None:
        from kubernetes_asyncio.client import AppsV1Api, BatchV1Api

        self._apps = AppsV1Api(api)
        self._batch = BatchV1Api(api)
        self._settings = settings
        self._stats = stats
        self._limit = limit
        self._cache: dict[str, tuple[float, tuple[str, str]]] = {}
        self._warned: set[str] = set()
        self._refused: set[str] = set()  # namespaces with a controller reference refused
        self._reading: dict[str, asyncio.Task[tuple[str, str]]] = {}  # by the owner's UID

    def known(self, meta: ObjectMeta, now: float) -> tuple[tuple[str, str], bool]:
        """The pod's workload as far as it is known without asking, and whether that is
        current: an owner never read is named by convention meanwhile, an expired one as it
        resolved to."""
        ref = self._controller(meta)
        if ref is None:
            return ("Pod", meta.name), True
        if ref.kind not in ("ReplicaSet", "Job"):
            return (ref.kind, ref.name), True
        hit = self._cache.get(ref.uid)
        if hit is None:
            return _by_convention(ref.kind, ref.name, meta.labels), False
        return hit[1], hit[0] > now

    async def workload(self, meta: ObjectMeta, now: float) -> tuple[str, str]:
        ref = self._controller(meta)
        if ref is None:
            return ("Pod", meta.name)
        if ref.kind not in ("ReplicaSet", "Job"):
            return (ref.kind, ref.name)
        hit = self._cache.get(ref.uid)
        if hit is not None and hit[0] > now:
            return hit[1]
        task = _one_read(self._reading, ref.uid, lambda: self._read(ref, meta, hit, now))
        return await asyncio.shield(task)

    def cancel(self) -> None:
        for task in self._reading.values():
            task.cancel()

    def _controller(self, meta: ObjectMeta) -> OwnerReference | None:
        ref = meta.controller()
        if ref is not None and not ref.names_an_object():
            if meta.namespace not in self._refused:
                self._refused.add(meta.namespace)
                log.warning(
                    "pod %s/%s: its controller reference %s/%s names no object that can be; "
                    "named as its own workload (logged once per namespace)",
                    meta.namespace,
                    meta.name,
                    shown(ref.kind),  # (repr: a character that is not printable escaped)
                    shown(ref.name),
                )
            return None
        return ref

    async def _read(
        self,
        ref: OwnerReference,
        meta: ObjectMeta,
        hit: tuple[float, tuple[str, str]] | None,
        now: float,
    ) -> tuple[str, str]:
        ttl = self._settings.owner_ttl_s
        try:
            async with self._limit:
                parent = await self._get(ref.kind, meta.namespace, ref.name)
            result = (parent.kind, parent.name) if parent is not None else (ref.kind, ref.name)
        except (*RETRYABLE, Gone) as exc:
            self._stats.owner_errors += 1
            if ref.kind not in self._warned:
                self._warned.add(ref.kind)
                log.warning(
                    "cannot read %s %s/%s (%s): naming its pods by convention until it can be",
                    ref.kind,
                    meta.namespace,
                    ref.name,
                    describe(exc),
                )
            # What it resolved to before, if it was, is better than the naming convention.
            fallback = _by_convention(ref.kind, ref.name, meta.labels)
            result = hit[1] if hit is not None else fallback
            ttl = min(ttl, self._settings.retry_failed_s)
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[ref.uid] = (now + ttl, result)
        return result

    async def _get(self, kind: str, namespace: str, name: str) -> Any:
        self._stats.owner_lookups += 1
        read = (
            self._apps.read_namespaced_replica_set
            if kind == "ReplicaSet"
            else self._batch.read_namespaced_job
        )
        resp = await _raw(
            read,
            name,
            namespace,
            _request_timeout=self._settings.request_timeout_s,
        )
        try:
            if resp.status != 200:
                raise await _failure(resp)
            owner = object_decoder.decode(await resp.read()).metadata.controller()
        finally:
            resp.release()
        if owner is None or owner.kind not in ("Deployment", "CronJob"):
            return None
        return owner if owner.names_an_object() else None


_T = TypeVar("_T")


def _one_read(
    reading: dict[str, asyncio.Task[_T]], key: str, read: Callable[[], Coroutine[Any, Any, _T]]
) -> asyncio.Task[_T]:
    """The read of `key` in flight, else a new one: one request however many ask meanwhile
    (each waits on it shielded, so that one caller's cancellation does not end the others')."""
    task = reading.get(key)
    if task is None:
        task = reading[key] = asyncio.create_task(read())

        def done(_: asyncio.Task[_T]) -> None:
            reading.pop(key, None)

        task.add_done_callback(done)
    return task


def _by_convention(kind: str, name: str, labels: Mapping[str, str]) -> tuple[str, str]:
    suffix = "-" + labels.get("pod-template-hash", "\0")
    if kind == "ReplicaSet" and name.endswith(suffix) and len(name) > len(suffix):
        return ("Deployment", name[: -len(suffix)])
    return (kind, name)


class NamespaceLabels:
    """The allowlisted labels of a namespace, read with `get` and cached for a while."""

    def __init__(
        self, api: Any, settings: KubeSettings, stats: WatchStats, limit: asyncio.Semaphore
    ) -> None:
        from kubernetes_asyncio.client import CoreV1Api

        self._core = CoreV1Api(api)
        self._settings = settings
        self._stats = stats
        self._limit = limit
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}
        self._reading: dict[str, asyncio.Task[dict[str, str]]] = {}

    def known(self, namespace: str, now: float) -> tuple[dict[str, str], bool]:
        """The labels as far as they are known without asking, and whether that is current."""
        if not self._settings.namespace_labels:
            return {}, True
        hit = self._cache.get(namespace)
        if hit is None:
            return {}, False
        return hit[1], hit[0] > now

    async def labels(self, namespace: str, now: float) -> dict[str, str]:
        if not self._settings.namespace_labels:
            return {}
        hit = self._cache.get(namespace)
        if hit is not None and hit[0] > now:
            return hit[1]
        task = _one_read(self._reading, namespace, lambda: self._read(namespace, hit, now))
        return await asyncio.shield(task)

    def cancel(self) -> None:
        for task in self._reading.values():
            task.cancel()

    async def _read(
        self, namespace: str, hit: tuple[float, dict[str, str]] | None, now: float
    ) -> dict[str, str]:
        wanted = self._settings.namespace_labels
        ttl = self._settings.namespace_ttl_s
        try:
            async with self._limit:
                resp = await _raw(
                    self._core.read_namespace,
                    namespace,
                    _request_timeout=self._settings.request_timeout_s,
                )
                try:
                    if resp.status != 200:
                        raise await _failure(resp)
                    have = object_decoder.decode(await resp.read()).metadata.labels
                finally:
                    resp.release()
            found = {k: have[k] for k in wanted if k in have}
        except (*RETRYABLE, Gone) as exc:
            self._stats.owner_errors += 1
            log.debug("namespace %s: %s", namespace, describe(exc))
            found = hit[1] if hit is not None else {}
            ttl = min(ttl, self._settings.retry_failed_s)
        self._cache[namespace] = (now + ttl, found)
        return found


@dataclass
class _Episode:
    """The trouble being retried now, so that it is logged once, not on every attempt."""

    what: str | None = None
    since: float = field(default_factory=time.monotonic)


class PodWatch:
    def __init__(self, api: Any, node: str, settings: KubeSettings) -> None:
        from kubernetes_asyncio.client import CoreV1Api

        self.node = node
        self.settings = settings
        self.stats = WatchStats()
        self.view: Mapping[str, PodView] = {}
        self.resource_version: str | None = None
        self._core = CoreV1Api(api)
        limit = asyncio.Semaphore(LOOKUPS_IN_FLIGHT)
        self._owners = Owners(api, settings, self.stats, limit)
        self._namespaces = NamespaceLabels(api, settings, self.stats, limit)
        self._resolving: set[asyncio.Task[None]] = set()  # see `_resolve_later`
        self._pending: set[str] = set()  # pods a `_resolve` task is reading for
        # Pods deleted before their identity was read: what to read it from (see `_event`).
        self._gone_metas: dict[str, ObjectMeta] = {}
        # The metadata of each live pod, what its identity is resolved from (the refresh).
        self._metas: dict[str, ObjectMeta] = {}
        self._selector = f"spec.nodeName={node}"
        self._episode = _Episode()
        # Set once the first complete list is in the view with its owners and namespaces read
        # (or their reads failed).
        self.synced = asyncio.Event()
        self._watch_events = 0  # events and bookmarks of the current (or last) watch

    # --- the protocol ----------------------------------------------------------------------

    async def run(self) -> None:
        """List and watch until cancelled (and refresh identities alongside)."""
        refresher = asyncio.create_task(self._refresh_loop())
        try:
            await self._list_and_watch()
        finally:
            background = [refresher, *self._resolving]
            for task in background:
                task.cancel()
            self._owners.cancel()
            self._namespaces.cancel()
            await asyncio.gather(*background, return_exceptions=True)

    async def _list_and_watch(self) -> None:
        while True:
            retrying = AsyncRetrying(
                wait=_Wait(self.settings),
                retry=retry_if_exception_type(RETRYABLE),
                before_sleep=self._failed,
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self._session()

    async def _session(self) -> None:
        """One list (when there is no version to resume from) and one watch request."""
        listed = self.resource_version is None
        try:
            if listed:
                await self._list()
            await self._watch(self.resource_version or "")
        except Gone:
            self.stats.relists += 1
            version, self.resource_version = self.resource_version, None
            if listed and not self._watch_events:  # (a list, then a watch refused at once:
                # listing again at once would loop as fast as the server answers)
                raise ShortWatch(
                    f"the version {version} of a list just made is too old (410) already"
                ) from None
            log.info("pod watch: resourceVersion %s is too old (410): listing again", version)

    async def _list(self) -> None:
        pods: list[Pod] = []
        token = ""
        version = ""
        while True:
            more = {"_continue": token} if token else {}
            resp = await _raw(
                self._core.list_pod_for_all_namespaces,
                field_selector=self._selector,
                limit=self.settings.page_size,
                _request_timeout=self.settings.request_timeout_s,
                **more,
            )
            try:
                if resp.status != 200:
                    raise await _failure(resp)
                page = pod_list_decoder.decode(await resp.read())
            finally:
                resp.release()
            pods += page.items
            version = page.metadata.resource_version
            token = page.metadata.continue_
            if not token:
                break
        self.stats.lists += 1
        # Back once the watch after it delivers (a list whose watch is refused at once is no
        # recovery: each round of such a loop logged a recovery and a new failure).
        self.stats.connected = True
        now = time.monotonic()
        listed = {p.metadata.uid for p in pods}
        metas, self._metas = self._metas, {p.metadata.uid: _kept(p.metadata) for p in pods}
        view = dict(self.view)
        unknown: list[str] = []
        for uid, pv in list(view.items()):
            if uid not in listed and not pv.deleted:
                view[uid] = _deleted(pv, now)  # deleted while we were not watching
                if (kept := metas.get(uid)) is not None and not self._known(kept, now)[1]:
                    # Deleted unnamed, as a DELETED event can leave it (see `_event`).
                    self._gone_metas[uid] = kept
                    unknown.append(uid)
        for pod in pods:
            uid = pod.metadata.uid
            view[uid], current = self._view_of(pod, view.get(uid), now)
            if not current:
                unknown.append(uid)
        self.view = self._pruned(view, now)
        self.resource_version = version
        resolving = self._resolve_later(unknown)
        if resolving is None:
            self.synced.set()
        elif not self.synced.is_set():
            resolving.add_done_callback(lambda _: self.synced.set())

    async def _watch(self, version: str) -> None:
        began = time.monotonic()
        self._watch_events = 0
        resp = await _raw(
            self._core.list_pod_for_all_namespaces,
            field_selector=self._selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.settings.watch_timeout_s,
            # No total bound (the stream is long-lived); a silent connection is a dead one.
            _request_timeout=aiohttp.ClientTimeout(
                sock_connect=self.settings.request_timeout_s,
                sock_read=self.settings.watch_timeout_s + self.settings.request_timeout_s,
            ),
        )
        try:
            if resp.status != 200:
                raise await _failure(resp)
            self.stats.watches += 1
            self.stats.connected = True
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    line = bytes(buf[start:end])
                    start = end + 1
                    if line.strip():
                        await self._event(line)
                        self._watch_events += 1
                        if self._episode.what is not None:
                            self._recovered()  # an event was understood: really back
                del buf[:start]
                if len(buf) > MAX_LINE:
                    raise MalformedResponse(f"a watch event longer than {MAX_LINE} bytes")
                await self._pause(resp)
            if buf.strip():
                await self._event(bytes(buf))
                self._watch_events += 1
            lasted = time.monotonic() - began
            if not self._watch_events and lasted < SHORT_WATCH_S:
                raise ShortWatch(f"the server ended a watch after {lasted:.3f} s with no event")
            if self._episode.what is not None:
                self._recovered()
        finally:
            resp.release()

    async def _pause(self, resp: ClientResponse) -> None:
        """Leave what arrives next in the socket for `batch_s` (the kernel buffers it)."""
        if self.settings.batch_s <= 0 or resp.connection is None:
            return
        transport = resp.connection.transport
        if transport is None or transport.is_closing():
            return
        transport.pause_reading()
        try:
            await asyncio.sleep(self.settings.batch_s)
        finally:
            if not transport.is_closing():
                transport.resume_reading()

    async def _event(self, line: bytes) -> None:
        ev = event_decoder.decode(line)
        kind = ev.type
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self.resource_version = object_decoder.decode(ev.object).metadata.resource_version
            return
        if kind == "ERROR":
            status = status_decoder.decode(ev.object)
            if status.code == 410:
                raise Gone(status.message)
            raise ApiError(status.code, status.message or status.reason)
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise MalformedResponse(f"unknown watch event type {kind[:40]!r}")
        # Nothing here waits for another request: a pod whose owner or namespace must be read
        # is published as far as it is known, and again once read (`_resolve_later`).
        self.stats.events += 1
        pod = pod_decoder.decode(ev.object)
        meta = pod.metadata
        now = time.monotonic()
        old = self.view.get(meta.uid)
        if kind == "DELETED":
            # The object is the pod as it was last: its final statuses (a run that ended just
            # before the deletion ends at its own finishedAt, not at the deletion).
            last = pod.status
            final = None if old is None else dataclasses.replace(old, phase=last.phase,
                                                                 runs=last.runs())  # fmt: skip
            new = _deleted(final, now) if final is not None else None
            kept = self._metas.pop(meta.uid, None)
            if new is not None and kept is not None and not self._known(kept, now)[1]:
                # Still named as far as the caches knew: its reads name it once they answer
                # (its containers may still be billed under that name).
                self._gone_metas[meta.uid] = kept
                self._resolve_later([meta.uid])
        else:
            self._metas[meta.uid] = _kept(meta)
            new, current = self._view_of(pod, old, now)
            if not current:
                self._resolve_later([meta.uid])
        if new is not None and new != old:
            view = dict(self.view)
            view[meta.uid] = new
            self.view = self._pruned(view, now)
        if meta.resource_version:
            self.resource_version = meta.resource_version

    # --- what a pod is -----------------------------------------------------------------------

    def _identity(
        self, meta: ObjectMeta, kind: str, name: str, namespace_labels: Mapping[str, str]
    ) -> Identity:
        labels = {**namespace_labels, **{k: meta.labels[k] for k in self.settings.pod_labels
                                         if k in meta.labels}}  # fmt: skip
        return Identity(
            pod_uid=meta.uid,
            namespace=meta.namespace,
            pod=meta.name,
            workload_kind=kind,
            workload=name,
            labels=dict(sorted(labels.items())),
        )

    def _known(self, meta: ObjectMeta, now: float) -> tuple[Identity, bool]:
        """The identity as far as the caches know it, and whether it is current."""
        (kind, name), owner_current = self._owners.known(meta, now)
        labels, labels_current = self._namespaces.known(meta.namespace, now)
        return self._identity(meta, kind, name, labels), owner_current and labels_current

    def _view_of(self, pod: Pod, old: PodView | None, now: float) -> tuple[PodView, bool]:
        """The pod's view, and whether its identity is current (else `_resolve_later`)."""
        meta = pod.metadata
        identity, current = self._known(meta, now)
        text = meta.annotations.get(allocation.ANNOTATION)
        alloc: allocation.Allocation | None = None
        error = None
        if text is not None:
            try:
                alloc = allocation.parse(text)
            except allocation.AllocationError as exc:
                error = str(exc)
        containers = tuple(c.name for c in pod.spec.containers)
        status = pod.status
        view = PodView(identity, containers, alloc, error, phase=status.phase, runs=status.runs())
        if old is not None and old == view:
            return old, current
        return view, current

    def _resolve_later(self, uids: list[str]) -> asyncio.Task[None] | None:
        """Read the owners and namespaces of these pods in the background and publish what
        changes: one slow or hung get holds back no other pod's name, and no watch event."""
        uids = [u for u in uids if u not in self._pending]  # (one task a pod at a time)
        if not uids:
            return None
        self._pending.update(uids)
        task = asyncio.create_task(self._resolve(uids))
        self._resolving.add(task)
        task.add_done_callback(self._resolving.discard)
        return task

    async def _resolve(self, uids: list[str]) -> None:
        began = {u: self._meta_of(u) for u in uids}
        try:
            now = time.monotonic()
            reads = [(u, m) for u, m in began.items() if m is not None]
            await asyncio.gather(*(self._republish_one(u, m, now) for u, m in reads))
        except Exception:  # a bug here must not go unseen, nor end the watch
            log.exception("pod watch: resolving identities failed")
        finally:
            self._pending.difference_update(uids)
        # A pod's event while this read ran (its task skipped), its deletion among them: named
        # from its newer metadata as far as the caches know now, and read again if that is
        # not current (a deleted pod keeps its metadata in `_gone_metas` until then).
        now = time.monotonic()
        again: list[str] = []
        for u in uids:
            if (m := self._meta_of(u)) is not None and m is not began[u]:
                self._publish_known(u, m)
                if not self._known(m, now)[1]:
                    again.append(u)
                    continue
            self._gone_metas.pop(u, None)
        self._resolve_later(again)

    def _meta_of(self, uid: str) -> ObjectMeta | None:
        """What to name the pod from: its latest metadata, live or deleted unnamed."""
        return self._metas.get(uid) or self._gone_metas.get(uid)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await self._refresh(time.monotonic())
            except Exception:  # a bug here must not end the watch: the next pass tries again
                log.exception("pod watch: refreshing identities failed")

    async def _refresh(self, now: float) -> None:
        """Resolve the identity of every live pod again and publish the ones that changed, as
        an event of the pod would (the identity stage then sends `PodIdentity`)."""
        await self._republish(list(self._metas), now)

    async def _republish(self, uids: list[str], now: float) -> None:
        """Resolve these pods' identities, all at once (each owner and namespace is read
        once), and publish each one that changed as soon as it is resolved."""
        live = [(uid, meta) for uid in uids if (meta := self._metas.get(uid)) is not None
                and (pv := self.view.get(uid)) is not None and not pv.deleted]  # fmt: skip
        await asyncio.gather(*(self._republish_one(uid, meta, now) for uid, meta in live))

    async def _republish_one(self, uid: str, meta: ObjectMeta, now: float) -> None:
        """Read the pod's owner and namespace (what is not current) and publish the identity
        the caches then give after each read: one that hangs holds back not the other."""

        async def then_publish(read: Awaitable[object]) -> None:
            await read
            self._publish_known(uid, meta)

        await asyncio.gather(
            then_publish(self._owners.workload(meta, now)),
            then_publish(self._namespaces.labels(meta.namespace, now)),
        )

    def _publish_known(self, uid: str, meta: ObjectMeta) -> None:
        pv = self.view.get(uid)
        # Deleted pods keep the identity they had, unless deleted unnamed (`_gone_metas`); an
        # event or a list that came in meanwhile named the pod from newer metadata.
        if pv is None:
            return
        if pv.deleted and self._gone_metas.get(uid) is not meta:
            return
        if not pv.deleted and self._metas.get(uid) is not meta:
            return
        now = time.monotonic()
        identity, _ = self._known(meta, now)
        if pv.identity != identity:
            view = dict(self.view)
            view[uid] = dataclasses.replace(pv, identity=identity)
            self.view = self._pruned(view, now)

    def _pruned(self, view: dict[str, PodView], now: float) -> dict[str, PodView]:
        keep = self.settings.keep_deleted_s
        return {uid: pv for uid, pv in view.items() if not pv.deleted or now - pv.deleted_at < keep}

    # --- trouble -------------------------------------------------------------------------------

    def _failed(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if exc is None:
            return
        stats = self.stats
        stats.errors += 1
        stats.connected = False
        what = describe(exc)
        if isinstance(exc, ApiError) and exc.status in (401, 403):
            stats.auth_errors += 1
            kind = "auth"
        elif isinstance(exc, CredentialsUnavailable):
            stats.auth_errors += 1
            kind = "credentials"
        elif isinstance(exc, ApiError) and exc.status == 429:
            stats.throttled += 1
            kind = "throttled"
        else:
            kind = "error"
        if self._episode.what == kind:
            return
        self._episode = _Episode(kind)
        if kind == "auth":
            log.error(
                "kubernetes API refused the collector's credentials (%s): pod names stay "
                "unknown until the service account may list and watch pods; retrying",
                what,
            )
        elif kind == "throttled":
            log.warning("kubernetes API is throttling the pod watch (%s): waiting", what)
        elif kind == "credentials":
            log.error(
                "the collector's kubernetes credentials cannot be loaded (%s): pod names stay "
                "unknown until they can; retrying",
                what,
            )
        else:
            log.warning(
                "kubernetes API: %s; retrying with back-off (usage is still collected, "
                "names of new pods wait)",
                what,
            )

    def _recovered(self) -> None:
        self.stats.connected = True
        if self._episode.what is not None:
            log.info(
                "kubernetes API answers again after %.0f s: watching the pods of node %s",
                time.monotonic() - self._episode.since,
                self.node,
            )
            self._episode = _Episode()


def _kept(meta: ObjectMeta) -> ObjectMeta:
    """What the refresh resolves an identity from: the annotations are not needed and can be
    large (a last-applied configuration), so they are not kept."""
    return msgspec.structs.replace(meta, annotations={})


def _deleted(pv: PodView, now: float) -> PodView:
    if pv.deleted:
        return pv
    return dataclasses.replace(pv, deleted=True, deleted_at=now)


async def open_api(settings: KubeSettings) -> Any:
    """An ApiClient from the kubeconfig, else from the in-cluster service account. Raises
    KubeConfigError with a one-line message when the configuration cannot be used."""
    import yaml  # what kubernetes_asyncio parses a kubeconfig with
    from kubernetes_asyncio.client import ApiClient, Configuration
    from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

    cfg = Configuration()
    try:
        if settings.kubeconfig:
            loader = await load_kube_config(
                config_file=settings.kubeconfig, client_configuration=cfg, persist_config=False
            )
            cfg.refresh_api_key_hook = _reloading(loader)
        else:
            load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (
        ConfigException,
        OSError,
        ValueError,
        TypeError,
        KeyError,
        yaml.YAMLError,
        RecursionError,
    ) as exc:
        where = settings.kubeconfig or "in-cluster service account"
        # One line, whatever the parser said (a RecursionError: it recurses once per level).
        deep = isinstance(exc, RecursionError)
        detail = "values nested too deeply" if deep else " ".join(str(exc).split())
        raise KubeConfigError(f"kubernetes configuration ({where}): {detail}") from None
    return ApiClient(configuration=cfg)


def _reloading(loader: Any) -> Callable[[Any], Awaitable[None]]:
    """A hook the client calls before each request that carries a bearer token: the
    kubeconfig's credentials loaded again, so a rotated `tokenFile` or an exec plugin's expired
    token is replaced (the loader runs the plugin again once its token has expired, or every
    time if it gives no expiry). Client certificates stay those the client was made with. The
    library refreshes the in-cluster token itself, a kubeconfig's only when asked."""

    from kubernetes_asyncio.config import ConfigException

    async def reload(cfg: Any) -> None:
        try:
            await loader.load_and_set(cfg)
        except ConfigException:
            raise
        except Exception as exc:
            # The library passes an exec plugin's unexpected answer on as it is (`null`: a
            # TypeError, an expiry that is no time: a ValueError): credentials that cannot be
            # loaded, retried as its ConfigException is, not the end of the watch.
            raise ConfigException(f"{type(exc).__name__}: {exc}") from None

    return reload


class KubeConfigError(Exception):
    """The kubeconfig or the in-cluster configuration cannot be used (one line)."""
