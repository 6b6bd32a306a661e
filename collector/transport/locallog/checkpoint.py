"""Consumer checkpoints of a log directory: `consumers/<group>.json`, replaced atomically."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec

CONSUMERS_DIR = "consumers"
CHECKPOINT_SUFFIX = ".json"
# Group names become file names, so they are kept to a portable, traversal-free alphabet.
GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


class CorruptCheckpointError(ValueError):
    """A consumer checkpoint file exists but cannot be decoded."""


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
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from exc


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
