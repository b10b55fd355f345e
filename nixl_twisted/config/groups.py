"""The options grouped by what they are for, in the order ``--help`` and the docs show them.

``settings.SETTINGS`` says what each option is; this says where a reader
looks for it. Every option of ``twistd nixlproxy`` is in one group (the
tests check it), with the placeholder its value is written as
(``--listen ENDPOINT``), as the README and ``docs/configuration.md`` write it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """Options read together: a heading in ``--help`` and in the docs' option tables."""

    title: str
    #: Each option's name and its value's placeholder ("" for a flag).
    options: tuple[tuple[str, str], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.options)


GROUPS: tuple[Group, ...] = (
    Group(
        "Listening and the admin API",
        (
            ("listen", "ENDPOINT"),
            ("admin-listen", "ENDPOINT"),
            ("metrics-listen", "ENDPOINT"),
            ("admin-token", "TOKEN"),
        ),
    ),
    Group(
        "Pools and discovery",
        (
            ("prefill", "URL"),
            ("decode", "URL"),
            ("prefill-selector", "SELECTOR"),
            ("decode-selector", "SELECTOR"),
            ("models", "TABLE"),
            ("kubernetes-namespace", "NAME"),
            ("kubernetes-port", "PORT"),
            ("kubeconfig", "PATH"),
            ("dns-server", "ADDRESS:PORT"),
            ("dns-min-refresh", "SECONDS"),
            ("dns-max-refresh", "SECONDS"),
            ("discovery-grace", "SECONDS"),
            ("discovery-max-instances", "N"),
            ("allowed-backends", "NET_OR_NAME"),
        ),
    ),
    Group(
        "Routing",
        (
            ("prefill-policy", "NAME"),
            ("decode-policy", "NAME"),
            ("cache-aware-balance", "FACTOR"),
            ("cache-aware-margin", "LEGS"),
            ("warm-up", "SECONDS"),
            ("cache-aware-entries", "N"),
            ("cache-aware-min-match", "SHARE"),
            ("cache-key-bytes", "N"),
            ("prefill-kv-events-port", "PORT"),
            ("prefill-kv-replay-port", "PORT"),
            ("decode-kv-events-port", "PORT"),
            ("decode-kv-replay-port", "PORT"),
            ("kv-index-blocks", "N"),
            ("render-timeout", "SECONDS"),
        ),
    ),
    Group(
        "Deciding: two legs or decode alone",
        (
            ("decode-only-below", "N"),
            ("decode-only-uncached-below", "N"),
            ("decode-only-busy-below", "N"),
            ("prefill-busy-at", "N"),
            ("prefill-fallback", "MODE"),
            ("token-ids-to-decode", "MODE"),
            ("multi-turn-reuse", "MODE"),
            ("reuse-handle-ttl", "SECONDS"),
        ),
    ),
    Group(
        "Backends: connections, timeouts, retries, health",
        (
            ("backend-api-key", "KEY"),
            ("forward-header", "NAME"),
            ("connect-timeout", "SECONDS"),
            ("backend-idle-timeout", "SECONDS"),
            ("max-idle-per-backend", "N"),
            ("prefill-timeout", "SECONDS"),
            ("decode-timeout", "SECONDS"),
            ("stream-idle-timeout", "SECONDS"),
            ("sse-keepalive", "SECONDS"),
            ("prefill-retries", "N"),
            ("decode-retries", "N"),
            ("decode-migrations", "N"),
            ("migration-deadline", "SECONDS"),
            ("health-interval", "SECONDS"),
            ("health-timeout", "SECONDS"),
            ("unhealthy-threshold", "N"),
            ("healthy-threshold", "N"),
            ("outlier-consecutive-failures", "N"),
            ("outlier-ejection-seconds", "SECONDS"),
        ),
    ),
    Group(
        "Admission: capacity, queue, request limits",
        (
            ("max-in-flight", "N"),
            ("prefill-max-in-flight", "N"),
            ("decode-max-in-flight", "N"),
            ("queue-size", "N"),
            ("queue-timeout", "SECONDS"),
            ("prefill-run-ahead", "N"),
            ("kv-lease-duration", "SECONDS"),
            ("replicas-redis", "URL"),
            ("max-connections", "N"),
            ("header-timeout", "SECONDS"),
            ("body-timeout", "SECONDS"),
            ("body-min-rate", "BYTES"),
            ("body-max-timeout", "SECONDS"),
            ("max-body-size", "BYTES"),
            ("max-buffered-bodies", "BYTES"),
            ("max-batch-prompts", "N"),
            ("max-n", "N"),
            ("responses-per-tenant", "N"),
        ),
    ),
    Group(
        "Clients and tenants",
        (
            ("api-key", "KEY"),
            ("api-keys-file", "PATH"),
            ("tenant-header", "NAME"),
            ("tenant-max-in-flight", "N"),
            ("tenant-requests-per-minute", "N"),
            ("tenant-tokens-per-minute", "N"),
            ("limits-redis", "URL"),
            ("tenant-priority", "N"),
            ("tenants", "TABLE"),
            ("tenant-salt-secret-file", "PATH"),
        ),
    ),
    Group(
        "Observability",
        (
            ("log-format", "FORMAT"),
            ("log-level", "LEVEL"),
            ("access-log", "MODE"),
            ("handoff-warning", "SECONDS"),
            ("otlp-traces-endpoint", "URL"),
            ("otlp-traces-protocol", "PROTOCOL"),
            ("otel-sampling-ratio", "RATIO"),
        ),
    ),
    Group(
        "Lifecycle",
        (
            ("config", "PATH"),
            ("workers", "N"),
            ("drain-timeout", "SECONDS"),
            ("shutdown-delay", "SECONDS"),
            ("version", ""),
            ("help", ""),
            ("worker", "N"),
        ),
    ),
)

#: Each option's placeholder, by name.
METAVARS: dict[str, str] = {name: metavar for g in GROUPS for name, metavar in g.options}
