"""What each replica's checkpoint keeps across the group: a replica's first start does not
forget the group's emitted windows, the Parquet part count survives a merge with commits
made before `parquet` was on, turning `parquet` on commits the part count at start, and a
replica's Parquet parts are told from another's whose instance begins with its own (real
files; the local log as the input)."""

from __future__ import annotations

import asyncio
import csv
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from streams import T0_MS, WINDOW, build, reference, write_local_log

from collector.aggregate.parquet import ParquetSink
from collector.aggregate.service import (
    AggregateSettings,
    Checkpoint,
    Outputs,
    merge_checkpoints,
    parse_checkpoint,
    run_local,
)
from collector.aggregate.windows import Aggregator
from collector.transport.locallog import LogReader

AT_T0 = Aggregator(WINDOW, emitted_until_ms=T0_MS)  # what its commits are of


def record_ids(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return [row["record_id"] for row in csv.DictReader(f)]


def test_a_replicas_first_start_keeps_the_groups_emitted_windows(tmp_path: Path) -> None:
    """Replica 0 drains the first half of the log; replica 1 starts for the first time (and
    stops at once), then drains the rest: it must not emit again a window replica 0 emitted."""
    msgs = build(tmp_path / "nodes", T0_MS)
    half = len(msgs) // 2
    log = tmp_path / "log"
    write_local_log(log, msgs[:half])

    def run(instance: str, out: Path, *, stop_at_once: bool = False) -> None:
        settings = AggregateSettings(
            window=WINDOW, kafka=None, topic="t", billing_topic="b", group="g", log_dir=log,
            csv=str(out), instance=instance, drain=True,
        )  # fmt: skip
        stopping = asyncio.Event()
        if stop_at_once:
            stopping.set()
        asyncio.run(run_local(settings, stopping))

    run("0", tmp_path / "0.csv")
    run("1", tmp_path / "1.csv", stop_at_once=True)  # its first start: commits where it stands
    write_local_log(log, msgs[half:])
    run("1", tmp_path / "1.csv")
    first, second = record_ids(tmp_path / "0.csv"), record_ids(tmp_path / "1.csv")
    assert first and second
    assert set(first).isdisjoint(second)
    # together they are the records of one uninterrupted run, but for the windows whose events
    # straddle the two halves (replica 0's drain closed them early: the rest came late)
    whole = {r.record_id for r in reference(msgs)}
    assert set(second) <= whole


def test_the_parquet_part_count_survives_a_merge_with_older_commits(tmp_path: Path) -> None:
    """Replica 0 turned `parquet` on; replica 1's commits still carry replica 0's lengths as
    [csv, jsonl]. Whatever order the merge sees them in, replica 0's part count stays, so its
    restart deletes the part it wrote after its last commit (the counterpart of cutting its
    CSV back)."""
    records = reference(build(tmp_path / "nodes", T0_MS))
    parts = tmp_path / "pq"
    before = Checkpoint(0, 0, 0, {"0": [0, 0], "1": [0, 0]})  # replica 0 without Parquet
    out = Outputs.open(str(tmp_path / "0.csv"), None, None, before, "0", str(parts))
    out.write(records[:50])
    own = out.checkpoint(AT_T0)
    out.write(records[50:])  # written, then a crash before its commit
    out.close_files()
    other = Checkpoint(T0_MS, 0, 0, {"0": [0, 0], "1": [500, 0]})
    assert own.replicas["0"][2] == 1
    for order in ([own, other], [other, own]):
        merged = merge_checkpoints(order)
        assert merged is not None
        assert merged.replicas == {"0": own.replicas["0"], "1": [500, 0]}
        assert merged.parquet_of("0") == 1
    again = Outputs.open(str(tmp_path / "0.csv"), None, None, merged, "0", str(parts))
    assert sorted(p.name for p in parts.rglob("*.parquet")) == ["part-0-0000000000.parquet"]
    again.close_files()


def test_an_output_left_out_of_a_run_keeps_what_was_committed_for_it(tmp_path: Path) -> None:
    """A run without `--csv` committed the CSV's length as 0, and the next run with it cut the
    file to nothing; a run without `parquet` dropped the part count, and another replica's
    older copy of it then made the restart with `parquet` delete committed parts."""
    records = reference(build(tmp_path / "nodes", T0_MS))
    csv_path, parts = tmp_path / "0.csv", tmp_path / "pq"
    out = Outputs.open(str(csv_path), None, None, None, "0", str(parts))
    out.write(records[:10])
    stale = out.checkpoint(AT_T0)  # what another replica goes on carrying for replica 0
    for i in range(1, 5):
        out.write(records[i * 10 : i * 10 + 10])
    first = out.checkpoint(AT_T0)
    out.close_files()
    size = csv_path.stat().st_size
    assert first.replicas["0"] == [size, -1, 5]  # -1: no JSONL ever written
    without = Outputs.open(None, None, None, first, "0", None)  # neither CSV nor Parquet
    second = without.checkpoint(AT_T0)
    assert second.replicas["0"] == [size, -1, 5]
    merged = merge_checkpoints([second, stale])
    assert merged is not None and merged.replicas["0"] == [size, -1, 5]
    again = Outputs.open(str(csv_path), str(tmp_path / "0.jsonl"), None, merged, "0", str(parts))
    assert csv_path.stat().st_size == size
    assert len(list(parts.rglob("*.parquet"))) == 5
    assert again.first_start  # the JSONL's length is committed at once
    assert again.checkpoint(AT_T0).replicas["0"] == [size, 0, 5]
    again.close_files()


@pytest.mark.parametrize(
    "older",
    [
        '{"emitted_until_ms": 1, "replicas": {"0": [0, 0]}}',  # per-replica lengths
        '{"emitted_until_ms": 1}',  # before them: csv_bytes and jsonl_bytes left out as 0
    ],
)
def test_a_checkpoint_of_an_older_release_cuts_no_file_it_did_not_write(
    tmp_path: Path, older: str
) -> None:
    """Releases before the -1 of an output never written committed 0 for an output left out
    of a run: the next run with it cut the file to nothing (a CSV of 60 records gone)."""
    records = reference(build(tmp_path / "nodes", T0_MS))
    csv_path, jsonl_path = tmp_path / "0.csv", tmp_path / "0.jsonl"
    out = Outputs.open(str(csv_path), str(jsonl_path), None, None, "0")
    out.write(records[:20])
    out.close_files()
    sizes = (csv_path.stat().st_size, jsonl_path.stat().st_size)
    again = Outputs.open(str(csv_path), str(jsonl_path), None, parse_checkpoint(older), "0")
    assert (csv_path.stat().st_size, jsonl_path.stat().st_size) == sizes
    assert again.first_start  # its lengths are committed at once
    again.write(records[20:30])
    again.close_files()
    assert record_ids(csv_path) == [r.record_id for r in records[:30]]
    assert len(jsonl_path.read_bytes().splitlines()) == 30
    # This release's commits say -1 for a file never written: a JSON Lines file committed at
    # 0 and written after its commit is cut back to 0 (those records are recomputed).
    current = Checkpoint(1, sizes[0], 0, {"0": [sizes[0], 0]}, WINDOW.window_ms)
    Outputs.open(str(csv_path), str(jsonl_path), None, current, "0").close_files()
    assert (csv_path.stat().st_size, jsonl_path.stat().st_size) == (sizes[0], 0)


def test_a_rewind_cuts_a_json_lines_file_committed_empty_back_to_empty(tmp_path: Path) -> None:
    """After a lost membership the files go back to the last commit, as a restart from it
    would: a JSON Lines file committed at 0 kept the aborted transaction's records (written
    again when those windows were recomputed)."""
    records = reference(build(tmp_path / "nodes", T0_MS))
    csv_path, jsonl_path = tmp_path / "0.csv", tmp_path / "0.jsonl"
    out = Outputs.open(str(csv_path), str(jsonl_path), None, None, "0")
    header = out.checkpoint(AT_T0).replicas["0"][0]
    out.committed()
    out.write(records[:20])
    out.rewind()
    out.close()
    assert (csv_path.stat().st_size, jsonl_path.stat().st_size) == (header, 0)


class Crash(Exception):
    """A stand-in for SIGKILL: the part is on disk, the commit never happens."""


def test_parquet_turned_on_later_writes_each_record_once_across_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica drains half the log with CSV only, then restarts with `parquet` on and dies
    after writing its first part, before that write's commit. The checkpoint it resumed from
    has CSV lengths but no part count: it must commit the part count at start, so the next
    restart deletes that part instead of writing its records again."""
    msgs = build(tmp_path / "nodes", T0_MS)
    half = len(msgs) // 2
    log, parts = tmp_path / "log", tmp_path / "pq"
    write_local_log(log, msgs[:half])

    def run(parquet: str | None) -> None:
        settings = AggregateSettings(
            window=WINDOW, kafka=None, topic="t", billing_topic="b", group="g", log_dir=log,
            csv=str(tmp_path / "b.csv"), parquet=parquet, drain=True,
        )  # fmt: skip
        asyncio.run(run_local(settings, asyncio.Event()))

    run(None)
    write_local_log(log, msgs[half:])
    real = LogReader.commit

    def commit(self: LogReader, group: str, position: int, meta: str = "") -> None:
        if any(parts.rglob("*.parquet")):
            raise Crash
        real(self, group, position, meta)

    with monkeypatch.context() as m:
        m.setattr(LogReader, "commit", commit)
        with pytest.raises(Crash):
            run(str(parts))
    assert [p.name for p in parts.rglob("*.parquet")] == ["part-0-0000000000.parquet"]
    run(str(parts))
    ids = [
        i
        for f in sorted(parts.rglob("*.parquet"))
        for i in pq.read_table(f, columns=["record_id"]).column("record_id").to_pylist()
    ]
    csv_ids = record_ids(tmp_path / "b.csv")
    assert len(ids) == len(set(ids)) == 52
    assert len(csv_ids) == len(set(csv_ids)) == 112
    # the second half's records, as the CSV file has them after its own cut back
    assert set(ids) <= set(csv_ids)


def test_a_replica_leaves_the_parts_of_one_whose_instance_it_begins(tmp_path: Path) -> None:
    """Replicas `a` and `a-b` share the folder. `a` restarting removes its own parts after its
    last commit and its own unfinished write, never `a-b`'s: `a-b`'s write in flight then
    finishes with its rename."""
    records = reference(build(tmp_path / "nodes", T0_MS))
    parts = tmp_path / "pq"
    other = ParquetSink(parts, instance="a-b", resume_at=0)
    other.write(records[:10])
    mine = ParquetSink(parts, instance="a", resume_at=0)
    mine.write(records[10:20])
    day = next(parts.glob("day=*"))
    theirs = day / "part-a-b-0000000001.parquet.tmp"  # a-b between its write and its rename
    theirs.write_bytes(b"being written")
    (day / "part-a-0000000001.parquet.tmp").write_bytes(b"a's write that never finished")
    ParquetSink(parts, instance="a", resume_at=0)  # a restarts: its commit said 0 parts
    assert sorted(f.name for f in day.iterdir()) == [
        "part-a-b-0000000000.parquet",
        "part-a-b-0000000001.parquet.tmp",
    ]
    theirs.rename(day / "part-a-b-0000000001.parquet")
    again = ParquetSink(parts, instance="a-b", resume_at=2)
    assert again.tell() == 2
    assert sorted(f.name for f in day.iterdir()) == [
        "part-a-b-0000000000.parquet",
        "part-a-b-0000000001.parquet",
    ]
