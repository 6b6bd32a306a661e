"""Bad settings: one line on stderr, exit 2, no traceback, no hang, nothing started.

Each case runs the real `hami-usage` command with a timeout; every value below once crashed
with a traceback, hung, or was accepted.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from collector.settings_check import SettingError, writable_file
from collector.transport.security import KafkaSecurity

HAMI_USAGE = Path(sys.executable).parent / "hami-usage"
LONG_NODE = "n" * 70_000


def run(
    *args: str, cwd: Path, node: str = "node-a", extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The command, with a clean environment, bounded in time: a hang fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
    env["NODE_NAME"] = node
    env.update(extra_env or {})
    argv = [str(HAMI_USAGE), *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def assert_one_line(proc: subprocess.CompletedProcess[str], expected: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", expected + "\n")


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "root"
    root.mkdir()
    log = tmp_path / "log"
    log.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {"root": str(root), "log": str(log), "dir": str(tmp_path), "file": str(a_file)}


COLLECT = [
    (["--interval", "inf"], "invalid setting interval: Expected `float` <= 3600.0"),
    (["--heartbeat", "1e300"], "invalid setting heartbeat: Expected `float` <= 86400.0"),
    (["--kafka", "garbage,,:"], "invalid setting kafka: 'garbage' is not host:port"),
    (
        ["--kafka", "not-a-host:99999"],
        "invalid setting kafka: port 99999 of 'not-a-host:99999' is outside 1..65535",
    ),
    (
        ["--compression", "brotli"],
        "invalid setting compression: 'brotli' is not one of gzip, snappy, lz4, zstd, none",
    ),
    (
        ["--node", LONG_NODE],
        "invalid setting node: 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'... "
        "is not 1 to 253 printable characters without spaces",
    ),
    (
        ["--node", ""],
        "invalid setting node: must not be empty (leave it out: $NODE_NAME, else host name)",
    ),
    (
        ["--topic", "a/b"],
        "invalid setting topic: 'a/b' is not 1 to 249 of the characters A-Z a-z 0-9 . _ -",
    ),  # fmt: skip
    (
        ["--log-max-bytes", str(2**60)],
        "invalid setting log_max_bytes: Expected `int` <= 1125899906842624",
    ),  # fmt: skip
    (
        ["--metrics-bind-address", "not an address"],
        "invalid setting metrics_bind_address: 'not an address' is not an IP address or host name",
    ),  # fmt: skip
    (["--root", "/proc"], "--root /proc: not a cache-file folder (it is /proc)"),
    (["--root", "/proc/self"], "--root /proc/self: not a cache-file folder (it is /proc/{pid})"),
    (["--root", "/"], "--root /: not a cache-file folder (it is /)"),
]


@pytest.mark.parametrize("args,message", COLLECT, ids=lambda v: repr(v)[:40])
def test_collect(paths: dict[str, str], tmp_path: Path, args: list[str], message: str) -> None:
    base = ["collect", "--root", paths["root"], "--log", paths["log"], "--max-scans", "1"]
    if "--root" in args:
        base = ["collect", "--log", paths["log"], "--max-scans", "1"]
    proc = run(*base, *args, cwd=tmp_path)
    if "{pid}" in message:
        real = proc.stderr.rsplit("(it is ", 1)[-1].rstrip(")\n")
        message = message.replace("/proc/{pid}", real)
    assert_one_line(proc, "hami-usage collect: " + message)
    assert os.listdir(paths["log"]) == []  # nothing started


def test_collect_node_name_from_the_environment_is_checked_too(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    args = ["collect", "--root", str(root), "--log", str(tmp_path / "log")]
    proc = run(*args, cwd=tmp_path, node="bad node")
    assert_one_line(
        proc,
        "hami-usage collect: node: 'bad node' is not 1 to 253 printable characters without "
        "spaces (from $NODE_NAME or the host name)",
    )
    assert not (tmp_path / "log").exists()  # (checked before --log is made)
    # An empty $NODE_NAME (a fieldRef gone wrong) was taken for the host name.
    proc = run(*args, cwd=tmp_path, node="")
    assert_one_line(
        proc, "hami-usage collect: node: must not be empty (from $NODE_NAME or the host name)"
    )
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("where", ["flag", "env", "toml"])
def test_an_empty_node_is_refused_wherever_it_is_set(
    paths: dict[str, str], tmp_path: Path, where: str
) -> None:
    """From the environment or TOML it was silently taken for the host name."""
    config = tmp_path / "c.toml"
    config.write_text('[collect]\nnode = ""\n')
    args = {"flag": ["--node", ""], "env": [], "toml": ["--config", str(config)]}[where]
    env = {"HAMI_USAGE_NODE": ""} if where == "env" else {}
    proc = run("collect", "--root", paths["root"], "--log", paths["log"], "--max-scans", "1",
               *args, cwd=tmp_path, extra_env=env)  # fmt: skip
    assert_one_line(
        proc,
        "hami-usage collect: invalid setting node: must not be empty "
        "(leave it out: $NODE_NAME, else host name)",
    )
    assert os.listdir(paths["log"]) == []


@pytest.mark.parametrize("command", ["collect", "aggregate"])
@pytest.mark.parametrize("host", ["127.0.0.1", "no.such.host.invalid"])
def test_a_listener_that_cannot_start_is_one_line_and_makes_no_folder(
    paths: dict[str, str], tmp_path: Path, command: str, host: str
) -> None:
    """A port in use, or a bind address that does not resolve: one line, exit 2, and (tried
    before any folder is made) the new --log or --parquet folder is not left behind, as it
    was, holding the local log's first segment and lock."""
    flag = {"collect": "--metrics", "aggregate": "--health"}[command]
    made = tmp_path / "made"
    args = {
        "collect": ["--root", paths["root"], "--log", str(made), "--max-scans", "1", "--no-nvml"],
        "aggregate": ["--log", paths["log"], "--parquet", str(made), "--drain"],
    }[command]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(command, *args, f"{flag}-port", str(port), f"{flag}-bind-address", host,
                   cwd=tmp_path)  # fmt: skip
    said = f"hami-usage {command}: {flag}-port {port} on {host}: "
    if host == "127.0.0.1":
        assert_one_line(proc, said + "Address already in use")
    else:  # (the resolver's words: "Name or service not known", or a failure to ask)
        assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(said) and proc.stderr.count("\n") == 1, proc.stderr
    assert not made.exists()


AGGREGATE = [
    (["--max-gap", "inf"], "invalid setting max_gap: Expected `float` <= 604800.0"),
    (["--window", "1e12"], "invalid setting window: Expected `float` <= 3600.0"),
    # a record's integrals hold 2**63 - 1 byte-ms: a day's of a busy 141 GB GPU was refused
    (["--window", "86400"], "invalid setting window: Expected `float` <= 3600.0"),
    (["--lateness", "1e300"], "invalid setting lateness: Expected `float` <= 86400.0"),
    (
        ["--group", "../x"],
        "invalid setting group: '../x' is not 1 to 249 of the characters A-Z a-z 0-9 . _ -",
    ),  # fmt: skip
    (["--group", ".."], "invalid setting group: '..' is not a name"),
    (["--otlp", "notaurl"], "invalid setting otlp: 'notaurl' is not an http(s) URL"),
    (
        ["--otlp", "http://a b:4318"],
        "invalid setting otlp: 'http://a b:4318' does not name a valid host",
    ),
    (
        ["--otlp", "ftp://x/v1/metrics"],
        "invalid setting otlp: 'ftp://x/v1/metrics' is not an http(s) URL",
    ),  # fmt: skip
    (["--kafka", "garbage,,:"], "invalid setting kafka: 'garbage' is not host:port"),
    (
        ["--instance", "a b"],
        "invalid setting instance: 'a b' is not 1 to 249 of the characters A-Z a-z 0-9 . _ -",
    ),  # fmt: skip
    (  # it names the replica's Parquet parts: a traceback at the first write
        ["--instance", "a/b"],
        "invalid setting instance: 'a/b' is not 1 to 249 of the characters A-Z a-z 0-9 . _ -",
    ),  # fmt: skip
    (["--instance", ".."], "invalid setting instance: '..' is not a name"),
    (  # it wrote its billing records among the events it reads
        ["--billing-topic", "hami.usage.v1"],
        "invalid setting billing_topic: 'hami.usage.v1' is the usage topic (topic) too",
    ),  # fmt: skip
    (  # it read the topic and left the log, or the other way round, unsaid
        ["--kafka", "localhost:9"],
        "--log reads the local log and --kafka the usage topic: give one of them",
    ),  # fmt: skip
    (["--csv", "{dir}"], "--csv {dir}: is a directory"),
    (["--jsonl", "/sys/x.jsonl"], "--jsonl /sys/x.jsonl: cannot write: Permission denied"),
    (
        ["--jsonl", "{dir}/missing/x.jsonl"],
        "--jsonl {dir}/missing/x.jsonl: cannot write: No such file or directory",
    ),  # fmt: skip
    (["--csv", "/dev/null"], "--csv /dev/null: not a regular file"),
    (["--parquet", ""], "invalid setting parquet: must not be empty"),  # not Parquet off
    (["--parquet", "{file}"], "--parquet {file}: not a directory"),
    (["--parquet", "/proc/x"], "--parquet /proc/x: No such file or directory"),
    (
        ["--window", "0.0005"],
        "invalid setting window: must be a whole number of milliseconds, got 0.0005",
    ),  # fmt: skip
    (
        ["--window", "0.0015"],
        "invalid setting window: must be a whole number of milliseconds, got 0.0015",
    ),  # fmt: skip
    (
        ["--max-gap", "0.0004"],
        "invalid setting max_gap: must be a whole number of milliseconds, got 0.0004",
    ),  # fmt: skip
]


@pytest.mark.parametrize("args,message", AGGREGATE, ids=lambda v: repr(v)[:40])
def test_aggregate(paths: dict[str, str], tmp_path: Path, args: list[str], message: str) -> None:
    args = [a.replace("{dir}", paths["dir"]).replace("{file}", paths["file"]) for a in args]
    proc = run("aggregate", "--log", paths["log"], "--drain", *args, cwd=tmp_path)
    message = message.replace("{dir}", paths["dir"]).replace("{file}", paths["file"])
    assert_one_line(proc, "hami-usage aggregate: " + message)
    assert os.listdir(paths["log"]) == []  # no checkpoint written: nothing started


def test_an_output_that_is_a_symlink_to_a_file_not_made_yet_is_writable(tmp_path: Path) -> None:
    """`billing.csv -> /mnt/vol/billing-2026-12.csv`, the file not made yet: the trial open's
    O_EXCL does not follow a symlink, so every output flag said "cannot write: File exists",
    exit 2. The trial is made at the file the link names, and removed there: the link stays."""
    (tmp_path / "vol").mkdir()
    link = tmp_path / "billing.csv"
    link.symlink_to(tmp_path / "vol" / "billing-2026-12.csv")
    writable_file("--csv", str(link))
    assert link.is_symlink() and os.listdir(tmp_path / "vol") == []
    (tmp_path / "log").mkdir()
    proc = run("replay", "--log", str(tmp_path / "log"), "--from", "2026-12-01", "--to",
               "2026-12-02", "--csv", str(link), cwd=tmp_path)  # fmt: skip
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (
        0, "replay: 0 records; damage: none"
    )  # fmt: skip
    written = (tmp_path / "vol" / "billing-2026-12.csv").read_text()
    assert written.startswith("window_start,window_end,node,")
    nowhere = tmp_path / "nowhere.csv"
    nowhere.symlink_to(tmp_path / "no-such-folder" / "x.csv")
    with pytest.raises(SettingError, match="nowhere.csv: cannot write: No such file or dir"):
        writable_file("--csv", str(nowhere))


def test_aggregate_refuses_a_local_log_it_cannot_write_its_checkpoint_in() -> None:
    """The checkpoint goes in `<log>/consumers`: a log folder the aggregator cannot write in
    was a PermissionError traceback after its outputs were opened. (Not under pytest's own
    folder, which no other user can enter: as root the command runs as nobody.)"""
    base = Path(tempfile.mkdtemp(prefix="hami-usage-ro-"))
    try:
        base.chmod(0o755)
        log = base / "log"
        log.mkdir(mode=0o555)
        log.chmod(0o555)  # (whatever the umask)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
        argv = [*(as_nobody if os.geteuid() == 0 else []), str(HAMI_USAGE), "aggregate"]
        argv += ["--log", str(log), "--drain"]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=base, timeout=60)
        assert_one_line(proc, f"hami-usage aggregate: --log {log}: {log} is not writable")
    finally:
        shutil.rmtree(base)


def test_an_empty_parquet_from_the_environment_is_refused_too(
    paths: dict[str, str], tmp_path: Path
) -> None:
    proc = run("aggregate", "--log", paths["log"], "--drain", cwd=tmp_path,
               extra_env={"HAMI_USAGE_PARQUET": ""})  # fmt: skip
    assert_one_line(proc, "hami-usage aggregate: invalid setting parquet: must not be empty")


@pytest.mark.parametrize("window", ["16.1", "1.005", "32.2"])
def test_a_window_of_whole_milliseconds_is_accepted(
    paths: dict[str, str], tmp_path: Path, window: str
) -> None:
    """16.1 * 1000 is 16100.000000000002 as a float: the test is on the decimal written."""
    proc = run("aggregate", "--log", paths["log"], "--drain", "--window", window,
               "--csv", str(tmp_path / "o.csv"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "milliseconds" not in proc.stderr


def test_a_local_log_aggregate_with_no_output_is_refused(
    paths: dict[str, str], tmp_path: Path
) -> None:
    """Its checkpoint moved on past every window closed, and the records went nowhere: a later
    run of the group with --csv wrote none of them (56 records gone in the report)."""
    proc = run("aggregate", "--log", paths["log"], "--drain", cwd=tmp_path)
    assert_one_line(
        proc,
        "hami-usage aggregate: with a local log, give --csv FILE, --jsonl FILE or --parquet DIR "
        "(there is no billing topic)",
    )
    assert os.listdir(paths["log"]) == []  # no checkpoint


def test_the_whole_milliseconds_rule_is_the_settings_own() -> None:
    """TOML, the environment and flags alike, `aggregate` and `replay` alike."""
    from collector.config import AggregateConfig, ConfigError, ReplayConfig, load

    for cls in (ReplayConfig, AggregateConfig):
        for ok in ("16.1", "1.005", "32.2", "0.001", "60"):
            assert load(cls, "replay", env={"HAMI_USAGE_WINDOW": ok}).window == float(ok)
        with pytest.raises(ConfigError, match="window: must be a whole number of milliseconds"):
            load(cls, "replay", env={"HAMI_USAGE_WINDOW": "0.0015"})


def test_replay_checks_its_outputs_and_numbers(paths: dict[str, str], tmp_path: Path) -> None:
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    proc = run("replay", "--log", paths["log"], *span, "--csv", paths["dir"], cwd=tmp_path)
    assert_one_line(proc, f"hami-usage replay: --csv {paths['dir']}: is a directory")
    csv = str(tmp_path / "out.csv")
    proc = run("replay", "--log", paths["log"], *span, "--csv", csv, "--max-gap", "inf",
               cwd=tmp_path)  # fmt: skip
    assert_one_line(proc, "hami-usage replay: invalid setting max_gap: Expected `float` <= "
                          "604800.0")  # fmt: skip
    assert not Path(csv).exists()


@pytest.mark.parametrize("where", ["env", "toml"])
def test_replay_replaces_no_output_it_was_not_given_by_flag(
    paths: dict[str, str], tmp_path: Path, where: str
) -> None:
    """An aggregator's CSV named by HAMI_USAGE_CSV (or its config) was cut to the range's
    records by a replay run beside it with only --jsonl given, exit 0."""
    live = tmp_path / "live.csv"
    live.write_text("the aggregator's records\n")
    config = tmp_path / "c.toml"
    config.write_text(f'[replay]\ncsv = "{live}"\n')
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    args = ["--config", str(config)] if where == "toml" else []
    env = {"HAMI_USAGE_CSV": str(live)} if where == "env" else {}
    proc = run("replay", "--log", paths["log"], *span, "--jsonl", str(tmp_path / "r.jsonl"),
               *args, cwd=tmp_path, extra_env=env)  # fmt: skip
    assert_one_line(
        proc,
        f"hami-usage replay: --csv {live} (from the environment or --config) is not empty: "
        "replay replaces its output, so only one given as --csv",
    )
    assert live.read_text() == "the aggregator's records\n"
    assert not (tmp_path / "r.jsonl").exists()
    # Given as a flag, it is replaced, as the README says (a range's new file).
    proc = run("replay", "--log", paths["log"], *span, "--csv", str(live), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert live.read_text().startswith("window_start,")


def test_replay_refuses_a_log_beside_a_broker_from_the_environment(
    paths: dict[str, str], tmp_path: Path
) -> None:
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    csv = str(tmp_path / "out.csv")
    proc = run("replay", "--log", paths["log"], *span, "--csv", csv, cwd=tmp_path,
               extra_env={"HAMI_USAGE_KAFKA": "localhost:9"})  # fmt: skip
    assert_one_line(
        proc, "hami-usage replay: --log reads the local log and --kafka the usage topic: "
        "give one of them"
    )  # fmt: skip
    assert not Path(csv).exists()
    # the environment's broker alone is read, the flag's log alone too (no broker at :9)
    proc = run("replay", "--log", paths["log"], *span, "--csv", csv, cwd=tmp_path)
    assert (proc.returncode, Path(csv).exists()) == (0, True), proc.stderr


@pytest.mark.parametrize("command", ["aggregate", "replay", "report"])
@pytest.mark.parametrize("how", ["same", "dot-slash", "symlink", "new"])
def test_two_outputs_that_are_one_file_are_refused(
    paths: dict[str, str], tmp_path: Path, command: str, how: str
) -> None:
    """The second writer replaced what the first wrote (the CSV was lost without a word)."""
    out = tmp_path / "out"
    if how != "new":
        out.write_text("")
    second = {"same": "out", "dot-slash": "./out", "symlink": "link", "new": "out"}[how]
    (tmp_path / "link").symlink_to("out")
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    first, other = ("--out-csv", "--html") if command == "report" else ("--csv", "--jsonl")
    args = {
        "aggregate": ["--log", paths["log"], "--drain"],
        "replay": ["--log", paths["log"], *span],
        "report": [*span, "--csv", paths["file"]],
    }[command]
    proc = run(command, *args, first, "out", other, second, cwd=tmp_path)
    assert_one_line(
        proc, f"hami-usage {command}: {first} out and {other} {second} are the same file"
    )
    assert os.listdir(paths["log"]) == []
    assert sorted(os.listdir(tmp_path)) == sorted(["a-file", "link", "log", "root"]
                                                  + (["out"] if how != "new" else []))  # fmt: skip


@pytest.mark.parametrize("inside", ["spool", ".", "pod_x/spool"])
def test_a_collector_log_inside_its_root_is_refused(
    paths: dict[str, str], tmp_path: Path, inside: str
) -> None:
    """The collector never writes below the root: `--log ROOT/spool` put its spool among HAMi's
    container folders (exit 0)."""
    root = Path(paths["root"])
    log = os.path.normpath(root / inside)
    proc = run("collect", "--root", str(root), "--log", log, "--max-scans", "1", cwd=tmp_path)
    assert_one_line(proc, f"hami-usage collect: --log {log} is inside --root {root}")
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    ("command", "flag"),
    [(c, f) for c in ("aggregate", "replay") for f in ("--csv", "--jsonl")]
    + [("aggregate", "--parquet")],  # (replay writes no Parquet)
)
def test_an_output_inside_the_log_it_reads_is_refused(
    paths: dict[str, str], tmp_path: Path, command: str, flag: str
) -> None:
    """`--csv LOG/00000000000000000000.log` replaced the log's only segment with CSV text (exit
    0), and every later start exited 3 on the torn segment."""
    log = Path(paths["log"])
    segment = log / "00000000000000000000.log"
    segment.write_bytes(b"")
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    extra = ["--drain"] if command == "aggregate" else span
    proc = run(command, "--log", str(log), *extra, flag, str(segment), cwd=tmp_path)
    assert_one_line(proc, f"hami-usage {command}: {flag} {segment} is inside --log {log}")
    assert os.listdir(log) == [segment.name] and segment.read_bytes() == b""


def test_topics_refuses_one_topic_for_usage_and_billing(tmp_path: Path) -> None:
    """`--apply` created the one and failed on the other (a broker error, exit 1)."""
    config = tmp_path / "c.toml"
    config.write_text('[topics]\ntopic = "t"\nbilling_topic = "t"\n')
    proc = run("topics", "--config", str(config), "--kafka", "127.0.0.1:9", "--apply",
               cwd=tmp_path)  # fmt: skip
    assert_one_line(
        proc, "hami-usage topics: invalid setting billing_topic: 't' is the usage topic (topic) too"
    )


def test_topics_refuses_a_retention_that_rounds_to_no_millisecond(tmp_path: Path) -> None:
    """1e-9 days passed `> 0` and planned retention.ms=0."""
    proc = run("topics", "--kafka", "127.0.0.1:9", "--usage-retention-days", "1e-9", cwd=tmp_path)
    assert_one_line(
        proc,
        "hami-usage topics: invalid setting usage_retention_days: 1e-09 days is less than 1 ms",
    )


@pytest.mark.parametrize("name", ["replication_factor", "min_insync_replicas"])
def test_topics_refuses_more_replicas_than_kafkas_16_bit_field_holds(
    tmp_path: Path, name: str
) -> None:
    """`--replication-factor 40000 --apply` was a traceback from the request's int16 encoder."""
    flag = "--" + name.replace("_", "-")
    proc = run("topics", "--kafka", "127.0.0.1:9", flag, "32768", "--apply", cwd=tmp_path)
    assert_one_line(proc, f"hami-usage topics: invalid setting {name}: Expected `int` <= 32767")


@pytest.mark.parametrize("window", ["0.0005", "0.0015"])
def test_replay_refuses_a_window_of_part_of_a_millisecond(
    paths: dict[str, str], tmp_path: Path, window: str
) -> None:
    """0.0005 once rounded to a 0 ms window (a traceback), 0.0015 silently to 2 ms."""
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    csv = str(tmp_path / "out.csv")
    proc = run("replay", "--log", paths["log"], *span, "--csv", csv, "--window", window,
               cwd=tmp_path)  # fmt: skip
    assert_one_line(proc, "hami-usage replay: invalid setting window: must be a whole number "
                          f"of milliseconds, got {window}")  # fmt: skip
    assert not Path(csv).exists()


@pytest.mark.parametrize("command", ["collect", "aggregate", "replay", "topics", "demo", "report"])
def test_a_config_file_that_is_not_utf8(tmp_path: Path, command: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_bytes(b"[x]\nkey = '\xff'\n")  # offset 11
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    extra = {
        "collect": ["--root", str(tmp_path), "--log", str(tmp_path / "log")],
        "replay": [*span, "--csv", str(tmp_path / "o.csv")],
        "topics": ["--kafka", "127.0.0.1:9"],
        "demo": ["--out", str(tmp_path / "demo")],
        "report": [*span, "--csv", str(tmp_path / "in.csv")],
    }.get(command, [])
    proc = run(command, "--config", str(config), *extra, cwd=tmp_path)
    assert_one_line(proc, f"hami-usage {command}: config {config}: not UTF-8 text (byte 11)")
    # An integer past Python's 4 300 digits: a ValueError's traceback, exit 1.
    config.write_text(f"[{command}]\nx = {'1' * 5000}\n")
    proc = run(command, "--config", str(config), *extra, cwd=tmp_path)
    assert_one_line(
        proc, f"hami-usage {command}: config {config}: an integer of more than 4300 digits"
    )


def _not_a_settings_file(tmp_path: Path, kind: str) -> tuple[str, str]:
    """(path, why) of something a settings file must not be: /dev/zero never ends (a
    MemoryError), a FIFO waits for a writer (it hung), and a file over 1 MiB is no config."""
    if kind == "dev-zero":
        return "/dev/zero", "not a regular file"
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
        return str(path), "not a regular file"
    if kind == "folder":
        path.mkdir()
        return str(path), "is a directory"
    path.write_bytes(b"#" * (1 << 20) + b"\n")
    return str(path), "larger than 1048576 bytes"


KINDS = ["dev-zero", "fifo", "folder", "over-1-MiB"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_that_is_no_regular_file_of_at_most_1_mib(tmp_path: Path, kind: str) -> None:
    config, why = _not_a_settings_file(tmp_path, kind)
    proc = run("topics", "--config", config, "--kafka", "127.0.0.1:9", cwd=tmp_path)
    assert_one_line(proc, f"hami-usage topics: config {config}: {why}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_password_file_that_is_no_regular_file_of_at_most_1_mib(
    tmp_path: Path, kind: str
) -> None:
    secret, why = _not_a_settings_file(tmp_path, kind)
    proc = run(*SASL, secret, cwd=tmp_path)
    assert_one_line(proc, f"hami-usage aggregate: kafka_password_file {secret}: {why}")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--root", "{file}"], "hami-usage simulate: --root {file}: not a directory"),
        (
            ["--root", "{dir}", "--interval", "inf"],
            "argument --interval: must be > 0 and <= 86400, got inf",
        ),  # fmt: skip
        (
            ["--root", "{dir}", "--containers", "100000"],
            "argument --containers: must be > 0 and <= 4096, got 100000",
        ),  # fmt: skip
    ],
    ids=["root-a-file", "interval-inf", "containers"],
)
def test_simulate(paths: dict[str, str], tmp_path: Path, args: list[str], message: str) -> None:
    args = [a.replace("{file}", paths["file"]).replace("{dir}", paths["dir"]) for a in args]
    proc = run("simulate", "--duration", "1", *args, cwd=tmp_path)
    message = message.replace("{file}", paths["file"])
    if message.startswith("argument"):
        message = "hami-usage simulate: " + message
    assert_one_line(proc, message)


def test_simulate_with_a_file_where_a_container_folder_goes(tmp_path: Path) -> None:
    """Found while writing, not at start: one line and exit 1 (a FileExistsError traceback)."""
    assert run("simulate", "--root", "probe", "--containers", "1", "--duration", "1",
               cwd=tmp_path).returncode == 0  # fmt: skip
    (name,) = os.listdir(tmp_path / "probe")  # the same seed names the same folder
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / name).write_text("")
    proc = run("simulate", "--root", "root", "--containers", "1", "--duration", "1", cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1, "", f"hami-usage simulate: root/{name}: not a directory\n"
    )  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        (["schema", "--out", "{file}"], "hami-usage schema: --out {file}: not a directory"),
        (
            ["schema", "--out", "/proc/x"],
            "hami-usage schema: --out /proc/x: No such file or directory",
        ),  # fmt: skip
        (["schema", "--out", ""], "hami-usage schema: invalid setting out: must not be empty"),
        (["demo", "--out", "{file}"], "hami-usage demo: --out {file}: not a directory"),
        (["demo", "--out", ""], "hami-usage demo: invalid setting out: must not be empty"),
        (
            ["simulate", "--duration", "1", "--root", "/proc/x"],
            "hami-usage simulate: --root /proc/x: No such file or directory",
        ),
        (
            ["simulate", "--duration", "1", "--root", ""],
            "hami-usage simulate: invalid setting root: must not be empty",
        ),
        (
            ["demo", "--out", "{dir}/demo", "--kafka", "bad"],
            "hami-usage demo: invalid setting kafka: 'bad' is not host:port",
        ),
        (
            ["demo", "--out", "{dir}/demo", "--kafka", "localhost:99999"],
            "hami-usage demo: invalid setting kafka: port 99999 of 'localhost:99999' is outside "
            "1..65535",
        ),
    ],
    ids=lambda v: repr(v)[:50],
)
def test_output_folders_and_demo_kafka_are_checked_first(
    paths: dict[str, str], tmp_path: Path, args: list[str], message: str
) -> None:
    """Each once a traceback, wrapped the port, or (an empty folder) wrote into the current
    directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run(*(a.format(**paths) for a in args), cwd=cwd)
    assert_one_line(proc, message.format(**paths))
    assert os.listdir(cwd) == []
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("name", ["events.schema.json", "billing.schema.json"])
def test_schema_refuses_a_folder_where_a_schema_goes(tmp_path: Path, name: str) -> None:
    """An IsADirectoryError traceback, after the other schema was written."""
    (tmp_path / "out" / name).mkdir(parents=True)
    proc = run("schema", "--out", "out", cwd=tmp_path)
    assert_one_line(proc, f"hami-usage schema: --out out/{name}: is a directory")
    assert os.listdir(tmp_path / "out") == [name]


@pytest.mark.parametrize("name", ["billing.csv", "bill.csv", "report.html"])
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_demo_refuses_what_it_cannot_write_in_its_folder(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A folder there was an IsADirectoryError traceback (for the bill and the report, after
    the whole run); a FIFO there held the demo for good, waiting for a reader."""
    path = tmp_path / "out" / name
    path.parent.mkdir()
    if kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    proc = run("demo", "--duration", "5", "--out", "out", cwd=tmp_path)
    why = "is a directory" if kind == "folder" else "not a regular file"
    assert_one_line(proc, f"hami-usage demo: --out out/{name}: {why}")
    assert os.listdir(tmp_path / "out") == [name]


def test_demo_duration_is_bounded(tmp_path: Path) -> None:
    proc = run("demo", "--duration", "inf", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert_one_line(proc, "hami-usage demo: argument --duration: must be > 0 and <= 86400, got inf")


@pytest.mark.parametrize(
    "args",
    [
        ["aggregate", "--log", "{log}", "--kafka-password", "s3cret-value"],  # not ..-file
        ["collect", "--root", "{root}", "--log", "{log}", "--kafka-password=s3cret-value"],
        ["collect", "--root", "{root}", "--log", "{log}", "--kafka-pass", "s3cret-value"],
        ["aggregate", "--log", "{log}", "--drain", "s3cret-value"],
        ["topics", "--kafka", "127.0.0.1:9", "--kafka-password", "-s3cret-value"],
    ],
)
def test_a_secret_given_to_an_option_that_does_not_exist_is_never_echoed(
    paths: dict[str, str], tmp_path: Path, args: list[str]
) -> None:
    proc = run(*(a.format(**paths) for a in args), cwd=tmp_path)
    unknown = [a.partition("=")[0] for a in args[2:] if a.startswith("--kafka-pass")]
    shown = " ".join(unknown) or "(values not shown)"
    assert_one_line(proc, f"hami-usage: unrecognized arguments: {shown}")
    assert "s3cret" not in proc.stderr


def test_a_secret_given_to_an_on_off_flag_is_never_echoed(
    paths: dict[str, str], tmp_path: Path
) -> None:
    proc = run("aggregate", "--log", paths["log"], "--drain=s3cret-value", cwd=tmp_path)
    assert_one_line(
        proc, "hami-usage aggregate: argument --drain: ignored explicit argument (value not shown)"
    )
    assert "s3cret" not in proc.stderr


def test_a_secret_where_the_subcommand_goes_is_never_echoed(tmp_path: Path) -> None:
    proc = run("--kafka-password", "s3cret-value", "topics", "--kafka", "127.0.0.1:9", cwd=tmp_path)
    assert_one_line(
        proc,
        "hami-usage: argument command: invalid choice (choose from 'inspect', 'simulate', "
        "'collect', 'aggregate', 'replay', 'demo', 'topics', 'decode', 'report', 'schema')",
    )
    assert "s3cret" not in proc.stderr


def test_an_encrypted_client_key_is_one_line_not_a_passphrase_prompt(tmp_path: Path) -> None:
    """OpenSSL asks for the passphrase on the terminal when nothing answers for it: with one
    the command hung, without one it printed the prompt and a misleading reason."""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out",
         str(cert), "-subj", "/CN=client", "-days", "1", "-passout", "pass:s3cret-value"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    proc = run(
        "topics", "--kafka", "127.0.0.1:9", "--kafka-security-protocol", "SSL",
        "--kafka-cert-file", str(cert), "--kafka-key-file", str(key), cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(
        proc, "hami-usage topics: kafka_key_file is encrypted: give an unencrypted PEM key"
    )


def test_a_password_file_and_a_password_in_the_environment_are_one_or_the_other(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret-value\n")
    proc = run(*SASL, str(secret), cwd=tmp_path,
               extra_env={"HAMI_USAGE_KAFKA_PASSWORD": "other-value"})  # fmt: skip
    assert_one_line(
        proc,
        "hami-usage aggregate: set kafka_password_file or HAMI_USAGE_KAFKA_PASSWORD, not both",
    )
    assert "s3cret" not in proc.stderr and "other-value" not in proc.stderr


REPORT_SPAN = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_prices_file_that_is_no_regular_file_of_at_most_1_mib(
    paths: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """Read as --config is: a FIFO hung the report, /dev/zero was read without bound."""
    prices, why = _not_a_settings_file(tmp_path, kind)
    proc = run("report", *REPORT_SPAN, "--csv", paths["file"], "--prices", prices, cwd=tmp_path)
    assert_one_line(proc, f"hami-usage report: prices {prices}: {why}")


def test_a_prices_file_that_is_not_utf8_is_one_line_naming_it(
    paths: dict[str, str], tmp_path: Path
) -> None:
    """The line was the codec's ("'utf-8' codec can't decode ..."), without the file."""
    prices = tmp_path / "prices.toml"
    prices.write_bytes(b'currency = "USD"\n\xff')
    proc = run("report", *REPORT_SPAN, "--csv", paths["file"], "--prices", str(prices),
               cwd=tmp_path)  # fmt: skip
    assert_one_line(proc, f"hami-usage report: prices {prices}: not UTF-8 text (byte 17)")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--csv", "in", "--out-csv", "in"], "--csv in and --out-csv in are the same file"),
        (["--jsonl", "in", "--html", "./in"], "--jsonl in and --html ./in are the same file"),
        (["--csv", "in", "--html", "link"], "--csv in and --html link are the same file"),
        (["--csv", "in", "--jsonl", "link"], "--csv in and --jsonl link are the same file"),
        (["--csv", "in", "--csv", "./in"], "--csv in and --csv ./in are the same file"),
        (["--parquet", "pq", "--out-csv", "pq/x.csv"], "--out-csv pq/x.csv is inside --parquet pq"),
        (
            ["--parquet", "link-pq", "--html", "pq/day=2024-01-01/x.html"],
            "--html pq/day=2024-01-01/x.html is inside --parquet link-pq",
        ),
    ],
    ids=["csv-out", "jsonl-html", "symlink", "input-twice-linked", "input-twice", "in-parquet",
         "in-parquet-linked"],
)  # fmt: skip
def test_report_refuses_an_output_that_is_one_of_its_inputs(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """`--csv in --out-csv in` replaced the billing records with the bill, exit 0; an input
    given twice was billed twice. Refused before anything is read or written."""
    (tmp_path / "in").write_text("x\n")
    (tmp_path / "link").symlink_to("in")
    (tmp_path / "pq" / "day=2024-01-01").mkdir(parents=True)
    (tmp_path / "link-pq").symlink_to("pq")
    proc = run("report", *REPORT_SPAN, *args, cwd=tmp_path)
    assert_one_line(proc, f"hami-usage report: {message}")
    assert (tmp_path / "in").read_text() == "x\n"
    assert sorted(os.listdir(tmp_path)) == ["in", "link", "link-pq", "pq"]
    assert os.listdir(tmp_path / "pq" / "day=2024-01-01") == []


@pytest.mark.parametrize("output", ["--out-csv", "--html"])
@pytest.mark.parametrize("source", ["--prices", "--config"])
def test_report_refuses_to_write_its_bill_over_its_prices_or_settings(
    tmp_path: Path, source: str, output: str
) -> None:
    """`--prices p.toml --out-csv p.toml` replaced the prices with the bill, exit 0."""
    (tmp_path / "in").write_text("x\n")
    text = {"--prices": "default = 1.20\n", "--config": "[report]\n"}[source]
    (tmp_path / "s.toml").write_text(text)
    (tmp_path / "link").symlink_to("s.toml")
    proc = run("report", *REPORT_SPAN, "--csv", "in", source, "s.toml", output, "./link",
               cwd=tmp_path)  # fmt: skip
    same = f"{source} s.toml and {output} ./link are the same file"
    assert_one_line(proc, f"hami-usage report: {same}")
    assert (tmp_path / "s.toml").read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["in", "link", "s.toml"]


SASL = [
    "aggregate", "--kafka", "127.0.0.1:9", "--kafka-security-protocol", "SASL_SSL",
    "--kafka-sasl-mechanism", "PLAIN", "--kafka-username", "u", "--kafka-password-file",
]  # fmt: skip


def test_a_password_file_that_is_not_utf8_is_one_line_without_its_bytes(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_bytes(b"s3\xffcret\n")
    proc = run(*SASL, str(secret), cwd=tmp_path)
    assert_one_line(proc, f"hami-usage aggregate: kafka_password_file {secret}: not UTF-8 text")
    assert "s3" not in proc.stderr and "xff" not in proc.stderr


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
@pytest.mark.parametrize(
    "args,env,name",
    [
        (["--kafka-sasl-mechanism", "PLAIN"], {}, "kafka_sasl_mechanism"),
        (["--kafka-username", "u"], {}, "kafka_username"),
        (["--kafka-password-file", "pw"], {}, "kafka_password_file"),
        ([], {"HAMI_USAGE_KAFKA_PASSWORD": "s3cret-value"}, "kafka_password"),
    ],
    ids=["mechanism", "username", "password-file", "password"],
)
def test_sasl_settings_without_sasl_are_refused(
    tmp_path: Path, protocol: str, args: list[str], env: dict[str, str], name: str
) -> None:
    """A user and password were ignored without SASL_SSL (a mechanism was refused)."""
    (tmp_path / "pw").write_text("s3cret-value\n")
    proc = run("topics", "--kafka", "127.0.0.1:9", "--kafka-security-protocol", protocol, *args,
               cwd=tmp_path, extra_env=env)  # fmt: skip
    assert_one_line(proc, f"hami-usage topics: {name} needs kafka_security_protocol SASL_SSL")
    assert "s3cret" not in proc.stderr


@pytest.mark.parametrize("content", [b"", b"\n", b" \n\n"], ids=["empty", "newline", "blank"])
def test_an_empty_password_is_no_password(tmp_path: Path, content: bytes) -> None:
    """README: SASL without a user or password exits 2 (it once tried to connect)."""
    secret = tmp_path / "pw"
    secret.write_bytes(content)
    proc = run(*SASL, str(secret), cwd=tmp_path)
    assert_one_line(
        proc,
        "hami-usage aggregate: SASL needs kafka_username and a password (kafka_password_file or "
        "HAMI_USAGE_KAFKA_PASSWORD)",
    )


def test_an_empty_password_in_the_environment_is_no_password(tmp_path: Path) -> None:
    proc = run(*SASL[:-1], cwd=tmp_path, extra_env={"HAMI_USAGE_KAFKA_PASSWORD": ""})
    assert_one_line(
        proc,
        "hami-usage aggregate: SASL needs kafka_username and a password (kafka_password_file or "
        "HAMI_USAGE_KAFKA_PASSWORD)",
    )


@pytest.mark.parametrize("command", ["collect", "aggregate"])
def test_a_bad_topics_table_is_the_running_commands_error(
    paths: dict[str, str], tmp_path: Path, command: str
) -> None:
    """`collect` and `aggregate` with `--kafka` read `[topics]` of their config to check the
    topics: an error there is theirs, not `hami-usage topics:`'s."""
    config = tmp_path / "c.toml"
    new_log = tmp_path / "collect-log"  # (not made by a refused run)
    where = ["--root", paths["root"], "--log", str(new_log)] if command == "collect" else []
    for table, message in [
        ("usage_partitions = 0", "usage_partitions: Expected `int` >= 1"),
        # (it was exit 2 in `topics` alone: the services warned of every topic's config)
        ("min_insync_replicas = 5", "min_insync_replicas: 5 is more than replication_factor 3"),
    ]:
        config.write_text(f"[topics]\n{table}\n")
        proc = run(command, "--config", str(config), "--kafka", "127.0.0.1:9", *where,
                   cwd=tmp_path)  # fmt: skip
        assert_one_line(proc, f"hami-usage {command}: invalid setting {message}")
        assert not new_log.exists()


@pytest.mark.parametrize("command", ["aggregate", "topics", "collect"])
def test_a_password_in_the_environment_that_is_not_utf8_is_one_line_without_its_bytes(
    paths: dict[str, str], tmp_path: Path, command: str
) -> None:
    """It reached aiokafka as it was: a traceback naming one of its bytes and its length in
    the commands, and a forwarder stopped for good in the collector."""
    where = {
        "aggregate": [],
        "topics": [],
        "collect": ["--root", paths["root"], "--log", paths["log"], "--no-nvml",
                    "--no-kubernetes"],
    }[command]  # fmt: skip
    proc = run(command, *where, *SASL[1:-1], cwd=tmp_path,
               extra_env={"HAMI_USAGE_KAFKA_PASSWORD": "s3\udcffcret"})  # fmt: skip
    assert_one_line(proc, f"hami-usage {command}: HAMI_USAGE_KAFKA_PASSWORD: not UTF-8 text")
    assert "s3" not in proc.stderr and "ff" not in proc.stderr


def test_an_empty_password_in_the_environment_beside_a_password_file_is_none(
    tmp_path: Path,
) -> None:
    """README: an empty password is none. Beside a password file it was refused as 'not
    both'; the file's password is the one used."""
    secret = tmp_path / "pw"
    secret.write_text("s3cret-value\n")
    for env in ("", " \n"):
        security = KafkaSecurity(protocol="SASL_SSL", sasl_mechanism="PLAIN", username="u",
                                 password=env, password_file=str(secret))  # fmt: skip
        assert security.client_kwargs()["sasl_plain_password"] == "s3cret-value"


@pytest.mark.parametrize("command", ["collect", "aggregate", "replay", "report"])
def test_security_settings_are_checked_without_a_broker_too(
    paths: dict[str, str], tmp_path: Path, command: str
) -> None:
    """Inconsistent settings exit 2 whether or not a broker is given; they were accepted,
    unused, without `--kafka` (a config meant for Kafka run against the local log)."""
    span = ["--from", "2024-01-01T00:00Z", "--to", "2024-01-02T00:00Z"]
    out = str(tmp_path / "out.csv")
    where = {
        "collect": ["--root", paths["root"], "--log", paths["log"], "--no-nvml",
                    "--no-kubernetes", "--max-scans", "1"],
        "aggregate": ["--log", paths["log"], "--drain", "--csv", out],
        "replay": ["--log", paths["log"], *span, "--csv", out],
        "report": ["--csv", out, *span],
    }[command]  # fmt: skip
    if command == "report":
        Path(out).touch()
    proc = run(command, *where, "--kafka-username", "u", cwd=tmp_path)
    assert_one_line(
        proc, f"hami-usage {command}: kafka_username needs kafka_security_protocol SASL_SSL"
    )


def test_a_group_too_long_for_a_local_checkpoint_is_one_line(
    paths: dict[str, str], tmp_path: Path
) -> None:
    """Groups of 201-249 characters pass the settings' check (Kafka's limit) but name no
    checkpoint file: with a local log that was a 38-line traceback."""
    proc = run("aggregate", "--log", paths["log"], "--group", "g" * 201, "--drain",
               "--jsonl", str(tmp_path / "o.jsonl"), cwd=tmp_path)  # fmt: skip
    assert_one_line(
        proc,
        "hami-usage aggregate: --group: with a local log, at most 200 of A-Z a-z 0-9 . _ - "
        "(not . or - first)",
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--start-from", "bogus"], "--start-from 'bogus': not an ISO-8601 time"),
        (["--group", "g" * 201], "--group: with a local log, at most 200 of A-Z a-z 0-9 . _ -"),
        (["--kafka-username", "u"], "SASL"),
        (["--log", "no-such-log"], "--log no-such-log: not a directory"),
    ],
    ids=["start-from", "group", "security", "log"],
)
def test_a_refused_aggregate_makes_no_output_folder(
    paths: dict[str, str], tmp_path: Path, flags: list[str], message: str
) -> None:
    """The outputs were checked (and --parquet made) before the other settings."""
    log = [] if "--log" in flags else ["--log", paths["log"]]
    proc = run("aggregate", *log, "--drain", "--parquet", "pq", *flags, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "pq").exists() and os.listdir(paths["log"]) == []


@pytest.mark.parametrize("kind", ["config", "prices", "kubeconfig"])
def test_a_settings_file_nested_too_deeply_is_one_line(
    paths: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """1 000 nested arrays (2 KB): the parsers recurse once a level, and the line was a
    RecursionError's 3 000-line traceback, exit 1."""
    deep = "[" * 1000 + "]" * 1000
    if kind == "config":
        path = tmp_path / "c.toml"
        path.write_text(f"[aggregate]\nwindow = {deep}\n")
        proc = run("aggregate", "--config", str(path), "--log", paths["log"], cwd=tmp_path)
        expected = f"hami-usage aggregate: config {path}: values nested too deeply"
    elif kind == "prices":
        path = tmp_path / "prices.toml"
        path.write_text(f"default = {deep}\n")
        proc = run("report", *REPORT_SPAN, "--csv", paths["file"], "--prices", str(path),
                   cwd=tmp_path)  # fmt: skip
        expected = f"hami-usage report: prices {path}: values nested too deeply"
    else:
        path = tmp_path / "kubeconfig"
        path.write_text(f"a: {'[' * 5000}{']' * 5000}\n")
        proc = run("collect", "--root", paths["root"], "--log", paths["log"], "--max-scans", "1",
                   "--no-nvml", "--kubeconfig", str(path), cwd=tmp_path)  # fmt: skip
        expected = f"hami-usage collect: kubernetes configuration ({path}): values nested too "
        expected += "deeply"
    assert_one_line(proc, expected)


@pytest.mark.parametrize("command", ["aggregate", "inspect", "report"])
def test_a_path_with_a_newline_is_still_one_line(tmp_path: Path, command: str) -> None:
    """A newline in a path (or a prices key) made the message two lines: every command's
    line is printed with what is not printable escaped."""
    bad = str(tmp_path / "no\nsuch")
    shown = bad.replace("\n", "\\n")
    args = {
        "aggregate": ["aggregate", "--config", bad],
        "inspect": ["inspect", bad],
        "report": ["report", *REPORT_SPAN, "--csv", bad],
    }[command]
    proc = run(*args, cwd=tmp_path)
    expected = {
        "aggregate": f"hami-usage aggregate: config {shown}: No such file or directory",
        "inspect": f"hami-usage inspect: {shown}: no such file",
        "report": f"hami-usage report: {shown}: no such file",
    }[command]
    assert (proc.returncode, proc.stderr) == (2 if command == "aggregate" else 1, expected + "\n")


@pytest.mark.parametrize(
    "args",
    [
        ["report", *REPORT_SPAN, "--parquet", "{dir}", "--parquet", "{log}"],
        ["report", *REPORT_SPAN, "--csv", "{file}", "--kafka", "127.0.0.1:9", "--kafka=h:1"],
        ["aggregate", "--log", "{log}", "--csv", "a.csv", "--csv", "b.csv"],
        ["collect", "--root", "{root}", "--log", "{log}", "--log", "{dir}"],
        ["replay", *REPORT_SPAN, "--log", "{log}", "--jsonl", "a", "--jsonl", "b"],
    ],
    ids=lambda v: v[0],
)
def test_an_option_of_one_value_given_twice_is_refused(
    paths: dict[str, str], tmp_path: Path, args: list[str]
) -> None:
    """argparse keeps the last value: `report --parquet A --parquet B` billed B alone (an empty
    bill when B held nothing), and a second output or broker replaced the first unsaid."""
    proc = run(*(a.format(**paths) for a in args), cwd=tmp_path)
    option = next(a for a in reversed(args) if a.startswith("--")).partition("=")[0]
    assert_one_line(
        proc, f"hami-usage {args[0]}: argument {option}: given more than once (it takes one value)"
    )
