"""`hami-usage decode`: raw Kafka message values on stdin -> one JSON object a line on stdout.

Usage events (msgpack arrays) become objects with their field names and a `"kind"` (the event
type's name); billing values (JSON, or msgpack maps) become the record's JSON object. Framings:

* `length` (default): each value preceded by its length as a 4-byte big-endian signed integer,
  what `kcat -C -f '%R%s'` writes; a length of -1 is a null value and is skipped. Safe for any
  bytes, so it is the one to use for usage events.
* `base64`: one base64-encoded value a line (`kcat` has no base64 output; other tools do).
* `lines`: one raw value a line; only for JSON billing values, which never hold a newline.

A value that is neither a known event nor a billing record is counted and reported on stderr
(exit 1), never guessed at.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterator
from typing import Any, BinaryIO, TextIO

import msgspec

from .aggregate.billing import decode_billing
from .events import UnknownSchemaVersion, decode

_encoder = msgspec.json.Encoder(decimal_format="number")  # exact record decimals
# The first byte of a msgpack map: fixmap, map 16, map 32.
_MSGPACK_MAPS = frozenset(bytes([b]) for b in [*range(0x80, 0x90), 0xDE, 0xDF])


def named(value: Any) -> Any:
    """Array-like structs as objects with their field names (a kind first for events)."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        tag = type(value).__struct_config__.tag
        if tag is not None:
            out["kind"] = type(value).__name__
        for name in value.__struct_fields__:
            out[name] = named(getattr(value, name))
        return out
    if isinstance(value, list | tuple):
        return [named(v) for v in value]
    return value


def to_json(payload: bytes) -> bytes:
    """One raw message value as a JSON object (no newline); ValueError when it is neither."""
    # (events are msgpack arrays: a JSON object or a msgpack map is a billing record, and its
    # error says why it is not one)
    if payload[:1] == b"{" or payload[:1] in _MSGPACK_MAPS:
        try:
            return _encoder.encode(decode_billing(payload))
        except ValueError as exc:  # msgspec's errors, and a version or kind not known
            raise ValueError(f"not a billing record: {exc}") from None
    try:
        return _encoder.encode(named(decode(payload)))
    except UnknownSchemaVersion:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError) as event_error:
        try:
            return _encoder.encode(decode_billing(payload))
        except ValueError:
            raise ValueError(f"not a usage event or billing record: {event_error}") from None


class FramingError(ValueError):
    pass


def _length_framed(stream: BinaryIO) -> Iterator[bytes]:
    while header := stream.read(4):
        if len(header) < 4:
            raise FramingError(f"stream ends inside a length prefix ({len(header)} of 4 bytes)")
        (size,) = struct.unpack(">i", header)
        if size == -1:
            continue  # a null value (a tombstone): kcat's %R writes -1
        if size < 0:
            raise FramingError(f"a length prefix of {size}: not kcat's %R framing")
        payload = stream.read(size)
        if len(payload) < size:
            raise FramingError(f"stream ends inside a value ({len(payload)} of {size} bytes)")
        yield payload


def _lines(stream: BinaryIO, b64: bool) -> Iterator[bytes]:
    for line in stream:
        line = line.rstrip(b"\r\n")
        if not line:
            continue
        if b64:
            try:
                yield base64.b64decode(line, validate=True)
            except binascii.Error as exc:
                raise FramingError(f"not base64: {exc}") from None
        else:
            yield line


def decode_stream(stream: BinaryIO, out: BinaryIO, err: TextIO, framing: str) -> int:
    values = _length_framed(stream) if framing == "length" else _lines(stream, framing == "base64")
    decoded = bad = 0
    try:
        for payload in values:
            try:
                line = to_json(payload)
            except ValueError as exc:  # UnknownSchemaVersion included
                bad += 1
                if bad <= 5:
                    err.write(f"hami-usage decode: message {decoded + bad}: {exc}\n")
                continue
            out.write(line + b"\n")
            decoded += 1
    except FramingError as exc:
        err.write(f"hami-usage decode: {framing} framing: {exc}\n")
        return 1
    out.flush()
    if bad:
        err.write(f"hami-usage decode: {decoded} decoded, {bad} undecodable\n")
        return 1
    return 0
