"""``dns+`` and ``dnssrv+`` pool members: names resolved again as their TTL says.

``dns+http://NAME:PORT``: each A and AAAA record of NAME is an instance at
PORT (a headless Kubernetes Service gives exactly its Ready pods);
``dnssrv+http://_SERVICE._tcp.NAME``: each SRV record's target, resolved to
its addresses by the same resolver, at the record's port. Thanos' notation,
which operators of Prometheus-style stacks know.

Resolution is Twisted Names': asynchronous, no thread per lookup. A name is
asked again when the shortest TTL of its answer runs out, bounded by
``--dns-min-refresh`` and ``--dns-max-refresh``; after a failure or an
empty answer, from the least interval doubling to the most.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.names import client, dns, hosts, resolve
from twisted.names.error import DNSNameError
from twisted.python.failure import Failure

from nixl_twisted.discovery.membership import Membership

log = Logger()

#: Seconds a query waits for each try (and tries): 4 s in all, not Twisted's 60.
QUERY_TIMEOUT = (1, 3)


class NoRecords(Exception):
    """The name has no usable records: an authoritative none (NXDOMAIN, NODATA)."""


@dataclass(frozen=True)
class Answer:
    """The instances a name gives now, and how long that holds (its shortest TTL)."""

    urls: tuple[str, ...]
    ttl: float


def resolver(server: str | None, reactor: Any) -> Any:
    """The resolver for every name: ``--dns-server``'s, or the system's (hosts file first)."""
    if server is not None:
        host, _, port = server.rpartition(":")
        return client.Resolver(
            servers=[(host.strip("[]"), int(port))], reactor=reactor, timeout=QUERY_TIMEOUT
        )
    system = client.Resolver(resolv="/etc/resolv.conf", reactor=reactor, timeout=QUERY_TIMEOUT)
    return resolve.ResolverChain([hosts.Resolver(file=b"/etc/hosts"), system])


def close(resolver: Any) -> None:
    """Stop what a resolver keeps scheduled (the system one re-reads resolv.conf)."""
    for each in getattr(resolver, "resolvers", [resolver]):
        call = getattr(each, "_parseCall", None)
        if call is not None and call.active():
            call.cancel()


async def resolve_member(resolver: Any, member: str) -> Answer:
    """The instances a ``dns+`` or ``dnssrv+`` member names now; raises ``NoRecords``."""
    kind, _, url = member.partition("+")
    parts = urlsplit(url)
    name = parts.hostname or ""
    if kind == "dns":
        found = await _addresses(resolver, name)
        if not found:
            raise NoRecords(f"{name} has no A or AAAA record")
        assert parts.port is not None
        return Answer(tuple(_url(parts, a, parts.port) for a, _ in found), _ttl(found))
    try:
        answers, _, _ = await resolver.lookupService(name)
    except DNSNameError:
        raise NoRecords(f"{name} does not exist (NXDOMAIN)") from None
    records = [a for a in answers if a.type == dns.SRV]
    urls: list[str] = []
    ttls = [float(r.ttl) for r in records]
    for record in records:
        target = str(record.payload.target)
        for address, ttl in await _addresses(resolver, target):
            urls.append(_url(parts, address, record.payload.port))
            ttls.append(ttl)
    if not urls:
        raise NoRecords(f"{name} has no SRV record whose target has an address")
    return Answer(tuple(urls), min(ttls))


async def _addresses(resolver: Any, name: str) -> list[tuple[str, float]]:
    """``name``'s IPv4 and IPv6 addresses with their TTLs; [] for NXDOMAIN or no record."""
    asked = [resolver.lookupAddress(name), resolver.lookupIPV6Address(name)]
    results = await DeferredList(asked, consumeErrors=True)
    found: list[tuple[str, float]] = []
    for ok, result in results:
        if not ok:
            assert isinstance(result, Failure)
            if result.check(DNSNameError):
                continue
            result.raiseException()
        answers, _, _ = result
        for record in answers:
            if record.type == dns.A:
                found.append((record.payload.dottedQuad(), float(record.ttl)))
            elif record.type == dns.AAAA:
                found.append(
                    (socket.inet_ntop(socket.AF_INET6, record.payload.address), float(record.ttl))
                )
    return found


def _url(parts: Any, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{host}:{port}{parts.path}{fragment}"


def _ttl(found: Sequence[tuple[str, float]]) -> float:
    return min(ttl for _, ttl in found)


class DnsSource:
    """One ``dns+``/``dnssrv+`` member of one pool, resolved in a loop that cannot die."""

    def __init__(
        self,
        role: str,
        member: str,
        resolver: Any,
        clock: IReactorTime,
        membership: Membership,
        refresh: tuple[float, float],
    ) -> None:
        self.role = role
        self.member = member
        self.resolver = resolver
        self.clock = clock
        self.membership = membership
        self.least, self.most = refresh
        self._backoff = self.least
        self._next: IDelayedCall | None = None
        self._asking: Deferred[Answer] | None = None
        self.running = False

    def start(self) -> None:
        self.running = True
        self.membership.add(self.role, self.member)
        self.resolve()

    def stop(self) -> None:
        self.running = False
        if self._next is not None and self._next.active():
            self._next.cancel()
        if self._asking is not None:
            self._asking.cancel()

    def resolve(self) -> None:
        """Ask now; the answer (or its failure) schedules the next time."""
        self._next = None
        asking = self._asking = ensureDeferred(resolve_member(self.resolver, self.member))
        asking.addCallbacks(self._answered, self._failed)
        asking.addErrback(lambda failure: log.failure("DNS discovery error", failure))

    def _answered(self, answer: Answer) -> None:
        # The next time is set before the answer is applied: whoever the
        # change wakes finds it scheduled.
        self._asking = None
        self._backoff = self.least
        self._again(min(self.most, max(self.least, answer.ttl)))
        self.membership.found(self.role, self.member, answer.urls)

    def _failed(self, failure: Failure) -> None:
        self._asking = None
        if not self.running:
            return  # cancelled by stop
        self._again(self._backoff)
        self._backoff = min(self.most, self._backoff * 2)
        if failure.check(NoRecords):
            self.membership.found(self.role, self.member, ())
        else:
            self.membership.failed(self.role, self.member, _reason(failure))

    def _again(self, delay: float) -> None:
        if self.running:
            self._next = self.clock.callLater(delay, self.resolve)


def _reason(failure: Failure) -> str:
    kind = getattr(failure.type, "__name__", "error")
    text = failure.getErrorMessage() or kind
    return text if kind in text else f"{kind}: {text}"
