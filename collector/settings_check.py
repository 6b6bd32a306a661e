"""Checks of setting values that a type annotation cannot say: syntax (Kafka bootstrap lists,
names, URLs, paths) and, at start, the machine (writable outputs, forbidden roots).

Syntax checks raise `ValueError("name: why")`; the settings structs call them from
`__post_init__`, so a TOML file, the environment and flags are held to the same rules and the
message becomes the one line `hami-usage` prints before exiting 2. Machine checks raise
`SettingError` and run once, before a command starts work. A new setting (e.g. a Kafka security
option) adds its check here and one call in its struct's `__post_init__`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from decimal import Decimal
from urllib.parse import urlsplit

MAX_PATH = 4096  # PATH_MAX on Linux
MAX_NAME = 249  # Kafka's limit on topic names; group and transactional ids are held to it too
MAX_NODE = 253  # a Kubernetes node name is a DNS subdomain
MAX_BOOTSTRAP = 4096
MAX_SETTING_FILE = 1 << 20  # a config or password file; more is no such file

_KAFKA_NAME = re.compile(r"[A-Za-z0-9._-]+")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"  # '_' too: some hosts file names have it
_HOST = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
COMPRESSIONS = ("gzip", "snappy", "lz4", "zstd", "none")
# Pseudo-filesystems: a cache-file root there reads kernel state, never HAMi's files.
FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev")


class SettingError(Exception):
    """A setting the machine cannot honour; the message is one line for stderr."""


def path(name: str, value: str | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError(f"{name}: must not be empty")
    if len(value) > MAX_PATH:
        raise ValueError(f"{name}: longer than {MAX_PATH} characters")
    if "\0" in value:
        raise ValueError(f"{name}: contains a NUL character")


def kafka_name(name: str, value: str) -> None:
    """A topic or consumer-group name; the group also names a checkpoint file, so `..`, `/`
    and the like are refused."""
    if not value or len(value) > MAX_NAME or not _KAFKA_NAME.fullmatch(value):
        raise ValueError(
            f"{name}: {shown(value)} is not 1 to {MAX_NAME} of the characters A-Z a-z 0-9 . _ -"
        )
    if value in (".", ".."):
        raise ValueError(f"{name}: {value!r} is not a name")


def billing_topic(name: str, value: str, usage: str) -> None:
    """The billing topic is not the usage topic: the broker refuses the second creation, and
    the aggregator would write its records among the events it reads."""
    if value == usage:
        raise ValueError(f"{name}: {shown(value)} is the usage topic (topic) too")


def printable(name: str, value: str, limit: int = MAX_NAME) -> None:
    """An identifier such as a replica id: 1 to `limit` printable ASCII characters, no spaces."""
    if not value or len(value) > limit or not _PRINTABLE.fullmatch(value):
        raise ValueError(
            f"{name}: {shown(value)} is not 1 to {limit} printable characters without spaces"
        )


def label_key(name: str) -> bool:
    """Whether `name` can be a Kubernetes label key as a setting or flag names one: 1 to 317
    printable characters (a 253-character prefix, '/', a 63-character name), no space, no
    comma (lists of them are comma-separated)."""
    return (
        0 < len(name) <= 317
        and name.isprintable()
        and not any(c.isspace() or c == "," for c in name)
    )


def node_name(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name}: must not be empty")
    if len(value) > MAX_NODE or not _PRINTABLE.fullmatch(value):
        raise ValueError(
            f"{name}: {shown(value)} is not 1 to {MAX_NODE} printable characters without spaces"
        )


def bootstrap(name: str, value: str | None) -> None:
    """`host:port[,host:port...]`; host a DNS name, an IPv4 address or a bracketed IPv6 one."""
    if value is None:
        return
    if not value or len(value) > MAX_BOOTSTRAP:
        raise ValueError(f"{name}: must be 1 to {MAX_BOOTSTRAP} characters of host:port,...")
    for server in value.split(","):
        _server(name, server.strip())


def _server(name: str, server: str) -> None:
    bad = f"{name}: {shown(server)} is not host:port"
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(bad)
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{name}: port {port} of {shown(server)} is outside 1..65535")
    if not _valid_host(host):
        raise ValueError(bad)


def _valid_host(host: str) -> bool:
    """A DNS name, an IPv4 address, or an IPv6 address in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return len(host) <= MAX_NODE and _HOST.fullmatch(host) is not None


def whole_ms(name: str, seconds: float) -> None:
    """Seconds that the windows count in whole milliseconds: 16.1 is 16 100 ms, 0.0015 is not a
    whole number of them and is refused rather than rounded (0.0005 would round to none). The
    test is on the decimal the value was written as, not on the binary float."""
    if Decimal(repr(seconds)) * 1000 % 1:
        raise ValueError(f"{name}: must be a whole number of milliseconds, got {seconds:g}")


def retention_ms(days: float) -> int:
    """A topic retention in days as Kafka's `retention.ms`."""
    return round(days * 86_400_000)


def retention(name: str, days: float) -> None:
    """A retention that rounds to 0 ms is none at all (Kafka would delete every message)."""
    if retention_ms(days) < 1:
        raise ValueError(f"{name}: {days:g} days is less than 1 ms")


def http_url(name: str, value: str | None) -> None:
    if value is None:
        return
    if len(value) > MAX_PATH:
        raise ValueError(f"{name}: longer than {MAX_PATH} characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError(f"{name}: {shown(value)} is not an http(s) URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name}: {shown(value)} is not an http(s) URL")
    host = parts.hostname  # (without the brackets of an IPv6 address)
    if not _valid_host(f"[{host}]" if ":" in host else host):
        # `http://a b:4318` was taken, and every push then failed
        raise ValueError(f"{name}: {shown(value)} does not name a valid host")
    if port == 0:
        raise ValueError(f"{name}: port 0 in {shown(value)}")


def compression(name: str, value: str) -> None:
    if value not in COMPRESSIONS:
        raise ValueError(f"{name}: {shown(value)} is not one of {', '.join(COMPRESSIONS)}")


def address(name: str, value: str) -> None:
    """A listen address: an IP address or a host name."""
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if not value or len(value) > MAX_NODE or not _HOST.fullmatch(value):
        raise ValueError(f"{name}: {shown(value)} is not an IP address or host name")


def one_line(text: str) -> str:
    """A message as one line: a character that is not printable (a newline in a path, in a
    key) is shown escaped, `\\n`."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: str) -> str:
    """A value quoted in a message: repr, cut short so that one line stays one short line."""
    return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."


# --- the machine, at start -------------------------------------------------------------------


def compression_available(flag: str, value: str) -> None:
    """The library for a Kafka compression codec must be installed, or the producer fails
    on its first batch."""
    from aiokafka import codec

    has = {
        "gzip": codec.has_gzip,
        "snappy": codec.has_snappy,
        "lz4": codec.has_lz4,
        "zstd": codec.has_zstd,
    }
    if value in has and not has[value]():
        raise SettingError(f"{flag} {value}: its compression library is not installed")


def cache_root(flag: str, value: str) -> None:
    real = os.path.realpath(value)
    for forbidden in ("/", *FORBIDDEN_ROOTS):
        if real == forbidden or (forbidden != "/" and real.startswith(forbidden + "/")):
            raise SettingError(f"{flag} {value}: not a cache-file folder (it is {real})")
    if not os.path.isdir(real):
        raise SettingError(f"{flag} {value}: not a directory")


def writable_dir(flag: str, value: str) -> None:
    """A folder to write in: made if missing."""
    try:
        os.makedirs(value, exist_ok=True)
    except FileExistsError:  # a file, not a folder, of that name
        raise SettingError(f"{flag} {value}: not a directory") from None
    except OSError as exc:
        raise SettingError(f"{flag} {value}: {exc.strerror}") from None
    if not os.access(value, os.W_OK | os.X_OK):
        raise SettingError(f"{flag} {value}: not writable")


def distinct_files(outputs: list[tuple[str, str]]) -> None:
    """The (flag, path) outputs of one command (and `report`'s inputs) are different files: two
    writers of one file lose what the first wrote, a writer of an input replaces what it reads
    (a symlink or `./x` for `x` is the same file too)."""
    for i, (flag, value) in enumerate(outputs):
        for other_flag, other in outputs[:i]:
            if _same_file(value, other):
                raise SettingError(f"{other_flag} {other} and {flag} {value} are the same file")


def outside_folder(outputs: list[tuple[str, str]], folder_flag: str, folder: str) -> None:
    """No output lies in an input folder (`report --parquet`): written among the parts it
    would be read as one, or replace one (a symlink or `./` spelling is inside too)."""
    real = os.path.realpath(folder)
    for flag, value in outputs:
        where = os.path.realpath(value)
        if where == real or where.startswith(real.rstrip("/") + "/"):
            raise SettingError(f"{flag} {value} is inside {folder_flag} {folder}")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: where it will be
        return os.path.realpath(a) == os.path.realpath(b)


def small_file(value: str | os.PathLike[str]) -> bytes:
    """The bytes of a file of settings (`--config`, a password file). Only a regular file of at
    most MAX_SETTING_FILE bytes: /dev/zero never ends and a FIFO waits for a writer forever.
    OSError when it cannot be opened or read; SettingError (the reason, without the path)
    when it is not such a file."""
    # O_NONBLOCK: opening a FIFO does not wait for a writer before fstat refuses it.
    fd = os.open(value, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise SettingError("is a directory")
        if not stat.S_ISREG(mode):
            raise SettingError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, MAX_SETTING_FILE + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_SETTING_FILE:
                raise SettingError(f"larger than {MAX_SETTING_FILE} bytes")
    finally:
        os.close(fd)
    return b"".join(chunks)


def writable_file(flag: str, value: str) -> None:
    """A regular file to append to, or one that can be created: tried, not guessed (root passes
    every permission check, a read-only filesystem none). A file made to try is removed."""
    try:
        st = os.stat(value)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise SettingError(f"{flag} {value}: {exc.strerror}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise SettingError(f"{flag} {value}: is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise SettingError(f"{flag} {value}: not a regular file")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | (0 if st else os.O_CREAT | os.O_EXCL)
    # A symlink to a file not made yet is tried at the file it names: O_EXCL does not follow
    # the link (it said "File exists"), and the trial file removed must not be the link.
    target = value if st is not None else os.path.realpath(value)
    try:
        fd = os.open(target, flags, 0o644)
    except OSError as exc:
        raise SettingError(f"{flag} {value}: cannot write: {exc.strerror}") from None
    os.close(fd)
    if st is None:
        os.unlink(target)


def utf8(text: str) -> bool:
    """Whether text from the filesystem or the environment is UTF-8 (Python holds bytes that
    are not as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
