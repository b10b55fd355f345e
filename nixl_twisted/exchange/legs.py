"""``Legs``: what every leg is sent with, the proxy's and not a request's, made once.

The pools and their client, the KV events, the clock, the metrics, the
renderer, the queue in front of capped instances and the configuration in
effect, made once by the root and shared by every leg of every request. One
attempt of a leg is ``prefill.prefill_attempt`` or ``decode.decode_attempt``;
choosing, holding and retrying an instance is ``sending``.
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime

from nixl_twisted.admission import Slots
from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.tokens import Renderer
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.reuse import HandleStore, SharedHandles


class Legs:
    """What the proxy sends every leg with, and the one attempt of a decode leg.

    Both pools and their HTTP client, the clock, the metrics, the renderer,
    and the configuration in effect (a reload replaces it: a request takes
    the timeouts, retries and keys in effect when it starts): the same for
    every request, made once and shared by every leg.
    """

    def __init__(
        self,
        backends: BackendService,
        kv: KvEvents,
        clock: IReactorTime,
        metrics: ProxyMetrics,
        config: ProxyConfig,
        slots: Slots | None = None,
        shared: SharedHandles | None = None,
    ) -> None:
        """``slots``: where completions wait for room at capped instances (None: never);
        ``shared``: where the replicas keep decode's handles (None: this process alone)."""
        self.backends = backends
        #: What vLLM's KV events say each instance holds (kv-aware, the cached rule).
        self.kv = kv
        self.clock = clock
        self.metrics = metrics
        self.config = config
        #: Where prefill's handoff may point decode (``--allowed-backends``, metadata never).
        self.allowed = AllowedBackends(config.discovery.allowed)
        self.slots = slots
        #: Prompts' token ids from vLLM's render endpoints, for kv-aware.
        self.renderer = Renderer(backends.upstream, clock)
        #: Decode's handles on finished conversations' KV (``--multi-turn-reuse``).
        self.handles = HandleStore(clock, config.reuse.lifetime, shared)

    def reuse_status(self) -> dict[str, object]:
        """Multi-turn reuse as the status page shows it (``HandleStore.status``)."""
        return self.handles.status(self.config.reuse.enabled)

    def configure(self, config: ProxyConfig) -> None:
        """A reload: the next request takes ``config``'s timeouts, retries and rules."""
        self.config = config
        self.allowed = AllowedBackends(config.discovery.allowed)
        self.handles.lifetime = config.reuse.lifetime
