"""``--api-keys-file``: when a change is applied, what a broken or half-written file keeps,
and what the log says of it (once).

The file is looked at every 2 s on a ``Clock``; a test moves the clock by
hand. A change is applied when two looks in a row read the same bytes, and
only when its last line ends in a newline.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.web.http_headers import Headers
from zope.interface import provider

from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.run import startup
from nixl_twisted.web.keys import FILE_CHECK, ClientKeys
from nixl_twisted.web.keys_file import read_keys

POOLS: dict[str, Any] = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}


@pytest.fixture
def where() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def lines() -> Iterator[list[tuple[LogLevel, str]]]:
    """What ``web.keys`` logs, each line with its level."""
    seen: list[tuple[LogLevel, str]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixl_twisted.web.keys":
            seen.append((event["log_level"], formatEvent(event)))

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


def write(path: Path, text: str, mtime_ns: int) -> None:
    """``text`` into ``path``, with the modification time the look compares."""
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def tenant(keys: ClientKeys, key: str) -> str | None:
    return keys.tenant(Headers({b"authorization": [f"Bearer {key}".encode()]}), b"/v1/models")


def keyed_by(where: Path, text: str) -> tuple[Path, ClientKeys, Clock]:
    """A keys file in ``where`` holding ``text``, and the keys configured from it."""
    path = where / "keys"
    write(path, text, 1)
    return (path, *keyed(path))


def keyed(path: Path, *given: str) -> tuple[ClientKeys, Clock]:
    clock = Clock()
    keys = ClientKeys(clock)
    keys.configure(ProxyConfig.create(**POOLS, api_key=list(given), api_keys_file=str(path)))
    return keys, clock


def test_a_broken_file_is_logged_once_per_error_and_its_mending_once(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    path, keys, clock = keyed_by(where, "sk-a team-a\n")
    assert lines == [(LogLevel.info, "client keys: 1 in effect")]
    del lines[:]

    write(path, "sk-a team-a extra\n", 2)
    for _ in range(10):  # 20 s of looks while it stays broken
        clock.advance(FILE_CHECK)
    assert lines == [
        (
            LogLevel.error,
            f"--api-keys-file cannot be used: {path}:1: a key, then at most a tenant's name; "
            "keeping the 1 key it gave until it can be read",
        )
    ]
    assert tenant(keys, "sk-a") == "team-a"  # kept meanwhile

    path.unlink()  # another error: said
    clock.advance(FILE_CHECK)
    assert len(lines) == 2
    assert lines[-1][1].startswith(f"--api-keys-file cannot be used: {path}: No such file")

    write(path, "sk-b team-b\n", 3)
    clock.advance(FILE_CHECK)  # (seen once: applied when the next look agrees)
    clock.advance(FILE_CHECK)
    assert lines[2:] == [
        (LogLevel.info, f"--api-keys-file {path} read again: 1 client key in effect")
    ]
    assert (tenant(keys, "sk-a"), tenant(keys, "sk-b")) == (None, "team-b")
    keys.stop()


def test_a_rewrite_of_the_same_size_and_modification_time_is_seen(where: Path) -> None:
    """The bytes are compared: a rewrite within the clock's grain, to the same size, is a change."""
    path, keys, clock = keyed_by(where, "sk-a team-a\n")
    write(path, "sk-b team-b\n", 1)  # (keyed_by wrote it at 1 too)
    clock.advance(FILE_CHECK)
    clock.advance(FILE_CHECK)
    assert (tenant(keys, "sk-a"), tenant(keys, "sk-b")) == (None, "team-b")
    keys.stop()


def test_a_half_written_file_keeps_the_keys_in_effect_and_says_so(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    """Its last line does not end in a newline: none of it is loaded, not even the
    lines before, until it is whole."""
    path, keys, clock = keyed_by(where, "sk-a team-a\n")
    del lines[:]
    write(path, "sk-c team-c\nsk-be", 2)  # a writer stopped mid-key
    for _ in range(10):
        clock.advance(FILE_CHECK)
    assert lines == [
        (
            LogLevel.error,
            f"--api-keys-file cannot be used: {path}: its last line does not end in a newline "
            "(a file still being written?); write it whole, then rename it into place; "
            "keeping the 1 key it gave until it can be read",
        )
    ]
    assert (tenant(keys, "sk-a"), tenant(keys, "sk-be"), tenant(keys, "sk-c")) == (
        "team-a",
        None,
        None,
    )
    write(path, "sk-c team-c\nsk-best team-b\n", 3)  # written whole
    clock.advance(FILE_CHECK)
    clock.advance(FILE_CHECK)
    assert lines[1:] == [
        (LogLevel.info, f"--api-keys-file {path} read again: 2 client keys in effect")
    ]
    assert [tenant(keys, key) for key in ("sk-a", "sk-be", "sk-best")] == [None, None, "team-b"]
    keys.stop()


def test_a_change_is_applied_when_two_looks_in_a_row_read_the_same_bytes(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    """A writer still writing, between two lines: each look finds other bytes, none is loaded."""
    path, keys, clock = keyed_by(where, "sk-a\n")
    del lines[:]
    path.write_text("sk-a\nsk-b\n")
    clock.advance(FILE_CHECK)
    assert tenant(keys, "sk-b") is None  # seen once: not yet
    path.write_text("sk-b\nsk-c\n")  # (the writer goes on: sk-a taken out)
    clock.advance(FILE_CHECK)
    assert (tenant(keys, "sk-a"), tenant(keys, "sk-b")) == ("key-" + _hex("sk-a"), None)
    clock.advance(FILE_CHECK)  # the same bytes again: applied
    assert [tenant(keys, key) is not None for key in ("sk-a", "sk-b", "sk-c")] == [
        False,
        True,
        True,
    ]
    assert lines == [(LogLevel.info, "client keys: 2 in effect")]
    keys.stop()


def test_a_change_undone_before_a_second_look_changes_nothing(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    path, keys, clock = keyed_by(where, "sk-a\n")
    del lines[:]
    path.write_text("sk-b\n")
    clock.advance(FILE_CHECK)
    path.write_text("sk-a\n")
    for _ in range(3):
        clock.advance(FILE_CHECK)
    assert (tenant(keys, "sk-a") is not None, tenant(keys, "sk-b"), lines) == (True, None, [])
    keys.stop()


def test_the_bytes_in_effect_back_again_are_read_again_at_the_next_look(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    """As a chmod mends an unreadable file: nothing changed, it can be read again."""
    path, keys, clock = keyed_by(where, "sk-a team-a\n")
    path.rename(where / "aside")
    clock.advance(FILE_CHECK)
    (where / "aside").rename(path)
    clock.advance(FILE_CHECK)
    assert [level for level, _ in lines[1:]] == [LogLevel.error, LogLevel.info]
    assert lines[-1][1] == f"--api-keys-file {path} read again: 1 client key in effect"
    assert tenant(keys, "sk-a") == "team-a"
    keys.stop()


def test_a_reload_reads_a_change_at_once(where: Path) -> None:
    """SIGHUP (or a reload) is the operator saying the file is written: no second look."""
    path, keys, _ = keyed_by(where, "sk-a\n")
    path.write_text("sk-b team-b\n")
    keys.configure(ProxyConfig.create(**POOLS, api_keys_file=str(path)))
    assert (tenant(keys, "sk-a"), tenant(keys, "sk-b")) == (None, "team-b")
    keys.stop()


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def test_a_reload_says_again_what_is_wrong(where: Path, lines: list[tuple[LogLevel, str]]) -> None:
    path, keys, clock = keyed_by(where, "sk-a b c\n")
    clock.advance(FILE_CHECK)
    keys.configure(ProxyConfig.create(**POOLS, api_keys_file=str(path)))  # SIGHUP
    assert [level for level, _ in lines] == [LogLevel.error] * 2
    keys.stop()


def test_a_keys_file_that_is_not_utf_8_is_an_invalid_value(where: Path) -> None:
    path = where / "keys"
    path.write_bytes(b"sk-\xff\n")
    with pytest.raises(InvalidValue, match="not UTF-8 text"):
        read_keys(str(path))


def test_a_keys_file_that_cannot_be_read_at_start_stops_the_proxy(where: Path) -> None:
    missing = str(where / "kyes")
    config = ProxyConfig.create(**POOLS, api_key=["sk-a"], api_keys_file=missing)
    with pytest.raises(SystemExit, match=re.escape(f"--api-keys-file: {missing}: No such file")):
        startup.check_keys_file(config)
    (where / "kyes").write_text("sk-a\n")
    startup.check_keys_file(config)  # readable: nothing to say
    (where / "kyes").write_text("sk-a")
    with pytest.raises(SystemExit, match="its last line does not end in a newline"):
        startup.check_keys_file(config)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # A comma where a space was meant: one key "sk-b1,team-b" with no tenant.
        ("sk-a team-a\nsk-b1,team-b\n", ":2: a comma in the key: write the key, a space, then"),
        # One key under two tenants: which one is it charged to?
        (
            "sk-a team-a\n# more\nsk-a team-b\n",
            ":3: this key is on line 1 already, under tenant 'team-a'; here under tenant "
            "'team-b': give each key once",
        ),
        ("sk-a\nsk-a team-b\n", ":2: this key is on line 1 already, under no tenant;"),
    ],
)
def test_a_line_that_looks_like_a_mistake_is_refused_with_its_number(
    where: Path, text: str, said: str
) -> None:
    path = where / "keys"
    path.write_text(text)
    with pytest.raises(InvalidValue) as refused:
        read_keys(str(path))
    assert str(refused.value).startswith(f"{path}{said}")
    assert "sk-" not in str(refused.value).replace(str(path), "")  # never the key


def test_the_same_key_twice_under_the_same_tenant_is_one_key(where: Path) -> None:
    path = where / "keys"
    path.write_text("sk-a team-a\nsk-a team-a\n")
    assert read_keys(str(path)) == {"sk-a": "team-a"}


def test_a_mistaken_line_at_start_stops_the_proxy_and_at_a_reload_keeps_the_keys(
    where: Path, lines: list[tuple[LogLevel, str]]
) -> None:
    path = where / "keys"
    path.write_text("sk-a team-a\nsk-b1,team-b\n")
    config = ProxyConfig.create(**POOLS, api_keys_file=str(path))
    with pytest.raises(SystemExit, match=re.escape(f"{path}:2: a comma in the key")):
        startup.check_keys_file(config)
    path, keys, _ = keyed_by(where, "sk-a team-a\n")
    del lines[:]
    path.write_text("sk-a team-a\nsk-a team-b\n")
    keys.configure(config)  # SIGHUP
    assert lines == [
        (
            LogLevel.error,
            f"--api-keys-file cannot be used: {path}:2: this key is on line 1 already, under "
            "tenant 'team-a'; here under tenant 'team-b': give each key once; "
            "keeping the 1 key it gave until it can be read",
        )
    ]
    assert tenant(keys, "sk-a") == "team-a"
    keys.stop()
