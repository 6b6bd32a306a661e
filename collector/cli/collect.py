"""`hami-usage collect`: the node collector's flags, settings and start-up checks."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .. import settings_check as check
from ..config import CollectConfig
from ..events import MAX_LABELS
from ..transport.locallog import LogOpenError
from .args import Command, UsageError, say, switch
from .kafka import KAFKA_FLAGS, kafka_flags, kafka_security, start_logging
from .settings import listener, load_settings, machine
from .topics import topic_plan

if TYPE_CHECKING:
    from ..node.podwatch import KubeSettings

# The CollectConfig fields with a flag: `load_settings` takes these from the command line.
COLLECT_FLAGS = [
    "root",
    "node",
    "kafka",
    "topic",
    "log",
    "log_max_bytes",
    "fsync",
    "interval",
    "heartbeat",
    "host_proc",
    "presence",
    "linger_ms",
    "compression",
    "max_scans",
    "nvml",
    "nvml_timeout",
    "drift_tolerance_bytes",
    "drift_tolerance_ratio",
    "metrics_port",
    "metrics_bind_address",
    "metrics_hami",
    "metrics_hami_legacy",
    "dir_max_entries",
    "dir_relist",
    "listing_budget",
    "open_files",
    "stuck_seqlock_after",
    "kubernetes",
    "kubeconfig",
    "pod_labels",
    "namespace_labels",
    "kube_backoff_max",
    "kube_watch_timeout",
    *KAFKA_FLAGS,
]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file; settings in its [collect] table")
    p.add_argument(
        "--root", help="folder of <podUID>_<container>/ (default /usr/local/vgpu/containers)"
    )
    p.add_argument("--node", help="node name, the Kafka key (default $NODE_NAME, else host name)")
    p.add_argument(
        "--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers; default: no broker"
    )
    p.add_argument("--topic", help="usage topic (default hami.usage.v1)")
    p.add_argument(
        "--log",
        metavar="DIR",
        help="local log: the events with no broker, the spool "
        "with --kafka (default /var/lib/hami-usage/events)",
    )
    p.add_argument("--log-max-bytes", type=int, help="bound of the local log (default 256 MiB)")
    switch(p, "--fsync", "fsync the log every scan", negatable=False)
    p.add_argument("--interval", type=float, help="seconds between scans (default 1)")
    p.add_argument("--heartbeat", type=float, help="seconds between heartbeats (default 30)")
    p.add_argument(
        "--host-proc",
        metavar="DIR",
        help="the host's /proc (hostPID): report stale_process for slots whose host pid is gone",
    )
    p.add_argument(
        "--presence",
        metavar="{folder,processes}",
        help="a container is present (its limits billed) while its folder exists, or while it "
        "has a live process (default folder)",
    )
    p.add_argument("--linger-ms", type=int, help="Kafka producer linger (default 50)")
    p.add_argument("--compression", help="Kafka producer compression (default gzip)")
    p.add_argument("--max-scans", type=int, help="stop after this many scans")
    switch(
        p, "--nvml", "NVML inventory and cross-check (default on; off by itself without a driver)"
    )
    p.add_argument(
        "--nvml-timeout", type=float, help="bound on one interval's NVML calls (default 2 s)"
    )
    p.add_argument(
        "--drift-tolerance-bytes",
        type=int,
        help="accounting_drift beyond max(this, ratio x NVML) (default 64 MiB)",
    )
    p.add_argument("--drift-tolerance-ratio", type=float, help="see above (default 0.05)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics (hami_usage_* names) and /healthz on this port; "
        "default off",
    )
    p.add_argument(
        "--metrics-bind-address",
        metavar="ADDRESS",
        help="address the metrics port listens on (default 0.0.0.0)",
    )
    switch(
        p,
        "--metrics-hami",
        "also serve HAMi's vGPU monitor metrics (names, labels) to replace its monitor",
    )
    switch(
        p,
        "--metrics-hami-legacy",
        "also serve the metric names HAMi's monitor used before it renamed them",
    )
    p.add_argument(
        "--dir-max-entries",
        type=int,
        help="a container folder with more entries is listed at most once per --dir-relist "
        "seconds, and reported (default 1000)",
    )
    p.add_argument("--dir-relist", type=float, help="see above (default 60 s)")
    p.add_argument(
        "--listing-budget",
        type=float,
        help="seconds of folder listing per scan; the rest waits for the next (default 0.2)",
    )
    p.add_argument(
        "--open-files",
        type=int,
        help="descriptors of container folders and cache files kept open across scans "
        "(default 16384; 0: open and close each file every scan)",
    )
    p.add_argument(
        "--stuck-seqlock-after",
        type=float,
        help="a slot whose seqlock stays odd and its bytes unchanged on two scans this far "
        "apart is read as it stands, with a stuck_seqlock anomaly (default 0: two scans)",
    )
    switch(
        p,
        "--kubernetes",
        "watch this node's pods for names, workloads and labels (default on; off by itself "
        "outside a cluster without a kubeconfig)",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig to use (default $KUBECONFIG, else the in-cluster service account)",
    )
    p.add_argument(
        "--pod-labels",
        type=_names,
        metavar="KEY,...",
        help="pod labels to copy into the records, e.g. team,cost-center",
    )
    p.add_argument(
        "--namespace-labels", type=_names, metavar="KEY,...", help="namespace labels likewise"
    )
    p.add_argument(
        "--kube-backoff-max", type=float, help="longest wait between API retries (default 30 s)"
    )
    p.add_argument(
        "--kube-watch-timeout", type=int, help="seconds of one watch request (default 300)"
    )
    kafka_flags(p)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import socket

    from ..node.crosscheck import DriftTolerance
    from ..node.discover import ListingLimits
    from ..node.podwatch import KubeConfigError
    from ..node.service import CollectSettings, collect
    from ..node.writer_faults import WriterFaultSettings
    from ..transport.http import ListenError
    from ..transport.kafka import ProducerSettings

    cfg = load_settings(args, CollectConfig, "collect", COLLECT_FLAGS)
    root = Path(cfg.root)
    # (an empty $NODE_NAME, a fieldRef gone wrong, is refused: not taken for the host name)
    env_node = os.environ.get("NODE_NAME")
    node = cfg.node or (env_node if env_node is not None else socket.gethostname())
    # What needs nothing made first is checked first: a refused run leaves no --log behind.
    with machine("collect"):
        try:
            check.node_name("node", node)
        except ValueError as exc:
            raise check.SettingError(f"{exc} (from $NODE_NAME or the host name)") from None
    security = kafka_security(cfg, "collect")  # (checked even when no broker is given)
    usage = topic_plan(args, "collect", cfg.topic, "").usage() if cfg.kafka else None
    with machine("collect"):
        check.cache_root("--root", cfg.root)
        if cfg.host_proc is not None and not os.path.isdir(cfg.host_proc):
            raise check.SettingError(f"--host-proc {cfg.host_proc}: not a directory")
        if cfg.kafka:
            check.compression_available("--compression", cfg.compression)
        # The collector never writes below the root: its spool there would sit among the
        # containers' folders (HAMi's, and read as one of them).
        check.outside_folder([("--log", cfg.log)], "--root", cfg.root)
    listener("collect", "--metrics-port", cfg.metrics_bind_address, cfg.metrics_port)
    kube = _kube(cfg)
    kafka = None
    if cfg.kafka and usage is not None:
        kafka = ProducerSettings(
            cfg.kafka,
            topic=cfg.topic,
            linger_ms=cfg.linger_ms,
            compression=cfg.compression,
            security=security,
            expect=(usage,),
        )
    settings = CollectSettings(
        root=root,
        node=node,
        log_dir=Path(cfg.log),
        kafka=kafka,
        interval_s=cfg.interval,
        heartbeat_s=cfg.heartbeat,
        host_proc=cfg.host_proc,
        presence=cfg.presence,
        log_max_bytes=cfg.log_max_bytes,
        fsync=cfg.fsync,
        max_scans=cfg.max_scans,
        nvml=cfg.nvml,
        nvml_timeout_s=cfg.nvml_timeout,
        drift=DriftTolerance(cfg.drift_tolerance_bytes, cfg.drift_tolerance_ratio),
        metrics_port=cfg.metrics_port,
        metrics_bind_address=cfg.metrics_bind_address,
        metrics_hami=cfg.metrics_hami,
        metrics_hami_legacy=cfg.metrics_hami_legacy,
        listing=ListingLimits(
            cfg.dir_max_entries, cfg.dir_relist, cfg.listing_budget, cfg.open_files
        ),
        writer_faults=WriterFaultSettings(cfg.stuck_seqlock_after),
        kube=kube,
    )

    def make_log_dir() -> None:  # the last check: the kubeconfig loads before it
        with machine("collect"):
            check.writable_dir("--log", cfg.log)

    if kube is None:
        make_log_dir()
    start_logging(logging.INFO)
    if cfg.kubernetes and settings.kube is None:
        logging.getLogger("collector.node.podwatch").info(
            "not in a cluster and no --kubeconfig or $KUBECONFIG: pod names are off"
        )
    try:
        asyncio.run(collect(settings, None if kube is None else make_log_dir))
    except KubeConfigError as exc:
        raise UsageError(f"hami-usage collect: {exc}") from None
    except LogOpenError as exc:
        say(f"hami-usage collect: {exc}")
        return 1
    except ListenError as exc:
        raise UsageError(f"hami-usage collect: --metrics-port {exc}") from None
    return 0


def _kube(cfg: CollectConfig) -> KubeSettings | None:
    """The pod watch's settings; None when it is off or there is nothing to connect with."""
    import os

    from ..node.podwatch import KubeSettings

    # (checked with the watch off too: a name that can be no label's is a wrong setting)
    for name in (*cfg.pod_labels, *cfg.namespace_labels):
        if not check.label_key(name):
            raise UsageError(f"hami-usage collect: {name!r} is not a label key")
    if len({*cfg.pod_labels, *cfg.namespace_labels}) > MAX_LABELS:
        raise UsageError(
            f"hami-usage collect: pod_labels and namespace_labels name more than {MAX_LABELS} "
            "label keys (a pod identity carries at most that many)"
        )
    if not cfg.kubernetes:
        return None
    kubeconfig = cfg.kubeconfig or os.environ.get("KUBECONFIG") or None
    if kubeconfig is not None:
        kubeconfig = kubeconfig.split(os.pathsep)[0]  # kubectl merges a list; the first here
        if not Path(kubeconfig).is_file():
            raise UsageError(f"hami-usage collect: --kubeconfig {kubeconfig}: no such file")
    elif not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    return KubeSettings(
        kubeconfig=kubeconfig,
        pod_labels=tuple(cfg.pod_labels),
        namespace_labels=tuple(cfg.namespace_labels),
        backoff_max_s=cfg.kube_backoff_max,
        backoff_initial_s=min(0.5, cfg.kube_backoff_max),
        watch_timeout_s=cfg.kube_watch_timeout,
    )


COMMAND = Command(
    "collect", "node collector: cache files -> events (local log, Kafka)", _arguments, _run
)
