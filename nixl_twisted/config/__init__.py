"""Configuration: the settings table, the grammar of values, their sources, ``ProxyConfig``.

Imports nothing else of the proxy. Every other room reads its settings from
the frozen ``ProxyConfig`` and its parts, re-exported here.
"""

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
    TenantsConfig,
    Timeouts,
    Traces,
)
from nixl_twisted.config.proxy import ProxyConfig, resolve
from nixl_twisted.config.sources import ConfigError
from nixl_twisted.config.tenants import NO_RULE, TenantRow, TenantRule

__all__ = [
    "NO_RULE",
    "ConfigError",
    "Disaggregation",
    "DiscoveryConfig",
    "Health",
    "KvEventsConfig",
    "Limits",
    "MigrationRules",
    "ModelPools",
    "Policies",
    "Pools",
    "ProxyConfig",
    "Retries",
    "TenantRow",
    "TenantRule",
    "TenantsConfig",
    "Timeouts",
    "Traces",
    "resolve",
]
