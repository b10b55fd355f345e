"""The Helm chart's ``values.schema.json``, made from the proxy's own settings table.

Helm checks the values against it before it renders anything: ``config:
{decode-max-in-flight: abc}`` is then an error at ``helm install`` naming the
key, not a pod that crash-loops. Each key of ``config`` (the TOML file the
chart mounts) takes the type its setting's parser reads
(``nixl_twisted.config.settings``); the keys the chart sets itself, as flags,
are refused there (the command line would win over them, silently).

    python deploy/helm/values_schema.py > deploy/helm/nixl-twisted/values.schema.json

(``make chart-schema``; ``tests/smoke/test_chart.py`` holds the file equal to it.)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nixl_twisted.config.settings import SETTINGS, Setting

#: What the chart passes as flags (or in the environment, from a Secret): set by
#: ``port``, ``adminPort``, ``metricsPort``, ``shutdownDelay``, ``drainTimeout``,
#: ``apiKeysFile``, ``tls`` and ``secrets`` (or ``redis``), never in ``config``.
SET_BY_THE_CHART = {
    "listen": "port (and tls)",
    "admin-listen": "adminPort",
    "metrics-listen": "metricsPort",
    "shutdown-delay": "shutdownDelay",
    "drain-timeout": "drainTimeout",
    "api-keys-file": "apiKeysFile.secretName",
    "api-key": "secrets.apiKeys",
    "backend-api-key": "secrets.backendApiKey",
    "admin-token": "secrets.adminToken",
    "limits-redis": "secrets.limitsRedis",
    "replicas-redis": "secrets.replicasRedis or redis.enabled",
}

WHOLE = {"type": ["integer", "string"], "pattern": "^[0-9]+$"}
NUMBER = {"type": ["number", "string"], "pattern": r"^[0-9]+(\.[0-9]+)?$"}
STRING = {"type": "string"}
STRINGS = {"type": "array", "items": STRING}


def setting_schema(setting: Setting) -> dict[str, Any]:
    """The JSON schema of one setting's value in the TOML file, by its parser."""
    parser = setting.parse
    name = getattr(parser, "__qualname__", "")
    closure = {
        var: cell.cell_contents
        for var, cell in zip(
            parser.__code__.co_freevars, getattr(parser, "__closure__", None) or (), strict=True
        )
    }
    if setting.many:
        return dict(STRINGS)
    if name.startswith("count."):
        return {**WHOLE, "minimum": closure["least"]}
    if name == "port_or_off":
        return {**WHOLE, "minimum": 0, "maximum": 65535}
    if name == "priority":
        return {"type": "integer"}
    if name.startswith("choice."):
        return {"type": "string", "enum": list(closure["choices"])}
    if name == "switch":
        return {"enum": [True, False, "on", "off"]}
    if name == "seconds":
        return {**NUMBER, "exclusiveMinimum": 0}
    if name == "seconds_or_off":
        return {**NUMBER, "minimum": 0}
    if name == "ratio":
        return {**NUMBER, "minimum": 1}
    if name == "fraction":
        return {**NUMBER, "minimum": 0, "maximum": 1}
    if name == "port_or_name":
        return {"type": ["integer", "string"]}
    if name in ("model_table", "tenant_table"):
        return {"type": "object"}
    return dict(STRING)


def config_schema() -> dict[str, Any]:
    """``config``: every setting the file may hold, by its dashed name, typed."""
    properties: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.name in SET_BY_THE_CHART:
            continue
        properties[setting.name] = {
            **setting_schema(setting),
            "description": setting.help.split(". ")[0].rstrip(".") + ".",
        }
    return {
        "type": "object",
        "description": "The proxy's configuration file (docs/configuration.md), by the "
        "options' long names, dashed.",
        "properties": properties,
        "additionalProperties": False,
    }


def _object(properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **more}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
SECONDS = {"type": "number", "minimum": 0}
ANY_OBJECT = {"type": "object"}
ANY_LIST = {"type": "array"}


def schema() -> dict[str, Any]:
    """The whole ``values.schema.json``: the chart's own values, and ``config``."""
    image = _object(
        {
            "repository": STRING,
            "tag": STRING,
            "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        }
    )
    secrets = _object(
        {
            "existingSecret": STRING,
            "apiKeys": STRINGS,
            "backendApiKey": STRING,
            "adminToken": STRING,
            "limitsRedis": {"type": "string", "pattern": "^(rediss?://.*)?$"},
            "replicasRedis": {"type": "string", "pattern": "^(rediss?://.*)?$"},
        }
    )
    redis = _object(
        {
            "enabled": {"type": "boolean"},
            "image": image,
            "existingSecret": STRING,
            # (it goes into a redis:// URL as it is: no character that URL would read)
            "password": {"type": "string", "pattern": "^[A-Za-z0-9._~-]*$"},
            "database": {"type": "integer", "minimum": 0, "maximum": 15},
            "resources": ANY_OBJECT,
            "podSecurityContext": ANY_OBJECT,
            "securityContext": ANY_OBJECT,
            "nodeSelector": ANY_OBJECT,
            "tolerations": ANY_LIST,
            "affinity": ANY_OBJECT,
        },
        additionalProperties=False,
    )
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "nixl-twisted",
        "type": "object",
        "properties": {
            "replicaCount": {"type": "integer", "minimum": 0},
            "image": image,
            "imagePullSecrets": ANY_LIST,
            "nameOverride": STRING,
            "fullnameOverride": STRING,
            "config": config_schema(),
            "port": PORT,
            "adminPort": PORT,
            "metricsPort": PORT,
            "shutdownDelay": SECONDS,
            "drainTimeout": SECONDS,
            "graceMargin": SECONDS,
            "secrets": secrets,
            "apiKeysFile": _object({"secretName": STRING}),
            "tls": _object({"secretName": STRING}),
            "redis": redis,
            "service": _object(
                {
                    "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                    "port": PORT,
                    "annotations": ANY_OBJECT,
                }
            ),
            "serviceAccount": _object(
                {"create": {"type": "boolean"}, "name": STRING, "annotations": ANY_OBJECT}
            ),
            "rbac": _object({"create": {"type": "boolean"}}),
            "resources": ANY_OBJECT,
            "podDisruptionBudget": _object(
                {"enabled": {"type": "boolean"}, "maxUnavailable": {"type": ["integer", "string"]}}
            ),
            "podSecurityContext": ANY_OBJECT,
            "securityContext": ANY_OBJECT,
            "readinessProbe": ANY_OBJECT,
            "livenessProbe": ANY_OBJECT,
            "serviceMonitor": ANY_OBJECT,
            "grafanaDashboard": ANY_OBJECT,
            "autoscaling": ANY_OBJECT,
            "podAnnotations": ANY_OBJECT,
            "podLabels": ANY_OBJECT,
            "nodeSelector": ANY_OBJECT,
            "tolerations": ANY_LIST,
            "affinity": ANY_OBJECT,
            "topologySpread": _object(
                {
                    "enabled": {"type": "boolean"},
                    "topologyKey": STRING,
                    "maxSkew": {"type": "integer", "minimum": 1},
                },
                additionalProperties=False,
            ),
            "topologySpreadConstraints": ANY_LIST,
            "extraEnv": ANY_LIST,
            # (what Helm passes every chart, a parent's included)
            "global": ANY_OBJECT,
        },
        "additionalProperties": False,
    }


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
