"""What an option imports only once it is set, and its refusal when that cannot be imported.

A plain ``pip install nixl-twisted`` runs every option: what an option needs
is a dependency of the package, or an extra named here. The proxy imports
some of them late (only when their option is set, so that a proxy without it
pays nothing, and ``txredisapi`` not before twistd has chosen its reactor);
:func:`missing` looks for each, without importing it, as the options are
parsed (``tap.Options.postOptions``). A package that is not there is then one
line naming what to install, before anything is bound, not a traceback once
the proxy serves.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nixl_twisted.config import ProxyConfig
from nixl_twisted.observe import tracing


@dataclass(frozen=True)
class Need:
    """A module imported late, the option that imports it, and what brings it."""

    module: str
    #: The option as a user sets it.
    option: str
    #: The distribution that provides ``module``.
    distribution: str
    #: The extra of nixl-twisted that installs it; None: a dependency.
    extra: str | None
    wanted: Callable[[ProxyConfig, Mapping[str, str]], bool]

    def refusal(self) -> str:
        """One line: the option, what it lacks, what to install."""
        if self.extra is None:
            # (a --no-deps install, or a distribution that split the package)
            return (
                f"{self.option} needs {self.distribution}, a dependency of nixl-twisted, "
                "which is not installed: pip install nixl-twisted again, with its dependencies"
            )
        return (
            f"{self.option} needs {self.distribution}, which is not installed: "
            f"pip install 'nixl-twisted[{self.extra}]'"
        )


def _traced(protocol: str | None) -> Callable[[ProxyConfig, Mapping[str, str]], bool]:
    def wanted(config: ProxyConfig, environ: Mapping[str, str]) -> bool:
        on = tracing.enabled(config.traces, environ)
        return on and (protocol is None or config.traces.protocol == protocol)

    return wanted


def _selected(config: ProxyConfig, environ: Mapping[str, str]) -> bool:
    return any(config.discovery.selector(role) for role in ("prefill", "decode"))


NEEDS: tuple[Need, ...] = (
    Need(
        "txredisapi",
        "--limits-redis/--replicas-redis",
        "txredisapi",
        None,
        lambda config, environ: bool(config.tenants.redis or config.replicas.redis),
    ),
    Need(
        "opentelemetry.sdk.trace",
        "--otlp-traces-endpoint",
        "opentelemetry-sdk",
        None,
        _traced(None),
    ),
    Need(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "--otlp-traces-protocol http/protobuf",
        "opentelemetry-exporter-otlp-proto-http",
        None,
        _traced("http/protobuf"),
    ),
    Need(
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "--otlp-traces-protocol grpc",
        "opentelemetry-exporter-otlp-proto-grpc",
        "otlp-grpc",
        _traced("grpc"),
    ),
    Need("yaml", "--prefill-selector/--decode-selector", "PyYAML", None, _selected),
)


def findable(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (its parents may be)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(
    config: ProxyConfig, environ: Mapping[str, str], found: Callable[[str], bool] | None = None
) -> str | None:
    """The first option set whose module cannot be imported, said in one line; None: none.

    ``found``: whether a module can be imported (``findable``, looked up when called).
    """
    found = found or findable
    for need in NEEDS:
        if need.wanted(config, environ) and not found(need.module):
            return need.refusal()
    return None
