"""The parts of a ``ProxyConfig``: each a frozen value for one concern of the proxy.

``ProxyConfig`` (``proxy.py``) is built of them, each from the settings whose
field names it (``part.attribute``); the rooms above read the part they need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nixl_twisted.config.models import ModelPools
from nixl_twisted.config.tenants import TenantRow
from nixl_twisted.config.values import discovered_by


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
    #: Discovered instances one pool takes at most (the first by source and URL).
    max_instances: int = 256

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
    #: Each listed tenant's own: (name, in flight, requests, tokens, priority, weight, salt,
    #: first-token target, class); -1 (None for the rest): the default.
    table: tuple[TenantRow, ...] = ()
    #: The vLLM ``priority`` of every tenant's requests (None: the client's own).
    priority: int | None = None
    #: The Redis that every replica counts requests and tokens per minute in (None: each its own).
    redis: str | None = None
    #: A file whose secret derives each tenant's ``cache_salt`` from its name (None: none).
    salt_secret_file: str | None = None


@dataclass(frozen=True)
class Policies:
    """How each pool chooses its instance (``nixl_twisted.backends.routing``), and the knobs."""

    prefill: str
    decode: str
    #: cache-aware's and kv-aware's balance guard (``routing.Balance``: how many times,
    #: and how many legs, busier than the least busy an instance holding a prefix must
    #: be before a prompt leaves it), and the prompt bytes that name a conversation.
    balance: float
    key_bytes: int
    margin: float = 4.0
    #: cache-aware's memory of prefixes sent (entries per pool), and the share of a
    #: prompt a remembered prefix must cover to be followed.
    entries: int = 100_000
    min_match: float = 0.5
    #: cache-aware's and kv-aware's misses go to an instance that joined this lately.
    warm_up: float = 60.0

    def of(self, role: str) -> str:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Reuse:
    """Multi-turn reuse: a conversation's next prefill reads its earlier turns' KV back from
    the decode instance that holds it (vLLM's ``bidirectional_kv_xfer``)."""

    enabled: bool = False
    #: vLLM's ``decoder_kv_blocks_ttl`` on decode: how long it holds a handle's blocks.
    lifetime: float = 480.0


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
    #: Bytes of body per second that extend ``body`` by one second (0: none), and
    #: the least a body must bring in any ``body`` seconds.
    body_min_rate: int
    #: The most any body may take, extended or not (at least ``body``).
    body_max: float
    #: Prefill answered -> decode sent, past which a request is counted and logged.
    handoff_warning: float
    #: Between two SSE comment frames while a stream waits for its first token (0: off).
    sse_keepalive: float


@dataclass(frozen=True)
class Retries:
    """Other instances tried per leg."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class MigrationRules:
    """A decode answer that fails mid-answer, continued on another decode instance."""

    #: Moves per request at most (0: none).
    limit: int
    #: Seconds from a request's arrival past which it no longer moves (0: no deadline).
    deadline: float


@dataclass(frozen=True)
class Health:
    """Active ``GET /health`` checks; ``interval`` 0 turns them off."""

    interval: float
    timeout: float
    #: Failures in a row that mark an instance down, successes that bring it back.
    unhealthy_threshold: int
    healthy_threshold: int
    #: Failed legs in a row that eject an instance a while (0: off), and for how long first.
    outlier_failures: int = 5
    outlier_seconds: float = 30.0


@dataclass(frozen=True)
class Limits:
    """What the proxy accepts at once, and keeps."""

    max_in_flight: int
    max_body_size: int
    #: Bytes of request bodies held at once, all requests together.
    max_buffered_bodies: int
    #: Prompts one batched completion may hold.
    max_batch_prompts: int
    #: Choices (``n``, ``best_of``) one completion may ask for.
    max_n: int
    #: Stored responses kept per tenant (their decode instance, and whose they are).
    responses_per_tenant: int
    max_idle_per_backend: int
    #: Client connections open at once (each holds a file descriptor).
    max_connections: int


@dataclass(frozen=True)
class Capacity:
    """How many legs each instance takes at once, and the queue in front of them.

    A cap of 0 is none. With none anywhere, there is no queue: every
    request goes to the engines at once, as vLLM's own queue takes it.
    """

    #: Legs each prefill / decode instance takes at once, unless its URL says
    #: (``#max-in-flight=N``) or its model's table does.
    prefill_max_in_flight: int
    decode_max_in_flight: int
    #: Requests that may wait for a slot, in all; and how long each may wait.
    queue_size: int
    queue_timeout: float
    #: Requests of a model that may hold a prefill slot or wait ready for decode at once
    #: (0: the sum of its decode caps); vLLM's ``kv_lease_duration`` on prefill.
    prefill_run_ahead: int = 0
    kv_lease_duration: float = 30.0


@dataclass(frozen=True)
class Replicas:
    """Several processes acting as one proxy (``nixl_twisted.fleet``)."""

    #: The Redis every replica and worker of this proxy shares (None: each on its own:
    #: replicas apart, ``--workers`` splitting each cap between them).
    redis: str | None = None


@dataclass(frozen=True)
class Traces:
    """OpenTelemetry tracing (``nixl_twisted.observe.tracing``): where to, how, how much."""

    #: The OTLP collector's URL, as given; None: the SDK's environment decides.
    endpoint: str | None
    protocol: str
    #: Parent-based share of new traces; None: the SDK's OTEL_TRACES_SAMPLER.
    sampling_ratio: float | None
