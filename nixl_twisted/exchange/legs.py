"""What every leg is sent with (``Legs``), and the one attempt of a decode leg.

``Legs`` is the proxy's, not a request's: the pools and their client, the
KV events, the clock, the metrics, the renderer and the configuration in
effect, made once by the root. One attempt of a decode leg is
:meth:`Legs.decode_attempt`; what a prefill status means,
:func:`prefill.classify_prefill`; the gap between the two legs is counted
here too. Choosing, holding and retrying an instance is ``sending``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.relay import abandon
from nixl_twisted.exchange.sending import account, full, timed_out, unreachable
from nixl_twisted.exchange.slots import Slots
from nixl_twisted.exchange.tokens import Renderer
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import LegTrace
from nixl_twisted.protocol.headers import for_rank

log = Logger()


@dataclass(frozen=True)
class DecodeRequest:
    """What a decode leg sends, the same to whichever instance serves it."""

    #: The path and query, after the instance's base URL.
    target: str
    #: The JSON body to POST; None: a GET.
    body: bytes | None
    headers: Headers
    #: Seconds for decode's response headers (``--decode-timeout``).
    timeout: float
    #: A 503 (vLLM's engine queue full) is retried on another instance, not relayed.
    full_is_retried: bool = False


def _as_it_is(waiting: Deferred[IResponse]) -> Deferred[IResponse]:
    return waiting


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
    ) -> None:
        """``slots``: where completions wait for room at capped instances (None: never)."""
        self.backends = backends
        #: What vLLM's KV events say each instance holds (kv-aware, the cached rule).
        self.kv = kv
        self.clock = clock
        self.metrics = metrics
        self.config = config
        self.slots = slots
        #: Prompts' token ids from vLLM's render endpoints, for kv-aware.
        self.renderer = Renderer(backends.upstream, clock)

    def configure(self, config: ProxyConfig) -> None:
        """A reload: the next request takes ``config``'s timeouts, retries and rules."""
        self.config = config

    async def decode_attempt(
        self,
        instance: Instance,
        leg: LegTrace,
        request: DecodeRequest,
        record: AccessRecord,
        track: Callable[[Deferred[IResponse]], Deferred[IResponse]] = _as_it_is,
    ) -> IResponse:
        """``request`` to ``instance``, and its response headers; the body is the caller's.

        A completion's decode leg and the single-leg routes alike. ``track``
        is shown what is awaited (to cancel it). No headers within the
        timeout: a 504, counted against the instance. Unreachable: a
        ``Retry`` (nothing reached the client, another instance may serve).
        """
        record.decode = instance.url
        url = instance.base + request.target
        headers = leg.headers(url, for_rank(request.headers, instance.rank))
        upstream = self.backends.upstream
        sent = (
            upstream.get(url, headers)
            if request.body is None
            else upstream.post(url, request.body, headers)
        )
        pool = self.backends.decode
        try:
            response = await track(sent.addTimeout(request.timeout, self.clock))
        except TimeoutError:
            account(self.metrics, pool, instance, "timeout", "decode timed out")
            raise timed_out(instance, request.timeout) from None
        except CancelledError:
            raise
        except Exception as error:
            raise unreachable(instance, error) from None
        leg.answered(response.code)
        if response.code == 503 and request.full_is_retried:
            abandon(response)
            raise full(instance)  # (vLLM's engine queue is full: another instance is asked)
        # An answer, even an error (a KV-load failure is a 500), shows the
        # instance is up: only silence and refusals take it out.
        account(self.metrics, pool, instance, "answered" if response.code < 400 else "error_status")
        return response


def note_handoff(
    metrics: ProxyMetrics, gap: float, warning: float, request_id: str, url: str
) -> bool:
    """Prefill answered -> decode sent: observed; past ``warning``, counted and logged.

    vLLM frees prefill's blocks when its KV lease (30 s) expires: a decode
    sent later fails to load them or computes them again. Returns whether it warned.
    """
    metrics.handoff_gap.observe(gap)
    if gap <= warning:
        return False
    metrics.handoff_gap_over_warning.inc()
    log.warn(
        "handoff gap of {seconds:.1f} s for {request_id} (decode {url}): past "
        "--handoff-warning; vLLM's KV lease is 30 s",
        seconds=gap,
        request_id=request_id,
        url=url,
    )
    return True
