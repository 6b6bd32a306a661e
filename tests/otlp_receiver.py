"""A minimal OTLP/HTTP metrics receiver for tests: POST /v1/metrics, protobuf bodies.

Runs ``http.server`` on 127.0.0.1 (port 0) in a daemon thread, decodes each body (gzip/deflate
``Content-Encoding`` handled) as ``ExportMetricsServiceRequest`` and keeps it. Answers 200 with
an empty ``ExportMetricsServiceResponse`` unless told to fail (``fail_status``; a 3xx with
``Location: /moved``), to stall (``delay_s``) or to send its answer a byte at a time
(``dribble_s`` between bytes of a ``dribble_bytes``-byte body). A body over ``max_body`` bytes
is answered 413, as the OpenTelemetry Collector answers one over its `max_request_body_size`.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

Attrs = frozenset[tuple[str, Any]]


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(any_value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return attrs(v.kvlist_value.values)
    return getattr(v, kind)


def attrs(kvs: Any) -> Attrs:
    """Protobuf ``repeated KeyValue`` -> frozenset of (key, python value)."""
    out: list[tuple[str, Any]] = []
    for kv in kvs:
        assert isinstance(kv, KeyValue)
        out.append((kv.key, any_value(kv.value)))
    return frozenset(out)


@dataclass
class MetricView:
    """One metric of one request, flattened."""

    name: str
    unit: str
    kind: str  # "sum", "gauge", ...
    is_monotonic: bool | None
    temporality: int | None
    points: dict[Attrs, float | int]
    start_times: dict[Attrs, int] = field(default_factory=dict)
    times: dict[Attrs, int] = field(default_factory=dict)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    request: ExportMetricsServiceRequest

    def resource_attributes(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for rm in self.request.resource_metrics:
            out.update(dict(attrs(rm.resource.attributes)))
        return out

    def metrics(self) -> dict[str, MetricView]:
        """name -> metric (a name must occur once per request)."""
        out: dict[str, MetricView] = {}
        for rm in self.request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    assert m.name not in out, f"metric {m.name} twice in one request"
                    kind = m.WhichOneof("data")
                    assert kind is not None
                    data = getattr(m, kind)
                    view = MetricView(
                        name=m.name,
                        unit=m.unit,
                        kind=kind,
                        is_monotonic=getattr(data, "is_monotonic", None),
                        temporality=getattr(data, "aggregation_temporality", None),
                        points={},
                    )
                    for p in data.data_points:
                        key = attrs(p.attributes)
                        assert key not in view.points, f"{m.name}: attribute set twice"
                        value_kind = p.WhichOneof("value")
                        view.points[key] = getattr(p, value_kind)
                        view.start_times[key] = p.start_time_unix_nano
                        view.times[key] = p.time_unix_nano
                    out[m.name] = view
        return out


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self._cond = threading.Condition(self._lock)
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.dribble_s = 0.0
        self.dribble_bytes = 40
        self.max_body: int | None = None
        # Answer 200 with OTLP's partial_success: (rejected points, message) per request.
        self.partial: tuple[int, str] | None = None
        self.attempts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.attempts += 1
                    delay, fail = receiver.delay_s, receiver.fail_status
                if delay:
                    time.sleep(delay)
                if self.path != "/v1/metrics":
                    self._answer(404, b"")
                    return
                if fail is not None:
                    self._answer(fail, b"")
                    return
                if receiver.max_body is not None and length > receiver.max_body:
                    self._answer(413, b"")
                    return
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                with receiver._cond:
                    receiver._received.append(
                        Received(
                            self.path, {k.lower(): v for k, v in self.headers.items()}, request
                        )
                    )
                    receiver._cond.notify_all()
                if receiver.dribble_s:
                    self._answer(200, b"\n" * receiver.dribble_bytes, receiver.dribble_s)
                    return
                answer = ExportMetricsServiceResponse()
                if receiver.partial is not None:
                    answer.partial_success.rejected_data_points = receiver.partial[0]
                    answer.partial_success.error_message = receiver.partial[1]
                self._answer(200, answer.SerializeToString())

            def _answer(self, status: int, body: bytes, dribble_s: float = 0.0) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(body)))
                    if 300 <= status < 400:
                        self.send_header("Location", "/moved")
                    self.end_headers()
                    if not dribble_s:
                        self.wfile.write(body)
                    for i in range(len(body) if dribble_s else 0):
                        self.wfile.write(body[i : i + 1])
                        self.wfile.flush()
                        time.sleep(dribble_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-receiver",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def wait_for(self, count: int, timeout_s: float = 5.0) -> list[Received]:
        with self._cond:
            self._cond.wait_for(lambda: len(self._received) >= count, timeout_s)
            return list(self._received)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
