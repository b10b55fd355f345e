"""Configuration: the settings table, the grammar of values, their sources, ``ProxyConfig``.

Imports nothing else of the proxy. Every other room reads its settings from
the frozen ``ProxyConfig`` and its parts, re-exported here, with the grammar of
values and the words other rooms use to say them.
"""

from nixl_twisted.config import help, words
from nixl_twisted.config.endpoints import tcp_address, tcp_endpoint
from nixl_twisted.config.models import ModelPools
from nixl_twisted.config.parts import (
    Disaggregation,
    DiscoveryConfig,
    Health,
    KvEventsConfig,
    Limits,
    MigrationRules,
    Policies,
    Pools,
    Retries,
    Reuse,
    TenantsConfig,
    Timeouts,
    Traces,
)
from nixl_twisted.config.proxy import ProxyConfig, resolve
from nixl_twisted.config.settings import BACKEND_API_KEY_ENV, BY_NAME, SETTINGS, default_text
from nixl_twisted.config.sources import ConfigError, from_environment, read_file
from nixl_twisted.config.spelling import did_you_mean
from nixl_twisted.config.tenants import (
    NO_RULE,
    TenantRow,
    TenantRule,
    cache_salt,
    client_key,
    redis_ca_file,
)
from nixl_twisted.config.values import (
    MAX_RANKS,
    InvalidValue,
    backend_url,
    cap_of,
    discovered_by,
    instance_url,
    kv_ports,
    rank_urls,
)
from nixl_twisted.config.words import counted

__all__ = [
    "BACKEND_API_KEY_ENV",
    "BY_NAME",
    "MAX_RANKS",
    "NO_RULE",
    "SETTINGS",
    "ConfigError",
    "Disaggregation",
    "DiscoveryConfig",
    "Health",
    "InvalidValue",
    "KvEventsConfig",
    "Limits",
    "MigrationRules",
    "ModelPools",
    "Policies",
    "Pools",
    "ProxyConfig",
    "Retries",
    "Reuse",
    "TenantRow",
    "TenantRule",
    "TenantsConfig",
    "Timeouts",
    "Traces",
    "backend_url",
    "cache_salt",
    "cap_of",
    "client_key",
    "counted",
    "default_text",
    "did_you_mean",
    "discovered_by",
    "from_environment",
    "help",
    "instance_url",
    "kv_ports",
    "rank_urls",
    "read_file",
    "redis_ca_file",
    "resolve",
    "tcp_address",
    "tcp_endpoint",
    "words",
]
