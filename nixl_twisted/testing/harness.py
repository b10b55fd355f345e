"""A real proxy built from a ``ProxyConfig``, on loopback.

- :func:`start_pair` starts a fake prefill and a fake decode sharing a ledger;
- :func:`start_proxy` / :func:`run_proxy` start the proxy's whole service
  tree, as ``twistd nixlproxy`` builds it, in the running reactor.

The same tree with no socket at all is ``nixl_twisted.testing.memory``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.config import ProxyConfig
from nixl_twisted.run.root import build
from nixl_twisted.testing.fake import FakeVLLM
from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.site import netloc

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from nixl_twisted.run.proxy_service import ProxyService
    from nixl_twisted.web.app import ProxyApp
    from nixl_twisted.web.site import TrackingSite


@dataclass
class FakePair:
    """A fake prefill and a fake decode sharing one ledger."""

    prefill: FakeVLLM
    decode: FakeVLLM

    def stop(self) -> Deferred[Any]:
        return gatherResults([self.prefill.stop(), self.decode.stop()])


async def start_pair(
    reactor: Any = None,
    prefill_listen: str = "tcp:0:interface=127.0.0.1",
    decode_listen: str = "tcp:0:interface=127.0.0.1",
    **fake_options: Any,
) -> FakePair:
    """Start a fake prefill and a fake decode on loopback that share a ledger."""
    ledger = TransferLedger()
    pair = FakePair(
        FakeVLLM(name="fake-prefill", ledger=ledger, **fake_options),
        FakeVLLM(name="fake-decode", ledger=ledger, **fake_options),
    )
    await pair.prefill.listen(prefill_listen, reactor)
    await pair.decode.listen(decode_listen, reactor)
    return pair


@dataclass
class RunningProxy:
    """A real nixl-twisted service tree, started in this process on loopback."""

    service: ProxyService
    url: str
    #: The proxy's site: its client connections.
    site: TrackingSite

    @property
    def app(self) -> ProxyApp:
        return self.service.app

    def stop(self) -> Deferred[Any]:
        return maybeDeferred(self.service.stopService)


def run_proxy(
    config: ProxyConfig,
    clock: IReactorTime | None = None,
    reactor: Any = None,
    tracer_provider: TracerProvider | None = None,
) -> RunningProxy:
    """Build the proxy from ``config`` exactly as ``twistd nixlproxy`` would, and start it.

    A ``clock`` (such as ``twisted.internet.task.Clock``) drives its
    timeouts, backoffs and health checks, so a test can advance time by
    hand. Stop it with :meth:`RunningProxy.stop` (a trial ``addCleanup``).
    """
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    service = build(
        config, reactor, clock=clock, take_signals=False, tracer_provider=tracer_provider
    )
    service.privilegedStartService()
    service.startService()
    host = service.ports()[0].getHost()
    assert isinstance(host, IPv4Address | IPv6Address)
    return RunningProxy(service, f"http://{netloc(host)}", service.site)


def start_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    listen: str = "tcp:0:interface=127.0.0.1",
    clock: IReactorTime | None = None,
    reactor: Any = None,
    tracer_provider: TracerProvider | None = None,
    **settings: object,
) -> RunningProxy:
    """Start a proxy before these instances; ``settings`` are any other options
    by name (``max_in_flight=8``, ``health_interval=0``), checked as the
    command line's are. ``tracer_provider``: trace with it (an in-memory exporter's)."""
    config = ProxyConfig.create(
        listen=[listen], prefill=list(prefill), decode=list(decode), **settings
    )
    return run_proxy(config, clock=clock, reactor=reactor, tracer_provider=tracer_provider)
