"""The event schema: the checked-in JSON Schema, the msgpack codec and its evolution rules."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.aggregate.records import BillingRecord, to_json
from collector.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    CollectorStarted,
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceLimit,
    Event,
    Heartbeat,
    Identity,
    LayoutAnomaly,
    LimitsChanged,
    PodIdentity,
    ProcessStarted,
    UnknownSchemaVersion,
    UsageRow,
    UsageSample,
    decode,
    encode,
)
from collector.layout import reader
from collector.layout.declarations import UUID_LEN

REPO = Path(__file__).resolve().parent.parent
CHECKED_IN = REPO / "schemas" / "events.schema.json"
# msgpack carries integers in [-2**63, 2**64 - 1]; counters are u64, ids and times i64.
INTS = st.integers(-(2**63), 2**64 - 1)
_BASE = {"v": st.integers(0, SCHEMA_VERSION)}


def strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Random values of a field type, derived from the declarations (new fields included)."""
    if tp is int:
        return INTS
    if tp is str:
        return st.text(max_size=40)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bool:
        return st.booleans()
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # a string with bounds: within them, the upper one too
        base, meta = typing.get_args(tp)
        assert isinstance(meta, msgspec.Meta) and meta.max_length is not None
        if typing.get_origin(base) in (list, dict):  # (bounded: a few items, as any other)
            return strategy(base)
        assert base is str
        least = meta.min_length or 0
        return st.text(min_size=least, max_size=min(40, meta.max_length)) | st.just(
            "é" * meta.max_length
        )
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(strategy(item), max_size=3)
    if origin is dict:
        key, value = typing.get_args(tp)
        return st.dictionaries(strategy(key), strategy(value), max_size=3)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy(a) for a in typing.get_args(tp)])
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        kwargs = {
            f.name: _BASE[f.name] if f.name in _BASE else strategy(f.type)
            for f in msgspec.structs.fields(tp)
        }
        return st.builds(tp, **kwargs)
    raise TypeError(f"no strategy for {tp!r}")


EVENTS = st.one_of([strategy(cls) for cls in EVENT_TYPES])


def sample_events() -> list[Event]:
    dev = DeviceLimit(0, "GPU-0", 4 << 30, 50)
    r = UsageRow(1, 101, 0, 3 << 30, 1, 2, (3 << 30) - 3, 5 << 30, 77)
    ident = Identity("p", "ml", "trainer-x", "Deployment", "trainer", {"team": "vision"})
    base: dict[str, Any] = {"v": SCHEMA_VERSION, "inc": 5, "seq": 0, "ts": 1_700_000_000_000}
    return [
        ContainerAppeared(**base, cid=0, pod_uid="p", container="c", path="/x", layout="v1.2",
                          devices=[dev]),
        ContainerGone(**base, cid=0),
        ProcessStarted(**base, cid=0, pid=1, hostpid=101),
        UsageSample(**base, cid=0, rows=[r]),
        LayoutAnomaly(**base, cid=-1, path="/x", anomaly="skipped_path", detail="d"),
        LayoutAnomaly(**base, cid=3, path="/x", anomaly="over_limit", detail="d", device=0,
                      value=2**64 - 1),
        Heartbeat(**base, interval_ms=30_000, part=0, parts=1,
                  containers=[ContainerState(0, "p", "c", "v1.2", [dev], [r])], scan_ms=1.5,
                  pods=[ident]),
        PodIdentity(**base, identity=ident),
        CollectorStarted(**base, host="node-1", pid=4242, log="/var/lib/hami-usage/events"),
    ]  # fmt: skip


def test_schema_command_output_equals_the_checked_in_schema(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "collector", "schema", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    names = ["events.schema.json", "billing.schema.json"]
    assert proc.stdout == "".join(f"wrote {tmp_path / n}\n" for n in names)
    for name in names:
        generated = (tmp_path / name).read_bytes()
        assert generated == (REPO / "schemas" / name).read_bytes(), (
            f"schemas/{name} is out of date: run `hami-usage schema` and commit it"
        )


def test_every_array_position_is_named_by_its_field() -> None:
    schema = json.loads(CHECKED_IN.read_text())
    sample = schema["$defs"]["UsageSample"]
    assert sample["x-fields"] == ["kind", "v", "inc", "seq", "ts", "cid", "rows"]
    assert [i["title"] for i in sample["prefixItems"]] == sample["x-fields"]
    row = schema["$defs"]["UsageRow"]
    assert row["x-fields"] == [f.name for f in msgspec.structs.fields(UsageRow)]
    for name, definition in schema["$defs"].items():
        if "prefixItems" in definition:
            assert len(definition["x-fields"]) == len(definition["prefixItems"]), name


def test_checked_in_schema_describes_the_events_as_sent() -> None:
    schema = json.loads(CHECKED_IN.read_text())
    assert schema["x-schema-version"] == SCHEMA_VERSION
    for event in sample_events():
        # JSON mirrors the msgpack shape: [tag, v, inc, seq, ts, ...fields].
        as_sent = msgspec.msgpack.decode(encode(event))
        jsonschema.validate(as_sent, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([5, 1, 5, 0, 0, 0, "not rows"], schema)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_msgpack_round_trip_of_every_event_type(event: Event) -> None:
    payload = encode(event)
    raw = msgspec.msgpack.decode(payload)
    assert raw[:2] == [type(event).__struct_config__.tag, event.v]  # tag and version first
    assert decode(payload) == event


def test_every_kind_has_a_distinct_tag() -> None:
    tags = [cls.__struct_config__.tag for cls in EVENT_TYPES]
    # Append-only: tags are never reused, so they are 1..n in declaration order.
    assert tags == list(range(1, len(tags) + 1))
    assert set(typing.get_args(Event)) == set(EVENT_TYPES)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_newer_schema_version_is_refused(event: Event) -> None:
    newer = msgspec.structs.replace(event, v=SCHEMA_VERSION + 1)
    with pytest.raises(UnknownSchemaVersion, match=r"schema version 2 > 1"):
        decode(encode(newer))


def test_newer_version_with_an_unknown_kind_or_shape_is_refused_as_such() -> None:
    # Version 2 might add kinds or change fields: still refused by version, not as garbage.
    with pytest.raises(UnknownSchemaVersion):
        decode(msgspec.msgpack.encode([99, 2, 5, 0, 0, "whatever"]))
    with pytest.raises(UnknownSchemaVersion):
        decode(msgspec.msgpack.encode([3, 2, 5, 0, 0, "cid is a string in v2"]))
    # The same at the known version is malformed, not "newer".
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode([99, 1, 5, 0, 0]))
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1 not msgpack")
    with pytest.raises(msgspec.DecodeError):
        decode(msgspec.msgpack.encode({"kind": 3}))


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_trailing_fields_of_a_newer_minor_evolution_are_ignored(event: Event) -> None:
    raw = msgspec.msgpack.decode(encode(event))
    evolved = msgspec.msgpack.encode([*raw, 42, "added later", [1, 2], None])
    assert decode(evolved) == event


def test_older_message_without_defaulted_trailing_fields_decodes_with_defaults() -> None:
    hb = next(e for e in sample_events() if isinstance(e, Heartbeat))
    assert isinstance(hb, Heartbeat)
    raw = msgspec.msgpack.decode(encode(hb))
    assert len(raw) == 1 + len(msgspec.structs.fields(Heartbeat))
    # before scan_ms, files, spool_depth, dropped, log_blocked, pods
    older = msgspec.msgpack.encode(raw[:-6])
    assert decode(older) == msgspec.structs.replace(hb, scan_ms=0.0, pods=[])


def test_both_schemas_name_their_dialect_and_billing_integers_are_bounded() -> None:
    """Without `$schema` a validator may assume an older draft, which ignores `prefixItems`
    (every position of an event would pass). A record's integers lie in [0, 2^63 - 1]."""
    names = ("events.schema.json", "billing.schema.json")
    schemas = {n: json.loads((CHECKED_IN.parent / n).read_text()) for n in names}
    for schema in schemas.values():
        assert jsonschema.validators.validator_for(schema) is jsonschema.Draft202012Validator
    billing = schemas["billing.schema.json"]
    rec = BillingRecord(0, 60_000, "n1", "p", "c", "GPU-1", 1.5, 2.0, 0.0, 3.25, 0, 7, 60.0, 4, "a")
    record = msgspec.json.decode(to_json(rec))
    jsonschema.validate(record, billing)
    for field, value in (("samples", -1), ("peak_memory_bytes", 1 << 63), ("window_end_ms", -5)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**record, field: value}, billing)
    jsonschema.validate({**record, "peak_memory_bytes": (1 << 63) - 1}, billing)


@settings(max_examples=300)
@given(st.binary(min_size=UUID_LEN, max_size=UUID_LEN))
def test_every_uuid_a_cache_file_can_hold_is_decodable(raw: bytes) -> None:
    """A tenant writes its cache file's UUID field; the collector sends it as shown, each byte
    that is not printable ASCII escaped to 4 characters. A bound on UUIDs below that made a
    tenant's garbage UUID refuse the whole heartbeat part it was in, other containers too."""
    shown, _ = reader._uuid(raw)
    event = LimitsChanged(1, 1, 1, 1, 1, [DeviceLimit(0, shown, 0, 0)])
    assert decode(encode(event)) == event


_NAME_PART = st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",))
_FOLDER_NAMES = st.one_of(
    st.tuples(st.text(st.characters(blacklist_characters="/\0_", blacklist_categories=("Cs",)),
                      min_size=1), st.text(_NAME_PART)).map("_".join),
    st.just("a" * 254 + "_"),  # 255 bytes, the most a name holds (NAME_MAX): all pod UID
    st.just("a_" + "b" * 253),  # ... all container
).filter(lambda name: len(name.encode()) <= 255)  # fmt: skip


@settings(max_examples=300)
@given(_FOLDER_NAMES)
def test_every_folder_name_the_collector_reads_is_decodable(name: str) -> None:
    """The pod UID and container come from a folder's name: at most 255 bytes of UTF-8 (one
    that is not UTF-8 is reported, never read), a '_' after a non-empty pod UID."""
    pod_uid, container = name.split("_", 1)
    state = ContainerState(1, pod_uid, container, "v1.2", [], [])
    event = Heartbeat(1, 1, 1, 1, 30_000, 0, 1, [state])
    assert decode(encode(event)) == event
