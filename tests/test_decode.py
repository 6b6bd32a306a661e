"""`hami-usage decode`: framed raw values -> JSON lines with field names (no broker needed)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
import subprocess
import sys
import threading

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schema import EVENTS, sample_events

from collector.aggregate.billing import billing_message
from collector.aggregate.records import BillingRecord
from collector.decode import decode_stream, named
from collector.events import Event, encode


def framed(values: list[bytes]) -> bytes:
    return b"".join(struct.pack(">i", len(v)) + v for v in values)


def run(data: bytes, framing: str = "length") -> tuple[int, list[object], str]:
    out, err = io.BytesIO(), io.StringIO()
    rc = decode_stream(io.BytesIO(data), out, err, framing)
    return rc, [json.loads(x) for x in out.getvalue().splitlines()], err.getvalue()


def record() -> BillingRecord:
    return BillingRecord(
        0, 60_000, "n1", "p", "c", "GPU-1", 1.5, 2.0, 0.0, 3.25, 0.0, 7, 60.0, 4, "ab"
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENTS, max_size=5))
def test_length_framed_events_decode_with_field_names(events: list[Event]) -> None:
    rc, objects, err = run(framed([encode(e) for e in events]))
    assert (rc, err) == (0, "")
    assert objects == [json.loads(msgspec.json.encode(named(e))) for e in events]
    for obj, e in zip(objects, events, strict=True):
        assert isinstance(obj, dict)
        assert list(obj) == ["kind", *e.__struct_fields__]
        assert obj["kind"] == type(e).__name__


def test_base64_lines_billing_and_nulls() -> None:
    events = sample_events()
    _, json_value, _ = billing_message(record(), "json")
    _, packed, _ = billing_message(record(), "msgpack")
    data = b"".join(base64.b64encode(v) + b"\n" for v in [encode(events[0]), json_value, packed])
    rc, objects, err = run(data, "base64")
    assert (rc, err) == (0, "")
    assert objects[1] == objects[2] == json.loads(json_value)
    assert objects[0]["kind"] == "ContainerAppeared"
    # A null value (length -1, a tombstone) is skipped; JSON values one a line.
    assert run(struct.pack(">i", -1) + framed([json_value]))[1] == [json.loads(json_value)]
    assert run(json_value + b"\n" + json_value + b"\n", "lines")[1] == [json.loads(json_value)] * 2


def test_bad_input_is_counted_never_guessed() -> None:
    good = encode(sample_events()[1])
    rc, objects, err = run(framed([good, b"\xc1junk", good]))
    assert rc == 1 and len(objects) == 2
    assert err.endswith("hami-usage decode: 2 decoded, 1 undecodable\n")
    rc, objects, err = run(framed([good]) + b"\x00\x00\x01\x00abc")
    assert rc == 1 and len(objects) == 1
    assert err == "hami-usage decode: length framing: stream ends inside a value (3 of 256 bytes)\n"
    rc, _, err = run(b"!!!\n", "base64")
    assert rc == 1 and err.startswith("hami-usage decode: base64 framing: not base64")
    # Only -1 is kcat's null value: any other negative length was skipped unsaid, exit 0.
    for size in (-2, -(2**31)):
        rc, objects, err = run(framed([good]) + struct.pack(">i", size) + framed([good]))
        assert (rc, len(objects)) == (1, 1)
        assert err == (
            f"hami-usage decode: length framing: a length prefix of {size}: not kcat's %R "
            "framing\n"
        )


def test_a_value_nested_too_deeply_is_undecodable_not_a_crash() -> None:
    """msgspec gives up a thousand levels deep (RecursionError): as an event, a billing record
    in JSON and in msgpack, such a value is counted like any other undecodable one."""
    good = encode(sample_events()[1])
    deep = [
        b"\x95\x02\x01\x00\x00" + b"\x91" * 1000 + b"\x00",  # an event-like array
        b'{"x":' + b"[" * 1000 + b"]" * 1000 + b"}",  # a billing record in JSON
        b"\x81\xa1x" + b"\x91" * 1000 + b"\x00",  # a billing record in msgpack
    ]
    rc, objects, err = run(framed([good, *deep, good]))
    assert rc == 1 and len(objects) == 2
    assert err.endswith("hami-usage decode: 2 decoded, 3 undecodable\n")
    assert "Traceback" not in err


def test_the_command_reads_stdin() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "collector", "decode"],
        input=framed([encode(e) for e in sample_events()]),
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == len(sample_events())


def test_a_reader_that_closes_the_pipe_early_ends_it_quietly() -> None:
    """`decode | head -1`: a BrokenPipeError traceback once `head` had its line."""
    values = framed([encode(e) for e in sample_events()] * 2000)  # more than a pipe holds
    with subprocess.Popen(
        [sys.executable, "-m", "collector", "decode"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        stdin = proc.stdin

        def feed() -> None:
            with contextlib.suppress(BrokenPipeError):  # it stopped reading: all the better
                stdin.write(values)
                stdin.close()

        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        assert proc.stdout.readline().startswith(b"{")
        proc.stdout.close()
        err = proc.stderr.read()
        assert (proc.wait(timeout=60), err) == (0, b"")
        writer.join(timeout=60)


def test_an_output_that_cannot_be_written_is_one_line() -> None:
    """`decode > /dev/full`: an OSError traceback (no space left on device)."""
    values = framed([encode(e) for e in sample_events()] * 200)
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "collector", "decode"], input=values,
                              stdout=full, capture_output=False, stderr=subprocess.PIPE,
                              timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stderr) == (1, b"hami-usage decode: No space left on device\n")


def test_a_msgpack_map_that_is_no_billing_record_says_why_as_one() -> None:
    """A billing message from before records had a kind: the line gave the usage event's
    error (an array was expected), not the record's missing field."""
    fields = msgspec.structs.asdict(record())
    del fields["kind"]
    rc, objects, err = run(framed([msgspec.msgpack.encode(fields)]))
    assert (rc, objects) == (1, [])
    assert err == (
        "hami-usage decode: message 1: not a billing record: Object missing required field "
        "`kind`\nhami-usage decode: 0 decoded, 1 undecodable\n"
    )


def test_a_json_value_that_is_no_billing_record_says_what_it_is_not() -> None:
    """A JSON billing value cut short: the line said only "Input data was truncated"."""
    cut = msgspec.json.encode(record())[:40]
    rc, objects, err = run(framed([cut, msgspec.json.encode(record())]))
    assert (rc, len(objects)) == (1, 1)
    assert err == (
        "hami-usage decode: message 1: not a billing record: Input data was truncated\n"
        "hami-usage decode: 1 decoded, 1 undecodable\n"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 3}, "version 3 is not one of 1 to 2"),
        ({"kind": "bogus"}, "kind 'bogus' is not one of node, gpu, idle, container"),
    ],
)
def test_a_record_of_no_known_version_or_kind_is_no_billing_record(
    change: dict[str, object], message: str
) -> None:
    """Its line lacked the 'not a billing record:' that every other bad billing value has."""
    fields = msgspec.structs.asdict(record()) | change
    rc, objects, err = run(framed([msgspec.json.encode(fields), msgspec.msgpack.encode(fields)]))
    assert (rc, objects) == (1, [])
    assert err == (
        f"hami-usage decode: message 1: not a billing record: {message}\n"
        f"hami-usage decode: message 2: not a billing record: {message}\n"
        "hami-usage decode: 0 decoded, 2 undecodable\n"
    )
