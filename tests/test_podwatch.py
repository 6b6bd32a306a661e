"""The pod watch (collector/node/podwatch.py) with the real kubernetes_asyncio client against the
API server stand-in (tests/kube_apiserver.py) over HTTP, configured by a kubeconfig file.

Covers the list/watch protocol (pages, resourceVersion, BOOKMARK, 410 Gone as an ERROR event
and as a status, dropped streams, an unreachable server, 401, 403, 429 with Retry-After) and
what is learnt per pod (namespace, name, workload through ReplicaSet/Job owners, labels,
allocation annotation, deletion).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from kube_apiserver import ApiServer, flag, make_pod, owner_ref

from collector.events import MAX_LABELS, Identity, PodIdentity, decode
from collector.layout.declarations import V12
from collector.node.allocation import AllocatedDevice
from collector.node.pods import Run
from collector.node.podwatch import KubeConfigError, KubeSettings, PodWatch, open_api
from collector.simulate import GiB, SimDevice, new_cache_file
from collector.transport.locallog import LogReader

ROOT = Path(__file__).resolve().parent.parent
NODE = "node-a"
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "request_timeout_s": 2.0}


@pytest.fixture
def server() -> Iterator[ApiServer]:
    srv = ApiServer(node=NODE, bookmark_every_s=0.2).start()
    srv.add_namespace("ml", {"cost-center": "cc-17"})
    srv.add_namespace("web", {"cost-center": "cc-02"})
    try:
        yield srv
    finally:
        srv.close()


@contextlib.asynccontextmanager
async def watching(
    server: ApiServer,
    tmp_path: Path,
    token: str | None = None,
    user: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[PodWatch]:
    kube = KubeSettings(
        kubeconfig=str(server.kubeconfig(tmp_path / "kubeconfig", token, user)),
        **{**FAST, "pod_labels": ("team",), "namespace_labels": ("cost-center",), **settings},
    )
    api = await open_api(kube)
    watch = PodWatch(api, NODE, kube)
    task = asyncio.create_task(watch.run())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()


async def until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def names(watch: PodWatch) -> dict[str, tuple[str, str, str, str, dict[str, str]]]:
    return {
        uid: (i.namespace, i.pod, i.workload_kind, i.workload, i.labels)
        for uid, pv in watch.view.items()
        for i in [pv.identity]
    }


async def test_list_then_watch_resolves_every_kind_of_workload(
    server: ApiServer, tmp_path: Path
) -> None:
    dep = server.add_deployment_pod("ml", "trainer", ["main"], labels={"team": "vision"})
    cron = server.add_cronjob_pod("ml", "nightly-eval", ["eval"])
    sts = server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"], labels={"team": "x"})
    ds = server.add_owned_pod("web", "DaemonSet", "agent", "agent-7x9", ["a"])
    other = server.put_pod(make_pod("web", "elsewhere", "node-b", ["c"]))
    async with watching(server, tmp_path, page_size=2) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert names(watch) == {
            dep["metadata"]["uid"]: (
                "ml",
                dep["metadata"]["name"],
                "Deployment",
                "trainer",
                {"cost-center": "cc-17", "team": "vision"},
            ),
            cron["metadata"]["uid"]: (
                "ml",
                cron["metadata"]["name"],
                "CronJob",
                "nightly-eval",
                {"cost-center": "cc-17"},
            ),
            sts["metadata"]["uid"]: (
                "web",
                "db-0",
                "StatefulSet",
                "db",
                {"cost-center": "cc-02", "team": "x"},
            ),
            ds["metadata"]["uid"]: (
                "web",
                "agent-7x9",
                "DaemonSet",
                "agent",
                {"cost-center": "cc-02"},
            ),
        }
        assert other["metadata"]["uid"] not in watch.view  # another node's pod
        lists = [r for r in server.requests if r.path == "/api/v1/pods" and "watch" not in r.query]
        assert [r.query.get("limit") for r in lists] == ["2", "2"]  # two pages of 2 (4 pods)
        assert lists[1].query["continue"]
        assert all(r.query["fieldSelector"] == f"spec.nodeName={NODE}" for r in lists)

        bare = server.put_pod(make_pod("ml", "debug", NODE, ["sh"]))
        await until(lambda: bare["metadata"]["uid"] in watch.view)
        assert names(watch)[bare["metadata"]["uid"]] == (
            "ml",
            "debug",
            "Pod",
            "debug",
            {"cost-center": "cc-17"},
        )
        (first_watch, *_) = server.watch_requests()
        assert first_watch.query["allowWatchBookmarks"] in ("true", "True")
        assert first_watch.query["resourceVersion"] == lists[-1].query.get(
            "resourceVersion", first_watch.query["resourceVersion"]
        )

        server.relabel(dep["metadata"]["uid"], team="speech")
        await until(lambda: names(watch)[dep["metadata"]["uid"]][4]["team"] == "speech")

        server.delete_pod(dep["metadata"]["uid"])
        await until(lambda: watch.view[dep["metadata"]["uid"]].deleted)
        # Deleted, but its identity is kept: its container may still be running.
        assert names(watch)[dep["metadata"]["uid"]][:4] == (
            "ml",
            dep["metadata"]["name"],
            "Deployment",
            "trainer",
        )
        assert watch.stats.lists == 1 and watch.stats.relists == 0
        assert watch.stats.errors == 0 and watch.stats.connected


async def test_watch_resumes_from_the_last_bookmark_without_listing_again(
    server: ApiServer, tmp_path: Path
) -> None:
    server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"])
    async with watching(server, tmp_path, watch_timeout_s=1) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        other = server.put_pod(make_pod("web", "x", "node-b", ["c"]))
        # Only another node's pod changed: this watch saw no event, only bookmarks, and the
        # history before them is gone. A client that ignored bookmarks would get 410 now.
        await until(lambda: watch.stats.bookmarks >= 2)
        await until(lambda: watch.resource_version == other["metadata"]["resourceVersion"])
        server.compact()
        await until(lambda: watch.stats.watches >= 3)  # the server ends each after 1 s
        assert watch.stats.relists == 0 and watch.stats.lists == 1
        versions = [r.query["resourceVersion"] for r in server.watch_requests()]
        assert versions[-1] == other["metadata"]["resourceVersion"]
        assert all(r.query["timeoutSeconds"] == "1" for r in server.watch_requests())


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again_and_marks_pods_deleted_meanwhile(
    server: ApiServer, tmp_path: Path, as_status: bool
) -> None:
    server.gone_as_status = as_status
    kept = server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"])
    lost = server.add_owned_pod("web", "StatefulSet", "db", "db-1", ["pg"])
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        server.go_down()
        await until(lambda: not watch.stats.connected)
        server.delete_pod(lost["metadata"]["uid"])
        new = server.add_owned_pod("web", "StatefulSet", "db", "db-2", ["pg"])
        server.bookmark_every_s = 60.0  # no bookmark can carry the watch past the compaction
        server.compact()
        server.come_up()
        await until(lambda: new["metadata"]["uid"] in watch.view)
        assert watch.stats.relists == 1 and watch.stats.lists == 2
        assert watch.view[lost["metadata"]["uid"]].deleted
        assert not watch.view[kept["metadata"]["uid"]].deleted


@pytest.mark.parametrize("trouble", ["watches_end_at_once", "always_gone"])
async def test_watches_ended_at_once_or_gone_at_once_are_retried_with_back_off(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, trouble: str
) -> None:
    """A watch answered 200 and ended at once with no event (a proxy, a server shedding load),
    or a 410 for the version a list has just given, is a failure retried with back-off, as
    client-go's reflector does: the watch went round as fast as the server answered, 650
    watches (or 300 lists and watches) a second."""
    pod = server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"])
    setattr(server, trouble, True)
    with caplog.at_level(logging.INFO, logger="collector.node.podwatch"):
        async with watching(server, tmp_path) as watch:
            await asyncio.sleep(2.0)
            with server.lock:
                calls = len(server.requests)
            # back-off 0.05 s doubling to 0.2 s, jitter up to 0.05 s: at most 16 rounds of a
            # list and a watch in 2 s (at least a dozen without the list a 410 adds)
            assert 4 <= calls <= 2 * 16, calls
            assert watch.stats.errors >= 3 and not watch.stats.connected
            if trouble == "always_gone":
                assert watch.stats.relists == watch.stats.errors
            setattr(server, trouble, False)
            await until(lambda: watch.stats.connected and watch.stats.bookmarks > 0, 10)
            assert pod["metadata"]["uid"] in watch.view
    what = (
        "ShortWatch: the server ended a watch after"
        if trouble == "watches_end_at_once"
        else "ShortWatch: the version"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and what in warned[0], warned
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_a_410_after_a_watch_that_delivered_lists_again_at_once(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch that delivered (here 3 bookmarks) and then got a 410 (the history compacted)
    lists again at once, even when it was the first watch after a list: no error, no warning,
    no back-off. Only a 410 the list's own version gets at once is retried with back-off."""
    server.gone_after = 3
    with caplog.at_level(logging.INFO, logger="collector.node.podwatch"):
        async with watching(server, tmp_path) as watch:
            await until(lambda: watch.stats.relists >= 3, 10)
            assert watch.stats.errors == 0 and watch.stats.lists >= watch.stats.relists
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_dropped_streams_resume_from_the_last_version_seen(
    server: ApiServer, tmp_path: Path
) -> None:
    server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"])
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        for i in range(3):
            pod = server.add_owned_pod("web", "StatefulSet", "db", f"db-{i + 1}", ["pg"])
            await until(lambda p=pod: p["metadata"]["uid"] in watch.view)  # type: ignore[misc]
            seen = watch.resource_version
            server.drop_watches()
            await until(lambda n=i: watch.stats.watches >= n + 2)  # type: ignore[misc]
            assert int(server.watch_requests()[-1].query["resourceVersion"]) >= int(seen or 0)
        assert watch.stats.errors >= 3
        assert watch.stats.relists == 0 and watch.stats.lists == 1
        assert len(watch.view) == 4


async def test_unreachable_at_start_then_answers(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "collector.node.podwatch")
    pod = server.add_owned_pod("web", "DaemonSet", "agent", "agent-1", ["a"])
    server.go_down()
    async with watching(server, tmp_path) as watch:
        await until(lambda: watch.stats.errors >= 5)
        assert not watch.synced.is_set()
        server.come_up()
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert pod["metadata"]["uid"] in watch.view
        # back once the watch after the list delivers (its first bookmark, here)
        await until(lambda: any("answers again" in r.getMessage() for r in caplog.records))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per episode
    assert "retrying with back-off" in warnings[0].getMessage()


async def test_401_is_one_clear_line_and_a_counter_and_never_a_crash(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "collector.node.podwatch")
    server.add_owned_pod("web", "DaemonSet", "agent", "agent-1", ["a"])
    async with watching(server, tmp_path, token="expired") as watch:
        await until(lambda: watch.stats.auth_errors >= 4)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, errors
        assert "refused the collector's credentials (HTTP 401 Unauthorized)" in errors[0]
        server.token = "expired"  # the credentials become valid (a rotated token)
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert watch.stats.connected


async def test_a_kubeconfig_token_file_is_read_again_when_it_is_rotated(
    server: ApiServer, tmp_path: Path
) -> None:
    """The client reads a kubeconfig's `tokenFile` once; a rotated token (a projected service
    account token is replaced every hour) was never read again: 401 until a restart, and no
    pod named meanwhile."""
    token = tmp_path / "token"
    token.write_text(server.token)
    async with watching(server, tmp_path, user={"tokenFile": str(token)}) as watch:
        await names_a_new_pod_after_rotating(server, watch, token)
        assert watch.stats.connected


async def names_a_new_pod_after_rotating(server: ApiServer, watch: PodWatch, token: Path) -> None:
    """Once the watch is open with its token: the server takes only a new one, written to
    `token`, and cuts the watch; a pod added then is named within 10 s."""
    await until(lambda: server.open_watches > 0)
    token.write_text("rotated")
    server.token = "rotated"
    server.drop_watches()
    pod = server.add_owned_pod("web", "StatefulSet", "db", "db-1", ["pg"])
    await until(lambda: pod["metadata"]["uid"] in watch.view, 10)


def plugin(tmp_path: Path) -> tuple[dict[str, Any], Path, Path]:
    """An exec credential plugin (a kubeconfig `user`) handing out the token in its token file,
    expiring at once; it fails while its fail file exists. Its runs are counted in a file."""
    token, fail, runs = tmp_path / "plugin-token", tmp_path / "plugin-fail", tmp_path / "runs"
    script = tmp_path / "plugin.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"echo run >> {runs}\n"
        f"if [ -e {fail} ]; then echo 'no credentials' >&2; exit 1; fi\n"
        'printf \'{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":'
        '"ExecCredential","status":{"token":"%s","expirationTimestamp":'
        f'"2000-01-01T00:00:00Z"}}}}\' "$(cat {token})"\n'
    )
    script.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": str(script),
            "interactiveMode": "Never",
        }
    }
    return user, token, fail


async def test_an_exec_plugins_expired_token_is_replaced(server: ApiServer, tmp_path: Path) -> None:
    """The plugin ran once, at start: once its token expired and the server wanted the new
    one, every request was refused (401) for good."""
    user, token, _ = plugin(tmp_path)
    token.write_text(server.token)
    async with watching(server, tmp_path, user=user) as watch:
        await names_a_new_pod_after_rotating(server, watch, token)
    assert len((tmp_path / "runs").read_text().splitlines()) > 1


async def test_credentials_that_cannot_be_loaded_are_retried_not_the_end_of_the_watch(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client loads credentials before each request and raises its ConfigException when
    it cannot (an exec plugin that fails): that ended the pod watch for good (nothing named
    again until a restart). It is retried like a refusal."""
    caplog.set_level(logging.INFO, "collector.node.podwatch")
    user, token, fail = plugin(tmp_path)
    token.write_text(server.token)
    async with watching(server, tmp_path, user=user) as watch:
        await until(lambda: server.open_watches > 0)  # the watch, with its token
        fail.touch()
        server.drop_watches()
        await until(lambda: watch.stats.auth_errors >= 3)
        fail.unlink()
        pod = server.add_owned_pod("web", "StatefulSet", "db", "db-1", ["pg"])
        await until(lambda: pod["metadata"]["uid"] in watch.view, 10)
    ours = [r for r in caplog.records if r.name == "collector.node.podwatch"]
    errors = [r.getMessage() for r in ours if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        "the collector's kubernetes credentials cannot be loaded (CredentialsUnavailable: "
        "exec: process returned 1. no credentials)"
    )
    assert errors[0].endswith("pod names stay unknown until they can; retrying")


@pytest.mark.parametrize("answer", ["null", "an expiry that is no time"])
async def test_an_exec_plugins_unexpected_answer_is_retried_not_the_end_of_the_watch(
    server: ApiServer, tmp_path: Path, answer: str
) -> None:
    """A plugin that exits 0 with `null`, or with an expiry the client cannot parse: the client
    raised a TypeError or a ValueError, not its ConfigException, and the watch ended for good
    (new pods unnamed, finished ones still running, until a restart)."""
    user, token, _ = plugin(tmp_path)
    token.write_text(server.token)
    said = {
        "null": "null",
        "an expiry that is no time": json.dumps(
            {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "kind": "ExecCredential",
                "status": {"token": server.token, "expirationTimestamp": "soon"},
            }
        ),
    }[answer]
    script = tmp_path / "plugin.sh"
    lines = script.read_text().splitlines()
    odd = tmp_path / "plugin-odd"
    lines.insert(2, f"if [ -e {odd} ]; then cat {odd}; exit 0; fi")
    script.write_text("\n".join(lines) + "\n")
    async with watching(server, tmp_path, user=user) as watch:
        await until(lambda: server.open_watches > 0)
        odd.write_text(said)
        server.drop_watches()
        await until(lambda: watch.stats.auth_errors >= 2)
        odd.unlink()
        pod = server.add_owned_pod("web", "StatefulSet", "db", "db-1", ["pg"])
        await until(lambda: pod["metadata"]["uid"] in watch.view, 10)
        assert watch.stats.connected


async def test_403_on_pods_is_reported_and_on_replicasets_falls_back_to_the_name(
    server: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "collector.node.podwatch")
    pod = server.add_deployment_pod("ml", "trainer", ["main"])
    server.forbidden = {"pods", "replicasets"}
    async with watching(server, tmp_path) as watch:
        await until(lambda: watch.stats.auth_errors >= 2)
        (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "HTTP 403" in line and "cannot list resource" in line
        server.forbidden = {"replicasets"}
        await asyncio.wait_for(watch.synced.wait(), 30)
        identity: Identity = watch.view[pod["metadata"]["uid"]].identity
        # No get on ReplicaSets: the Deployment by the pod-template-hash naming convention.
        assert (identity.workload_kind, identity.workload) == ("Deployment", "trainer")
        assert watch.stats.owner_errors == 1


def workload(watch: PodWatch, uid: str) -> tuple[str, str]:
    identity = watch.view[uid].identity
    return (identity.workload_kind, identity.workload)


def gets(server: ApiServer, path: str) -> list[int]:
    return [r.status for r in server.requests if r.path == path]


async def test_a_hung_owner_get_holds_back_no_other_pods_name_nor_the_watch(
    server: ApiServer, tmp_path: Path
) -> None:
    """Owners are read in the background, all at once, one get per owner: while every Job get
    hangs, each pod is named as far as is known (a Job's pods as the Job's), a pod that needs
    no owner read is named in full, and the watch goes on; once the gets answer, the pods are
    named again. `synced` waits for the first list's reads."""
    server.held = {"jobs"}
    crons = [server.add_cronjob_pod("ml", f"eval{i}", ["eval"]) for i in range(3)]
    twin = json.loads(json.dumps(crons[0]))  # a second pod of the first Job
    twin["metadata"].update(name="eval0-29412360-z1x2c", uid="uid-twin")
    server.put_pod(twin)
    uids = [c["metadata"]["uid"] for c in crons] + ["uid-twin"]
    jobs = [f"eval{i}-29412360" for i in (0, 1, 2, 0)]
    db = server.add_owned_pod("web", "StatefulSet", "db", "db-0", ["pg"])["metadata"]["uid"]

    def job_gets() -> list[Any]:
        return [r for r in server.requests if "/jobs/" in r.path]

    async with watching(server, tmp_path, request_timeout_s=60) as watch:
        stateful = ("web", "db-0", "StatefulSet", "db", {"cost-center": "cc-02"})
        await until(lambda: db in watch.view and names(watch)[db] == stateful)
        await until(lambda: len(job_gets()) == 3)  # in flight together, the twin's shared
        assert [workload(watch, u) for u in uids] == [("Job", j) for j in jobs]
        assert names(watch)[uids[0]][4] == {"cost-center": "cc-17"}
        assert not watch.synced.is_set() and watch.stats.owner_lookups == 3

        late = server.add_cronjob_pod("ml", "late", ["eval"])["metadata"]["uid"]
        db1 = server.add_owned_pod("web", "StatefulSet", "db", "db-1", ["pg"])["metadata"]["uid"]
        await until(lambda: db1 in watch.view)  # the watch went on past the held pod
        assert workload(watch, late) == ("Job", "late-29412360")
        assert len(job_gets()) == 4 and all(r.status == 0 for r in job_gets())

        server.held = set()
        await asyncio.wait_for(watch.synced.wait(), 30)
        await until(lambda: workload(watch, late) == ("CronJob", "late"))
        assert [workload(watch, u) for u in uids] == [("CronJob", f"eval{i}") for i in (0, 1, 2, 0)]
        assert [r.status for r in job_gets()] == [200] * 4
        assert watch.stats.owner_errors == 0


async def test_a_failed_owner_get_is_retried_without_an_event_of_the_pod(
    server: ApiServer, tmp_path: Path
) -> None:
    """A long-running pod gets no event: its identity is resolved again by the refresh once
    the fallback expires, with one get for the two pods of the Job, and published as a new view
    (what the identity stage sends `PodIdentity` from)."""
    server.forbidden = {"jobs"}
    first = server.add_cronjob_pod("ml", "nightly-eval", ["eval"])
    twin = json.loads(json.dumps(first))
    twin["metadata"].update(name="nightly-eval-29412360-z1x2c", uid="uid-twin")
    server.put_pod(twin)
    uids = [first["metadata"]["uid"], "uid-twin"]
    job = "/apis/batch/v1/namespaces/ml/jobs/nightly-eval-29412360"
    async with watching(server, tmp_path, retry_failed_s=0.5, refresh_s=0.05) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        before = watch.view
        assert [workload(watch, u) for u in uids] == [("Job", "nightly-eval-29412360")] * 2
        assert gets(server, job) == [403]
        events = watch.stats.events
        server.forbidden = set()
        await until(lambda: workload(watch, uids[0]) == ("CronJob", "nightly-eval"), 5)
        assert workload(watch, uids[1]) == ("CronJob", "nightly-eval")
        assert before[uids[0]].identity.workload_kind == "Job"  # a new view, the old one kept
        await asyncio.sleep(0.3)  # several refresh passes: the resolved owner is cached
        assert gets(server, job) == [403, 200]
        assert watch.stats.events == events and watch.stats.lists == 1


async def test_a_failed_reread_of_a_resolved_owner_keeps_what_it_resolved_to(
    server: ApiServer, tmp_path: Path
) -> None:
    pod = server.add_cronjob_pod("ml", "nightly-eval", ["eval"])
    uid = pod["metadata"]["uid"]
    job = "/apis/batch/v1/namespaces/ml/jobs/nightly-eval-29412360"
    async with watching(
        server, tmp_path, owner_ttl_s=0.3, retry_failed_s=0.3, refresh_s=0.05
    ) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert workload(watch, uid) == ("CronJob", "nightly-eval")
        server.forbidden = {"jobs"}
        await until(lambda: 403 in gets(server, job), 5)  # the refresh read it again
        await until(lambda: watch.stats.owner_errors >= 1, 5)
        assert workload(watch, uid) == ("CronJob", "nightly-eval")  # not ("Job", ...)


async def test_namespace_labels_are_read_again_after_their_ttl_without_a_pod_event(
    server: ApiServer, tmp_path: Path
) -> None:
    pods = [server.add_owned_pod("ml", "StatefulSet", "s", f"s-{i}", ["a"]) for i in range(3)]
    uids = [p["metadata"]["uid"] for p in pods]
    async with watching(server, tmp_path, namespace_ttl_s=0.5, refresh_s=0.05) as watch:
        # The expiry of the namespace's entry after each lookup: a new one is a get, made at
        # the lookup's `now` (the server's arrival times would add the requests' latencies).
        cache = watch._namespaces._cache
        lookup = watch._namespaces.labels
        expiries: list[float] = []

        async def recorded(namespace: str, now: float) -> dict[str, str]:
            found = await lookup(namespace, now)
            if namespace == "ml" and cache["ml"][0] not in expiries:
                expiries.append(cache["ml"][0])
            return found

        watch._namespaces.labels = recorded  # type: ignore[method-assign]
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert [names(watch)[u][4] for u in uids] == [{"cost-center": "cc-17"}] * 3
        events = watch.stats.events
        server.add_namespace("ml", {"cost-center": "cc-99"})
        await until(lambda: all(names(watch)[u][4] == {"cost-center": "cc-99"} for u in uids), 5)
        assert watch.stats.events == events and watch.stats.lists == 1
    # One get per expiry of the namespace's entry, not one per pod: never two within the TTL.
    times = [r.at for r in server.requests if r.path == "/api/v1/namespaces/ml"]
    assert len(times) == len(expiries) >= 2
    assert all(b - a >= 0.5 for a, b in zip(expiries, expiries[1:], strict=False))


@pytest.mark.parametrize(
    "owners",
    [[("ConfigMap", "shared-config")], [("PersistentVolumeClaim", "scratch"), ("Secret", "creds")]],
    ids=["configmap", "pvc-and-secret"],
)
async def test_owners_without_a_controller_leave_the_pod_its_own_workload(
    server: ApiServer, tmp_path: Path, owners: list[tuple[str, str]]
) -> None:
    pod = make_pod("ml", "notebook-0", NODE, ["main"])
    pod["metadata"]["ownerReferences"] = [
        {**owner_ref(kind, name, f"uid-{name}", "v1"), "controller": False} for kind, name in owners
    ]
    uid = server.put_pod(pod)["metadata"]["uid"]
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert workload(watch, uid) == ("Pod", "notebook-0")


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Thing", "w" * 300),  # past an event's Name: every heartbeat of the node undecodable
        ("Thing", "job\rx"),  # a CR splits a CSV row; a newline forges a log line
        ("=HYPERLINK(1)", "x"),
        ("Thing", "x\x1b[1A\x1b[2KPod/db-0"),
        ("Thing", "a/b"),
        ("Thing", ".."),
    ],
    ids=["300-chars", "cr", "formula-kind", "escape", "slash", "dotdot"],
)
async def test_a_controller_reference_no_object_can_have_leaves_the_pod_its_own_workload(
    server: ApiServer, tmp_path: Path, kind: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    pod = make_pod("ml", "notebook-0", NODE, ["main"])
    pod["metadata"]["ownerReferences"] = [owner_ref(kind, name, "uid-x", "example.com/v1")]
    uid = server.put_pod(pod)["metadata"]["uid"]
    real = server.add_owned_pod("ml", "RayCluster", "ray-1.v2", "ray-1-head", ["main"])
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert workload(watch, uid) == ("Pod", "notebook-0")
        assert workload(watch, real["metadata"]["uid"]) == ("RayCluster", "ray-1.v2")
        identity = watch.view[uid].identity
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(identity), type=Identity) == identity
    warned = [r.getMessage() for r in caplog.records if "names no object" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "\r" not in warned[0]


async def test_a_deployment_reference_no_object_can_have_leaves_the_replicaset(
    server: ApiServer, tmp_path: Path
) -> None:
    uid = server.add_deployment_pod("web", "api", ["a"])["metadata"]["uid"]
    rs = server.replicasets[("web", "api-5d8f7c9b4")]
    rs["metadata"]["ownerReferences"][0]["name"] = "d" * 300
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert workload(watch, uid) == ("ReplicaSet", "api-5d8f7c9b4")


async def test_429_waits_for_retry_after(server: ApiServer, tmp_path: Path) -> None:
    server.add_owned_pod("web", "DaemonSet", "agent", "agent-1", ["a"])
    server.throttle = [1.0]
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        throttled, after = [r for r in server.requests if r.path == "/api/v1/pods"][:2]
        assert throttled.status == 429 and after.status == 200
        # Retry-After: 1 wins over the back-off (at most 0.2 s here).
        assert after.at - throttled.at >= 0.95
        assert watch.stats.throttled == 1


async def test_allocation_annotation_is_decoded_per_container(
    server: ApiServer, tmp_path: Path
) -> None:
    text = "GPU-a,NVIDIA,4000,30:;;GPU-b,NVIDIA,8000,0:GPU-c,NVIDIA,1000,50:;"
    ok = server.add_owned_pod(
        "ml",
        "StatefulSet",
        "s",
        "s-0",
        ["a", "sidecar", "b"],
        annotations={"hami.io/vgpu-devices-allocated": text},
    )
    bad = server.add_owned_pod(
        "ml",
        "StatefulSet",
        "s",
        "s-1",
        ["a"],
        annotations={"hami.io/vgpu-devices-allocated": "GPU-a,4000:;"},
    )
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        view = watch.view[ok["metadata"]["uid"]]
        assert view.containers == ("a", "sidecar", "b")
        assert view.allocation == [
            [AllocatedDevice("GPU-a", "NVIDIA", 4000, 30)],
            [],
            [
                AllocatedDevice("GPU-b", "NVIDIA", 8000, 0),
                AllocatedDevice("GPU-c", "NVIDIA", 1000, 50),
            ],
        ]
        assert watch.view[bad["metadata"]["uid"]].allocation is None
        assert "is not UUID,Type,MiB,cores" in (
            watch.view[bad["metadata"]["uid"]].allocation_error or ""
        )


async def test_a_kubeconfig_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    with pytest.raises(KubeConfigError, match=r"^kubernetes configuration \(.*kubeconfig\): "):
        await open_api(KubeSettings(kubeconfig=str(path)))


# --- the collect command's Kubernetes settings ----------------------------------------------


def collect(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    root, log = tmp_path / "root", tmp_path / "log"
    root.mkdir(exist_ok=True)
    drop = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_") and k not in drop
    }
    return subprocess.run(
        [str(Path(sys.executable).parent / "hami-usage"), "collect", "--root", str(root),
         "--log", str(log), "--node", NODE, "--no-nvml", "--interval", "0.3", *args],
        capture_output=True, text=True, timeout=60, env={**clean, **env}, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "hami-usage collect: --kubeconfig {path}: no such file"),
        ("clusters: [", "hami-usage collect: kubernetes configuration ({path}): "),
        (
            "apiVersion: v1\nkind: Config\n",
            "hami-usage collect: kubernetes configuration ({path}): ",
        ),
    ],
)
def test_a_kubeconfig_that_cannot_be_used_exits_2_with_one_line(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    proc = collect(tmp_path, "--kubeconfig", str(path), "--max-scans", "1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(path=path)), proc.stderr
    # Checked before the local log's folder is made (it was left behind).
    assert not (tmp_path / "log").exists()


def test_a_log_folder_that_cannot_be_made_once_the_kubeconfig_loaded_is_one_line(
    server: ApiServer, tmp_path: Path
) -> None:
    """The folder is made last, after the kubeconfig has loaded: the client opened for it is
    closed, so nothing but the one line is said."""
    kubeconfig = str(server.kubeconfig(tmp_path / "kubeconfig"))
    (tmp_path / "log").write_text("a file where the folder goes")
    proc = collect(tmp_path, "--kubeconfig", kubeconfig, "--max-scans", "1")
    assert (proc.returncode, proc.stderr) == (
        2, f"hami-usage collect: --log {tmp_path / 'log'}: not a directory\n"
    )  # fmt: skip


def test_more_label_keys_than_an_identity_carries_exit_2_with_one_line(
    server: ApiServer, tmp_path: Path
) -> None:
    """An identity carries at most MAX_LABELS labels (the aggregator refuses more as
    undecodable): a collector asked to copy more would have every pod's identity refused."""
    kubeconfig = str(server.kubeconfig(tmp_path / "kubeconfig"))
    keys = ",".join(f"k{i}" for i in range(MAX_LABELS + 1))
    proc = collect(tmp_path, "--kubeconfig", kubeconfig, "--pod-labels", keys, "--max-scans", "1")
    assert (proc.returncode, proc.stderr) == (2, (
        f"hami-usage collect: pod_labels and namespace_labels name more than {MAX_LABELS} "
        "label keys (a pod identity carries at most that many)\n"
    ))  # fmt: skip
    assert not (tmp_path / "log").exists()  # (it was made before the keys were checked)


@pytest.mark.parametrize("watch", [[], ["--no-kubernetes"]])
def test_a_name_that_is_no_label_key_is_refused_with_the_watch_off_too(
    tmp_path: Path, watch: list[str]
) -> None:
    """Outside a cluster (no kubeconfig: the watch is off by itself) or with the watch turned
    off, a wrong key was accepted without a word, where in a cluster it is refused."""
    proc = collect(tmp_path, *watch, "--max-scans", "1", HAMI_USAGE_POD_LABELS="a b")
    assert (proc.returncode, proc.stderr) == (2, "hami-usage collect: 'a b' is not a label key\n")
    assert not (tmp_path / "log").exists()


def test_kubeconfig_from_the_environment_and_no_kubernetes(
    server: ApiServer, tmp_path: Path
) -> None:
    pod = server.add_owned_pod("web", "DaemonSet", "agent", "agent-1", ["a"])
    new_cache_file(tmp_path / "root", pod["metadata"]["uid"], "a", V12, [SimDevice("GPU-a", GiB)])
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")

    def identities(proc: subprocess.CompletedProcess[str]) -> list[str]:
        assert proc.returncode == 0, proc.stderr
        records = LogReader(tmp_path / "log").read(0, 100_000)
        return [e.identity.pod for r in records for e in [decode(r.value)]
                if isinstance(e, PodIdentity)]  # fmt: skip

    # $KUBECONFIG is used when --kubeconfig is not given (scans wait for nothing: a few of them
    # pass before the list comes back; the last ones carry the name).
    assert "agent-1" in identities(
        collect(tmp_path, "--max-scans", "15", KUBECONFIG=str(kubeconfig))
    )
    shutil.rmtree(tmp_path / "log")
    asked = len(server.requests)
    off = collect(tmp_path, "--max-scans", "3", "--no-kubernetes", KUBECONFIG=str(kubeconfig))
    assert identities(off) == []
    assert len(server.requests) == asked  # not a single request
    shutil.rmtree(tmp_path / "log")
    # Neither a kubeconfig nor a cluster: off by itself, in one log line.
    alone = collect(tmp_path, "--max-scans", "2")
    assert identities(alone) == []
    assert "not in a cluster and no --kubeconfig or $KUBECONFIG: pod names are off" in alone.stderr


async def test_container_statuses_and_phase_reach_the_view(
    server: ApiServer, tmp_path: Path
) -> None:
    """Each container's state with its Kubernetes timestamps (init containers and native
    sidecars first), `lastState` and restart count, and the pod's phase."""
    pod = server.add_cronjob_pod("ml", "nightly-eval", ["eval", "log"], sidecars=("proxy",))
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        uid = pod["metadata"]["uid"]
        assert watch.view[uid].phase == "Running"
        assert watch.view[uid].runs == (
            Run("proxy", "running", "2026-11-30T10:00:03Z"),
            Run("eval", "running", "2026-11-30T10:00:05Z"),
            Run("log", "running", "2026-11-30T10:00:05Z"),
        )
        done = json.loads(json.dumps(pod))
        done["status"]["phase"] = "Succeeded"
        done["status"]["containerStatuses"][0]["state"] = {
            "terminated": {"exitCode": 0, "reason": "Completed",
                           "startedAt": "2026-11-30T10:00:05Z",
                           "finishedAt": "2026-11-30T10:00:13Z"}
        }  # fmt: skip
        done["status"]["containerStatuses"][1].update(
            restartCount=1,
            state={"waiting": {"reason": "CrashLoopBackOff"}},
            lastState={"terminated": {"exitCode": 1, "finishedAt": "2026-11-30T10:00:09Z"}},
        )
        done["status"]["initContainerStatuses"].insert(0,
            {"name": "init", "ready": False, "restartCount": 0, "image": "busybox",
             "state": {"terminated": {"exitCode": 0, "finishedAt": "2026-11-30T10:00:04Z"}}}
        )  # fmt: skip
        server.put_pod(done)
        await until(lambda: watch.view[uid].phase == "Succeeded")
        assert watch.view[uid].runs == (
            Run("init", "terminated", "", "2026-11-30T10:00:04Z"),
            Run("proxy", "running", "2026-11-30T10:00:03Z"),
            Run("eval", "terminated", "2026-11-30T10:00:05Z", "2026-11-30T10:00:13Z"),
            Run("log", "waiting", "", "", "2026-11-30T10:00:09Z", 1, last_terminated=True),
        )


async def test_a_null_time_in_a_container_status_is_unknown_not_an_error(
    server: ApiServer, tmp_path: Path
) -> None:
    """An evicted pod whose container the runtime lost: the API server writes its zero times
    as null. The list still syncs (the pod's run is known to be terminated, its times not),
    and pods after it are learnt."""
    evicted = make_pod("ml", "evicted", NODE, ["main"])
    evicted["status"].update(phase="Failed", reason="Evicted")
    evicted["status"]["containerStatuses"][0]["state"] = {
        "terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown",
                       "startedAt": None, "finishedAt": None}
    }  # fmt: skip
    evicted["status"]["containerStatuses"][0]["lastState"] = {
        "terminated": {"exitCode": 0, "startedAt": None, "finishedAt": None}
    }
    uid = server.put_pod(evicted)["metadata"]["uid"]
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        assert watch.view[uid].runs == (Run("main", "terminated", last_terminated=True),)
        later = server.put_pod(make_pod("ml", "later", NODE, ["main"]))["metadata"]["uid"]
        await until(lambda: later in watch.view)
        assert watch.stats.errors == 0


def _rbac_verb(path: str, query: dict[str, str]) -> tuple[str, str, str]:
    """(API group, resource, verb) of a request, as the API server's authorizer names it."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]  # a namespaced resource: /namespaces/NS/<resource>[/name]
    if len(rest) == 2:
        return group, rest[0], "get"
    return group, rest[0], "watch" if flag(query.get("watch")) else "list"


async def test_the_cluster_role_grants_exactly_what_the_watch_asks(
    server: ApiServer, tmp_path: Path
) -> None:
    """Least privilege, checked against the requests the real client makes: every (group,
    resource, verb) the watch and owner resolution use is granted, and nothing else is."""
    server.add_deployment_pod("ml", "trainer", ["main"])
    server.add_cronjob_pod("ml", "nightly-eval", ["eval"])
    async with watching(server, tmp_path) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        await until(lambda: len(server.watch_requests()) > 0)
    used = {_rbac_verb(r.path, r.query) for r in server.requests}
    assert used == {
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "namespaces", "get"),
        ("apps", "replicasets", "get"),
        ("batch", "jobs", "get"),
    }
    role = next(
        doc
        for doc in yaml.safe_load_all((ROOT / "deploy" / "collector-rbac.yaml").read_text())
        if doc["kind"] == "ClusterRole"
    )
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == used


def job_statuses(server: ApiServer) -> list[int]:
    return [r.status for r in server.requests if "/jobs/" in r.path]


@pytest.mark.parametrize("held", [True, False])
async def test_a_pod_deleted_before_its_owner_is_read_is_named_once_it_is(
    server: ApiServer, tmp_path: Path, held: bool
) -> None:
    """Deleted while its Job get hangs, or added and deleted in one batch of the watch: it kept
    the Job's name (and no namespace labels) for as long as a deleted pod is kept."""
    if held:
        server.held = {"jobs"}
        uid = server.add_cronjob_pod("ml", "nightly", ["eval"])["metadata"]["uid"]
    async with watching(server, tmp_path, request_timeout_s=60, batch_s=0.3) as watch:
        if held:
            await until(lambda: uid in watch.view and job_statuses(server) == [0])
            assert workload(watch, uid) == ("Job", "nightly-29412360")
        else:
            await asyncio.wait_for(watch.synced.wait(), 30)
            uid = server.add_cronjob_pod("ml", "nightly", ["eval"])["metadata"]["uid"]
        server.delete_pod(uid)
        await until(lambda: uid in watch.view and watch.view[uid].deleted)
        server.held = set()
        await until(lambda: workload(watch, uid) == ("CronJob", "nightly"))
        assert names(watch)[uid][4] == {"cost-center": "cc-17"}
        assert job_statuses(server) == [200]


@pytest.mark.parametrize("how", ["event-between", "deleted-while-away"])
async def test_a_pod_deleted_while_its_namespace_read_hangs_is_named_once_it_answers(
    server: ApiServer, tmp_path: Path, how: str
) -> None:
    """The read's answer was published only from the metadata the read began with: a pod with
    an event between (a status change, here a label) and then deleted, or deleted while the
    watch was away (a 410 and a list), kept its name without the namespace's labels for as
    long as a deleted pod is kept."""
    async with watching(server, tmp_path, request_timeout_s=60) as watch:
        await asyncio.wait_for(watch.synced.wait(), 30)
        server.held = {"namespaces"}
        pod = server.add_owned_pod(
            "ml", "StatefulSet", "db", "db-0", ["main"], labels={"team": "a"}
        )
        uid = pod["metadata"]["uid"]
        await until(lambda: uid in watch.view and namespace_gets(server) == [0])
        if how == "event-between":
            server.relabel(uid, team="b")
            await until(lambda: names(watch)[uid][4] == {"team": "b"})
            server.delete_pod(uid)
        else:
            lists = watch.stats.lists
            server.compact()
            server.delete_pod(uid)
            server.compact()
            server.drop_watches()
            await until(lambda: watch.stats.lists > lists)
        await until(lambda: watch.view[uid].deleted)
        server.held = set()
        team = "b" if how == "event-between" else "a"
        await until(lambda: names(watch)[uid][4] == {"cost-center": "cc-17", "team": team})
        assert names(watch)[uid][:4] == ("ml", "db-0", "StatefulSet", "db")
        assert not watch._gone_metas


def namespace_gets(server: ApiServer) -> list[int]:
    return [r.status for r in server.requests if r.path == "/api/v1/namespaces/ml"]


async def test_the_events_of_a_pod_whose_owner_read_hangs_share_one_task(
    server: ApiServer, tmp_path: Path
) -> None:
    server.held = {"jobs"}
    uid = server.add_cronjob_pod("ml", "nightly", ["eval"])["metadata"]["uid"]
    async with watching(server, tmp_path, request_timeout_s=60) as watch:
        await until(lambda: uid in watch.view)
        for i in range(50):
            server.relabel(uid, team=f"t{i}")
        await until(lambda: names(watch)[uid][4].get("team") == "t49")
        assert len(watch._resolving) == 1 and job_statuses(server) == [0]
        server.held = set()
        await until(lambda: workload(watch, uid) == ("CronJob", "nightly"))
        assert names(watch)[uid][4]["team"] == "t49"
