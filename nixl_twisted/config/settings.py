"""Every setting of the proxy: its name, field, default, parser and help, in one table.

The command line (``tap.Options`` is generated from this table), the TOML
file, SIGHUP reloads, the admin API and the workers' configuration all read
values through these parsers (``values``), so a value means the same
wherever it came from; ``ProxyConfig`` is built from, and read back into,
the settings by each one's ``field``. ``docs/configuration.md`` and the
README's options table are checked against this table by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nixl_twisted.config.models import model_table
from nixl_twisted.config.tenants import client_key, header_name, priority, redis_url, tenant_table
from nixl_twisted.config.values import (
    POLICIES,
    address_port,
    allowed_backend,
    choice,
    collector_url,
    count,
    endpoint,
    fraction,
    label_selector,
    migrations,
    pool_member,
    port_or_name,
    port_or_off,
    ratio,
    seconds,
    seconds_or_off,
    switch,
    text,
)

#: Environment variables for the secrets, so they need not appear in a
#: process listing or a file.
BACKEND_API_KEY_ENV = "NIXLPROXY_BACKEND_API_KEY"
ADMIN_TOKEN_ENV = "NIXLPROXY_ADMIN_TOKEN"
#: The OpenTelemetry SDK's own variables, read as the SDK reads them.
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


@dataclass(frozen=True)
class Setting:
    """One option: ``--name`` on the command line, ``name`` in the TOML file."""

    name: str
    #: Where ``ProxyConfig`` keeps the value: an attribute, or ``part.attribute``.
    field: str
    default: Any
    parse: Callable[[object], Any]
    help: str
    #: Repeatable on the command line, a list in the file.
    many: bool = False
    #: Read from the first of these environment variables that is set, when
    #: neither the command line nor the file gives it.
    env: tuple[str, ...] = ()
    #: SIGHUP applies a new value from the file to a running proxy; False:
    #: it takes a restart (ports bound, processes spawned, clients built).
    live: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "listen",
        "listen",
        ("tcp:8000",),
        endpoint,
        many=True,
        help=(
            "Endpoint to serve on, as a Twisted endpoint string (repeatable), e.g. "
            "tcp:8000:interface=127.0.0.1, ssl:8443:privateKey=key.pem:certKey=cert.pem, "
            "unix:/run/nixlproxy.sock."
        ),
        live=False,
    ),
    Setting(
        "prefill",
        "pools.prefill",
        (),
        pool_member,
        many=True,
        help=(
            "Base URL of a vLLM prefill instance, e.g. http://10.0.0.1:8100 "
            "(repeatable; at least one, or --prefill-selector); URL#dp=N: N data-parallel "
            "ranks behind one port, URL#rank=I: one of them; dns+http://NAME:PORT: every "
            "A/AAAA record of NAME, dnssrv+http://_SERVICE._tcp.NAME: every SRV record."
        ),
    ),
    Setting(
        "models",
        "pools.models",
        (),
        model_table,
        help=(
            "Each model's own pools, [models.NAME] tables in the file (prefill, decode, "
            "and optionally its policies and decide rules), JSON on the command line."
        ),
    ),
    Setting(
        "prefill-selector",
        "discovery.prefill_selector",
        None,
        label_selector,
        help=(
            "Kubernetes label selector of the prefill pods (e.g. app=vllm,role=prefill): "
            "their Ready pods are the pool's instances, listed and watched."
        ),
    ),
    Setting(
        "decode",
        "pools.decode",
        (),
        pool_member,
        many=True,
        help=(
            "Base URL of a vLLM decode instance, e.g. http://10.0.0.2:8200 "
            "(repeatable; at least one, or --decode-selector); URL#dp=N: N data-parallel "
            "ranks behind one port, URL#rank=I: one of them; dns+http://NAME:PORT: every "
            "A/AAAA record of NAME, dnssrv+http://_SERVICE._tcp.NAME: every SRV record."
        ),
    ),
    Setting(
        "decode-selector",
        "discovery.decode_selector",
        None,
        label_selector,
        help=(
            "Kubernetes label selector of the decode pods (e.g. app=vllm,role=decode): "
            "their Ready pods are the pool's instances, listed and watched."
        ),
    ),
    Setting(
        "kubernetes-namespace",
        "discovery.namespace",
        None,
        text,
        help=(
            "Namespace of the pods the selectors match; unset: the proxy's own (in a "
            "cluster), else the kubeconfig context's, else default."
        ),
    ),
    Setting(
        "kubernetes-port",
        "discovery.port",
        "8000",
        port_or_name,
        help=("Port of each selected pod's vLLM: a number, or a container port's name (http)."),
    ),
    Setting(
        "kubeconfig",
        "discovery.kubeconfig",
        None,
        text,
        env=("KUBECONFIG",),
        help=(
            "kubeconfig file for the selectors outside a cluster (its current context); "
            "unset in a pod: the service account's token and CA."
        ),
    ),
    Setting(
        "dns-server",
        "discovery.dns_server",
        None,
        address_port,
        help=(
            "DNS server (ADDRESS:PORT) that resolves dns+ and dnssrv+ names; unset: the system's."
        ),
    ),
    Setting(
        "dns-min-refresh",
        "discovery.dns_min_refresh",
        1.0,
        seconds,
        help=("Least seconds between two resolutions of a name, whatever its TTL."),
    ),
    Setting(
        "dns-max-refresh",
        "discovery.dns_max_refresh",
        30.0,
        seconds,
        help=("Most seconds between two resolutions of a name, whatever its TTL."),
    ),
    Setting(
        "discovery-grace",
        "discovery.grace",
        30.0,
        seconds_or_off,
        help=(
            "Seconds a name or selector must answer 'none' (NXDOMAIN, no records, no "
            "Ready pod) before its instances drain; errors never empty a pool."
        ),
    ),
    Setting(
        "discovery-max-instances",
        "discovery.max_instances",
        256,
        count(1),
        help=(
            "Most instances discovery adds to one pool: the first by source name and then "
            "URL; the rest are ignored, said once and shown by /healthcheck."
        ),
    ),
    Setting(
        "allowed-backends",
        "discovery.allowed",
        (),
        allowed_backend,
        many=True,
        help=(
            "Networks (10.0.0.0/8) that discovery and the admin API may add instances (and "
            "their KV event endpoints) in, and host names (*.example.internal) the admin API "
            "may (repeatable); unset: any but the cloud metadata services."
        ),
    ),
    Setting(
        "api-key",
        "api_keys",
        (),
        client_key,
        many=True,
        env=("NIXLPROXY_API_KEYS",),
        help=(
            "A key clients must send (Authorization: Bearer KEY, or x-api-key on "
            "/v1/messages); repeatable; $NIXLPROXY_API_KEYS: comma-separated. Unset, with "
            "no --api-keys-file: anyone is served."
        ),
    ),
    Setting(
        "api-keys-file",
        "api_keys_file",
        None,
        text,
        help=(
            "A file of client keys, one per line, each optionally followed by its tenant's "
            "name; it must be readable at start (and by the twistd --uid user); read again on "
            "SIGHUP and when it changes (rename a whole new file into place)."
        ),
    ),
    Setting(
        "tenant-header",
        "tenants.header",
        None,
        header_name,
        help=(
            "A request header naming the client's tenant, for proxies behind a gateway that "
            "authenticates; with client keys, the key's tenant wins."
        ),
    ),
    Setting(
        "tenant-max-in-flight",
        "tenants.max_in_flight",
        0,
        count(0),
        help=("Requests one tenant may have in flight at once (0: no limit); past it, 429."),
    ),
    Setting(
        "tenant-requests-per-minute",
        "tenants.requests_per_minute",
        0,
        count(0),
        help=("Requests one tenant may start in any 60 s (0: no limit); past it, 429."),
    ),
    Setting(
        "tenant-tokens-per-minute",
        "tenants.tokens_per_minute",
        0,
        count(0),
        help=(
            "Prompt plus completion tokens one tenant may use in any 60 s, as vLLM counts "
            "them (0: no limit); past it, 429."
        ),
    ),
    Setting(
        "tenant-priority",
        "tenants.priority",
        None,
        priority,
        help=(
            "The vLLM priority of a tenant's requests (lower is served earlier); a client "
            "may ask a later one, never an earlier. Needs vLLM's --scheduling-policy priority."
        ),
    ),
    Setting(
        "replicas-redis",
        "replicas.redis",
        None,
        redis_url,
        live=False,
        env=("NIXLPROXY_REPLICAS_REDIS",),
        help=(
            "A Redis server (redis://HOST:PORT/DB) every replica and worker of this proxy "
            "shares: each instance's cap, the fair queue and tenants' requests in flight "
            "hold for all of them (docs/operations.md, 'Replicas')."
        ),
    ),
    Setting(
        "limits-redis",
        "tenants.redis",
        None,
        redis_url,
        live=False,
        env=("NIXLPROXY_LIMITS_REDIS",),
        help=(
            "A Redis server (redis://HOST:PORT/DB) where every replica and worker counts each "
            "tenant's requests and tokens per minute; unreachable, each counts its own."
        ),
    ),
    Setting(
        "tenants",
        "tenants.table",
        (),
        tenant_table,
        help=(
            "Each tenant's own limits, [tenants.NAME] tables in the file (max-in-flight, "
            "requests-per-minute, tokens-per-minute, priority, weight, cache-salt, ttft-slo-ms, "
            "class, ttft-miss), JSON on the command line."
        ),
    ),
    Setting(
        "tenant-salt-secret-file",
        "tenants.salt_secret_file",
        None,
        text,
        help=(
            "A file holding a secret from which each tenant's vLLM cache_salt is derived "
            "(HMAC-SHA256 of its name), set on both legs so tenants never share cached "
            "prefixes; a [tenants.NAME] cache-salt wins. Read at start and on SIGHUP."
        ),
    ),
    Setting(
        "backend-api-key",
        "backend_api_key",
        None,
        text,
        env=(BACKEND_API_KEY_ENV,),
        help=(
            "API key sent to the backends as 'Authorization: Bearer KEY' when the "
            "client sent no Authorization."
        ),
    ),
    Setting(
        "forward-header",
        "forward_headers",
        (),
        header_name,
        many=True,
        help=(
            "A client header both legs carry (repeatable); without it a leg carries only "
            "the client's Authorization and W3C trace context (traceparent, tracestate, "
            "baggage) of what the client sent."
        ),
    ),
    Setting(
        "connect-timeout",
        "timeouts.connect",
        10.0,
        seconds,
        help=("Seconds to wait for a TCP connection to a backend."),
        live=False,
    ),
    Setting(
        "backend-idle-timeout",
        "timeouts.backend_idle",
        4.0,
        seconds,
        help=(
            "Seconds an idle backend connection is kept for reuse; keep it below "
            "vLLM's 5 s keep-alive."
        ),
    ),
    Setting(
        "max-idle-per-backend",
        "limits.max_idle_per_backend",
        512,
        count(1),
        help=("Idle keep-alive connections kept per backend instance."),
    ),
    Setting(
        "prefill-timeout",
        "timeouts.prefill",
        300.0,
        seconds,
        help=("Seconds to wait for a prefill instance's whole answer (504 after)."),
    ),
    Setting(
        "decode-timeout",
        "timeouts.decode",
        600.0,
        seconds,
        help=(
            "Seconds to wait for a decode instance's response headers; a "
            "non-streaming answer sends them when generation ends (504 after)."
        ),
    ),
    Setting(
        "stream-idle-timeout",
        "timeouts.stream_idle",
        60.0,
        seconds,
        help=(
            "Seconds of silence allowed between two chunks of a decode body; a "
            "long generation that keeps producing tokens is never cut. A client that "
            "reads nothing of its answer for as long is closed (client_slow)."
        ),
    ),
    Setting(
        "sse-keepalive",
        "timeouts.sse_keepalive",
        0.0,
        seconds_or_off,
        help=(
            "Seconds between SSE comment frames (': keep-alive') sent to a streamed "
            "completion's client while it waits for its first token, so idle timeouts "
            "of load balancers do not cut it; the first one sends the 200 headers, so "
            "a later failure is an in-band error event (0: off)."
        ),
    ),
    Setting(
        "prefill-retries",
        "retries.prefill",
        2,
        count(0),
        help=(
            "Other prefill instances tried when one cannot be reached or answers 502, 503 or 504."
        ),
    ),
    Setting(
        "decode-retries",
        "retries.decode",
        1,
        count(0),
        help=(
            "Other decode instances tried, with the same kv_transfer_params, when "
            "one cannot be reached."
        ),
    ),
    Setting(
        "decode-migrations",
        "migrations.limit",
        1,
        migrations,
        help=(
            "Times a completion whose decode instance fails after its first byte (its "
            "answer broken off, silent, an error event, the instance marked down) is "
            "continued on another decode instance, token for token (0: never; at most 8; "
            "docs/failures.md)."
        ),
    ),
    Setting(
        "migration-deadline",
        "migrations.deadline",
        600.0,
        seconds_or_off,
        help=(
            "Seconds from a completion's arrival past which its decode failing is no "
            "longer continued elsewhere (0: no deadline)."
        ),
    ),
    Setting(
        "health-interval",
        "health.interval",
        3.0,
        seconds_or_off,
        help=(
            "Seconds between GET /health checks of every instance, the first round at "
            "startup (0: off); below vLLM's 5 s keep-alive, each check reuses its connection."
        ),
    ),
    Setting(
        "health-timeout",
        "health.timeout",
        2.0,
        seconds,
        help=("Seconds a health check may take before it counts as failed."),
    ),
    Setting(
        "unhealthy-threshold",
        "health.unhealthy_threshold",
        3,
        count(1),
        help=(
            "Failures in a row (checks, refused connections, timeouts) that mark an instance down."
        ),
    ),
    Setting(
        "healthy-threshold",
        "health.healthy_threshold",
        2,
        count(1),
        help=("Successes in a row (checks or legs) that bring a down instance back."),
    ),
    Setting(
        "outlier-consecutive-failures",
        "health.outlier_failures",
        5,
        count(0),
        help=(
            "Failed legs in a row (5xx, refused, timed out, broken off) that eject an instance "
            "from rotation for a while, as Envoy's outlier detection (0: off; docs/failures.md)."
        ),
    ),
    Setting(
        "outlier-ejection-seconds",
        "health.outlier_seconds",
        30.0,
        seconds,
        help=(
            "Seconds an instance's first ejection lasts; each further one lasts that much "
            "longer, 300 s at most."
        ),
    ),
    Setting(
        "prefill-policy",
        "policies.prefill",
        "round-robin",
        choice(*POLICIES),
        help=(
            "How the prefill instance of each request is chosen: "
            f"{', '.join(POLICIES[:-1])} or {POLICIES[-1]} (docs/routing.md)."
        ),
    ),
    Setting(
        "decode-policy",
        "policies.decode",
        "round-robin",
        choice(*POLICIES),
        help=("How the decode instance of each request is chosen (the same names)."),
    ),
    Setting(
        "cache-aware-balance",
        "policies.balance",
        1.5,
        ratio,
        help=(
            "cache-aware and kv-aware: a prompt leaves the instance holding its prefix "
            "only when that instance is this many times as busy as the least busy one "
            "(legs in flight, and vLLM's queue where read), and --cache-aware-margin more."
        ),
    ),
    Setting(
        "cache-aware-margin",
        "policies.margin",
        4,
        count(1),
        help=(
            "cache-aware and kv-aware: ... and at least this many legs busier than the "
            "least busy instance (idle instances never move a prompt from its prefix)."
        ),
    ),
    Setting(
        "warm-up",
        "policies.warm_up",
        60.0,
        seconds_or_off,
        help=(
            "cache-aware and kv-aware: for this many seconds after an instance joins "
            "(added, discovered, or up again after down), prompts no instance holds go "
            "to it while it holds fewer legs in flight than the others' mean (0: off)."
        ),
    ),
    Setting(
        "cache-aware-entries",
        "policies.entries",
        100_000,
        count(0),
        help=(
            "cache-aware: prompt prefixes remembered per pool, 256 bytes of prompt each "
            "(about 190 bytes of memory each; least recently used go first; 0: none)."
        ),
    ),
    Setting(
        "cache-aware-min-match",
        "policies.min_match",
        0.5,
        fraction,
        help=(
            "cache-aware and kv-aware: a prompt follows the instance sent (or holding) its "
            "longest known prefix when that prefix is at least this share of the prompt."
        ),
    ),
    Setting(
        "cache-key-bytes",
        "policies.key_bytes",
        512,
        count(1),
        help=(
            "cache-aware: the leading bytes of a completion's prompt that name its "
            "conversation (about one vLLM block on CPU)."
        ),
    ),
    Setting(
        "prefill-kv-events-port",
        "kv_events.prefill_port",
        0,
        port_or_off,
        help=(
            "kv-aware: the port where each prefill instance publishes vLLM's KV cache "
            "events, for instances whose URL names none (#kv-events=PORT); plus the rank "
            "for data-parallel ranks. 0: none."
        ),
    ),
    Setting(
        "prefill-kv-replay-port",
        "kv_events.prefill_replay_port",
        0,
        port_or_off,
        help=(
            "kv-aware: the port where each prefill instance answers KV event replays "
            "(vLLM's replay_endpoint), for instances whose URL names none. 0: none."
        ),
    ),
    Setting(
        "decode-kv-events-port",
        "kv_events.decode_port",
        0,
        port_or_off,
        help=(
            "kv-aware: the port where each decode instance publishes vLLM's KV cache "
            "events, for instances whose URL names none (#kv-events=PORT); plus the rank "
            "for data-parallel ranks. 0: none."
        ),
    ),
    Setting(
        "decode-kv-replay-port",
        "kv_events.decode_replay_port",
        0,
        port_or_off,
        help=(
            "kv-aware: the port where each decode instance answers KV event replays "
            "(vLLM's replay_endpoint), for instances whose URL names none. 0: none."
        ),
    ),
    Setting(
        "kv-index-blocks",
        "kv_events.max_blocks",
        131_072,
        count(1),
        help=(
            "kv-aware: KV blocks indexed per instance (about 400 bytes each); past it "
            "the oldest stored are forgotten."
        ),
    ),
    Setting(
        "render-timeout",
        "kv_events.render_timeout",
        1.0,
        seconds,
        help=(
            "kv-aware: seconds a prompt's render request (its token ids, from vLLM) may "
            "take before the request is routed without them."
        ),
    ),
    Setting(
        "decode-only-below",
        "disaggregation.short_prompt",
        0,
        count(0),
        help=(
            "Prompts estimated at fewer than this many tokens skip prefill: the decode "
            "instance computes them (0: off; docs/routing.md)."
        ),
    ),
    Setting(
        "decode-only-uncached-below",
        "disaggregation.uncached",
        0,
        count(0),
        help=(
            "Skip prefill when fewer than this many of the prompt's tokens are not "
            "already cached on the chosen decode instance (0: off; needs its KV events)."
        ),
    ),
    Setting(
        "decode-only-busy-below",
        "disaggregation.busy_prompt",
        0,
        count(0),
        help=(
            "When every usable prefill instance is busy (--prefill-busy-at), prompts "
            "estimated at fewer than this many tokens skip prefill (0: off)."
        ),
    ),
    Setting(
        "prefill-busy-at",
        "disaggregation.busy_at",
        8,
        count(1),
        help=(
            "A prefill instance is busy at this load: this proxy's prefill legs in "
            "flight to it plus the requests vLLM says are waiting."
        ),
    ),
    Setting(
        "prefill-fallback",
        "disaggregation.fallback",
        "none",
        choice("none", "decode"),
        help=(
            "none: no usable prefill instance is a 503; decode: the request is served "
            "by its decode instance alone instead."
        ),
    ),
    Setting(
        "token-ids-to-decode",
        "token_ids_to_decode",
        True,
        switch,
        help=(
            "on: prefill is asked for a chat prompt's token ids, handed to decode in "
            "kv_transfer_params.prompt_token_ids so that decode does not render and "
            "tokenize it again; off: neither (docs/protocol.md)."
        ),
    ),
    Setting(
        "multi-turn-reuse",
        "reuse.enabled",
        False,
        switch,
        help=(
            "on: decode's handle on a finished conversation's KV (vLLM's "
            "bidirectional_kv_xfer, on both instances) is kept, and the conversation's next "
            "turn, when its prompt's token ids extend it, reads that KV back from decode "
            "instead of computing it (docs/routing.md). Its handle never reaches a client "
            "either way."
        ),
    ),
    Setting(
        "reuse-handle-ttl",
        "reuse.lifetime",
        480.0,
        seconds,
        help=(
            "vLLM's decoder_kv_blocks_ttl on decode: a handle is offered for this less "
            "10 s (a third when shorter)."
        ),
    ),
    Setting(
        "max-batch-prompts",
        "limits.max_batch_prompts",
        32,
        count(1),
        help=(
            "Prompts one /v1/completions request may hold; each is its own "
            "prefill/decode pair (400 past it)."
        ),
    ),
    Setting(
        "max-n",
        "limits.max_n",
        128,
        count(1),
        help=(
            "Choices one completion may ask for (n, and best_of where vLLM still reads "
            "it); past it, 400 before any leg (vLLM itself allows 16384)."
        ),
    ),
    Setting(
        "responses-per-tenant",
        "limits.responses_per_tenant",
        1000,
        count(1),
        live=False,
        help=(
            "Stored responses (Responses API ids) the proxy keeps the decode instance of, per "
            "tenant (and for requests without one, together); the oldest is forgotten first."
        ),
    ),
    Setting(
        "max-in-flight",
        "limits.max_in_flight",
        1024,
        count(1),
        help=("Requests served at once; past it, 503 with Retry-After at once."),
    ),
    Setting(
        "prefill-max-in-flight",
        "capacity.prefill_max_in_flight",
        0,
        count(0),
        help=(
            "Legs each prefill instance takes at once (0: no cap); a URL's "
            "#max-in-flight=N and a [models.NAME] table's prefill-max-in-flight win. Past "
            "it, requests wait in the proxy's queue (docs/operations.md, Overload)."
        ),
    ),
    Setting(
        "decode-max-in-flight",
        "capacity.decode_max_in_flight",
        0,
        count(0),
        help=(
            "Legs each decode instance takes at once (0: no cap), as vLLM's --max-num-seqs "
            "runs them; a two-leg request takes its decode slot once prefill answered."
        ),
    ),
    Setting(
        "prefill-run-ahead",
        "capacity.prefill_run_ahead",
        0,
        count(0),
        help=(
            "Requests of a model that may hold a prefill slot or wait, prefilled, for a "
            "decode slot at once (0: the sum of the model's decode caps until its rates are "
            "measured, then what keeps decode fed); shared through --replicas-redis, each "
            "replica holds its share."
        ),
    ),
    Setting(
        "kv-lease-duration",
        "capacity.kv_lease_duration",
        30.0,
        seconds,
        help=(
            "vLLM's kv_lease_duration on prefill: a prefilled request that waited for a "
            "decode slot until this less 10 s (a third when shorter) is sent over the cap."
        ),
    ),
    Setting(
        "queue-size",
        "capacity.queue_size",
        1024,
        count(0),
        help=(
            "Requests that may wait in all for a slot while instances are at their caps; "
            "past it, 503 queue_full with Retry-After."
        ),
    ),
    Setting(
        "queue-timeout",
        "capacity.queue_timeout",
        30.0,
        seconds,
        help="Longest a request waits for a slot; then 503 queue_timeout with Retry-After.",
    ),
    Setting(
        "max-connections",
        "limits.max_connections",
        4096,
        count(1),
        help=(
            "Client connections open at once, per process; past it, a new connection is "
            "answered 503 at once and closed. Keep it below the file descriptor limit."
        ),
    ),
    Setting(
        "header-timeout",
        "timeouts.header",
        10.0,
        seconds,
        help=(
            "Seconds a client has to send a request's line and headers (from the "
            "connection, or from a later request's first byte); 408 after."
        ),
    ),
    Setting(
        "body-timeout",
        "timeouts.body",
        30.0,
        seconds,
        help=(
            "Seconds a client has to send a request's body once its headers are in, "
            "extended by one second per --body-min-rate bytes received; 408 after."
        ),
    ),
    Setting(
        "body-min-rate",
        "timeouts.body_min_rate",
        65536,
        count(0),
        help=(
            "Bytes per second of body that each extend --body-timeout by a second; a body "
            "that brings fewer in any --body-timeout seconds is 408 (0: the body has "
            "--body-timeout seconds, whatever its size)."
        ),
    ),
    Setting(
        "body-max-timeout",
        "timeouts.body_max",
        120.0,
        seconds,
        help=(
            "Most seconds any body may take, however much --body-min-rate extended "
            "--body-timeout (never less than --body-timeout); 408 after."
        ),
    ),
    Setting(
        "max-body-size",
        "limits.max_body_size",
        32 * 1024 * 1024,
        count(1),
        help=("Largest request body in bytes (413 past it; vLLM's default too)."),
    ),
    Setting(
        "max-buffered-bodies",
        "limits.max_buffered_bodies",
        64 * 1024 * 1024,
        count(1),
        help=(
            "Bytes of request bodies held at once, all requests together, counted as "
            "they arrive; past it, 503 with Retry-After."
        ),
    ),
    Setting(
        "admin-token",
        "admin_token",
        None,
        text,
        env=(ADMIN_TOKEN_ENV,),
        help=(
            "Bearer token that enables the admin API (/admin/backends); without one there is none."
        ),
    ),
    Setting(
        "metrics-listen",
        "metrics_listen",
        None,
        endpoint,
        help=(
            "Serve GET /metrics on this endpoint (e.g. tcp:9100:interface=127.0.0.1) "
            "instead of on every --listen endpoint."
        ),
        live=False,
    ),
    Setting(
        "admin-listen",
        "admin_listen",
        None,
        endpoint,
        help=(
            "Serve /admin/*, /healthcheck in full, /metrics and the status page (/) on this "
            "endpoint only (e.g. tcp:9000:interface=127.0.0.1); the --listen endpoints then "
            "answer /healthcheck with readiness alone."
        ),
        live=False,
    ),
    Setting(
        "workers",
        "workers",
        1,
        count(1),
        help=(
            "Proxy processes sharing each TCP port (SO_REUSEPORT), supervised by "
            "this one, which checks health for all: they act as one proxy."
        ),
        live=False,
    ),
    Setting(
        "log-format",
        "log_format",
        "text",
        choice("text", "json"),
        help=(
            "text (for people) or json (one flat JSON object per line on stdout, for log "
            "pipelines; the same as twistd --logger=nixl_twisted.logs.json_lines)."
        ),
        live=False,
    ),
    Setting(
        "log-level",
        "log_level",
        "info",
        choice("debug", "info", "warn", "error", "critical"),
        help=(
            "Least severe events logged; warn keeps marks down, errors and failures "
            "and drops the access events."
        ),
    ),
    Setting(
        "access-log",
        "access_log",
        True,
        switch,
        help=(
            "on: one info event per request (nixlproxy.access); off: none, "
            "the request metrics still count every request."
        ),
    ),
    Setting(
        "drain-timeout",
        "timeouts.drain",
        30.0,
        seconds_or_off,
        help=("On SIGTERM, seconds to let requests in flight finish before closing them."),
    ),
    Setting(
        "handoff-warning",
        "timeouts.handoff_warning",
        10.0,
        seconds,
        help=(
            "Seconds between prefill's answer and decode's request past which the "
            "request is counted and logged: vLLM's KV lease is 30 s."
        ),
    ),
    Setting(
        "otlp-traces-endpoint",
        "traces.endpoint",
        None,
        collector_url,
        env=(TRACES_ENDPOINT_ENV,),
        help=(
            "OTLP collector URL that turns tracing on, used as given (http/protobuf: "
            "e.g. http://collector:4318/v1/traces); OTEL_EXPORTER_OTLP_ENDPOINT turns it on "
            "too."
        ),
        live=False,
    ),
    Setting(
        "otlp-traces-protocol",
        "traces.protocol",
        "http/protobuf",
        choice("http/protobuf", "grpc"),
        env=(TRACES_PROTOCOL_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        help=("http/protobuf or grpc (pip install 'nixl-twisted[otlp-grpc]')."),
        live=False,
    ),
    Setting(
        "otel-sampling-ratio",
        "traces.sampling_ratio",
        None,
        fraction,
        help=(
            "Share of new traces recorded, 0 to 1, parent-based: a client's sampled "
            "traceparent is always followed. Unset: the SDK's OTEL_TRACES_SAMPLER "
            "(all, by default)."
        ),
        live=False,
    ),
    Setting(
        "shutdown-delay",
        "timeouts.shutdown_delay",
        0.0,
        seconds_or_off,
        help=(
            "On SIGTERM, seconds to keep accepting while /healthcheck already says not "
            "ready, so that a load balancer stops sending first."
        ),
    ),
)

BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


def default_text(setting: Setting) -> str:
    """The default as ``--help`` and ``docs/configuration.md`` show it."""
    if setting.env:
        names = " or ".join(f"${name}" for name in setting.env)
        if setting.default is None or setting.default == ():
            return names
        return f"{names}, else {setting.default}"
    if setting.many:
        if setting.default:
            return ", ".join(setting.default)
        return "(required)" if setting.name in ("prefill", "decode") else "(none)"
    if setting.default is None or setting.default == ():
        return "(none)"
    if isinstance(setting.default, bool):
        return "on" if setting.default else "off"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return str(int(setting.default))
    return str(setting.default)
