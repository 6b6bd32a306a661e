"""What one OTLP push costs per container series: collecting (the callbacks and the SDK's
aggregation), encoding and sending to an OTLP/HTTP receiver on loopback that reads each body
and answers 200.

    python bench/bench_otlp_push.py [--sizes 1000,10000,100000] [--pushes 3]

Prints, per size, the first push (it creates every series) and the median of the later ones,
in seconds and in µs per point (9 counters a container series).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from collector.aggregate.otlp import COUNTERS, OtlpExporter
from collector.aggregate.records import BillingRecord


class _Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _record(i: int) -> BillingRecord:
    one = Decimal("1.5")
    uid = f"{i:08d}-aaaa-bbbb-cccc-dddddddddddd"
    return BillingRecord(
        0, 60_000, "node-a", uid, "main", "GPU-3f1c2a8e-1111-2222-3333-444455556666",
        one, one, one, one, one, 1, Decimal(60), 60, f"{uid}/main/0", namespace="ns",
        pod=f"job-{i}", workload_kind="Job", workload=f"job-{i}", allocated_gpu_seconds=one,
        used_gpu_seconds=one, reserved_idle_gpu_seconds=one,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    print(f"{'series':>8} {'points':>8} {'first s':>8} {'later s':>8} {'us/point':>9}")
    for n in (int(s) for s in args.sizes.split(",")):
        exporter = OtlpExporter(endpoint, timeout_s=10, dedupe_capacity=0, max_series=n + 1)
        exporter.record_window([_record(i) for i in range(n)])
        took = []
        for _ in range(args.pushes):
            started = time.perf_counter()
            assert exporter.flush(), "a push failed"
            took.append(time.perf_counter() - started)
        later = statistics.median(took[1:]) if len(took) > 1 else took[0]
        points = n * len(COUNTERS)
        print(f"{n:>8} {points:>8} {took[0]:>8.2f} {later:>8.2f} {later / points * 1e6:>9.1f}")
        exporter.shutdown()
    server.shutdown()


if __name__ == "__main__":
    main()
