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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nixl_twisted.config.endpoints import tcp_address
from nixl_twisted.config.parts import (
    Capacity,
    Disaggregation,
    DiscoveryConfig,
    Health,
    KvEventsConfig,
    Limits,
    MigrationRules,
    Policies,
    Pools,
    Replicas,
    Retries,
    Reuse,
    TenantsConfig,
    Timeouts,
    Traces,
)
from nixl_twisted.config.settings import SETTINGS
from nixl_twisted.config.sources import ConfigError, from_environment, parse, read_file

__all__ = ["ConfigError", "ProxyConfig", "resolve"]


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
    migrations: MigrationRules
    health: Health
    limits: Limits
    capacity: Capacity
    replicas: Replicas
    traces: Traces
    metrics_listen: str | None
    #: The admin endpoint: /admin/*, /healthcheck in full and /metrics there only.
    admin_listen: str | None
    workers: int
    log_format: str
    log_level: str
    access_log: bool
    #: Prefill is asked for a chat prompt's token ids, and decode is handed them.
    token_ids_to_decode: bool
    reuse: Reuse
    backend_api_key: str | None = field(repr=False)
    #: Keys clients must send (with ``api_keys_file``'s); none: anyone is served.
    api_keys: tuple[str, ...] = field(repr=False)
    api_keys_file: str | None
    admin_token: str | None = field(repr=False)
    #: Client headers both legs carry besides ``headers.FORWARDED`` (``--forward-header``).
    forward_headers: tuple[str, ...]
    #: The ``--config`` file, whose pools SIGHUP reloads.
    config_path: str | None = None
    #: Set in a ``--workers`` worker: its number; its TCP ports are shared.
    worker: int | None = None
    #: The workers of its proxy, in a worker (each takes its share of the instances' caps).
    worker_count: int = 1
    #: What the command line gave (parsed), which a reload keeps over the file's.
    command_line: tuple[tuple[str, object], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_settings(
        cls,
        values: Mapping[str, object],
        config_path: str | None = None,
        worker: int | None = None,
        command_line: Mapping[str, object] | None = None,
        worker_count: int = 1,
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
            worker_count=worker_count if worker is not None else 1,
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
            {
                "settings": self.settings(),
                "config_path": self.config_path,
                "worker": self.worker,
                "worker_count": self.worker_count,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> ProxyConfig:
        """A worker's configuration, checked as every other source is."""
        data = json.loads(raw)
        given = {key: value for key, value in data["settings"].items() if value is not None}
        count = int(data.get("worker_count", 1))
        return cls.from_settings(given, data["config_path"], data["worker"], worker_count=count)

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
            worker_count=self.workers,
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
    "migrations": MigrationRules,
    "health": Health,
    "limits": Limits,
    "capacity": Capacity,
    "replicas": Replicas,
    "traces": Traces,
    "reuse": Reuse,
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
