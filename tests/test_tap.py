"""``twistd nixlproxy``: options, the service tree, and the plugin as installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from twisted.application.service import IServiceCollection
from twisted.python import usage

import nixl_twisted
from nixl_twisted.pools import BackendService
from nixl_twisted.tap import BACKEND_API_KEY_ENV, ListenService, Options, makeService

POOLS = ["--prefill", "http://p1:8100", "--decode", "http://d1:8200"]
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
ROOT = Path(__file__).resolve().parent.parent


def parse(*args: str) -> Options:
    options = Options()
    options.parseOptions(list(args))
    return options


def test_defaults() -> None:
    options = parse(*POOLS)
    assert options["listen"] == ["tcp:8000"]
    # Below vLLM's 5 s keep-alive close, and well above Twisted's 2 idle.
    assert options["backend-idle-timeout"] < 5
    assert options["max-idle-per-backend"] >= 256
    assert options["backend-api-key"] is None


def test_repeatable_pools_and_listen() -> None:
    options = parse(
        "--listen", "tcp:0:interface=127.0.0.1", "--listen", "unix:/tmp/nixlproxy-test.sock",
        "--prefill", "http://p1:8100", "--prefill", "http://p2:8100", "--decode", "http://d1:8200",
    )  # fmt: skip
    assert options["prefill_pool"].urls == ("http://p1:8100", "http://p2:8100")
    assert options["decode_pool"].urls == ("http://d1:8200",)
    assert len(options["endpoints"]) == 2


def test_service_tree_has_backends_and_one_listener_per_endpoint() -> None:
    service = makeService(
        parse("--listen", "tcp:0", "--listen", "tcp:0:interface=127.0.0.1", *POOLS)
    )
    assert IServiceCollection.providedBy(service)
    children = list(service)
    assert [type(c) for c in children] == [BackendService, ListenService, ListenService]


def test_backend_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_API_KEY_ENV, "from-env")
    assert parse(*POOLS)["backend-api-key"] == "from-env"
    assert parse(*POOLS, "--backend-api-key", "from-flag")["backend-api-key"] == "from-flag"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode", "http://d:1"], "at least one --prefill URL is required"),
        (["--prefill", "http://p:1"], "at least one --decode URL is required"),
        (["--prefill", "p1:8100", "--decode", "http://d:1"], "--prefill: 'p1:8100' must start"),
        (["--prefill", "http://p:1", "--decode", "http://d:x"], "--decode: 'http://d:x'"),
        ([*POOLS, "--listen", "bogus:1"], "--listen 'bogus:1' is not a usable endpoint"),
        ([*POOLS, "--listen", "tcp:notaport"], "--listen 'tcp:notaport'"),
        ([*POOLS, "--connect-timeout", "soon"], "must be a number of seconds"),
        ([*POOLS, "--backend-idle-timeout", "0"], "must be greater than 0"),
        ([*POOLS, "--max-idle-per-backend", "0"], "must be at least 1"),
        ([*POOLS, "--log-format", "xml"], "must be one of text, json"),
        ([*POOLS, "--metrics-listen", "nope:1"], "--metrics-listen 'nope:1'"),
    ],
)
def test_unusable_options_are_usage_errors_naming_the_problem(
    args: list[str], message: str
) -> None:
    with pytest.raises(usage.UsageError, match=message.replace("?", r"\?")):
        parse(*args)


def installed_env() -> dict[str, str]:
    """An environment in which Python cannot see the source tree."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def run_installed(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args),
        cwd=tmp_path,
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_plugin_is_found_from_the_installed_package(tmp_path: Path) -> None:
    script = (
        "from twisted.plugin import getPlugins\n"
        "from twisted.application.service import IServiceMaker\n"
        "import importlib\n"
        "(maker,) = [p for p in getPlugins(IServiceMaker) if p.tapname == 'nixlproxy']\n"
        "print(maker.module)\n"
        "print(importlib.import_module(maker.module).__file__)\n"
        "print(importlib.import_module('twisted.plugins.nixlproxy').__file__)\n"
    )
    result = run_installed(tmp_path, sys.executable, "-c", script)
    assert result.returncode == 0, result.stderr
    module, *paths = result.stdout.split()
    assert module == "nixl_twisted.tap"
    for path in paths:
        assert "site-packages" in path, path
        assert not Path(path).is_relative_to(ROOT / "nixl_twisted"), path
        assert not Path(path).is_relative_to(ROOT / "twisted"), path


def test_help_documents_every_option(tmp_path: Path) -> None:
    result = run_installed(tmp_path, *TWISTD, "nixlproxy", "--help")
    assert result.returncode == 0, result.stderr
    for option in (
        "--listen", "--prefill", "--decode", "--backend-api-key", "--connect-timeout",
        "--backend-idle-timeout", "--max-idle-per-backend", "--prefill-timeout",
        "--decode-timeout", "--stream-idle-timeout", "--prefill-retries", "--decode-retries",
        "--health-interval", "--health-timeout", "--max-in-flight", "--max-body-size",
        "--metrics-listen", "--log-format", "--drain-timeout", "--config", "--admin-token",
        "--version",
    ):  # fmt: skip
        assert option in result.stdout
    assert nixl_twisted.ID in result.stdout


def test_a_missing_pool_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = run_installed(
        tmp_path, *TWISTD, "-n", "--pidfile=", "nixlproxy", "--decode", "http://d:1"
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "at least one --prefill URL is required" in output
    assert "Traceback" not in output
