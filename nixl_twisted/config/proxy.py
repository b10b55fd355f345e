"""``ProxyConfig``: the proxy's whole configuration as one frozen value.

Every source reaches the proxy through :func:`resolve` or
:meth:`ProxyConfig.from_settings`: the command line, the ``--config`` TOML
file (the command line wins; a list given there replaces the file's),
the environment for secrets, SIGHUP reloads (:meth:`ProxyConfig.reloaded`)
and the workers (:meth:`ProxyConfig.to_json` / :meth:`ProxyConfig.from_json`).
Each value passes the parser of its ``settings.Setting``; an error is a
``ConfigError`` that names where the value came from and the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nixl_twisted.config.endpoints import tcp_address
from nixl_twisted.config.settings import SETTINGS
from nixl_twisted.config.sources import ConfigError, from_environment, parse, read_file

__all__ = ["ConfigError", "ProxyConfig", "resolve"]


@dataclass(frozen=True)
class Pools:
    """The backend base URLs of each role (checked, normalized, never empty)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def of(self, role: str) -> tuple[str, ...]:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Policies:
    """How each pool chooses its instance (``nixl_twisted.backends.routing``), and the knobs."""

    prefill: str = "round-robin"
    decode: str = "round-robin"
    balance: float = 1.5
    key_bytes: int = 512

    def of(self, role: str) -> str:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Timeouts:
    """Seconds, for each thing the proxy waits on."""

    connect: float
    backend_idle: float
    prefill: float
    decode: float
    stream_idle: float
    drain: float
    #: On SIGTERM: still accepting, already not ready.
    shutdown_delay: float
    #: A client's request line and headers, then its body (extended by its rate).
    header: float
    body: float
    #: Bytes of body per second that extend ``body`` by one second (0: none).
    body_min_rate: int
    #: Prefill answered -> decode sent, past which a request is counted and logged.
    handoff_warning: float = 10.0


@dataclass(frozen=True)
class Retries:
    """Other instances tried per leg."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class Health:
    """Active ``GET /health`` checks; ``interval`` 0 turns them off."""

    interval: float
    timeout: float
    #: Failures in a row that mark an instance down, successes that bring it back.
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2


@dataclass(frozen=True)
class Limits:
    """What the proxy accepts at once, and keeps."""

    max_in_flight: int
    max_body_size: int
    #: Bytes of request bodies held at once, all requests together.
    max_buffered_bodies: int
    #: Prompts one batched completion may hold.
    max_batch_prompts: int
    max_idle_per_backend: int
    #: Client connections open at once (each holds a file descriptor).
    max_connections: int


@dataclass(frozen=True)
class Traces:
    """OpenTelemetry tracing (``nixl_twisted.observe.tracing``): where to, how, how much."""

    #: The OTLP collector's URL, as given; None: the SDK's environment decides.
    endpoint: str | None = None
    protocol: str = "http/protobuf"
    #: Parent-based share of new traces; None: the SDK's OTEL_TRACES_SAMPLER.
    sampling_ratio: float | None = None


@dataclass(frozen=True)
class ProxyConfig:
    """One proxy's configuration; made only from settings, so always valid."""

    listen: tuple[str, ...]
    pools: Pools
    policies: Policies
    timeouts: Timeouts
    retries: Retries
    health: Health
    limits: Limits
    traces: Traces
    metrics_listen: str | None
    workers: int
    log_format: str
    log_level: str
    access_log: bool
    backend_api_key: str | None = field(repr=False)
    admin_token: str | None = field(repr=False)
    #: The ``--config`` file, whose pools SIGHUP reloads.
    config_path: str | None = None
    #: Set in a ``--workers`` worker: its number; its TCP ports are shared.
    worker: int | None = None
    #: What the command line gave (parsed), which a reload keeps over the file's.
    command_line: tuple[tuple[str, object], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_settings(
        cls,
        values: Mapping[str, object],
        config_path: str | None = None,
        worker: int | None = None,
        command_line: Mapping[str, object] | None = None,
    ) -> ProxyConfig:
        """Build from settings by long name; defaults fill the rest.

        Each value goes through its setting's parser here too (they take
        their own output as input), so no caller can make an invalid one.
        """
        parsed = parse(values, lambda key: f"{key}: ")
        v: dict[str, Any] = {s.name: parsed.get(s.name, s.default) for s in SETTINGS}
        for role in ("prefill", "decode"):
            if not v[role]:
                raise ConfigError(
                    role, f"at least one --{role} URL is required (a vLLM {role} instance)"
                )
        if v["workers"] > 1 and worker is None and None in map(tcp_address, v["listen"]):
            raise ConfigError(
                "listen", "--workers needs every --listen to be tcp:PORT[:interface=...]"
            )
        shared_metrics = v["workers"] > 1 and worker is None and v["metrics-listen"]
        if shared_metrics and tcp_address(v["metrics-listen"]) is None:
            raise ConfigError(
                "metrics-listen", "--workers needs --metrics-listen to be tcp:PORT[:...]"
            )
        return cls(
            listen=tuple(v["listen"]),
            pools=Pools(tuple(v["prefill"]), tuple(v["decode"])),
            policies=Policies(
                prefill=v["prefill-policy"],
                decode=v["decode-policy"],
                balance=v["cache-aware-balance"],
                key_bytes=v["cache-key-bytes"],
            ),
            timeouts=Timeouts(
                connect=v["connect-timeout"],
                backend_idle=v["backend-idle-timeout"],
                prefill=v["prefill-timeout"],
                decode=v["decode-timeout"],
                stream_idle=v["stream-idle-timeout"],
                drain=v["drain-timeout"],
                shutdown_delay=v["shutdown-delay"],
                handoff_warning=v["handoff-warning"],
                header=v["header-timeout"],
                body=v["body-timeout"],
                body_min_rate=v["body-min-rate"],
            ),
            retries=Retries(prefill=v["prefill-retries"], decode=v["decode-retries"]),
            health=Health(
                interval=v["health-interval"],
                timeout=v["health-timeout"],
                unhealthy_threshold=v["unhealthy-threshold"],
                healthy_threshold=v["healthy-threshold"],
            ),
            limits=Limits(
                max_in_flight=v["max-in-flight"],
                max_body_size=v["max-body-size"],
                max_buffered_bodies=v["max-buffered-bodies"],
                max_batch_prompts=v["max-batch-prompts"],
                max_idle_per_backend=v["max-idle-per-backend"],
                max_connections=v["max-connections"],
            ),
            traces=Traces(
                endpoint=v["otlp-traces-endpoint"],
                protocol=v["otlp-traces-protocol"],
                sampling_ratio=v["otel-sampling-ratio"],
            ),
            metrics_listen=v["metrics-listen"],
            workers=1 if worker is not None else v["workers"],
            log_format=v["log-format"],
            log_level=v["log-level"],
            access_log=v["access-log"] == "on",
            backend_api_key=v["backend-api-key"],
            admin_token=v["admin-token"],
            config_path=config_path,
            worker=worker,
            command_line=tuple((command_line or {}).items()),
        )

    @classmethod
    def create(cls, **values: object) -> ProxyConfig:
        """Build from Python values (``max_in_flight=8``), checked like any source."""
        return cls.from_settings({key.replace("_", "-"): value for key, value in values.items()})

    def settings(self) -> dict[str, object]:
        """The settings this configuration was made of, by long name."""
        return {
            "listen": list(self.listen),
            "prefill": list(self.pools.prefill),
            "decode": list(self.pools.decode),
            "backend-api-key": self.backend_api_key,
            "prefill-policy": self.policies.prefill,
            "decode-policy": self.policies.decode,
            "cache-aware-balance": self.policies.balance,
            "cache-key-bytes": self.policies.key_bytes,
            "connect-timeout": self.timeouts.connect,
            "backend-idle-timeout": self.timeouts.backend_idle,
            "max-idle-per-backend": self.limits.max_idle_per_backend,
            "prefill-timeout": self.timeouts.prefill,
            "decode-timeout": self.timeouts.decode,
            "stream-idle-timeout": self.timeouts.stream_idle,
            "prefill-retries": self.retries.prefill,
            "decode-retries": self.retries.decode,
            "health-interval": self.health.interval,
            "health-timeout": self.health.timeout,
            "unhealthy-threshold": self.health.unhealthy_threshold,
            "healthy-threshold": self.health.healthy_threshold,
            "max-in-flight": self.limits.max_in_flight,
            "max-connections": self.limits.max_connections,
            "header-timeout": self.timeouts.header,
            "body-timeout": self.timeouts.body,
            "body-min-rate": self.timeouts.body_min_rate,
            "max-body-size": self.limits.max_body_size,
            "max-buffered-bodies": self.limits.max_buffered_bodies,
            "max-batch-prompts": self.limits.max_batch_prompts,
            "admin-token": self.admin_token,
            "metrics-listen": self.metrics_listen,
            "workers": self.workers,
            "log-format": self.log_format,
            "log-level": self.log_level,
            "access-log": "on" if self.access_log else "off",
            "drain-timeout": self.timeouts.drain,
            "shutdown-delay": self.timeouts.shutdown_delay,
            "handoff-warning": self.timeouts.handoff_warning,
            "otlp-traces-endpoint": self.traces.endpoint,
            "otlp-traces-protocol": self.traces.protocol,
            "otel-sampling-ratio": self.traces.sampling_ratio,
        }

    def to_json(self) -> str:
        """What a worker is handed: every setting, resolved."""
        return json.dumps(
            {"settings": self.settings(), "config_path": self.config_path, "worker": self.worker}
        )

    @classmethod
    def from_json(cls, raw: str) -> ProxyConfig:
        """A worker's configuration, checked as every other source is."""
        data = json.loads(raw)
        given = {key: value for key, value in data["settings"].items() if value is not None}
        return cls.from_settings(given, data["config_path"], data["worker"])

    def for_worker(
        self, number: int, listen: tuple[str, ...], metrics_listen: str | None
    ) -> ProxyConfig:
        """This configuration for worker ``number``, serving the supervisor's shared ports."""
        return replace(self, listen=listen, metrics_listen=metrics_listen, workers=1, worker=number)


def resolve(
    command_line: Mapping[str, object],
    config_path: str | None,
    environ: Mapping[str, str],
) -> ProxyConfig:
    """The configuration: the command line over the file over the environment.

    The environment gives the secrets and the OpenTelemetry SDK's variables
    (each setting's ``env``), and only what neither other source gave.
    """
    given = parse(command_line, lambda key: f"--{key} ")
    values = read_file(config_path) if config_path is not None else {}
    values.update(given)
    values.update(from_environment(values, environ))
    return ProxyConfig.from_settings(values, config_path, command_line=given)
