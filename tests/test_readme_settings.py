"""Every settings key the README documents has a flag that `hami-usage` accepts (`--key`, '-' for
'_'), or its row says "file/env only"; every setting is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collector import cli
from collector.config import AggregateConfig, CollectConfig, ReplayConfig

README = Path(__file__).resolve().parent.parent / "README.md"
FILE_ENV_ONLY = "file/env only"
TABLES = {
    "collect": ("`collect` settings", CollectConfig, cli.COLLECT_FLAGS),
    "aggregate": ("`aggregate` settings", AggregateConfig, cli.AGGREGATE_FLAGS),
}


def rows(heading: str) -> list[tuple[list[str], str]]:
    """(keys, whole row) of the settings table after `heading`."""
    text = README.read_text()
    start = text.index(heading)
    out = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("| key"):
            continue
        if line.startswith("|---"):
            continue
        if not line.startswith("|"):
            if out:
                break
            continue
        first = line.split("|")[1]
        out.append((re.findall(r"`([a-z_]+)`", first), line))
    return out


def accepted(command: str, flag: str) -> bool:
    parser = cli.build_parser()
    extra = {"replay": ["--from", "2026-01-01", "--to", "2026-01-02"]}.get(command, [])
    try:
        args = parser.parse_args([command, *extra, flag, "1"])
    except cli.UsageError as exc:
        # A boolean flag takes no value: "1" left unrecognized (values are not echoed) means the
        # flag itself is known; so does a flag with choices refusing the value.
        return "unrecognized arguments: (values not shown)" in str(exc) or (
            "invalid choice: '1'" in str(exc)
        )
    return args is not None


@pytest.mark.parametrize("command", sorted(TABLES))
def test_every_documented_key_has_a_flag_or_says_it_has_none(command: str) -> None:
    heading, cls, flags = TABLES[command]
    documented: set[str] = set()
    for keys, line in rows(heading):
        assert keys, line
        for key in keys:
            documented.add(key)
            assert key in cls.__struct_fields__, f"README documents unknown key {key}"
            if FILE_ENV_ONLY in line:
                assert key not in flags, f"{key} has a flag; the README says it has none"
                continue
            assert key in flags, f"{key}: no flag, and the README does not say {FILE_ENV_ONLY!r}"
            assert accepted(command, "--" + key.replace("_", "-")), key
    assert documented == set(cls.__struct_fields__)


def test_replay_takes_the_window_keys_as_flags() -> None:
    for key in ("window", "lateness", "max_gap", "max_skew"):
        assert key in cli.REPLAY_FLAGS
        assert accepted("replay", "--" + key.replace("_", "-")), key
    # The Kafka password alone has no flag (flags show in `ps`).
    assert set(cli.REPLAY_FLAGS) == set(ReplayConfig.__struct_fields__) - {"kafka_password"}


def test_the_check_can_fail() -> None:
    assert not accepted("collect", "--no-such-setting")
