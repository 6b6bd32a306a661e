"""`hami-usage collect` settings: defaults < TOML [collect] < HAMI_USAGE_* env < flags.

Every case runs the real command as a subprocess with `--max-scans` and reads what it wrote:
the Kafka key (node), the heartbeat period, which root it scanned and where its log went.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from collector.events import CollectorStarted, ContainerAppeared, Event, Heartbeat, decode
from collector.layout.declarations import V12
from collector.simulate import GiB, SimDevice, new_cache_file
from collector.transport.locallog import LogReader

REPO = Path(__file__).resolve().parent.parent
HAMI_USAGE = Path(sys.executable).parent / "hami-usage"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
    env.pop("NODE_NAME", None)
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HAMI_USAGE), "collect", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
        check=False,
    )


@dataclass
class Outcome:
    node: str
    heartbeat_ms: int
    pods: list[str]
    events: list[Event]


def outcome(log_dir: Path) -> Outcome:
    records = LogReader(log_dir).read(0, 10_000)
    assert records, f"nothing in {log_dir}"
    events = [decode(r.value) for r in records]
    (node,) = {r.key.decode() for r in records}
    hb = [e for e in events if isinstance(e, Heartbeat)]
    pods = [e.pod_uid for e in events if isinstance(e, ContainerAppeared)]
    return Outcome(node, hb[0].interval_ms, pods, events)


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    """Four roots, each with one container whose pod uid names the root."""
    out = {}
    for name in ("toml", "env", "flag", "default"):
        root = tmp_path / f"root-{name}"
        root.mkdir()
        w = new_cache_file(root, f"pod-{name}", "main", V12, [SimDevice("GPU-a", GiB)])
        w.close()
        out[name] = root
    return out


def write_toml(path: Path, **values: object) -> Path:
    lines = ["# a comment", "[aggregate]", "window = 30", "", "[collect]"]  # another's: ignored
    for k, v in values.items():
        lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_defaults(tmp_path: Path, roots: dict[str, Path]) -> None:
    log = tmp_path / "log"
    proc = run(
        ["--root", str(roots["default"]), "--log", str(log), "--max-scans", "1"],
        clean_env(NODE_NAME="node-from-downward-api"),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    got = outcome(log)
    assert (got.node, got.heartbeat_ms, got.pods) == (
        "node-from-downward-api",
        30_000,
        ["pod-default"],
    )
    # Without NODE_NAME the host name is the node.
    proc = run(
        ["--root", str(roots["default"]), "--log", str(tmp_path / "log2"), "--max-scans", "1"],
        clean_env(),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert outcome(tmp_path / "log2").node == os.uname().nodename


def test_precedence_flags_over_env_over_toml_over_defaults(
    tmp_path: Path, roots: dict[str, Path]
) -> None:
    cfg = write_toml(
        tmp_path / "collect.toml",
        root=str(roots["toml"]),
        node="node-toml",
        log=str(tmp_path / "log-toml"),
        heartbeat=11.0,
        max_scans=1,
    )
    env_values = {
        "HAMI_USAGE_NODE": "node-env",
        "HAMI_USAGE_HEARTBEAT": "22",
        "HAMI_USAGE_LOG": str(tmp_path / "log-env"),
    }

    # TOML over defaults (NODE_NAME is the default's source and loses to the TOML node).
    proc = run(["--config", str(cfg)], clean_env(NODE_NAME="node-default"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = outcome(tmp_path / "log-toml")
    assert (got.node, got.heartbeat_ms, got.pods) == ("node-toml", 11_000, ["pod-toml"])

    # env over TOML, key by key: root still comes from TOML.
    proc = run(["--config", str(cfg)], clean_env(**env_values), tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = outcome(tmp_path / "log-env")
    assert (got.node, got.heartbeat_ms, got.pods) == ("node-env", 22_000, ["pod-toml"])

    # flags over env.
    flags = [
        "--config", str(cfg),
        "--node", "node-flag",
        "--heartbeat", "33",
        "--log", str(tmp_path / "log-flag"),
        "--root", str(roots["flag"]),
    ]  # fmt: skip
    proc = run(flags, clean_env(**env_values, HAMI_USAGE_ROOT=str(roots["env"])), tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = outcome(tmp_path / "log-flag")
    assert (got.node, got.heartbeat_ms, got.pods) == ("node-flag", 33_000, ["pod-flag"])

    # env alone (no TOML file): strings converted to the setting's type.
    proc = run(
        [],
        clean_env(
            HAMI_USAGE_ROOT=str(roots["env"]),
            HAMI_USAGE_LOG=str(tmp_path / "log-env-only"),
            HAMI_USAGE_MAX_SCANS="1",
            HAMI_USAGE_HEARTBEAT="0.5",
            HAMI_USAGE_INTERVAL="0.25",  # (heartbeats say their spacing: 2 scans of 0.25 s)
            HAMI_USAGE_FSYNC="true",
            HAMI_USAGE_NODE="n-env",
        ),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    got = outcome(tmp_path / "log-env-only")
    assert (got.node, got.heartbeat_ms, got.pods) == ("n-env", 500, ["pod-env"])


def test_interval_and_max_scans_precedence(tmp_path: Path, roots: dict[str, Path]) -> None:
    # A heartbeat period under 1 ms (0 in the whole ms the scanner counts): every scan ends in
    # a heartbeat, even one that follows a late scan at once, so the heartbeat times show how
    # many scans ran and when.
    cfg = write_toml(tmp_path / "c.toml", interval=0.1, max_scans=11, heartbeat=0.0001)

    def scans(log: Path, *args: str, **env: str) -> tuple[int, int]:
        """How many scans ran, and the ms from the announcement to the last one."""
        base = ["--config", str(cfg), "--root", str(roots["toml"]), "--log", str(log)]
        proc = run([*base, *args], clean_env(**env), tmp_path)
        assert proc.returncode == 0, proc.stderr
        events = outcome(log).events
        (started,) = [e for e in events if isinstance(e, CollectorStarted)]
        beats = [e.ts for e in events if isinstance(e, Heartbeat)]
        return len(beats), beats[-1] - started.ts

    toml = scans(tmp_path / "a")
    env = scans(tmp_path / "b", HAMI_USAGE_INTERVAL="0.2", HAMI_USAGE_MAX_SCANS="16")
    flag = scans(tmp_path / "c", "--interval", "2", "--max-scans", "2", HAMI_USAGE_INTERVAL="0.2")
    # Scans run on a fixed grid that starts after the announcement and never before their
    # slot: N scans at interval I end at least (N - 1) * I after it (less 1: event times are
    # whole ms), later by however late the last one ran (unbounded on a loaded machine). So
    # each run's lower bound is its own interval's, and its upper bound the lower bound of the
    # one longer interval it could wrongly have used, the default 1 s: 9 s and 12 s of room.
    # (The shorter TOML or environment interval instead shows as a span below the lower bound
    # on any machine that is not late by the whole difference.)
    n, span = toml
    assert n == 11 and 10 * 100 - 1 <= span < 10 * 1000, toml
    n, span = env
    assert n == 16 and 15 * 200 - 1 <= span < 15 * 1000, env
    n, span = flag
    assert n == 2 and span >= 2000 - 1, flag


ERRORS = "hami-usage collect: "


@pytest.mark.parametrize(
    ("args", "env", "toml", "message"),
    [
        (["--interval", "-1"], {}, None, "invalid setting interval: Expected `float` > 0.0"),
        (["--interval", "0"], {}, None, "invalid setting interval: Expected `float` > 0.0"),
        (["--interval", "abc"], {}, None, "argument --interval: invalid float value: 'abc'"),
        ([], {"HAMI_USAGE_INTERVAL": "abc"}, None,
         "invalid setting interval: Expected `float`, got `str`"),
        ([], {"HAMI_USAGE_HEARTBEAT": "-5"}, None,
         "invalid setting heartbeat: Expected `float` > 0.0"),
        ([], {"HAMI_USAGE_MAX_SCANS": "1.5"}, None,
         "invalid setting max_scans: Expected `int | null`, got `str`"),
        (["--max-scans", "0"], {}, None, "invalid setting max_scans: Expected `int` >= 1"),
        (["--log-max-bytes", "-1"], {}, None,
         "invalid setting log_max_bytes: Expected `int` >= 1"),
        ([], {}, "interval = \"x\"\n", "invalid setting interval: Expected `float`, got `str`"),
        ([], {}, "intervall = 1\n", "invalid setting Object contains unknown field `intervall`"),
        # a key quoted as it is: two lines, and "`$." in it was taken for the setting's name
        ([], {}, '"a\\nb" = 1\n', "invalid setting Object contains unknown field `a\\nb`"),
        ([], {}, '"x`$.y" = 1\n', "invalid setting Object contains unknown field `x`$.y`"),
        (["--bogus"], {}, None, "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_bad_values_exit_2_with_one_line(
    tmp_path: Path,
    roots: dict[str, Path],
    args: list[str],
    env: dict[str, str],
    toml: str | None,
    message: str,
) -> None:
    base = ["--root", str(roots["default"]), "--log", str(tmp_path / "log")]
    if toml is not None:
        (tmp_path / "c.toml").write_text("[collect]\n" + toml)
        base += ["--config", str(tmp_path / "c.toml")]
    proc = run([*base, *args], clean_env(**env), tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    if message.startswith("unrecognized"):
        assert proc.stderr.startswith("hami-usage: ") and message in proc.stderr
    else:
        assert proc.stderr == ERRORS + message + "\n"
    assert not (tmp_path / "log").exists()  # nothing started


def test_bad_files_and_paths_exit_2_with_one_line(tmp_path: Path, roots: dict[str, Path]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "broken.toml").write_text("[collect\n")
    (tmp_path / "scalar.toml").write_text("collect = 3\n")
    # Each was ignored without a word: a key outside the tables, a misspelled table.
    (tmp_path / "top.toml").write_text('kafka = "x:1"\n[collect]\n')
    (tmp_path / "typo.toml").write_text("[colect]\ninterval = 5\n")
    (tmp_path / "newline.toml").write_text('["a\\nb"]\n')
    tables = "is not one of the tables collect, aggregate, replay, topics, demo, report"
    root, log = str(roots["default"]), str(tmp_path / "log")
    cases = {
        f"config {tmp_path / 'missing.toml'}: No such file or directory": [
            "--config", str(tmp_path / "missing.toml"), "--root", root, "--log", log,
        ],
        f"config {tmp_path / 'broken.toml'}: Expected ']' at the end of a table declaration"
        " (at line 1, column 9)": ["--config", str(tmp_path / "broken.toml")],
        f"config {tmp_path / 'scalar.toml'}: [collect] must be a table": [
            "--config", str(tmp_path / "scalar.toml"),
        ],
        f"config {tmp_path / 'top.toml'}: 'kafka' {tables}": [
            "--config", str(tmp_path / "top.toml"),
        ],
        f"config {tmp_path / 'typo.toml'}: 'colect' {tables}": [
            "--config", str(tmp_path / "typo.toml"),
        ],
        f"config {tmp_path / 'newline.toml'}: 'a\\nb' {tables}": [
            "--config", str(tmp_path / "newline.toml"),
        ],
        f"--root {tmp_path / 'nope'}: not a directory": [
            "--root", str(tmp_path / "nope"), "--log", log,
        ],
        f"--root {a_file}: not a directory": ["--root", str(a_file), "--log", log],
        f"--log {a_file}: not a directory": ["--root", root, "--log", str(a_file)],
        f"--log {a_file}/sub: Not a directory": ["--root", root, "--log", f"{a_file}/sub"],
    }  # fmt: skip
    for message, args in cases.items():
        proc = run(args, clean_env(), tmp_path)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", ERRORS + message + "\n")


def test_help_and_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "collector", "collect", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0
    for flag in ("--root", "--kafka", "--log", "--interval", "--heartbeat", "--max-scans"):
        assert flag in proc.stdout
