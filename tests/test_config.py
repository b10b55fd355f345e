"""The TOML config file: precedence and validation that names the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from twisted.python import usage

from nixl_twisted.tap import Options


def parse(*args: str) -> Options:
    options = Options()
    options.parseOptions(list(args))
    return options


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "nixlproxy.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


FILE = """
listen = ["tcp:0:interface=127.0.0.1"]
prefill = ["http://p1:8100", "http://p2:8100"]
decode = ["http://d1:8200"]
prefill-timeout = 120
stream_idle_timeout = 15.5
max-in-flight = 64
log-format = "json"
"""


def test_every_option_can_come_from_the_file(tmp_path: Path) -> None:
    options = parse("--config", config(tmp_path, FILE))
    assert options["prefill_pool"].urls == ("http://p1:8100", "http://p2:8100")
    assert options["decode_pool"].urls == ("http://d1:8200",)
    assert options["listen"] == ["tcp:0:interface=127.0.0.1"]
    assert options["prefill-timeout"] == 120
    assert options["stream-idle-timeout"] == 15.5
    assert options["max-in-flight"] == 64
    assert options["log-format"] == "json"


def test_the_command_line_wins(tmp_path: Path) -> None:
    options = parse(
        "--config", config(tmp_path, FILE),
        "--max-in-flight", "8", "--decode", "http://d9:8200",
    )  # fmt: skip
    assert options["max-in-flight"] == 8
    # A list given on the command line replaces the file's list.
    assert options["decode_pool"].urls == ("http://d9:8200",)
    assert options["prefill_pool"].urls == ("http://p1:8100", "http://p2:8100")
    assert options["prefill-timeout"] == 120


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('prefil = ["http://p:1"]', "unknown key 'prefil'"),
        ('prefill = "http://p:1"', "'prefill' must be a list of strings"),
        ("prefill-timeout = -1", "'prefill-timeout': --prefill-timeout must be greater than 0"),
        ('max-in-flight = "many"', "'max-in-flight': --max-in-flight must be a whole number"),
        ("drain-timeout = true", "'drain-timeout' must be a string or a number"),
        ('log-format = "xml"', "'log-format': --log-format must be one of text, json"),
        ("prefill = [", "not valid TOML"),
        ('version = "2"', "unknown key 'version'"),
    ],
)
def test_bad_files_are_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = config(tmp_path, 'decode = ["http://d:1"]\n' + text)
    with pytest.raises(usage.UsageError) as caught:
        parse("--config", path, "--prefill", "http://p:1")
    assert message in str(caught.value)
    assert path in str(caught.value)


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(usage.UsageError, match="cannot read it"):
        parse("--config", str(tmp_path / "absent.toml"))


def test_pool_urls_from_the_file_are_checked_like_options(tmp_path: Path) -> None:
    path = config(tmp_path, 'prefill = ["p1:8100"]\ndecode = ["http://d:1"]\n')
    with pytest.raises(usage.UsageError, match="--prefill: 'p1:8100' must start"):
        parse("--config", path)
