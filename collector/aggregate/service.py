"""`hami-usage aggregate`: events -> windows -> billing records, exactly once.

One `Aggregator` per source partition (watermarks are per partition, and a node's events all
live in one). After windows close, the records go out and the input position is committed in
one step:

* Kafka: records to the billing topic and the consumer offsets in **one transaction**. The
  committed offset is the earliest event still needed by an open window (not the position), and
  its metadata holds the end of the last emitted window plus the lengths of the file outputs.
  A restart re-reads from there, rebuilds the open windows and suppresses those already emitted.
* Local log: the same checkpoint in the log's consumer-checkpoint file (atomic rename).

File outputs are written and flushed before the commit; on restart they are truncated back to
the committed lengths, so a crash between the two leaves no duplicate lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from ..transport.locallog import CorruptCheckpointError, LogReader, ReaderStats, group_lock
from ..transport.locallog.checkpoint import checkpoint_path
from ..transport.security import KafkaSecurity
from .billing import Format, billing_message
from .damage import CheckpointError, DamageReport
from .health import HealthServer, Liveness
from .intake import InputStats, add_record
from .records import LAST_MS, BillingRecord, iso_utc, record_order
from .silence import Silence
from .sinks import CsvSink, JsonlSink
from .tally import Tally
from .windows import AggregateStats, Aggregator, WindowSettings

if TYPE_CHECKING:
    from ..transport.topics import TopicSpec
    from .otlp import OtlpExporter
    from .parquet import ParquetSink

HEALTH_STALE_AFTER_S = 60.0  # longest the input loop may stay away before /healthz says 503

log = logging.getLogger(__name__)

COMMIT_INTERVAL_S = 5.0
CHECKPOINT_WAIT_S = 120.0  # longest wait for a complete and stable checkpoint (committed_offsets)


# In a replica's committed lengths: an output it has never written (not configured). An output
# not configured in one run keeps what was committed for it before (a run without --csv
# committed its length as 0, and the next run with it cut the file to nothing).
NEVER_WRITTEN: Final = -1
# What a checkpoint may hold: a time a record can name, a length or count of a file (or
# NEVER_WRITTEN). A value past them is not this aggregator's (a hand-edited or damaged file): it
# is refused as unreadable, not carried into a traceback when the files are cut or the time
# is said.
_Time = Annotated[int, msgspec.Meta(ge=0, le=LAST_MS)]
_Length = Annotated[int, msgspec.Meta(ge=NEVER_WRITTEN, le=2**62)]


class Checkpoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """Commit metadata: end of the last emitted window and file-output lengths at that point:
    the committing replica's in `csv_bytes`/`jsonl_bytes`, every replica's (by `instance`) in
    `replicas` as [csv_bytes, jsonl_bytes] or, with a Parquet sink, [csv_bytes, jsonl_bytes,
    parquet_parts] (see `replicas`). A checkpoint without `replicas`
    was written before there were per-replica lengths: its lengths are the one replica's."""

    emitted_until_ms: _Time = 0
    csv_bytes: _Length = 0
    jsonl_bytes: _Length = 0
    replicas: dict[str, list[_Length]] = {}
    window_ms: _Time = 0  # the window size of the records emitted (0: not recorded)

    def lengths_of(self, instance: str) -> tuple[int | None, int | None] | None:
        """The committed file lengths of replica `instance` (None for a file it never wrote);
        None if it never committed.

        Releases before NEVER_WRITTEN committed 0 for an output not configured, and the next
        run with it cut the file to nothing. Their checkpoints have no window size (recorded
        since a later release): in one of those a file at 0 is never written. A CSV sink
        writes its header as it opens, so none of them had written a CSV committed at 0; a JSON
        Lines file they had written and not yet committed past 0 is kept, not cut."""
        if not self.replicas:
            csv, jsonl = self.csv_bytes, self.jsonl_bytes
        elif (mine := self.replicas.get(instance)) is not None and len(mine) >= 2:
            csv, jsonl = mine[0], mine[1]
        else:
            return None
        older = not self.window_ms
        return (
            None if csv == 0 and older else _written(csv),
            None if jsonl == 0 and older else _written(jsonl),
        )

    def parquet_of(self, instance: str) -> int | None:
        """The committed Parquet part count of replica `instance`; None if it has none."""
        mine = self.replicas.get(instance)
        return _written(mine[2]) if mine is not None and len(mine) >= 3 else None


def _written(length: int) -> int | None:
    return None if length == NEVER_WRITTEN else length


def parse_checkpoint(text: str | None, where: str = "checkpoint") -> Checkpoint:
    """The commit metadata; CheckpointError when it is not ours: resuming without knowing what
    was emitted and how long the files were would bill windows twice."""
    if not text:
        return Checkpoint()
    try:
        return msgspec.json.decode(text, type=Checkpoint)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"{where}: unreadable metadata {text[:80]!r}: {exc}") from None
    except msgspec.DecodeError:
        raise CheckpointError(f"{where}: unreadable metadata {text[:80]!r}") from None


def check_window(checkpoint: Checkpoint, window_ms: int, where: str) -> None:
    """CheckpointError when this run's windows would overlap the windows already emitted: the
    first one ending past the emitted end would bill again what the windows up to that end
    billed. An emitted end is a boundary of the windows that emitted it, so a size with a
    boundary there too (60 s after 300 s; 300 s after 60 s when the end is on a 5-minute mark)
    takes over from it exactly, and one without would overlap, whatever size is recorded
    (checkpoints written before the size was recorded have none)."""
    end = checkpoint.emitted_until_ms
    if end % window_ms == 0:
        return
    old = checkpoint.window_ms
    sizes = f"{old / 1000:g} s windows" if old else "windows of another size"
    start = end - end % window_ms
    keep = f"keep --window {old / 1000:g}" if old else "keep the window size it was written with"
    raise CheckpointError(
        f"{where} was written with {sizes}, emitted up to {iso_utc(end)}; --window "
        f"{window_ms / 1000:g} would bill {iso_utc(start)} to {iso_utc(end)} again: {keep}, or "
        "start the new size in a new --group"
    )


def _longest(a: list[int] | None, b: list[int]) -> list[int]:
    """Position by position the larger; a position only one list has (the Parquet part count
    of a replica that added `parquet` since the other was committed) is kept."""
    if a is None:
        return b
    return [max(x, y) for x, y in zip_longest(a, b, fillvalue=0)]


def merge_checkpoints(checkpoints: Iterable[Checkpoint]) -> Checkpoint | None:
    """One view of the checkpoints of several partitions: per replica the longest committed
    lengths (a replica's files only grow between the cuts back to its own committed length,
    so the longest is its last commit), the latest emitted window. None if there are none.

    File outputs with several replicas: each replica writes its own files and every commit
    carries every replica's lengths as last seen, so a replica that restarts, or gets
    partitions another replica committed, cuts its files back to its own last commit - never
    to another replica's length."""
    merged: Checkpoint | None = None
    for cp in checkpoints:
        if merged is None:
            merged = cp
            continue
        replicas = dict(merged.replicas)
        for instance, lengths in cp.replicas.items():
            replicas[instance] = _longest(replicas.get(instance), lengths)
        merged = Checkpoint(
            max(merged.emitted_until_ms, cp.emitted_until_ms),
            max(merged.csv_bytes, cp.csv_bytes),
            max(merged.jsonl_bytes, cp.jsonl_bytes),
            replicas,
            cp.window_ms or merged.window_ms,
        )
    return merged


@dataclass
class Outputs:
    """Where closed windows go besides the billing topic: files and OTLP."""

    csv: CsvSink | None = None
    jsonl: JsonlSink | None = None
    parquet: ParquetSink | None = None  # imported only when used: pyarrow is an extra
    otlp: OtlpExporter | None = None  # imported only when used: opentelemetry is slow to load
    written: int = 0
    instance: str = "0"
    # every replica's committed lengths, as last seen; this replica's are updated at commits
    replicas: dict[str, list[int]] = field(default_factory=dict)
    # this replica never committed its lengths (or, with --parquet, its part count): commit
    # them at once
    first_start: bool = False
    # the last commit (its checkpoint, to cut back to) and the records written by then:
    # `rewind` goes back to it
    kept: tuple[Checkpoint | None, int] = (None, 0)
    window_ms: int = 0  # of the records of the last checkpoint

    @classmethod
    def open(
        cls,
        csv: str | None,
        jsonl: str | None,
        otlp: str | None,
        resume: Checkpoint | None,
        instance: str = "0",
        parquet: str | None = None,
    ) -> Outputs:
        """resume: the last committed checkpoint; files are cut back to this replica's lengths
        in it. None (no checkpoint yet), or none of this replica's in it: files are appended
        to as they are."""
        out = cls(instance=instance)
        out.open_files(csv, jsonl, resume, parquet)
        out.kept = resume, 0
        if otlp:
            from .otlp import OtlpExporter

            out.otlp = OtlpExporter(otlp)
        return out

    def open_files(
        self,
        csv: str | None,
        jsonl: str | None,
        resume: Checkpoint | None,
        parquet: str | None = None,
    ) -> None:
        lengths = resume.lengths_of(self.instance) if resume is not None else None
        self.replicas = dict(resume.replicas) if resume is not None else {}
        self.first_start = lengths is None
        if csv:
            at = lengths[0] if lengths else None
            self.csv = CsvSink(Path(csv), resume_at=at)
            self.first_start = self.first_start or at is None  # (first written this run)
        if jsonl:
            at = lengths[1] if lengths else None
            self.jsonl = JsonlSink(Path(jsonl), resume_at=at)
            self.first_start = self.first_start or at is None
        if parquet:
            from .parquet import ParquetSink

            parts = resume.parquet_of(self.instance) if resume is not None else None
            self.parquet = ParquetSink(parquet, instance=self.instance, resume_at=parts)
            # --parquet turned on for a replica that committed without it: its first start
            # as far as Parquet goes; commit the part count now, or a crash before the next
            # commit would leave parts that the restart writes again
            self.first_start = self.first_start or parts is None

    def learn(self, checkpoint: Checkpoint) -> None:
        """Carry the other replicas' committed lengths forward (see `merge_checkpoints`)."""
        for instance, lengths in checkpoint.replicas.items():
            if instance != self.instance:
                self.replicas[instance] = _longest(self.replicas.get(instance), lengths)

    def close_files(self) -> None:
        """Every file is closed, even after one could not be (its buffer not written: a full
        disk); the first failure is raised."""
        failure: OutputError | None = None
        for sink in (self.csv, self.jsonl, self.parquet):
            if sink is not None:
                try:
                    sink.close()
                except OSError as exc:
                    failure = failure or cannot_write(sink.path, exc)
        self.csv = self.jsonl = self.parquet = None
        if failure is not None:
            raise failure

    def committed(self) -> None:
        """The transaction with this replica's lengths (`checkpoint`) has committed."""
        if self.instance in self.replicas:
            # (with this run's window size: a checkpoint of this release, whose 0 is a length)
            kept = Checkpoint(replicas=dict(self.replicas), window_ms=self.window_ms)
            self.kept = kept, self.written
            self.first_start = False

    def rewind(self) -> None:
        """Back to the last commit, after a transaction that failed once the files were
        written: each file cut back to its length then, as a restart would cut it."""
        resume, self.written = self.kept
        paths = [None if s is None else str(s.path) for s in (self.csv, self.jsonl, self.parquet)]
        self.close_files()
        self.open_files(paths[0], paths[1], resume, paths[2])

    def write(self, records: list[BillingRecord]) -> None:
        for sink in (self.csv, self.jsonl, self.parquet):
            if sink is not None:
                try:
                    sink.write(records)
                    sink.flush()
                except OSError as exc:  # a full disk, a file where a day folder goes
                    raise cannot_write(exc.filename or sink.path, exc) from None
        self.written += len(records)

    def export(self, records: list[BillingRecord], aggregators: Iterable[Aggregator]) -> None:
        """OTLP is best effort (metrics, not the record of truth); failures are counted there.
        The push runs on a thread of its own: nothing here waits for the collector."""
        if self.otlp is None:
            return
        if records:
            self.otlp.record_window(records)
        self.gauges(aggregators)
        self.otlp.push()

    def gauges(self, aggregators: Iterable[Aggregator]) -> None:
        """The gauges the next push sends: those of `aggregators`, the partitions held now."""
        if self.otlp is not None:
            self.otlp.set_gauges([g for agg in aggregators for g in agg.gauges()])

    def checkpoint(self, agg: Aggregator) -> Checkpoint:
        """The commit metadata of `agg`: its emitted end and window size, this replica's
        lengths now, an output not open in this run keeping the value last committed for it
        (NEVER_WRITTEN if none)."""
        was = self.replicas.get(self.instance, [])
        mine = [
            sink.tell() if sink is not None else was[i] if i < len(was) else NEVER_WRITTEN
            for i, sink in enumerate((self.csv, self.jsonl, self.parquet))
        ]
        if self.parquet is None and len(was) < 3:
            del mine[2]  # (never written with --parquet: no part count)
        self.replicas[self.instance] = mine
        self.window_ms = agg.settings.window_ms
        return Checkpoint(
            agg.emitted_until_ms,
            max(mine[0], 0),
            max(mine[1], 0),
            dict(self.replicas),
            agg.settings.window_ms,
        )

    def close(self, after_error: bool = False) -> None:
        """A file that cannot be closed (a full disk refused its buffer) is OutputError, unless
        `after_error`: the error already on its way out says what failed first (most likely
        this same disk), and raising here would replace it."""
        try:
            self.close_files()
        except OutputError:
            if not after_error:
                raise
        finally:
            if self.otlp is not None:
                self.otlp.shutdown()


@dataclass
class AggregateSettings:
    window: WindowSettings
    kafka: str | None
    topic: str
    billing_topic: str
    group: str
    log_dir: Path
    csv: str | None = None
    jsonl: str | None = None
    parquet: str | None = None
    otlp: str | None = None
    drain: bool = False
    instance: str = "0"
    start_timeout_s: float = 60.0
    stats: InputStats = field(default_factory=InputStats)
    drained: bool = False  # --drain read to the end (not stopped by a signal first)
    health_port: int | None = None  # /healthz; None: off
    health_bind_address: str = "0.0.0.0"
    liveness: Liveness = field(default_factory=Liveness)
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    billing_format: Format = "json"
    # Where a group with no committed offset starts: "earliest", "latest" or a time (unix ms).
    start_from: str | int = "earliest"
    # Checked at start (a warning per difference), when given.
    topics: list[TopicSpec] = field(default_factory=list)
    checkpoint_wait_s: float = CHECKPOINT_WAIT_S  # see committed_offsets


class DamageWatch:
    """Logs the damage summary whenever it grows (a live service never exits to say it), each
    node-name conflict the aggregators find, and each node the first time an event of it is
    refused as too far ahead."""

    def __init__(self, damage: DamageReport, max_skew_ms: int = 0) -> None:
        self.damage = damage
        self._said = damage.counts()
        self._max_skew_ms = max_skew_ms
        self._ahead: set[str] = set()  # nodes said to be ahead

    def check(self, aggregators: Iterable[Aggregator]) -> None:
        counts = self.damage.counts()
        if counts != self._said:
            self._said = counts
            log.warning("input damaged: %s", self.damage.line())
        for agg in aggregators:
            for conflict in agg.conflicts():
                log.warning("%s", conflict.line())
            self._future(agg.future_by_node)

    def _future(self, by_node: Mapping[str, int]) -> None:
        for node in by_node.keys() - self._ahead:
            self._ahead.add(node)
            log.warning(
                "node %s: event refused, its time more than max_skew (%d ms) after its record "
                "time (its clock runs ahead?); counted per node in future_events",
                node,
                self._max_skew_ms,
            )


def _sorted(records: Iterable[BillingRecord]) -> list[BillingRecord]:
    return sorted(records, key=record_order)


# nodes named beside future_events in the summary line; the others are counted together
FUTURE_NODES_SHOWN: Final = 5


def report(
    command: str,
    read: InputStats,
    stats: Iterable[AggregateStats],
    future_by_node: Mapping[str, int],
    written: int,
    otlp: OtlpExporter | None = None,
) -> str:
    """The summary line: what the aggregators counted (see `Tally`: each record and window
    once), the damage, and what the OTLP exporter counted once it has pushed for the last time."""
    totals: dict[str, int] = {}
    for st in stats:
        for name in st.__struct_fields__:
            totals[name] = totals.get(name, 0) + int(getattr(st, name))
    parts = [f"{written} records"]
    for k, v in sorted(totals.items()):
        if v:
            by_node = _by_node(future_by_node) if k == "future_events" else ""
            parts.append(f"{k}={v}{by_node}")
    if read.undecodable or read.unknown_schema:
        parts.append(f"undecodable={read.undecodable} unknown_schema={read.unknown_schema}")
    line = f"{command}: " + " ".join(parts) + "; " + read.damage.line()
    return line if otlp is None else f"{line}; {otlp.summary()}"


def _by_node(counts: Mapping[str, int]) -> str:
    """` (n2=5 n1=1 and 3 more nodes)`: the nodes with the most, then by name."""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = " ".join(f"{node}={n}" for node, n in top[:FUTURE_NODES_SHOWN])
    more = len(top) - FUTURE_NODES_SHOWN
    return f" ({shown} and {more} more nodes)" if more > 0 else f" ({shown})" if shown else ""


# --- local log ----------------------------------------------------------------------------

# A partial frame at the end of the newest segment that is still there this much later is a
# torn tail, not a record being written (a live collector writes whole buffers at once).
TAIL_SETTLE_S = 1.0


def open_checkpoint(reader: LogReader, group: str, log_dir: Path) -> tuple[int, str] | None:
    """The group's (offset, metadata), None on its first start; CheckpointError if the file is
    unreadable or points past the end of the log (a log replaced or cut under it)."""
    try:
        committed = reader.committed(group)
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"checkpoint of group {group} unreadable: {exc}") from None
    if committed is not None:
        end = reader.end_offset()
        if committed[0] > end:
            raise CheckpointError(
                f"checkpoint of group {group} is at offset {committed[0]}, beyond the end of "
                f"the log {log_dir} ({end}): the log was replaced or cut"
            )
    return committed


def read_damage(st: ReaderStats, damage: DamageReport) -> None:
    damage.corrupt_frames = st.corrupt_frames
    damage.missing_records = st.missing_records
    damage.missing_segments = st.missing_segments


def commit_local(reader: LogReader, settings: AggregateSettings, offset: int, meta: str) -> None:
    """A checkpoint the disk refuses ends the service as an output file it refuses does: the
    restart goes on from the last checkpoint written."""
    try:
        reader.commit(settings.group, offset, meta)
    except OSError as exc:
        raise cannot_write(checkpoint_path(settings.log_dir, settings.group), exc) from None


async def settled_tail(reader: LogReader) -> int:
    """Bytes of a torn tail of the newest segment, once it has had time to be completed."""
    torn = reader.torn_tail()
    if torn:
        await asyncio.sleep(TAIL_SETTLE_S)
        torn = reader.torn_tail()
    return torn


async def run_local(settings: AggregateSettings, stopping: asyncio.Event) -> Outputs:
    """Read the local log as `settings.group`, alone: GroupInUseError when another process
    does (each would bill the whole log)."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(group_lock(settings.log_dir, settings.group))
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ELOOP):  # not a folder of ours
                raise CheckpointError(
                    f"checkpoint of group {settings.group} unreadable: {exc.filename}: "
                    f"{exc.strerror}"
                ) from None
            raise cannot_write(exc.filename, exc) from None  # (a full disk, no permission)
        return await _run_local(settings, stopping)


async def _run_local(settings: AggregateSettings, stopping: asyncio.Event) -> Outputs:
    reader = LogReader(settings.log_dir)
    committed = open_checkpoint(reader, settings.group, settings.log_dir)
    read_from, first = fresh_start(settings.window, settings.start_from)
    position, meta = committed if committed else (_local_start(reader, read_from), "")
    resume = parse_checkpoint(meta, f"checkpoint of group {settings.group}")
    check_window(resume, settings.window.window_ms, f"checkpoint of group {settings.group}")
    damage = settings.stats.damage
    watch = DamageWatch(damage, settings.window.max_skew_ms)
    emitted = resume.emitted_until_ms if committed else max(resume.emitted_until_ms, first)
    agg = Aggregator(settings.window, emitted_until_ms=emitted)
    outputs = Outputs.open(
        settings.csv,
        settings.jsonl,
        settings.otlp,
        resume if committed else None,
        settings.instance,
        settings.parquet,
    )
    raising = False
    try:
        if outputs.first_start:
            # First start of this group: commit where the files stand now, so a crash before
            # the first window closes cuts back to here rather than appending twice.
            # (the group's last emitted window stays: a replica's first start is not the group's)
            outputs.write([])  # the new files' headers on disk before their lengths are committed
            meta = msgspec.json.encode(outputs.checkpoint(agg)).decode()
            commit_local(reader, settings, position, meta)
        last_commit = time.monotonic()
        silence = Silence()
        while not stopping.is_set():
            settings.liveness.beat()
            batch = await asyncio.to_thread(reader.read, position, 5000)
            for r in batch:
                add_record(
                    agg,
                    settings.stats,
                    r.key,
                    r.value,
                    source=0,
                    offset=r.offset,
                    record_ts_ms=r.timestamp_ms,
                )
            if batch:
                position = batch[-1].offset + 1
                silence.read(0, max(r.timestamp_ms for r in batch))
            else:
                # Nothing new: the record time that has come anyway (see `silence`); the next
                # record would close the same windows (windows/progress.py).
                silence.at_end(0)
                if (now_ms := silence.now_ms(0)) is not None:
                    agg.idle(now_ms)
            read_damage(reader.stats, damage)
            done = not batch and settings.drain
            if done:
                damage.torn_tail_bytes = await settled_tail(reader)
                if reader.end_offset() > position:
                    continue  # the tail was a record being written after all
            records = agg.flush() if done else agg.advance()
            watch.check([agg])
            if records or done or time.monotonic() - last_commit > COMMIT_INTERVAL_S:
                outputs.write(records)
                needed = agg.needed_offsets().get(0, position)
                meta = msgspec.json.encode(outputs.checkpoint(agg)).decode()
                commit_local(reader, settings, needed, meta)
                outputs.export(records, [agg])
                last_commit = time.monotonic()
            if done:
                settings.drained = True
                break
            if not batch:
                await asyncio.sleep(0.5)
    except BaseException:
        raising = True
        raise
    finally:
        try:
            outputs.close(after_error=raising)  # (the last OTLP push, which the line counts)
        finally:
            counted = [agg.stats], agg.future_by_node, outputs.written, outputs.otlp
            line = report("aggregate", settings.stats, *counted)
            log.info("%s", line)
    return outputs


# --- Kafka --------------------------------------------------------------------------------


async def run_kafka(settings: AggregateSettings, stopping: asyncio.Event) -> Outputs:
    from aiokafka import AIOKafkaProducer, TopicPartition
    from aiokafka.abc import ConsumerRebalanceListener
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import UnknownTopicOrPartitionError
    from aiokafka.structs import OffsetAndMetadata

    from ..transport.consumer import ConsumerSettings, NoSuchTopic, make_consumer
    from ..transport.fenced_offsets import GroupMembershipLost, commit_offsets_as_member
    from ..transport.kafka import delivery_error, wait_for_broker

    assert settings.kafka is not None
    aggs: dict[TopicPartition, Aggregator] = {}
    positions: dict[TopicPartition, int] = {}
    silence = Silence()  # each partition's newest record time read, and when
    last_polled: dict[TopicPartition, int | None] = {}  # each one's last fetch seen (ms)
    # --drain: each partition held, and its end when it was assigned (a partition gained in a
    # rebalance is read to its own end before the drain flushes; one lost is no longer waited for)
    ends: dict[TopicPartition, int] = {}
    # The rebalance listener runs in aiokafka's task, which only logs what it raises.
    failed: list[CheckpointError] = []
    watch = DamageWatch(settings.stats.damage, settings.window.max_skew_ms)
    tally = Tally(settings.window, settings.stats)  # what revoked aggregators counted, and more
    security = settings.security.client_kwargs
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka, **security())
    consumer = make_consumer(
        ConsumerSettings(
            settings.kafka,
            f"hami-usage-aggregator-{settings.instance}",
            settings.security,
            group=settings.group,
            # A restarted replica gets its partitions back at once instead of waiting for its
            # dead predecessor's session to time out.
            group_instance_id=f"{settings.group}-{settings.instance}",
        )
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka,
        transactional_id=f"{settings.group}-{settings.instance}",
        enable_idempotence=True,
        compression_type="gzip",
        **security(),
    )
    # Its offsets name this member of the group: a member the group has dropped (a commit
    # held past the rebalance timeout) has its transaction refused, not committed after the
    # partitions' new owner has read from before it.
    commit_offsets_as_member(producer, consumer)

    # Held from the first await of a `publish` to its commit: aiokafka runs the rebalance
    # listener in its own task, and a partition revoked in between would have its records
    # published without its offsets (its next owner would publish them again). The revocation
    # waits for the commit instead, so the next owner starts from it.
    publishing = asyncio.Lock()

    # An assignment is positioned by its own task, not in the listener: aiokafka sends no
    # heartbeat while the listener runs, and the wait for a stable checkpoint (a previous owner
    # killed inside a transaction: up to its transaction timeout) could outlast the session,
    # and the group dropped the member. Its partitions are paused until they are positioned.
    placing: list[asyncio.Task[None]] = []

    async def place(assigned: list[TopicPartition]) -> None:
        # Every await comes first; then, with no await in between, each partition is
        # positioned (what was fetched before is read again from there) and gets its
        # aggregator: a non-empty `aggs` is the whole assignment (drain end offsets, file
        # resume points).
        try:
            committed = await committed_offsets(
                admin, settings.group, assigned, settings.checkpoint_wait_s
            )
        except CheckpointError as exc:
            failed.append(exc)  # the service stops
            return
        read_from, first = fresh_start(settings.window, settings.start_from)
        fresh = await start_offsets(consumer, assigned, read_from)
        gained = await consumer.end_offsets(assigned) if settings.drain else {}
        ends.update(gained)
        for tp in assigned:
            om = committed.get(tp)
            try:
                where = f"checkpoint of group {settings.group} partition {tp.partition}"
                meta = parse_checkpoint(om.metadata if om is not None else None, where)
                check_window(meta, settings.window.window_ms, where)
            except CheckpointError as exc:
                failed.append(exc)
                return
            if om is not None and om.metadata and outputs is not None:
                outputs.learn(meta)
            resumed = om is not None and om.offset >= 0
            start = om.offset if om is not None and resumed else fresh[tp]
            consumer.seek(tp, start)
            positions[tp] = start
            emitted = meta.emitted_until_ms if resumed else max(meta.emitted_until_ms, first)
            aggs[tp] = tally.aggregator(tp.partition, emitted)
            settings.stats.damage.forget_source(tp.partition)
        consumer.resume(*assigned)

    async def unplace() -> None:
        """Cancel the placements not done (their partitions are being taken away, or the
        service stops); an error one of them ended with is logged, not lost."""
        for task in placing:
            task.cancel()
        for result in await asyncio.gather(*placing, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("placing an assignment failed before it was revoked: %r", result)
        placing.clear()

    def placed() -> bool:
        """Whether every assignment is positioned; what positioning one raised, raised."""
        for task in placing:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return all(task.done() for task in placing)

    def forget(tp: TopicPartition, aborted: bool = False) -> None:
        """`tp` leaves this replica, what it read since the last commit with it (the next
        owner reads it again from there); what its aggregator counted stays counted (`Tally`),
        but for the records of an `aborted` transaction."""
        agg = aggs.pop(tp, None)
        if agg is not None:
            (tally.abort if aborted else tally.revoke)(agg, tp.partition)
        positions.pop(tp, None)
        ends.pop(tp, None)
        silence.forget(tp)
        last_polled.pop(tp, None)
        if outputs is not None:
            # Its gauges are its next owner's to send now: a replica left holding nothing
            # pushes no more until shutdown, whose push sent them again, long stale.
            outputs.gauges(aggs.values())

    class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
            await unplace()  # (an assignment not positioned yet goes with it)
            async with publishing:
                for tp in revoked:
                    forget(tp)

        async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
            # aiokafka already hands out records of the new partitions while this runs; the
            # main loop skips those of a partition it has no aggregator for
            if assigned:
                consumer.pause(*assigned)
                placing.append(asyncio.create_task(place(list(assigned))))

    async def publish(outputs: Outputs, records: list[BillingRecord]) -> None:
        """Files first (cut back on restart), then records and offsets in one transaction: the
        offsets of the aggregators that made `records`, taken before anything is awaited."""
        async with publishing:
            outputs.write(records)
            offsets = {}
            for tp, agg in aggs.items():
                meta = msgspec.json.encode(outputs.checkpoint(agg)).decode()
                needed = agg.needed_offsets().get(tp.partition, positions[tp])
                offsets[tp] = OffsetAndMetadata(needed, meta)
            await producer.begin_transaction()
            sent = []
            topic = settings.billing_topic
            try:
                try:
                    for r in records:
                        key, value, headers = billing_message(r, settings.billing_format)
                        # Stamped with its window's start, not the publish time: a reader
                        # seeks to a range by time (`report --kafka`), and a window is
                        # published by the aggregator's clock, behind collectors' clocks that
                        # run ahead of it.
                        sent.append(
                            await producer.send(
                                topic,
                                value,
                                key=key,
                                headers=headers,
                                timestamp_ms=r.window_start_ms,
                            )
                        )
                except UnknownTopicOrPartitionError:
                    # (after request_timeout_ms of metadata requests; aiokafka names no topic,
                    # and says the same when the broker did not answer them)
                    raise NoSuchTopic(
                        f"billing topic {topic} is not in the broker's metadata: it does not "
                        "exist (`hami-usage topics --apply` creates it) or the broker did not "
                        "answer"
                    ) from None
                # A batch the broker refuses for good (records over the topic's
                # max.message.bytes) fails its own records only, and the transaction would
                # commit the offsets without them: every record is delivered first.
                await asyncio.gather(*sent)
                await producer.send_offsets_to_transaction(offsets, settings.group)
                await producer.commit_transaction()
            except BaseException as exc:
                try:
                    await producer.abort_transaction()
                except AssertionError:
                    # A fenced producer (a newer one with our transactional id, or a
                    # transaction past its timeout) cannot abort: aiokafka asserts on the
                    # state change. The broker ends that transaction; `exc` says why.
                    log.debug("transaction not aborted after %r", exc)
                if isinstance(exc, AssertionError):
                    # aiokafka asserts when a record joins a transaction that has already
                    # failed (a partition refused to it): the records before say why.
                    raise delivery_error(sent) or exc from None
                raise

    async def commit(outputs: Outputs, records: list[BillingRecord]) -> bool:
        """`publish`; False if the group had dropped this replica meanwhile (a session that ran
        out while the process was stopped, a commit held past the rebalance timeout). Its
        transaction is aborted; what it wrote since its last commit is cut back and its
        partitions are let go, as a restart would: the rebalance that follows (aiokafka rejoins
        the group) places what the group gives it from the group's checkpoint."""
        try:
            await publish(outputs, records)
        except GroupMembershipLost as exc:
            log.warning("%s; this replica rejoins the group", exc)
            outputs.rewind()
            for tp in list(aggs):
                forget(tp, aborted=True)
            return False
        outputs.committed()
        tally.committed((tp.partition, agg) for tp, agg in aggs.items())
        return True

    outputs: Outputs | None = None
    raising = False
    try:
        broker = wait_for_broker(settings.kafka, settings.start_timeout_s, settings.security)
        if not await _unless_stopped(broker, stopping):
            log.info("stopped while waiting for the broker at %s: nothing was read", settings.kafka)
            return Outputs()
        consumer.subscribe([settings.topic], listener=Rebalance())
        if settings.topics:
            from ..transport.topics import warn_on_mismatch

            await warn_on_mismatch(settings.kafka, settings.security, settings.topics)
        await admin.start()
        await producer.start()
        # Every partition's checkpoint, not only an assignment's: this replica's own file
        # lengths are in the last commit it made, whichever partitions that covered. Its files
        # are cut back to them before it joins the group, whatever it is then assigned: it is
        # their only writer, and a replica on standby (no partition) had left a crash's
        # uncommitted parts beside those another replica recomputed.
        everything = merge_checkpoints(
            parse_checkpoint(om.metadata, f"checkpoint of group {settings.group}")
            for om in (
                await committed_offsets(admin, settings.group, None, settings.checkpoint_wait_s)
            ).values()
            if om.metadata
        )
        outputs = Outputs.open(
            settings.csv,
            settings.jsonl,
            settings.otlp,
            everything,
            settings.instance,
            settings.parquet,
        )
        await consumer.start()
        # Wait for the first assignment. The group join runs in aiokafka's own task; a getmany
        # here would hand out (and this loop drop) records of partitions being assigned. A
        # replica on standby (more replicas than partitions) waits here as long as its group
        # gives it nothing, and its first assignment's placement may wait here for a stable
        # checkpoint (bounded: CheckpointError): alive meanwhile, as the main loop is with no
        # partition.
        while not aggs and not stopping.is_set() and not failed:
            placed()
            settings.liveness.beat()
            await asyncio.sleep(0.05)
        if failed:
            raise failed[0]
        last_commit = time.monotonic()
        while not stopping.is_set():
            settings.liveness.beat()
            # This replica's (or the group's) first start: commit where its files stand now,
            # before anything is written, so a crash before the first window closes cuts back
            # to here rather than appending twice (tried again after a refusal).
            if outputs.first_start and aggs and not await commit(outputs, []):
                continue
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, msgs in batch.items():
                agg = aggs.get(tp)
                if agg is None:
                    continue
                tally.add(agg, tp.partition, msgs)
                positions[tp] = msgs[-1].offset + 1
                silence.read(tp, max(m.timestamp for m in msgs))
            assigned = consumer.assignment()
            for tp, agg in aggs.items():
                # A partition whose nodes all fell silent closes on its own record time moved
                # on by the time it has been seen at its end (`silence`): a fetch answered
                # since the last loop (a new poll time) with nothing beyond what was read. A
                # backlog is not silence, nor is a broker that does not answer.
                high = consumer.highwater(tp) if tp in assigned else None
                if high is None or positions[tp] < high:
                    continue
                polled = consumer.last_poll_timestamp(tp)
                if polled != last_polled.get(tp):
                    last_polled[tp] = polled
                    silence.at_end(tp)
                if (now_ms := silence.now_ms(tp)) is not None:
                    agg.idle(now_ms)
            if failed:
                raise failed[0]
            # (a drain is done only once every partition aiokafka assigned is placed: it can
            # hand out a batch after an assignment, before it calls the listener)
            ready = placed() and assigned == aggs.keys()
            done = settings.drain and ready and await _caught_up(consumer, ends)
            records = _sorted(
                r for agg in aggs.values() for r in (agg.flush() if done else agg.advance())
            )
            watch.check(aggs.values())
            due = records or done or time.monotonic() - last_commit > COMMIT_INTERVAL_S
            if due and aggs:  # a replica with nothing assigned has nothing to commit
                if not await commit(outputs, records):
                    continue
                outputs.export(records, list(aggs.values()))
                last_commit = time.monotonic()
            if done:
                settings.drained = True
                break
    except BaseException:
        raising = True
        raise
    finally:
        await unplace()
        if outputs is not None:
            try:
                outputs.close(after_error=raising)  # (the last OTLP push, which the line counts)
            finally:
                counted = tally.stats(aggs.values()), tally.future_by_node(aggs.values())
                line = report("aggregate", settings.stats, *counted, outputs.written, outputs.otlp)
                log.info("%s", line)
        await consumer.stop()
        await unplace()  # (one its last join started)
        await producer.stop()
        await admin.close()
    return outputs if outputs is not None else Outputs()


async def _unless_stopped(work: Coroutine[Any, Any, None], stopping: asyncio.Event) -> bool:
    """`work` to its end, unless a stop signal comes first (a pod deleted while its broker is
    away must not wait out `start_timeout_s`): then it is cancelled. Whether it ended."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        ended = task.done()
        if not ended:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # (it closes its client)
    if not ended:
        return False
    task.result()  # (what it raised)
    return True


class OutputError(Exception):
    """An output file cannot be written: nothing after its last commit is lost (a restart cuts
    it back and writes the windows again), but the service cannot go on; one line."""


def cannot_write(where: str | Path, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {where}: {exc.strerror or exc}")


class CheckpointUnavailable(Exception):
    """The group coordinator would not say where this group stands."""


async def committed_offsets(
    admin: Any, group: str, tps: list[Any] | None, wait_s: float = CHECKPOINT_WAIT_S
) -> dict[Any, Any]:
    """Committed offsets and metadata of `tps` (None: of every partition the group committed);
    a partition never committed has offset -1. CheckpointError after `wait_s` without a
    complete and stable answer (exit 4: nothing is read from a checkpoint not known).

    Right after a broker restart the coordinator answers with no partitions at all while it
    loads its offsets ({} then). Starting from the beginning at that moment would bill
    everything again, so this waits for a complete answer, and gives up loudly. Likewise while
    a committed transaction's offsets are not applied yet (a partition taken over right after
    its previous owner's last commit): read before it, its windows would be published again
    (see `stable_offsets`). And while the group has no coordinator yet (a fresh broker creates
    its offsets topic at the first group's use): a replica reads its checkpoint before it joins.
    """
    from ..transport.stable_offsets import UnstableOffsets, fetch_stable_offsets

    def again(exc: BaseException) -> bool:
        # (aiokafka marks a coordinator not available, moving or loading as retriable)
        return isinstance(exc, CheckpointUnavailable | UnstableOffsets) or getattr(
            exc, "retriable", False
        )

    try:
        async for attempt in AsyncRetrying(
            # A replica SIGKILLed inside a transaction leaves its offsets pending until the
            # broker aborts it: the producer's transaction timeout (60 s), the broker's sweep
            # (10 s).
            stop=stop_after_delay(wait_s),
            wait=wait_exponential(multiplier=0.1, max=2),
            retry=retry_if_exception(again),
            reraise=True,
        ):
            with attempt:
                found = await fetch_stable_offsets(admin, group, tps)
                if tps is not None and any(tp not in found for tp in tps):
                    raise CheckpointUnavailable(f"no committed offsets for group {group} yet")
    except Exception as exc:
        if not again(exc):
            raise
        raise CheckpointError(
            f"committed offsets of group {group} not available after {wait_s:g} s: {exc}"
        ) from None
    return dict(found)


def fresh_start(window: WindowSettings, start_from: str | int) -> tuple[int | None, int]:
    """Where a group with no committed offset starts: the record time it reads from (None: the
    beginning) and the end of the windows it publishes none of. `latest` (now) and a time T
    publish the windows from the first boundary at or after it, read from as far before as
    their state needs (`WindowSettings.history_from`), so each is the record a group from
    `earliest` publishes, the same `record_id` with the same values: a window begun before T
    was billed from the part of its input after T, under that id."""
    if start_from == "earliest":
        return None, 0
    at = int(time.time() * 1000) if start_from == "latest" else int(start_from)
    if at <= 0:
        return None, 0  # (Kafka takes no time before 1970: such a time is every record's)
    return max(window.history_from(at), 0), window.first_whole(at)


def _local_start(reader: LogReader, read_from: int | None) -> int:
    """Where a new group starts in a local log (`fresh_start`)."""
    return 0 if read_from is None else reader.offset_for_time(read_from)


async def start_offsets(consumer: Any, tps: list[Any], read_from: int | None) -> dict[Any, int]:
    """Where each partition starts for a group that has committed nothing there (`fresh_start`)."""
    if read_from is None:
        return dict(await consumer.beginning_offsets(tps))
    ends: dict[Any, int] = await consumer.end_offsets(tps)
    found = await consumer.offsets_for_times({tp: read_from for tp in tps})
    return {tp: found[tp].offset if found.get(tp) else ends[tp] for tp in tps}


async def _caught_up(consumer: Any, ends: dict[Any, int]) -> bool:
    from aiokafka.errors import IllegalStateError

    for tp, end in list(ends.items()):  # (the rebalance listener changes it while this awaits)
        try:
            if await consumer.position(tp) < end:
                return False
        except IllegalStateError:  # revoked meanwhile: the next turn has the assignment
            return False
    return True


async def aggregate(settings: AggregateSettings) -> Outputs:
    import signal

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    health = None
    if settings.health_port is not None:
        health = HealthServer(
            settings.health_bind_address,
            settings.health_port,
            settings.liveness,
            stale_after_s=HEALTH_STALE_AFTER_S,
            # Start-up may wait start_timeout_s for the broker, then checkpoint_wait_s for the
            # group's checkpoint: alive meanwhile.
            start_grace_s=settings.start_timeout_s + settings.checkpoint_wait_s + 10,
        )
        port = await health.start()
        log.info("health on %s:%d/healthz", settings.health_bind_address, port)
    try:
        if settings.kafka:
            return await run_kafka(settings, stopping)
        return await run_local(settings, stopping)
    finally:
        if health is not None:
            await health.stop()
