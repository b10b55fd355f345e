"""``ProxyConfig``: one path for the command line, the TOML file, the environment,
reloads and workers; every error names where the value came from and its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from twisted.python import usage

from nixl_twisted.config import ConfigError, ProxyConfig, resolve
from nixl_twisted.config.settings import BACKEND_API_KEY_ENV, SETTINGS
from nixl_twisted.run.reloads import reloaded
from nixl_twisted.tap import Options
from nixl_twisted.testing.redis import self_signed

POOLS = ["--prefill", "http://p1:8100", "--decode", "http://d1:8200"]


def parse(*args: str) -> ProxyConfig:
    options = Options()
    options.parseOptions(list(args))
    assert options.config is not None
    return options.config


def config_file(tmp_path: Path, text: str) -> str:
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


def test_defaults() -> None:
    config = parse(*POOLS)
    assert config.listen == ("tcp:8000",)
    # Below vLLM's 5 s keep-alive close, and well above Twisted's 2 idle.
    assert config.timeouts.backend_idle < 5
    assert config.limits.max_idle_per_backend >= 256
    assert config.backend_api_key is None
    assert config.workers == 1 and config.worker is None


def test_defaults_let_a_long_generation_through() -> None:
    # Prefill may take minutes on long prompts; decode headers come at the
    # end of a non-streaming answer.
    timeouts = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"]).timeouts
    assert timeouts.prefill >= 120
    assert timeouts.decode >= timeouts.prefill
    assert timeouts.stream_idle >= 30


def test_repeatable_pools_and_listen_normalized() -> None:
    config = parse(
        "--listen",
        "tcp:0:interface=127.0.0.1",
        "--listen",
        "unix:/tmp/nixlproxy-test.sock",
        "--prefill",
        "http://p1:8100/",
        "--prefill",
        "http://p2:8100",
        "--decode",
        "http://d1:8200",
    )
    assert config.pools.prefill == ("http://p1:8100", "http://p2:8100")
    assert config.pools.decode == ("http://d1:8200",)
    assert config.listen == ("tcp:0:interface=127.0.0.1", "unix:/tmp/nixlproxy-test.sock")


def test_the_value_is_frozen() -> None:
    config = parse(*POOLS)
    with pytest.raises(AttributeError):
        config.workers = 3  # type: ignore[misc]


def test_backend_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_API_KEY_ENV, "from-env")
    assert parse(*POOLS).backend_api_key == "from-env"
    assert parse(*POOLS, "--backend-api-key", "from-flag").backend_api_key == "from-flag"
    assert "from-env" not in repr(parse(*POOLS))  # secrets stay out of reprs and logs


def test_every_option_can_come_from_the_file(tmp_path: Path) -> None:
    config = parse("--config", config_file(tmp_path, FILE))
    assert config.pools.prefill == ("http://p1:8100", "http://p2:8100")
    assert config.pools.decode == ("http://d1:8200",)
    assert config.listen == ("tcp:0:interface=127.0.0.1",)
    assert config.timeouts.prefill == 120
    assert config.timeouts.stream_idle == 15.5
    assert config.limits.max_in_flight == 64
    assert config.log_format == "json"


def test_the_command_line_wins(tmp_path: Path) -> None:
    config = parse(
        "--config",
        config_file(tmp_path, FILE),
        "--max-in-flight",
        "8",
        "--decode",
        "http://d9:8200",
    )
    assert config.limits.max_in_flight == 8
    # A list given on the command line replaces the file's list.
    assert config.pools.decode == ("http://d9:8200",)
    assert config.pools.prefill == ("http://p1:8100", "http://p2:8100")
    assert config.timeouts.prefill == 120


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--decode", "http://d:1"],
            "at least one --prefill URL (or --prefill-selector) is required",
        ),
        (
            ["--prefill", "http://p:1"],
            "at least one --decode URL (or --decode-selector) is required",
        ),
        (["--prefill", "p1:8100", "--decode", "http://d:1"], "--prefill 'p1:8100' must start"),
        (["--prefill", "http://p:1", "--decode", "http://d:x"], "--decode 'http://d:x'"),
        ([*POOLS, "--listen", "bogus:1"], "--listen 'bogus:1' is not a usable endpoint"),
        ([*POOLS, "--listen", "tcp:notaport"], "--listen 'tcp:notaport'"),
        ([*POOLS, "--connect-timeout", "soon"], "--connect-timeout must be a number of seconds"),
        ([*POOLS, "--backend-idle-timeout", "0"], "must be greater than 0"),
        ([*POOLS, "--max-idle-per-backend", "0"], "must be at least 1"),
        ([*POOLS, "--log-format", "xml"], "--log-format must be one of text, json"),
        ([*POOLS, "--metrics-listen", "nope:1"], "--metrics-listen 'nope:1'"),
        ([*POOLS, "--workers", "2", "--listen", "unix:/x"], "--workers needs every --listen"),
        ([*POOLS, "--workers", "2", "--metrics-listen", "unix:/m.sock"], "to be tcp:"),
        ([*POOLS, "--decode-migrations", "1000"], "--decode-migrations must be at most 8"),
    ],
)
def test_unusable_options_are_usage_errors_naming_the_problem(
    args: list[str], message: str
) -> None:
    with pytest.raises(usage.UsageError, match=re.escape(message)):
        parse(*args)


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ('prefil = ["http://p:1"]', "prefil", "'prefil' unknown key"),
        ('prefill = "http://p:1"', "prefill", "'prefill' must be a list of strings"),
        ("prefill-timeout = -1", "prefill-timeout", "'prefill-timeout' must be greater than 0"),
        ('max-in-flight = "many"', "max-in-flight", "'max-in-flight' must be a whole number"),
        ("max-in-flight = 2.5", "max-in-flight", "'max-in-flight' must be a whole number"),
        ("drain-timeout = true", "drain-timeout", "'drain-timeout' must be a number of seconds"),
        ('log-format = "xml"', "log-format", "'log-format' must be one of text, json"),
        ("prefill = [", "config", "not valid TOML"),
        ('version = "2"', "version", "'version' unknown key"),
        ('config = "other.toml"', "config", "'config' unknown key"),
        (
            "max-in-flight = 2\nmax_in_flight = 3",
            "max-in-flight",
            "'max-in-flight' and 'max_in_flight' are one key: give it once",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_key(
    tmp_path: Path, text: str, key: str, message: str
) -> None:
    path = config_file(tmp_path, 'decode = ["http://d:1"]\n' + text)
    with pytest.raises(ConfigError) as caught:
        resolve({"prefill": ["http://p:1"]}, path, {})
    assert caught.value.key == key
    assert message in str(caught.value)
    assert path in str(caught.value)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    # tomllib raised UnicodeDecodeError, no ConfigError: at SIGHUP a critical traceback.
    path = tmp_path / "nixlproxy.toml"
    path.write_bytes(b'decode = ["http://d:1"]\n# caf\xe9\n')
    with pytest.raises(ConfigError) as caught:
        resolve({"prefill": ["http://p:1"]}, str(path), {})
    assert caught.value.key == "config"
    assert str(path) in str(caught.value) and "not UTF-8" in str(caught.value)


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(usage.UsageError, match="cannot read it"):
        parse("--config", str(tmp_path / "absent.toml"))


def test_pool_urls_from_the_file_are_checked_like_options(tmp_path: Path) -> None:
    path = config_file(tmp_path, 'prefill = ["p1:8100"]\ndecode = ["http://d:1"]\n')
    with pytest.raises(usage.UsageError, match="'prefill' 'p1:8100' must start"):
        parse("--config", path)


def test_a_reload_takes_the_file_pools_and_keeps_the_rest(tmp_path: Path) -> None:
    path = config_file(tmp_path, FILE)
    config = parse("--config", path, "--max-in-flight", "8")
    config_file(tmp_path, 'prefill = ["http://p7:8100"]\ndecode = ["http://d7:8200"]\n')
    applied = reloaded(config, {}).config
    assert applied.pools.prefill == ("http://p7:8100",)
    assert applied.pools.decode == ("http://d7:8200",)
    assert applied.limits.max_in_flight == 8


def test_a_reload_applies_every_live_setting_and_names_what_it_cannot(tmp_path: Path) -> None:
    path = config_file(tmp_path, FILE)
    config = parse("--config", path, "--max-body-size", "1000")
    config_file(
        tmp_path,
        FILE.replace("max-in-flight = 64", "max-in-flight = 7")
        .replace('"tcp:0:', '"tcp:9:')
        .replace("15.5", "9")
        + "log-level = 'warn'\nmax-body-size = 5000\n"
        "workers = 3\nconnect-timeout = 1\n",
    )
    reload = reloaded(config, {})
    applied = reload.config
    assert applied.limits.max_in_flight == 7
    assert applied.timeouts.stream_idle == 9
    assert applied.log_level == "warn"
    assert applied.limits.max_body_size == 1000  # the command line wins
    assert (applied.listen, applied.workers, applied.timeouts.connect) == (
        config.listen,
        config.workers,
        config.timeouts.connect,
    )
    assert set(reload.changed) == {"max-in-flight", "stream-idle-timeout", "log-level"}
    assert set(reload.need_restart) == {"listen", "workers", "connect-timeout"}
    assert reload.overridden == ("max-body-size",)
    # Reloaded again, the command line still wins.
    assert reloaded(applied, {}).config.limits.max_body_size == 1000


def test_every_setting_is_live_or_takes_a_restart_as_documented() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("Settings that take a restart:"))
    documented = set(re.findall(r"`--([a-z-]+)`", line))
    assert documented == {s.name for s in SETTINGS if not s.live}


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('prefill = ["nope"]\ndecode = ["http://d:1"]\n', "prefill"),
        ('prefill = []\ndecode = ["http://d:1"]\n', "prefill"),
        ('prefill = ["http://p:1"]\ndecode = ["http://d:1"]\nbogus = 1\n', "bogus"),
        ("prefill = [", "config"),
    ],
)
def test_a_reload_that_fails_is_a_config_error_naming_the_key(
    tmp_path: Path, text: str, key: str
) -> None:
    config = parse("--config", config_file(tmp_path, FILE))
    config_file(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        reloaded(config, {})
    assert caught.value.key == key
    assert not isinstance(caught.value, usage.UsageError)


def test_a_reload_without_a_file_says_so() -> None:
    with pytest.raises(ConfigError, match="no --config file"):
        reloaded(parse(*POOLS), {})


def test_a_reload_without_a_file_applies_the_same_configuration_to_read_the_keys_file_again(
    tmp_path: Path,
) -> None:
    (tmp_path / "keys").write_text("sk-a\n")
    config = parse(*POOLS, "--api-keys-file", str(tmp_path / "keys"))
    reload = reloaded(config, {})
    assert (reload.config, reload.changed, reload.need_restart) == (config, (), ())


def test_a_worker_gets_the_resolved_configuration_back_whole(tmp_path: Path) -> None:
    path = config_file(tmp_path, FILE)
    config = parse("--config", path, "--backend-api-key", "k", "--workers", "2")
    worker = config.for_worker(1, ("tcp:4321:interface=127.0.0.1",), "tcp:4322")
    again = ProxyConfig.from_json(worker.to_json())
    assert again == worker
    assert (again.worker, again.workers, again.listen) == (1, 1, ("tcp:4321:interface=127.0.0.1",))
    assert again.backend_api_key == "k"
    assert again.config_path == config.config_path


def test_python_values_are_checked_as_the_command_line_is() -> None:
    with pytest.raises(ConfigError, match="max-in-flight: must be at least 1"):
        ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], max_in_flight=0)


def test_every_setting_round_trips_through_settings() -> None:
    config = parse(*POOLS)
    assert set(config.settings()) == {s.name for s in SETTINGS}


@pytest.mark.parametrize("name", ["x-tenänt", "x tenant", "", "x-tenant:"])
def test_the_tenant_header_must_be_a_header_name(name: str) -> None:
    with pytest.raises(usage.UsageError, match=r"tenant-header.*must be a header name"):
        parse("--prefill", "http://p:1", "--decode", "http://d:1", "--tenant-header", name)
    assert parse(
        "--prefill", "http://p:1", "--decode", "http://d:1", "--tenant-header", "X-Team_1.b~"
    )


def test_a_bodys_ceiling_is_never_below_its_timeout() -> None:
    from nixl_twisted.web.deadlines import ClientLimits

    def ceiling(**settings: object) -> float:
        config = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], **settings)
        return ClientLimits.of(config).body_max_timeout

    assert ceiling() == 120.0
    assert ceiling(body_max_timeout=600) == 600.0
    assert ceiling(body_timeout=300) == 300.0  # (a longer --body-timeout is kept whole)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("rediss://r:6380/0?ssl_cert_reqs=none", "unknown parameter 'ssl_cert_reqs'"),
        ("redis://r:6379/0?ssl_ca_certs=CA", "ssl_ca_certs is for TLS, in a rediss:// URL"),
        ("rediss://r:6380/0?ssl_ca_certs=/no/such/ca.pem", "cannot be read"),
        ("rediss://r:6380/0?ssl_ca_certs=EMPTY", "holds no PEM certificate"),
        ("rediss://r:6380/0?ssl_ca_certs=CA", "holds no PEM certificate"),
    ],
)
def test_a_redis_url_s_tls_parameters_are_checked_at_start(
    tmp_path: Path, url: str, message: str
) -> None:
    (tmp_path / "empty.pem").write_text("")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    url = url.replace("EMPTY", str(tmp_path / "empty.pem")).replace("CA", str(tmp_path / "ca.pem"))
    for option in ("--limits-redis", "--replicas-redis"):
        with pytest.raises(usage.UsageError, match=re.escape(message)):
            parse(*POOLS, option, url)


def test_a_rediss_url_may_name_its_ca_file(tmp_path: Path) -> None:
    ca_file, _ = self_signed(str(tmp_path), "r")
    url = f"rediss://:secret@r:6380/0?ssl_ca_certs={ca_file}"
    assert parse(*POOLS, "--limits-redis", url).tenants.redis == url


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("decode_max_inflight = 3", "'decode_max_inflight' unknown key; did you mean "
         "'decode-max-in-flight'?"),
        ("prefil = []", "'prefil' unknown key; did you mean 'prefill'?"),
        ('[replicas]\nurl = "redis://r"', "'[replicas] url' unknown key ([replicas] takes redis)"),
        ('[replicas]\nrediss = "redis://r"', "'[replicas] rediss' unknown key; did you mean "
         "'[replicas] redis'?"),
        ("colour = 3", "'colour' unknown key (the keys are the options' long names: "
         "twistd nixlproxy --help"),
    ],
)  # fmt: skip
def test_an_unknown_key_is_named_as_written_with_what_it_likely_meant(
    tmp_path: Path, text: str, said: str
) -> None:
    """Not the 90 keys in one line: the one it likely meant, or where they are listed."""
    path = config_file(tmp_path, 'decode = ["http://d:1"]\n' + text + "\n")
    with pytest.raises(ConfigError) as caught:
        resolve({"prefill": ["http://p:1"]}, path, {})
    assert str(caught.value).startswith(f"--config {path}: {said}")
    assert len(str(caught.value)) < 200 + len(path)


def test_a_mistyped_option_gets_the_option_it_likely_meant() -> None:
    with pytest.raises(usage.UsageError) as caught:
        parse(*POOLS, "--decode-max-inflight", "4")
    assert str(caught.value) == (
        "option --decode-max-inflight not recognized; did you mean --decode-max-in-flight?"
    )
    with pytest.raises(usage.UsageError) as caught:
        parse(*POOLS, "--colour", "4")
    assert str(caught.value) == "option --colour not recognized"
