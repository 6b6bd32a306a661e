"""Consumer checkpoints of a log directory: `consumers/<group>.json`, replaced atomically."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec

CONSUMERS_DIR = "consumers"
CHECKPOINT_SUFFIX = ".json"
# Group names become file names, so they are kept to a portable, traversal-free alphabet.
GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


class CorruptCheckpointError(ValueError):
    """A consumer checkpoint file exists but cannot be decoded, or read (`unreadable`: why)."""

    def __init__(self, message: str, unreadable: str | None = None) -> None:
        super().__init__(message)
        self.unreadable = unreadable


class GroupInUseError(Exception):
    """Another process reads the log as this consumer group; the message is one line."""


@contextlib.contextmanager
def group_lock(directory: Path, group: str) -> Iterator[None]:
    """Held while a process reads the log as `group` and commits its checkpoint: two of them
    would each bill the whole log and overwrite each other's checkpoint. OSError (with the
    lock file's name) when it cannot be made."""
    path = checkpoint_path(directory, group).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GroupInUseError(
                f"group {group} of {directory} is in use by another aggregator"
            ) from None
        yield
    finally:
        os.close(fd)


class Checkpoint(msgspec.Struct, frozen=True):
    offset: Annotated[int, msgspec.Meta(ge=0)]
    metadata: str = ""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Checkpoint)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(directory: Path, group: str) -> Path:
    if not GROUP_NAME.match(group):
        raise ValueError(f"invalid consumer group name {group!r}")
    return directory / CONSUMERS_DIR / f"{group}{CHECKPOINT_SUFFIX}"


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint, None when there is none; CorruptCheckpointError when the path holds
    something else (a folder, a FIFO that would wait for a writer, a device that never ends)
    or cannot be read."""
    try:
        data = _read_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise CorruptCheckpointError(f"{path}: {why}", why) from None
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from exc


def _read_regular(path: Path) -> bytes:
    # O_NONBLOCK: opening a FIFO does not wait for a writer before fstat refuses it.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def store_checkpoint(path: Path, group: str, checkpoint: Checkpoint) -> None:
    """After a crash the file holds the old or the new checkpoint, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _encoder.encode(checkpoint)
    # Temp names start with a dot and do not end in .json, so no reader mistakes them for
    # a checkpoint if a crash leaves one behind.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{group}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
