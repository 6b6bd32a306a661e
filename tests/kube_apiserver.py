"""A small Kubernetes API server stand-in that speaks the real list/watch protocol over HTTP.

It keeps pods, ReplicaSets, Jobs and namespaces shaped like the real objects, a history of pod
changes by resourceVersion, and serves:

* `GET /api/v1/pods` with `fieldSelector=spec.nodeName=N`, `limit`/`continue` pages, and with
  `watch=true`: a chunked stream of JSON lines `{"type","object"}` after `resourceVersion`, with
  BOOKMARK events when `allowWatchBookmarks=true`, ended after `timeoutSeconds`; a version older
  than the compacted history is answered `410 Gone` (as an ERROR event, as the real server does
  for a watch, or as the status when `gone_as_status`);
* `GET /apis/apps/v1/namespaces/NS/replicasets/N`, `/apis/batch/v1/namespaces/NS/jobs/N`,
  `/api/v1/namespaces/N`;
* faults: bearer-token check (401) and `forbidden` (403) for chosen resources, `held` (their
  gets hang, logged, until taken out of it), `throttle` (429 with Retry-After),
  `drop_watches()` (cut every open stream mid-body), `go_down()`/`come_up()` (the port refuses
  connections, open streams are cut).

Every request is logged (`requests`) with its time, so tests can check what the client sent.
The server runs on its own event loop in a thread (`ApiServer.start()`), so it serves a
collector subprocess and an in-process client alike; the mutators are thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

TOKEN = "stand-in-token"


@dataclass
class Request:
    at: float
    path: str
    query: dict[str, str]
    status: int = 0


def flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def owner_ref(kind: str, name: str, uid: str, api_version: str) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def make_pod(
    namespace: str,
    name: str,
    node: str,
    containers: list[str],
    *,
    uid: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
    init_containers: tuple[str, ...] = (),
    sidecars: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A pod as `kubectl get pod -o json` shows one (the fields a kubelet-run pod has).
    `init_containers` have completed; `sidecars` are native sidecars (init containers with
    `restartPolicy: Always`, Kubernetes 1.29+), running."""
    uid = uid or str(uuidlib.uuid4())
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "resourceVersion": "0",
        "creationTimestamp": "2026-11-30T10:00:00Z",
        "labels": labels or {},
        "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-30T09:59:00Z"}
        | (annotations or {}),
        "managedFields": [
            {
                "manager": "kube-controller-manager",
                "operation": "Update",
                "apiVersion": "v1",
                "time": "2026-11-30T10:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}},
            }
        ],
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    inits = [(c, False) for c in init_containers] + [(c, True) for c in sidecars]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "restartPolicy": "Always",
            "serviceAccountName": "default",
            "schedulerName": "hami-scheduler",
            "containers": [
                {
                    "name": c,
                    "image": "nvcr.io/nvidia/pytorch:24.10-py3",
                    "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000"}},
                    "terminationMessagePolicy": "File",
                    "imagePullPolicy": "IfNotPresent",
                }
                for c in containers
            ],
            **(
                {"initContainers": [_init_spec(c, sidecar) for c, sidecar in inits]}
                if inits
                else {}
            ),
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}
            ],
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.7",
            "podIP": "10.244.1.17",
            "startTime": "2026-11-30T10:00:01Z",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {
                    "name": c,
                    "ready": True,
                    "restartCount": 0,
                    "image": "nvcr.io/nvidia/pytorch:24.10-py3",
                    "state": {"running": {"startedAt": "2026-11-30T10:00:05Z"}},
                }
                for c in containers
            ],
            **(
                {"initContainerStatuses": [_init_status(c, sidecar) for c, sidecar in inits]}
                if inits
                else {}
            ),
        },
    }


def _init_spec(name: str, sidecar: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "image": "nvcr.io/nvidia/cuda:12.6.2-base-ubuntu24.04",
        "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}},
    }
    if sidecar:
        spec["restartPolicy"] = "Always"
    return spec


def _init_status(name: str, sidecar: bool) -> dict[str, Any]:
    if sidecar:
        state: dict[str, Any] = {"running": {"startedAt": "2026-11-30T10:00:03Z"}}
    else:
        state = {"terminated": {"exitCode": 0, "reason": "Completed",
                                "startedAt": "2026-11-30T10:00:02Z",
                                "finishedAt": "2026-11-30T10:00:03Z"}}  # fmt: skip
    return {"name": name, "ready": sidecar, "restartCount": 0, "started": sidecar,
            "image": "nvcr.io/nvidia/cuda:12.6.2-base-ubuntu24.04", "state": state}  # fmt: skip


def make_owned(
    kind: str, api_version: str, namespace: str, name: str, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """A ReplicaSet or a Job (the fields that matter, plus a spec so it looks like one)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": str(uuidlib.uuid4()),
        "resourceVersion": "1",
        "creationTimestamp": "2026-11-30T09:00:00Z",
        "labels": {},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {
        "kind": kind,
        "apiVersion": api_version,
        "metadata": meta,
        "spec": {"template": {"metadata": {}, "spec": {"containers": []}}},
        "status": {},
    }


class _WatchEnded(Exception):
    """The stand-in ended a watch with an ERROR event (`gone_after`)."""


@dataclass
class _Change:
    rv: int
    type: str
    pod: dict[str, Any]


@dataclass
class ApiServer:
    node: str = "node-a"
    bookmark_every_s: float = 0.5
    gone_as_status: bool = False  # 410 on a watch as the HTTP status instead of an ERROR event
    always_gone: bool = False  # every watch answered 410, from any version
    watches_end_at_once: bool = False  # every watch answered 200 and ended with no event
    gone_after: int | None = None  # every watch ends with a 410 after this many events
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    replicasets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    jobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    namespaces: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    token: str = TOKEN
    forbidden: set[str] = field(default_factory=set)  # resources answered 403
    held: set[str] = field(default_factory=set)  # resources whose gets hang while they are here
    throttle: list[float] = field(default_factory=list)  # Retry-After of the next 429s

    def __post_init__(self) -> None:
        self.rv = 100
        self.oldest = 100  # watches from a version below this are answered 410
        self.history: list[_Change] = []
        self.port = 0
        self.up = False
        self._streams: set[web.StreamResponse] = set()
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.lock = threading.Lock()

    # --- life ----------------------------------------------------------------------------

    def start(self) -> ApiServer:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        self.held = set()  # (a held request would hold the close)
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def go_down(self) -> None:
        """Refuse connections from now on, and cut the streams that are open."""
        self._call(self._down())

    def come_up(self) -> None:
        self._call(self._up())

    def drop_watches(self) -> None:
        """Cut every open watch stream in the middle of its body (a dropped connection)."""
        self._call(self._drop())

    @property
    def open_watches(self) -> int:
        """Watch streams open now."""
        return len(self._streams)

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        with self.lock:
            self.oldest = self.rv
            self.history.clear()

    def kubeconfig(
        self, path: Path, token: str | None = None, user: dict[str, Any] | None = None
    ) -> Path:
        """A kubeconfig for this server; `user`: the credentials, else `token`."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "collector", "user": user or {"token": token or self.token}}],
            "contexts": [
                {"name": "stand-in", "context": {"cluster": "stand-in", "user": "collector"}}
            ],
            "current-context": "stand-in",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- objects ---------------------------------------------------------------------------

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        with self.lock:
            self.namespaces[name] = {
                "kind": "Namespace",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "uid": str(uuidlib.uuid4()),
                    "resourceVersion": "5",
                    "labels": {"kubernetes.io/metadata.name": name} | (labels or {}),
                },
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            }

    def add_deployment_pod(
        self, namespace: str, deployment: str, containers: list[str], **kw: Any
    ) -> dict[str, Any]:
        """A pod of a ReplicaSet that a Deployment owns (named as the controllers name them)."""
        kw["labels"] = {"pod-template-hash": "5d8f7c9b4"} | kw.get("labels", {})
        top = ("Deployment", deployment, "apps/v1")
        mid = ("ReplicaSet", f"{deployment}-5d8f7c9b4", "apps/v1")
        return self._grandchild(namespace, top, mid, "x7k2p", containers, **kw)

    def add_cronjob_pod(
        self, namespace: str, cronjob: str, containers: list[str], **kw: Any
    ) -> dict[str, Any]:
        """A pod of a Job that a CronJob started."""
        top = ("CronJob", cronjob, "batch/v1")
        mid = ("Job", f"{cronjob}-29412360", "batch/v1")
        return self._grandchild(namespace, top, mid, "q9w8e", containers, **kw)

    def _grandchild(
        self,
        namespace: str,
        top: tuple[str, str, str],
        mid: tuple[str, str, str],
        suffix: str,
        containers: list[str],
        **kw: Any,
    ) -> dict[str, Any]:
        ref_top = owner_ref(top[0], top[1], str(uuidlib.uuid4()), top[2])
        owned = make_owned(mid[0], mid[2], namespace, mid[1], ref_top)
        with self.lock:
            store = self.replicasets if mid[0] == "ReplicaSet" else self.jobs
            store[(namespace, mid[1])] = owned
        ref = owner_ref(mid[0], mid[1], owned["metadata"]["uid"], mid[2])
        pod = make_pod(namespace, f"{mid[1]}-{suffix}", self.node, containers, owner=ref, **kw)
        return self.put_pod(pod)

    def add_owned_pod(
        self, namespace: str, kind: str, owner: str, name: str, containers: list[str], **kw: Any
    ) -> dict[str, Any]:
        """A pod a StatefulSet or DaemonSet owns directly."""
        ref = owner_ref(kind, owner, str(uuidlib.uuid4()), "apps/v1")
        return self.put_pod(make_pod(namespace, name, self.node, containers, owner=ref, **kw))

    def put_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a pod (ADDED or MODIFIED)."""
        with self.lock:
            uid = pod["metadata"]["uid"]
            kind = "MODIFIED" if uid in self.pods else "ADDED"
            self.rv += 1
            pod = json.loads(json.dumps(pod))
            pod["metadata"]["resourceVersion"] = str(self.rv)
            self.pods[uid] = pod
            self.history.append(_Change(self.rv, kind, pod))
        self._notify()
        return pod

    def relabel(self, uid: str, **labels: str) -> dict[str, Any]:
        with self.lock:
            pod = json.loads(json.dumps(self.pods[uid]))
        pod["metadata"]["labels"].update(labels)
        return self.put_pod(pod)

    def delete_pod(self, uid: str) -> None:
        with self.lock:
            pod = self.pods.pop(uid)
            self.rv += 1
            pod = json.loads(json.dumps(pod))
            pod["metadata"]["resourceVersion"] = str(self.rv)
            pod["metadata"]["deletionTimestamp"] = "2026-11-30T11:00:00Z"
            self.history.append(_Change(self.rv, "DELETED", pod))
        self._notify()

    def watch_requests(self) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if flag(r.query.get("watch"))]

    # --- the event loop side ---------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _notify(self) -> None:
        if self._changed is None:
            return

        async def wake() -> None:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

        asyncio.run_coroutine_threadsafe(wake(), self._loop)

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{name}", self._namespace)
        app.router.add_get("/apis/apps/v1/namespaces/{ns}/replicasets/{name}", self._replicaset)
        app.router.add_get("/apis/batch/v1/namespaces/{ns}/jobs/{name}", self._job)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await self._up()

    async def _up(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()
        if not self.port:
            server = self._site._server
            assert isinstance(server, asyncio.base_events.Server)
            self.port = server.sockets[0].getsockname()[1]
        self.up = True

    async def _down(self) -> None:
        self.up = False
        if self._site is not None:
            await self._site.stop()
            self._site = None
        await self._drop()
        # Idle keep-alive connections too: a client must not get through on an old one.
        assert self._runner is not None and self._runner.server is not None
        for handler in list(self._runner.server.connections):
            if handler.transport is not None:
                handler.transport.abort()

    async def _drop(self) -> None:
        for stream in list(self._streams):
            task = getattr(stream, "_task", None)
            transport = getattr(stream, "_transport", None)
            if transport is not None:
                transport.abort()
            if task is not None:
                task.cancel()
        self._streams.clear()

    async def _close(self) -> None:
        await self._drop()
        if self._runner is not None:
            await self._runner.cleanup()

    def _log(self, request: web.Request) -> Request:
        entry = Request(time.monotonic(), request.path, dict(request.query))
        with self.lock:
            self.requests.append(entry)
        return entry

    def _refuse(self, request: web.Request, entry: Request, resource: str) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            entry.status = 401
            return web.json_response(status_body(401, "Unauthorized", "Unauthorized"), status=401)
        if resource in self.forbidden:
            entry.status = 403
            message = (
                f'{resource} is forbidden: User "system:serviceaccount:hami-usage:'
                f'hami-usage-collector" cannot list resource "{resource}" at the cluster scope'
            )
            return web.json_response(status_body(403, "Forbidden", message), status=403)
        with self.lock:
            retry_after = self.throttle.pop(0) if self.throttle else None
        if retry_after is not None:
            entry.status = 429
            return web.json_response(
                status_body(429, "TooManyRequests", "the server has received too many requests"),
                status=429,
                headers={"Retry-After": str(int(retry_after))},
            )
        return None

    async def _get(
        self, request: web.Request, resource: str, obj: dict[str, Any] | None, what: str
    ) -> web.StreamResponse:
        entry = self._log(request)
        refused = self._refuse(request, entry, resource)
        if refused is not None:
            return refused
        while resource in self.held:  # an API server too busy to answer
            await asyncio.sleep(0.01)
        if obj is None:
            entry.status = 404
            return web.json_response(
                status_body(404, "NotFound", f'{resource} "{what}" not found'), status=404
            )
        entry.status = 200
        return web.json_response(obj)

    async def _namespace(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        return await self._get(request, "namespaces", self.namespaces.get(name), name)

    async def _replicaset(self, request: web.Request) -> web.StreamResponse:
        key = (request.match_info["ns"], request.match_info["name"])
        return await self._get(request, "replicasets", self.replicasets.get(key), key[1])

    async def _job(self, request: web.Request) -> web.StreamResponse:
        key = (request.match_info["ns"], request.match_info["name"])
        return await self._get(request, "jobs", self.jobs.get(key), key[1])

    def _selected(self, query: dict[str, str], pod: dict[str, Any]) -> bool:
        selector = query.get("fieldSelector", "")
        if not selector:
            return True
        field_name, _, value = selector.partition("=")
        assert field_name == "spec.nodeName", f"unsupported field selector {selector}"
        return bool(pod["spec"].get("nodeName") == value)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        entry = self._log(request)
        refused = self._refuse(request, entry, "pods")
        if refused is not None:
            return refused
        query = dict(request.query)
        if flag(query.get("watch")):
            return await self._watch(request, entry, query)
        limit = int(query.get("limit", "0") or 0)
        token = query.get("continue", "")
        with self.lock:
            if token:
                version, _, offset_text = token.partition(":")
                if int(version) < self.oldest:
                    entry.status = 410
                    return web.json_response(
                        status_body(410, "Expired", "The provided continue parameter is too old"),
                        status=410,
                    )
                offset = int(offset_text)
            else:
                version, offset = str(self.rv), 0
            items = sorted(
                (p for p in self.pods.values() if self._selected(query, p)),
                key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"]),
            )
        page = items[offset : offset + limit] if limit else items[offset:]
        more = bool(limit) and offset + limit < len(items)
        entry.status = 200
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {
                    "resourceVersion": version,
                    **({"continue": f"{version}:{offset + limit}"} if more else {}),
                },
                "items": page,
            }
        )

    async def _watch(
        self, request: web.Request, entry: Request, query: dict[str, str]
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or self.rv)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = flag(query.get("allowWatchBookmarks"))
        if since < self.oldest and self.gone_as_status:
            entry.status = 410
            return web.json_response(
                status_body(410, "Expired", f"too old resource version: {since}"), status=410
            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        entry.status = 200
        resp._transport = request.transport  # type: ignore[attr-defined]
        resp._task = asyncio.current_task()  # type: ignore[attr-defined]
        self._streams.add(resp)

        sent = 0

        async def send(kind: str, obj: dict[str, Any]) -> None:
            nonlocal sent
            if self.gone_after is not None and sent >= self.gone_after and kind != "ERROR":
                gone = status_body(410, "Expired", "too old resource version (compacted)")
                await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                raise _WatchEnded
            sent += 1
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        try:
            if since < self.oldest or self.always_gone:
                gone = status_body(410, "Expired", f"too old resource version: {since}")
                await send("ERROR", gone)
                return resp
            if self.watches_end_at_once:
                await resp.write_eof()
                return resp
            deadline = time.monotonic() + timeout
            last_bookmark = time.monotonic()
            assert self._changed is not None
            while (left := deadline - time.monotonic()) > 0:
                if not self.up:
                    # (a stream that `go_down` did not see yet: one being set up as it ran)
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                with self.lock:
                    changes = [c for c in self.history if c.rv > since]
                    now_rv = self.rv
                for c in changes:
                    if self._selected(query, c.pod):
                        await send(c.type, c.pod)
                    since = c.rv
                if bookmarks and time.monotonic() - last_bookmark >= self.bookmark_every_s:
                    last_bookmark = time.monotonic()
                    since = max(since, now_rv)
                    await send(
                        "BOOKMARK",
                        {"kind": "Pod", "apiVersion": "v1",
                         "metadata": {"resourceVersion": str(since)}},
                    )  # fmt: skip
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._changed.wait(), min(left, self.bookmark_every_s)
                        )
            await resp.write_eof()
        except _WatchEnded:
            await resp.write_eof()
        finally:
            self._streams.discard(resp)
        return resp


def stop_collector(proc: Any, server: ApiServer, writers: list[Any]) -> tuple[int, str]:
    """SIGTERM a `hami-usage collect` subprocess, close the stand-in and the cache writers; the
    collector's exit status and stderr."""
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    server.close()
    for w in writers:
        w.close()
    return int(proc.returncode), str(stderr)
