"""The part of the Kubernetes API objects the pod watch reads, decoded with msgspec.

Only these fields are decoded (unknown ones are skipped without building objects), which is what
keeps watch handling cheap: a real pod is 5-20 KB of JSON, mostly fields nobody here needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from ..events import Identity
from .allocation import Allocation

# A kind is a Go type's name; an object's name is at most a DNS subdomain's 253 characters,
# and a path segment (no '/', '%', never '.' or '..').
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")
_NAME_MAX = 253


class OwnerReference(msgspec.Struct, frozen=True, rename="camel"):
    kind: str = ""
    name: str = ""
    uid: str = ""
    controller: bool = False

    def names_an_object(self) -> bool:
        """Whether `kind` and `name` could be a real object's. The API server checks only that
        they are not empty, so whoever creates a pod can write anything there (a kind nothing
        resolves leaves the pod to run): a name of 300 characters made every heartbeat of its
        node undecodable, a newline forged log and CSV lines."""
        name = self.name
        return (
            _KIND.fullmatch(self.kind) is not None
            and 0 < len(name) <= _NAME_MAX
            and name.isprintable()
            and not any(c in name for c in " /%")
            and name not in (".", "..")
        )


class ObjectMeta(msgspec.Struct, frozen=True, rename="camel"):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resource_version: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    owner_references: list[OwnerReference] = []
    deletion_timestamp: str | None = None

    def controller(self) -> OwnerReference | None:
        """The managing owner (`controller: true`), else None. Other owner references (a
        ConfigMap, a PVC set as owner for garbage collection) do not manage the pod: such a pod
        is its own workload, not named after whichever of them happens to be listed first."""
        for ref in self.owner_references:
            if ref.controller:
                return ref
        return None


class ContainerSpec(msgspec.Struct, frozen=True):
    name: str = ""


class PodSpec(msgspec.Struct, frozen=True, rename="camel"):
    node_name: str = ""
    containers: list[ContainerSpec] = []


# The API server writes a zero time as null (an evicted container whose runtime lost it:
# `ContainerStatusUnknown` with `startedAt: null`): read as unknown (""), never a decode error,
# which would fail the whole list or watch stream it came in.
Time = str | None


class Running(msgspec.Struct, frozen=True, rename="camel"):
    started_at: Time = None


class Terminated(msgspec.Struct, frozen=True, rename="camel"):
    started_at: Time = None
    finished_at: Time = None
    exit_code: int = 0
    reason: str = ""


class Waiting(msgspec.Struct, frozen=True):
    reason: str = ""


class ContainerRunState(msgspec.Struct, frozen=True):
    """`state` of a container status: exactly one of running, waiting, terminated is set."""

    running: Running | None = None
    terminated: Terminated | None = None
    waiting: Waiting | None = None


class ContainerStatus(msgspec.Struct, frozen=True, rename="camel"):
    name: str = ""
    restart_count: int = 0
    state: ContainerRunState = ContainerRunState()
    last_state: ContainerRunState = ContainerRunState()

    def run(self) -> Run:
        state, last = self.state, self.last_state.terminated
        if state.running is not None:
            kind, started, finished = "running", state.running.started_at, None
        elif state.terminated is not None:
            kind, started = "terminated", state.terminated.started_at
            finished = state.terminated.finished_at
        else:
            kind, started, finished = ("waiting" if state.waiting is not None else ""), None, None
        last_finished = last.finished_at if last is not None else None
        return Run(self.name, kind, started or "", finished or "", last_finished or "",
                   self.restart_count, last is not None)  # fmt: skip


class PodStatus(msgspec.Struct, frozen=True, rename="camel"):
    phase: str = ""
    container_statuses: list[ContainerStatus] = []
    init_container_statuses: list[ContainerStatus] = []

    def runs(self) -> tuple[Run, ...]:
        """What the status says of each container, init containers (native sidecars among
        them) first."""
        return tuple(c.run() for c in (*self.init_container_statuses, *self.container_statuses))


class Pod(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: PodSpec = PodSpec()
    status: PodStatus = PodStatus()


class ListMeta(msgspec.Struct, frozen=True, rename="camel"):
    resource_version: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class PodList(msgspec.Struct, frozen=True):
    metadata: ListMeta = ListMeta()
    items: list[Pod] = []


class Object(msgspec.Struct, frozen=True):
    """An object of which only the metadata matters: a ReplicaSet or a Job (its owner), a
    Namespace (its labels), the object of a BOOKMARK (its resourceVersion)."""

    metadata: ObjectMeta = ObjectMeta()


class Status(msgspec.Struct, frozen=True):
    """The object of a watch ERROR event and the body of a failed request."""

    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct, frozen=True):
    type: str
    object: msgspec.Raw


@dataclass(frozen=True)
class Run:
    """One container's status: `state` is `running`, `terminated`, `waiting` or "" (none);
    times are Kubernetes' RFC 3339 text ("" when not given)."""

    container: str
    state: str
    started: str = ""  # state.running.startedAt (state.terminated.startedAt when terminated)
    finished: str = ""  # state.terminated.finishedAt
    last_finished: str = ""  # lastState.terminated.finishedAt: how the previous run ended
    restarts: int = 0
    # lastState.terminated is there, whatever its times (a run the runtime lost, e.g. at a
    # reboot, is `ContainerStatusUnknown` with null times behind a `waiting`)
    last_terminated: bool = False


@dataclass(frozen=True)
class PodView:
    identity: Identity
    containers: tuple[str, ...]  # spec.containers names, in order (the annotation's index)
    allocation: Allocation | None  # None: no annotation, or it does not parse
    allocation_error: str | None
    deleted: bool = False
    deleted_at: float = 0.0  # monotonic
    phase: str = ""
    runs: tuple[Run, ...] = ()  # the status of each container (spec and init)

    def run(self, container: str) -> Run | None:
        for r in self.runs:
            if r.container == container:
                return r
        return None


pod_decoder = msgspec.json.Decoder(Pod)
pod_list_decoder = msgspec.json.Decoder(PodList)
object_decoder = msgspec.json.Decoder(Object)
status_decoder = msgspec.json.Decoder(Status)
event_decoder = msgspec.json.Decoder(WatchEvent)
