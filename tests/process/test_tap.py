"""``twistd nixlproxy``: options, the service tree, and the plugin as installed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IServiceCollection
from twisted.internet import reactor

import nixl_twisted
from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.gc_pauses import GcPauses
from nixl_twisted.observe.history import History
from nixl_twisted.observe.recent_warnings import RecentWarnings
from nixl_twisted.run.proxy_service import ProxyService
from nixl_twisted.run.root import build
from nixl_twisted.run.signals import SignalService
from nixl_twisted.run.workers import SupervisorService, WorkerSupervisor
from nixl_twisted.tap import Options, makeService

POOLS = ["--prefill", "http://p1:8100", "--decode", "http://d1:8200"]
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
ROOT = Path(__file__).resolve().parents[2]


def options(*args: str) -> Options:
    parsed = Options()
    parsed.parseOptions(list(args))
    return parsed


def test_service_tree_has_backends_events_discovery_a_listener_per_endpoint_signals() -> None:
    service = makeService(
        options("--listen", "tcp:0", "--listen", "tcp:0:interface=127.0.0.1", *POOLS)
    )
    assert IServiceCollection.providedBy(service)
    assert [type(c) for c in service] == [
        BackendService,
        HealthChecks,
        Discovery,
        History,
        RecentWarnings,
        GcPauses,
        KvEvents,
        StreamServerEndpointService,
        StreamServerEndpointService,
        SignalService,
    ]


def test_workers_make_a_supervisor_tree() -> None:
    service = makeService(options("--workers", "2", "--listen", "tcp:0", *POOLS))
    assert isinstance(service, SupervisorService)
    # The backends stop after the workers: their health checks serve all of them.
    assert [type(c) for c in service] == [
        SignalService,
        BackendService,
        HealthChecks,
        Discovery,
        WorkerSupervisor,
    ]


def test_ports_are_bound_in_privileged_start_before_privileges_are_shed() -> None:
    """twistd binds in privilegedStartService, then sheds --uid, then starts."""
    config = ProxyConfig.create(
        listen=["tcp:0:interface=127.0.0.1"], prefill=["http://p:1"], decode=["http://d:1"]
    )
    service = build(config, reactor)
    assert isinstance(service, ProxyService)
    service.privilegedStartService()
    try:
        (port,) = service.ports()
        assert port.getHost().port > 0  # type: ignore[attr-defined]
        assert not service.running  # bound, not started
    finally:
        for listener in service.listeners():
            listener.stopService()


def test_a_bind_error_is_raised_at_once() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        config = ProxyConfig.create(
            listen=[f"tcp:{port}:interface=127.0.0.1"],
            prefill=["http://p:1"],
            decode=["http://d:1"],
        )
        service = build(config, reactor)
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: address already"):
            service.privilegedStartService()
    finally:
        taken.close()


def test_a_keys_file_that_cannot_be_read_stops_the_start() -> None:
    """A typo in its path is said at once, beside --api-key too, not found as 401s later."""
    missing = os.path.join(tempfile.mkdtemp(prefix="nixlproxy-keys-"), "kyes")
    try:
        said = re.escape(f"--api-keys-file: {missing}: No such file or directory")
        with pytest.raises(SystemExit, match=said):
            makeService(options(*POOLS, "--api-key", "sk-a", "--api-keys-file", missing))
    finally:
        os.rmdir(os.path.dirname(missing))


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
        "--listen",
        "--prefill",
        "--decode",
        "--backend-api-key",
        "--connect-timeout",
        "--backend-idle-timeout",
        "--max-idle-per-backend",
        "--prefill-timeout",
        "--decode-timeout",
        "--stream-idle-timeout",
        "--prefill-retries",
        "--decode-retries",
        "--health-interval",
        "--health-timeout",
        "--max-in-flight",
        "--max-body-size",
        "--metrics-listen",
        "--log-format",
        "--drain-timeout",
        "--config",
        "--admin-token",
        "--version",
        "--workers",
        "--access-log",
    ):
        assert option in result.stdout
    assert nixl_twisted.ID in result.stdout
    # What a backend URL takes: its data-parallel ranks, under each pool's option.
    for pool in ("--prefill", "--decode"):
        said = result.stdout.split(f"\n  {pool} URL ")[1].split("\n  -")[0]
        assert "URL#dp=N" in " ".join(said.split()), pool


def test_a_missing_pool_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = run_installed(
        tmp_path, *TWISTD, "-n", "--pidfile=", "nixlproxy", "--decode", "http://d:1"
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "at least one --prefill URL (or --prefill-selector) is required" in output
    assert "Traceback" not in output


def test_a_usage_error_prints_the_error_and_a_hint_not_the_whole_help(tmp_path: Path) -> None:
    result = run_installed(
        tmp_path, *TWISTD, "-n", "--pidfile=", "nixlproxy", "--prefill", "http://p:1"
    )
    assert result.returncode != 0
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) <= 5, output
    assert "at least one --decode URL (or --decode-selector) is required" in output[-1]
    assert any("twistd nixlproxy --help" in line for line in output)


def test_a_port_in_use_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        for workers in ("1", "2"):
            result = run_installed(
                tmp_path,
                *TWISTD,
                "-n",
                "--pidfile=",
                "nixlproxy",
                "--workers",
                workers,
                "--listen",
                f"tcp:{port}:interface=127.0.0.1",
                "--prefill",
                "http://p:1",
                "--decode",
                "http://d:1",
            )
            output = result.stdout + result.stderr
            assert result.returncode != 0
            assert "Traceback" not in output
            (line,) = [line for line in output.splitlines() if "cannot listen" in line]
            assert line.endswith(
                f"nixlproxy: cannot listen on 127.0.0.1:{port}: address already in use"
            )
    finally:
        taken.close()


def test_version_names_the_package_and_the_protocol(tmp_path: Path) -> None:
    result = run_installed(tmp_path, *TWISTD, "nixlproxy", "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == (
        f"nixl-twisted {nixl_twisted.__version__} "
        f"(protocol {nixl_twisted.ID} version {nixl_twisted.VERSION})"
    )


def test_the_proxy_imports_no_redis_client_unless_limits_redis_is_set(tmp_path: Path) -> None:
    check = (
        "import sys, nixl_twisted.run.root, nixl_twisted.tap; "
        "assert 'txredisapi' not in sys.modules, 'txredisapi imported'"
    )
    result = run_installed(tmp_path, sys.executable, "-c", check)
    assert result.returncode == 0, result.stderr
