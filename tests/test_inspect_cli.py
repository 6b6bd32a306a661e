"""`hami-usage inspect` (and the parser) on bad paths and bad flags, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collector.layout.declarations import LAYOUTS
from collector.simulate import CacheWriter, SimDevice

MiB = 1 << 20
UUIDS = [
    "GPU-0b8a3c1e-5f2d-4a6b-9c7e-1d2f3a4b5c6d",
    "MIG-4f1b2c3d-aaaa-bbbb-cccc-111122223333",
    "GPU-7e6d5c4b-3a2f-4e1d-8c9b-0a1b2c3d4e5f",
]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "collector", *args], capture_output=True, text=True, timeout=60
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.stderr.endswith("\n")
    return lines[0]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "pod_ctr" / "gone.cache"
    proc = cli("inspect", "--json", str(path))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert str(path) in line
    assert "no such file" in line


def test_an_empty_path_is_refused_not_taken_for_the_current_folder() -> None:
    """It was `.: is a directory`, exit 1 (`Path("")` is `.`)."""
    proc = cli("inspect", "")
    assert proc.returncode == 2
    assert one_error_line(proc) == "hami-usage inspect: invalid setting path: must not be empty"


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_path_that_cannot_be_read_is_named_escaped_when_not_utf8(
    tmp_path: Path, kind: str
) -> None:
    """The line printed the surrogate the name is held as (`\\udcff`), not `\\xff`."""
    path = os.fsdecode(os.fsencode(tmp_path) + b"/bad\xff")
    if kind == "directory":
        os.mkdir(path)
    proc = subprocess.run([sys.executable, "-m", "collector", "inspect", path],
                          capture_output=True, timeout=60)  # fmt: skip
    why = {"missing": "no such file", "directory": "is a directory, not a cache file"}[kind]
    assert (proc.returncode, proc.stdout) == (1, b"")
    assert proc.stderr == f"hami-usage inspect: {tmp_path}/bad\\xff: {why}\n".encode()


def test_directory(tmp_path: Path) -> None:
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert str(tmp_path) in line
    assert "directory" in line


# Root reads past file modes by CAP_DAC_OVERRIDE (and enters folders by CAP_DAC_READ_SEARCH):
# a root run reads without both, as the collector's container would without them.
WITHOUT_DAC = [
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
    "--",
]


@pytest.mark.parametrize("how", ["file-mode-000", "directory-mode-000"])
def test_unreadable(tmp_path: Path, how: str) -> None:
    """A file or folder the reader may not open: exit 1, one line."""
    d = tmp_path / "pod_ctr"
    d.mkdir()
    path = d / "x.cache"
    CacheWriter(path, LAYOUTS["v1.2"], [SimDevice(UUIDS[0])]).close()
    locked = path if how == "file-mode-000" else d
    locked.chmod(0)
    prefix = WITHOUT_DAC if os.geteuid() == 0 else []
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "collector", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc)
    assert str(path) in line
    assert "Permission denied" in line


def test_symlink_loop(tmp_path: Path) -> None:
    """An open that fails with something other than ENOENT (here ELOOP): exit 1, one line."""
    path = tmp_path / "loop.cache"
    path.symlink_to(path)
    proc = cli("inspect", str(path))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert str(path) in line
    assert "cannot open" in line


@pytest.mark.parametrize("kind", ["fifo", "/dev/null", "/dev/zero"])
def test_not_a_regular_file_exits_1_with_one_line(tmp_path: Path, kind: str) -> None:
    """A FIFO named *.cache must not hang inspect, nor /dev/zero read forever: exit 1."""
    if kind == "fifo":
        path = tmp_path / "fifo.cache"
        os.mkfifo(path)
    else:
        path = Path(kind)
    proc = cli("inspect", "--json", str(path))
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"hami-usage inspect: {path}: not a regular file\n"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["inspect"],
        ["inspect", "--bogus", "x.cache"],
        ["inspect", "a.cache", "b.cache"],
        ["nosuchcommand"],
        ["simulate"],  # --root is required
        ["simulate", "--root", "/tmp/x", "--duration", "-1"],
        ["simulate", "--root", "/tmp/x", "--containers", "many"],
        ["simulate", "--root", "/tmp/x", "--layout", "v9"],
    ],
    ids=repr,
)
def test_bad_flags(args: list[str]) -> None:
    proc = cli(*args)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith("hami-usage")


@pytest.mark.parametrize("command", ["inspect", "simulate"])
def test_help(command: str) -> None:
    proc = cli(command, "--help")
    assert proc.returncode == 0
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"usage: hami-usage {command}")
    if command == "inspect":
        assert "--json" in proc.stdout
    else:
        assert "--root" in proc.stdout and "v1.1-interim" in proc.stdout


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_table(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], [SimDevice(u, 2 * 1024 * MiB) for u in UUIDS])
    w.add_process(42, 4242)
    w.add_memory(42, 1, "data", 300 * MiB)
    w.close()
    proc = cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    first = out.splitlines()[0]
    assert first.startswith(f"{path}: {LAYOUTS[name].file_size} bytes, layout {name}")
    for u in UUIDS:
        assert u in out
    assert "4242" in out and "300.0" in out
    if name == "v1.1-interim":
        assert "anomaly mislabelled_layout" in out
    else:
        assert out.endswith("no anomalies\n")


def test_a_file_name_that_would_forge_or_hide_lines_is_shown_escaped(tmp_path: Path) -> None:
    """A tenant names its cache files: a newline and `ESC[8m` (which hides what follows on a
    terminal) once printed a forged clean header and hid the real anomaly."""
    path = tmp_path / "real.cache\nno anomalies\x1b[8m.cache"
    w = CacheWriter(path, LAYOUTS["v1.2"], [SimDevice("x" * 40, 2 * 1024 * MiB)])
    w.close()
    proc = cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path}/real.cache\\nno anomalies\\x1b[8m.cache: ")
    assert "\x1b" not in proc.stdout
    assert lines[-1].startswith("anomaly invalid_uuid: ")


def test_table_of_an_uninitialised_file(tmp_path: Path) -> None:
    path = tmp_path / "new.cache"
    path.write_bytes(b"\0" * 64)
    proc = cli("inspect", str(path))
    assert proc.returncode == 0
    assert "layout unknown" in proc.stdout
    assert "anomaly not_initialized" in proc.stdout


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_a_path_whose_name_is_not_utf8_is_shown_escaped(tmp_path: Path, as_json: bool) -> None:
    """README: every problem but an unopenable path is an anomaly, exit 0 (`--json` raised
    UnicodeEncodeError on the surrogates the name is held as)."""
    path = Path(os.fsdecode(os.fsencode(tmp_path) + b"/bad\xff.cache"))
    path.write_bytes(b"\0" * 64)
    proc = cli("inspect", *(["--json"] if as_json else []), str(path))
    assert (proc.returncode, proc.stderr) == (0, "")
    shown = f"{tmp_path}/bad\\xff.cache"
    if as_json:
        assert json.loads(proc.stdout)["path"] == shown
    else:
        assert proc.stdout.startswith(f"{shown}: 64 bytes, layout unknown\n")


def test_the_table_escapes_control_bytes_of_a_stored_uuid(tmp_path: Path) -> None:
    """A tenant's newline and ESC in a UUID forged a row of the table and coloured it."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS["v1.2"], [SimDevice(u, 2 * 1024 * MiB) for u in UUIDS])
    w.region.uuids[0].value = b"GPU-\n\x1b[31mFAKE ROW\x1b[0m\r"
    w.close()
    proc = cli("inspect", str(path))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines()[4] == (
        "  0  GPU-\\x0a\\x1b[31mFAKE ROW\\x1b[0m\\x0d              2048.0   100"
    )
