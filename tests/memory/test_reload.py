"""SIGHUP's reload through the service: each live setting applied, or nothing and the key logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel, formatEvent

from nixl_twisted.config import resolve
from nixl_twisted.logs import LogLevels
from nixl_twisted.run.proxy_service import ProxyService
from nixl_twisted.run.root import build
from tests.memory.support import Setup


def proxy_from(path: Path) -> ProxyService:
    config = resolve({"health-interval": 0}, str(path), {})
    return build(config, MemoryReactorClock(), clock=Clock(), take_signals=False)


def test_a_reload_makes_the_pools_what_the_file_says(tmp_path: Path) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_text('prefill = ["http://p1:1", "http://p2:1"]\ndecode = ["http://d2:1"]\n')
    service.reload()
    assert service.backends.prefill.urls == ("http://p1:1", "http://p2:1")
    assert service.backends.decode.urls == ("http://d2:1",)  # d1 had no leg: gone at once
    assert service.config.pools.decode == ("http://d2:1",)


def test_a_reload_gives_a_model_its_instances_and_its_own_policy(tmp_path: Path) -> None:
    """A model's table in the file (TOML's ``[models.NAME]``), added and then changed."""
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_text(
        'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
        '[models.qwen]\ndecode = ["http://d2:1#dp=2"]\ndecode-policy = "session"\n'
    )
    service.reload()
    decode = service.backends.decode
    assert [(i.url, sorted(i.named)) for i in decode.instances] == [
        ("http://d1:1", []),
        ("http://d2:1#rank=0", ["qwen"]),
        ("http://d2:1#rank=1", ["qwen"]),
    ]
    assert decode.policy_for("qwen").name == "session"
    assert decode.policy_for("llama").name == "round-robin"
    path.write_text(
        'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
        '[models.qwen]\ndecode = ["http://d1:1"]\n'
    )
    service.reload()
    assert [(i.url, sorted(i.named)) for i in decode.instances] == [("http://d1:1", ["qwen"])]
    assert decode.policy_for("qwen").name == "round-robin"


def test_a_reload_that_fails_leaves_the_pools_alone_and_logs_the_key(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_text('prefill = ["http://p9:1"]\ndecode = ["d9:1"]\n')
    service.reload()
    assert service.backends.prefill.urls == ("http://p1:1",)  # not half applied
    assert service.backends.decode.urls == ("http://d1:1",)
    (error,) = [e for e in logged if e.get("log_format", "").startswith("SIGHUP: nothing")]
    assert error["key"] == "decode"
    assert "'d9:1' must start with http://" in error["error"]


def test_a_reload_of_a_file_that_is_not_utf8_warns_naming_it_and_keeps_all(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_bytes(b'prefill = ["http://p9:1"]\ndecode = ["http://d9:1"] # \xff\n')
    service.reload()  # (raised UnicodeDecodeError, logged critical by the signal's caller)
    assert service.backends.prefill.urls == ("http://p1:1",)
    assert service.config.pools.decode == ("http://d1:1",)
    (warning,) = [e for e in logged if e.get("log_format", "").startswith("SIGHUP: nothing")]
    assert warning["log_level"] == LogLevel.warn
    assert str(path) in warning["error"] and "not UTF-8" in warning["error"]


def test_a_reload_changes_the_policies_too(tmp_path: Path) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    assert service.backends.prefill.policies.default.name == "round-robin"
    path.write_text(
        'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
        'prefill-policy = "cache-aware"\ndecode-policy = "least-loaded"\n'
    )
    service.reload()
    pools = service.backends
    assert (pools.prefill.policies.default.name, pools.decode.policies.default.name) == (
        "cache-aware",
        "least-loaded",
    )
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\nprefill-policy = "x"\n')
    service.reload()  # refused, named; the policy stays
    assert pools.prefill.policies.default.name == "cache-aware"


def test_a_reload_applies_limits_timeouts_and_the_log_level_and_warns_once(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    path = tmp_path / "nixlproxy.toml"
    pools = 'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
    path.write_text(pools)
    service = proxy_from(path)
    service.log_levels = LogLevels("info")
    path.write_text(
        pools + "max-in-flight = 3\nmax-connections = 9\nmax-body-size = 100\n"
        "max-buffered-bodies = 1000\nstream-idle-timeout = 7\nprefill-retries = 0\n"
        "unhealthy-threshold = 5\nlog-level = 'error'\naccess-log = 'off'\n"
        "admin-token = 't'\nworkers = 4\nlog-format = 'json'\n"
    )
    service.reload()
    app, site = service.app, service.site
    assert app.admission.max_in_flight == 3
    assert (site.limits.max_connections, site.limits.max_body_size) == (9, 100)
    assert site.body_budget is not None and site.body_budget.limit == 1000
    assert site.access_log is not None and not site.access_log.emit
    assert app.config.timeouts.stream_idle == 7 and app.serving.legs.config.retries.prefill == 0
    assert app.serving.legs.config.timeouts.stream_idle == 7  # the next exchange takes it
    assert service.backends.prefill.thresholds.unhealthy == 5
    assert service.log_levels.level == "error"
    assert app.admin._token == b"t"
    assert (service.config.workers, service.config.log_format) == (1, "text")
    (warning,) = [e for e in logged if e.get("log_format", "").startswith("SIGHUP: settings not")]
    assert set(warning["need_restart"]) == {"workers", "log-format"}
    (said,) = [e for e in logged if e.get("log_format", "").startswith("SIGHUP: reloaded")]
    assert "max-in-flight" in said["reloaded"] and "workers" not in said["reloaded"]


def test_a_reloaded_body_limit_is_the_next_requests(tmp_path: Path) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://prefill-0.memory"]\ndecode = ["http://decode-0.memory"]\n')
    setup = Setup()
    setup.proxy.service.config = resolve({"health-interval": 0}, str(path), {})
    body = {"model": "m", "prompt": "x" * 200}
    assert setup.post("/v1/completions", body).answer().status == 200
    path.write_text(path.read_text() + "max-body-size = 100\n")
    setup.proxy.service.reload()
    assert setup.post("/v1/completions", body).answer().status == 413


def test_sighup_without_a_config_file_reads_the_keys_file_again(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    """At once, not at the 2 s looks: whoever sends SIGHUP has finished writing it."""
    keys = tmp_path / "keys"
    keys.write_text("sk-a team-a\n")
    setup = Setup(api_keys_file=str(keys))
    keys.write_text("sk-b team-b\n")
    setup.proxy.service.reload()
    headers = {"Authorization": "Bearer sk-a"}
    assert setup.get("/v1/models", headers).answer().status == 401
    headers = {"Authorization": "Bearer sk-b"}
    assert setup.get("/v1/models", headers).answer().status == 200
    said = [formatEvent(event) for event in logged if "SIGHUP" in formatEvent(event)]
    assert said == [f"SIGHUP: no --config file; --api-keys-file {keys} read again"]
