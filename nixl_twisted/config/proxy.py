"""``ProxyConfig``: the proxy's whole configuration as one frozen value.

Every source reaches the proxy through :func:`resolve` or
:meth:`ProxyConfig.from_settings`: the command line, the ``--config`` TOML
file (the command line wins; a list given there replaces the file's),
the environment for secrets, SIGHUP reloads (``nixl_twisted.run.reloads.reloaded``)
and the workers (:meth:`ProxyConfig.to_json` / :meth:`ProxyConfig.from_json`).
Each value passes the parser of its ``settings.Setting``; an error is a
``ConfigError`` that names where the value came from and the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nixl_twisted.config.endpoints import tcp_address
from nixl_twisted.config.models import ModelPools
from nixl_twisted.config.settings import SETTINGS
from nixl_twisted.config.sources import ConfigError, from_environment, parse, read_file
from nixl_twisted.config.values import discovered_by

__all__ = ["ConfigError", "ProxyConfig", "TenantsConfig", "resolve"]


@dataclass(frozen=True)
class Pools:
    """Each role's members: instances' base URLs, and ``dns+``/``dnssrv+`` names (checked).

    ``models``' members are in their role's pool too, named as serving their model.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    models: tuple[ModelPools, ...] = ()

    def of(self, role: str) -> tuple[str, ...]:
        given = self.prefill if role == "prefill" else self.decode
        listed = [url for model in self.models for url in model.members(role)]
        return tuple(dict.fromkeys((*given, *listed)))  # (each once, in order)

    def named(self, role: str) -> dict[str, frozenset[str]]:
        """The models each member of a pool is listed under (``[models.NAME]``)."""
        named: dict[str, set[str]] = {}
        for model in self.models:
            for url in model.members(role):
                named.setdefault(url, set()).add(model.name)
        return {url: frozenset(names) for url, names in named.items()}

    def model(self, name: str | None) -> ModelPools | None:
        """The ``[models.NAME]`` table of this name, if there is one."""
        return next((model for model in self.models if model.name == name), None)

    def static(self, role: str) -> tuple[str, ...]:
        """A pool's instances as given, without the names discovery resolves."""
        return tuple(url for url in self.of(role) if discovered_by(url) is None)

    def names(self, role: str) -> tuple[str, ...]:
        """A pool's ``dns+`` and ``dnssrv+`` members: names that give instances."""
        return tuple(url for url in self.of(role) if discovered_by(url) is not None)


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where instances come from besides the pools' URLs: DNS names and Kubernetes selectors."""

    prefill_selector: str | None
    decode_selector: str | None
    #: The selected pods' namespace (None: the proxy's own, the context's, or default).
    namespace: str | None
    #: Each pod's vLLM port: a number or a container port's name.
    port: str
    kubeconfig: str | None
    #: ``HOST:PORT`` of the resolver for dns+ and dnssrv+; None: the system's.
    dns_server: str | None
    dns_min_refresh: float
    dns_max_refresh: float
    #: Seconds of authoritative "none" before a source's instances drain.
    grace: float
    #: Networks and host names discovery and the admin API may add; (): any but metadata.
    allowed: tuple[str, ...] = ()

    def selector(self, role: str) -> str | None:
        return self.prefill_selector if role == "prefill" else self.decode_selector


@dataclass(frozen=True)
class TenantsConfig:
    """Whose a request is (``header``, else a client key's tenant) and what each may use."""

    header: str | None
    #: The defaults for every tenant (0: no limit).
    max_in_flight: int
    requests_per_minute: int
    tokens_per_minute: int
    #: Each listed tenant's own: (name, in flight, requests, tokens, priority); -1 (None
    #: for the priority): the default.
    table: tuple[tuple[str, int, int, int, int | None], ...] = ()
    #: The vLLM ``priority`` of every tenant's requests (None: the client's own).
    priority: int | None = None
    #: The Redis that every replica counts requests and tokens per minute in (None: each its own).
    redis: str | None = None


@dataclass(frozen=True)
class Policies:
    """How each pool chooses its instance (``nixl_twisted.backends.routing``), and the knobs."""

    prefill: str
    decode: str
    #: cache-aware's balance guard, and the prompt bytes that name a conversation.
    balance: float
    key_bytes: int
    #: cache-aware's memory of prefixes sent (entries per pool), and the share of a
    #: prompt a remembered prefix must cover to be followed.
    entries: int = 100_000
    min_match: float = 0.5

    def of(self, role: str) -> str:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Disaggregation:
    """When a request skips its prefill leg (``nixl_twisted.exchange.decide``); 0: a rule off."""

    #: Prompts estimated under this many tokens.
    short_prompt: int
    #: Prompts with fewer than this many tokens not cached on the decode instance.
    uncached: int
    #: Prompts under this many tokens, while every prefill instance is at ``busy_at``.
    busy_prompt: int
    busy_at: int
    #: "decode": no usable prefill instance serves the request decode-only; "none": a 503.
    fallback: str

    @property
    def always(self) -> bool:
        """No rule can skip prefill before trying it (the fallback may, after)."""
        return not (self.short_prompt or self.uncached or self.busy_prompt)


@dataclass(frozen=True)
class KvEventsConfig:
    """Where instances publish vLLM's KV cache events, for ``kv-aware`` (0: a port unset)."""

    #: Each pool's ports for instances whose URL names none (``#kv-events=``).
    prefill_port: int
    prefill_replay_port: int
    decode_port: int
    decode_replay_port: int
    #: Blocks indexed per instance, the oldest stored forgotten first.
    max_blocks: int
    #: Seconds a render request (a prompt's token ids from vLLM) may take.
    render_timeout: float

    def read_for(self, role: str, urls: Sequence[str]) -> bool:
        """Whether any instance of that pool has its KV events read."""
        return bool(self.ports(role)[0]) or any("kv-events=" in url for url in urls)

    def ports(self, role: str) -> tuple[int, int]:
        """A pool's default events and replay ports."""
        if role == "prefill":
            return self.prefill_port, self.prefill_replay_port
        return self.decode_port, self.decode_replay_port


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
    handoff_warning: float


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
    unhealthy_threshold: int
    healthy_threshold: int


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
    endpoint: str | None
    protocol: str
    #: Parent-based share of new traces; None: the SDK's OTEL_TRACES_SAMPLER.
    sampling_ratio: float | None


@dataclass(frozen=True)
class ProxyConfig:
    """One proxy's configuration; made only from settings, so always valid."""

    listen: tuple[str, ...]
    pools: Pools
    policies: Policies
    disaggregation: Disaggregation
    kv_events: KvEventsConfig
    discovery: DiscoveryConfig
    tenants: TenantsConfig
    timeouts: Timeouts
    retries: Retries
    health: Health
    limits: Limits
    traces: Traces
    metrics_listen: str | None
    #: The admin endpoint: /admin/*, /healthcheck in full and /metrics there only.
    admin_listen: str | None
    workers: int
    log_format: str
    log_level: str
    access_log: bool
    backend_api_key: str | None = field(repr=False)
    #: Keys clients must send (with ``api_keys_file``'s); none: anyone is served.
    api_keys: tuple[str, ...] = field(repr=False)
    api_keys_file: str | None
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
            listed = any(model.members(role) for model in v["models"])
            if not v[role] and not v[f"{role}-selector"] and not listed:
                raise ConfigError(
                    role,
                    f"at least one --{role} URL (or --{role}-selector) is required "
                    f"(a vLLM {role} instance)",
                )
        if v["dns-min-refresh"] > v["dns-max-refresh"]:
            raise ConfigError(
                "dns-min-refresh",
                f"--dns-min-refresh {v['dns-min-refresh']} is more than "
                f"--dns-max-refresh {v['dns-max-refresh']}",
            )
        if v["workers"] > 1 and worker is None and None in map(tcp_address, v["listen"]):
            raise ConfigError(
                "listen", "--workers needs every --listen to be tcp:PORT[:interface=...]"
            )
        for own in ("metrics-listen", "admin-listen"):
            shared = v["workers"] > 1 and worker is None and v[own]
            if shared and tcp_address(v[own]) is None:
                raise ConfigError(own, f"--workers needs --{own} to be tcp:PORT[:...]")
        top: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        for setting in SETTINGS:
            part, _, attribute = setting.field.rpartition(".")
            value = tuple(v[setting.name]) if setting.many else v[setting.name]
            (parts[part] if part else top)[attribute] = value
        top["workers"] = 1 if worker is not None else top["workers"]
        return cls(
            **top,
            **{name: _PARTS[name](**given) for name, given in parts.items()},
            config_path=config_path,
            worker=worker,
            command_line=tuple((command_line or {}).items()),
        )

    @classmethod
    def create(cls, **values: object) -> ProxyConfig:
        """Build from Python values (``max_in_flight=8``), checked like any source."""
        return cls.from_settings({key.replace("_", "-"): value for key, value in values.items()})

    def settings(self) -> dict[str, object]:
        """The settings this configuration was made of, by long name (each its field's value)."""
        found: dict[str, object] = {}
        for setting in SETTINGS:
            value: Any = self
            for attribute in setting.field.split("."):
                value = getattr(value, attribute)
            found[setting.name] = list(value) if setting.many else value
        return found

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

    def rules_for(self, model: str | None) -> Disaggregation:
        """When a request for ``model`` skips prefill: its ``[models.NAME]`` table's rules."""
        table = self.pools.model(model)
        if table is None or not table.own:
            return self.disaggregation
        fields = {
            "short_prompt": "decode-only-below",
            "uncached": "decode-only-uncached-below",
            "busy_prompt": "decode-only-busy-below",
            "busy_at": "prefill-busy-at",
            "fallback": "prefill-fallback",
        }
        rules = self.disaggregation
        return replace(
            rules,
            **{name: table.setting(key, getattr(rules, name)) for name, key in fields.items()},
        )

    @property
    def keyed(self) -> bool:
        """Clients must send a key: theirs is then never forwarded to vLLM."""
        return bool(self.api_keys) or self.api_keys_file is not None

    def for_worker(
        self,
        number: int,
        listen: tuple[str, ...],
        metrics_listen: str | None,
        admin_listen: str | None = None,
    ) -> ProxyConfig:
        """This configuration for worker ``number``, serving the supervisor's shared ports."""
        return replace(
            self,
            listen=listen,
            metrics_listen=metrics_listen,
            admin_listen=admin_listen,
            workers=1,
            worker=number,
        )


#: The parts of a configuration, by the field name their settings give (``part.attribute``).
_PARTS: dict[str, type] = {
    "pools": Pools,
    "policies": Policies,
    "disaggregation": Disaggregation,
    "kv_events": KvEventsConfig,
    "discovery": DiscoveryConfig,
    "tenants": TenantsConfig,
    "timeouts": Timeouts,
    "retries": Retries,
    "health": Health,
    "limits": Limits,
    "traces": Traces,
}


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
