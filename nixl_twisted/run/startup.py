"""What a starting proxy does first: late imports made early, its descriptor limit, its summary.

``twistd`` builds the service before it sheds ``--uid``/``--gid``:
:func:`preload` then imports what serving would import later, when the new
user may no longer read Python's library.

Every client connection and every leg holds a file descriptor; a limit
below what ``--max-connections`` and ``--max-in-flight`` need turns into
accept errors under load. Like Go's runtime, the proxy raises its soft
limit toward the hard one when it is short, and warns when even that is not
enough. A keys file that cannot be read stops the start (``check_keys_file``).
The summary line is a lifecycle line (``logs.LIFECYCLE``): shown at
any ``--log-level``.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import os
import resource
from collections.abc import Mapping

from twisted.logger import Logger

from nixl_twisted import __version__
from nixl_twisted.admission import read_secret
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.config.words import counted
from nixl_twisted.exchange import decide
from nixl_twisted.fleet.replies import shown
from nixl_twisted.logs import lifecycle
from nixl_twisted.web.keys_file import read_keys

log = Logger()

#: What the proxy would import only once serving, and what needs each. Under
#: ``twistd --uid/--gid`` the new user may not be able to read Python's
#: library (a pyenv in root's home): each import would then fail on first use.
LATE_IMPORTS = {
    "encodings.idna": "the idna codec: Werkzeug's Map.bind encodes each request's Host "
    "with it (Klein binds per request), getaddrinfo each backend's host (every new "
    "connection and health check); unloadable, it is 'unknown encoding: idna'",
    "stringprep": "nameprep's tables, imported by encodings.idna",
}


def preload() -> None:
    """Import now what serving would import later: before twistd sheds ``--uid``/``--gid``.

    Found by running ``twistd --uid`` through every route, stream, error,
    health check and log format (``docs/operations.md``).
    """
    for name in LATE_IMPORTS:
        importlib.import_module(name)
    codecs.lookup("idna")  # and in the codec cache: no codec search later either


#: Descriptors beyond connections and legs: listeners, logs, health checks, pipes.
SPARE = 64


def descriptors_needed(config: ProxyConfig) -> int:
    """One per client connection, two per request in flight (its legs), and some spare."""
    return config.limits.max_connections + 2 * config.limits.max_in_flight + SPARE


def check_descriptors(config: ProxyConfig) -> tuple[int, int]:
    """Raise the soft descriptor limit toward what ``config`` needs; (before, after)."""
    needed = descriptors_needed(config)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = soft
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            lifecycle.info(
                "file descriptor limit raised from {soft} to {raised}", soft=soft, raised=raised
            )
    if raised != resource.RLIM_INFINITY and raised < needed:
        log.warn(
            "the file descriptor limit is {limit}, below the {needed} that --max-connections "
            "({connections}) and --max-in-flight ({in_flight}) need: raise it (LimitNOFILE, "
            "ulimit -n) or lower them",
            limit=raised,
            needed=needed,
            connections=config.limits.max_connections,
            in_flight=config.limits.max_in_flight,
        )
    return soft, raised


def summary(config: ProxyConfig) -> str:
    """One line: the pools, their policies and the limits in effect."""
    policies, limits, timeouts = (
        config.policies,
        config.limits,
        config.timeouts,
    )
    workers = f", {counted(config.workers, 'worker')}" if config.workers > 1 else ""
    interval = config.health.interval
    checks = f"every {interval:g} s" if interval else "off"
    return (
        f"nixl-twisted {__version__}{workers}: prefill {_members(config, 'prefill')} "
        f"({policies.prefill}); decode {_members(config, 'decode')} ({policies.decode}); "
        f"max-in-flight {limits.max_in_flight}, max-connections {limits.max_connections}, "
        f"max-body-size {limits.max_body_size}, retries {config.retries.prefill}/"
        f"{config.retries.decode}, prefill-timeout {timeouts.prefill:g} s, "
        f"decode-timeout {timeouts.decode:g} s, drain-timeout {timeouts.drain:g} s, "
        f"health checks {checks}; {decide.describe(config.disaggregation)}{_models(config)}"
        f"; {limiting(config)}"
    )


def limiting(config: ProxyConfig) -> str:
    """What holds requests back, besides max-in-flight: each instance's cap, the queue,
    the tenants' limits, the client keys (how many, never which) and the Redis each
    shares through (its URL without a password)."""
    capacity = config.capacity
    caps = (
        f"caps prefill {capacity.prefill_max_in_flight or 'none'}, "
        f"decode {capacity.decode_max_in_flight or 'none'} per instance"
    )
    queued = capacity.prefill_max_in_flight or capacity.decode_max_in_flight
    queue = (
        f"queue {capacity.queue_size}, {capacity.queue_timeout:g} s at most"
        if queued
        else "no queue"
    )
    return "; ".join([caps, queue, _tenants(config), _keys(config), _redis(config)])


def _tenants(config: ProxyConfig) -> str:
    tenants = config.tenants
    limits = [
        said
        for value, said in (
            (tenants.max_in_flight, f"{tenants.max_in_flight} in flight"),
            (tenants.requests_per_minute, f"{counted(tenants.requests_per_minute, 'request')}/min"),
            (tenants.tokens_per_minute, f"{counted(tenants.tokens_per_minute, 'token')}/min"),
        )
        if value
    ]
    whose = f"by {tenants.header}" if tenants.header else "by client key"
    each = f", each {', '.join(limits)}" if limits else ", no limit each"
    listed = f", [tenants] lists {len(tenants.table)}" if tenants.table else ""
    if not (tenants.header or config.keyed or tenants.table):
        return "tenants: none"
    return f"tenants {whose}{each}{listed}"


def _keys(config: ProxyConfig) -> str:
    """How many client keys: the given ones and the file's (read at start, just before)."""
    if not config.keyed:
        return "client keys: none (anyone is served)"
    keys = set(config.api_keys)
    if config.api_keys_file is not None:
        with contextlib.suppress(InvalidValue):  # (said by check_keys_file, each look)
            keys |= set(read_keys(config.api_keys_file))
    source = f", --api-keys-file {config.api_keys_file}" if config.api_keys_file else ""
    return f"client keys: {len(keys)}{source}"


def _redis(config: ProxyConfig) -> str:
    shared = [
        f"{what} {shown(url)}"
        for what, url in (
            ("replicas", config.replicas.redis),
            ("tenant limits", config.tenants.redis),
        )
        if url
    ]
    return f"Redis: {', '.join(shared)}" if shared else "Redis: none (this replica alone)"


def _models(config: ProxyConfig) -> str:
    """Each ``[models.NAME]`` table: its instances, and what it sets of its own."""
    said = []
    for model in config.pools.models:
        own = ", ".join(f"{key} {value}" for key, value in model.own)
        counts = f"{len(model.prefill)} prefill, {len(model.decode)} decode"
        said.append(f"{model.name} ({counts}{'; ' + own if own else ''})")
    return f"; models: {'; '.join(said)}" if said else ""


def _members(config: ProxyConfig, role: str) -> str:
    """A pool's URLs and DNS names as given, and its selector."""
    selector = config.discovery.selector(role)
    named = [*config.pools.of(role), *([f"pods {selector}"] if selector else [])]
    return ", ".join(named)


def check_discovery(config: ProxyConfig, environ: Mapping[str, str]) -> None:
    """Discovery's modules imported (before ``--uid``), when it is configured; and a selector
    with no way to reach the API server said at once, not retried forever."""
    selectors = [config.discovery.selector(role) for role in ("prefill", "decode")]
    names = config.pools.names("prefill") + config.pools.names("decode")
    if config.worker is not None or not (any(selectors) or names):
        return
    for name in ("nixl_twisted.discovery.dns", "nixl_twisted.discovery.kubernetes", "yaml"):
        importlib.import_module(name)
    if not any(selectors):
        return
    from nixl_twisted.discovery import kubeconfig

    try:
        kubeconfig.access(config.discovery.kubeconfig, environ)
    except kubeconfig.NoApiAccess as error:
        raise SystemExit(f"nixlproxy: --prefill-selector/--decode-selector: {error}") from None


def check_keys_file(config: ProxyConfig, serving: bool = False) -> None:
    """A keys file that cannot be used at start stops the proxy with the reason.

    A typo in its path is then said at once, not found later as every client
    refused (or, beside ``--api-key``, as the file's keys quietly missing).
    Once running, a file that breaks keeps its keys (``web.keys``). A worker
    does not check: its supervisor did, and a worker that exits is restarted.

    ``serving``: checked again once twistd has shed ``--uid``/``--gid``, as
    the user that serves. The keys were read before the change of user; a
    file that user cannot read would never be read again, and a key taken
    out of it would keep working until a restart: refused, saying so.
    """
    path = config.api_keys_file
    if path is None or config.worker is not None:
        return
    try:
        if serving:
            open(path, "rb").close()
    except PermissionError:
        raise SystemExit(
            f"nixlproxy: --api-keys-file: {path} cannot be read as uid {os.geteuid()}, the user "
            "twistd --uid serves as: the proxy could not read it again, and a key taken out of "
            "it would keep working until a restart; make it readable by that user (e.g. chgrp "
            "GROUP FILE; chmod 0640 FILE)"
        ) from None
    except OSError:
        pass  # (said below, as at start)
    try:
        read_keys(path)
    except InvalidValue as error:
        raise SystemExit(f"nixlproxy: --api-keys-file: {error}") from None


def check_salt_secret(config: ProxyConfig) -> None:
    """A salt secret that cannot be used at start stops the proxy with the reason: tenants
    would otherwise share their cached prefixes without anyone knowing."""
    path = config.tenants.salt_secret_file
    if path is None or config.worker is not None:
        return
    try:
        read_secret(path)
    except InvalidValue as error:
        raise SystemExit(f"nixlproxy: --tenant-salt-secret-file: {error}") from None


def announce(config: ProxyConfig) -> None:
    """The summary, as a lifecycle line; and what a rule set cannot do, as a warning."""
    lifecycle.info("{summary}", summary=summary(config))
    if not config.keyed:
        lent = " and lends --backend-api-key to every client" if config.backend_api_key else ""
        log.warn(
            "no --api-key: the --listen endpoints serve anyone{lent} (docs/security.md)",
            lent=lent,
        )
    if config.keyed and not (config.admin_listen or config.metrics_listen or config.admin_token):
        log.warn(
            "clients need a key and there is no --admin-token: the --listen endpoints answer "
            "/metrics to nobody and /healthcheck with readiness alone; serve them on "
            "--metrics-listen or --admin-listen, or set an admin token (docs/security.md)"
        )
    tenants = config.tenants
    limited = tenants.max_in_flight or tenants.requests_per_minute or tenants.tokens_per_minute
    limited = limited or tenants.priority is not None or tenants.salt_secret_file is not None
    limited = limited or any(
        max(row[1:4]) > 0 or any(v is not None for v in row[4:]) for row in tenants.table
    )
    if limited and not (config.keyed or tenants.header):
        log.warn(
            "tenant limits, priorities or cache salts are set, but no request has a tenant: "
            "they apply "
            "to a client key's tenant or to --tenant-header's (docs/security.md)"
        )
    blind = decide.blind_rules(
        config.disaggregation, config.kv_events.read_for("decode", config.pools.decode)
    )
    if blind is not None:
        log.warn("{blind}", blind=blind)
