"""``dns+`` and ``dnssrv+`` pool members: names resolved again as their TTL says.

``dns+http://NAME:PORT``: each A and AAAA record of NAME is an instance at
PORT (a headless Kubernetes Service gives exactly its Ready pods);
``dnssrv+http://_SERVICE._tcp.NAME``: each SRV record's target, resolved to
its addresses by the same resolver, at the record's port. Thanos' notation,
which operators of Prometheus-style stacks know.

Resolution is Twisted Names': asynchronous, no thread per lookup, each
query's tries timed out by the proxy's clock (``QUERY_TIMEOUT``). A name is
asked again when the shortest TTL of its answer runs out, bounded by
``--dns-min-refresh`` and ``--dns-max-refresh``; after a failure or an
empty answer, from the least interval doubling to the most.

Each query (A, AAAA, each SRV target's) answers or fails on its own: one
that fails keeps what it last gave, and says so once; the name fails only
when all of them fail.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.names import client, dns, hosts, resolve
from twisted.names.error import DNSNameError
from twisted.python.failure import Failure

from nixl_twisted.discovery.membership import Membership
from nixl_twisted.discovery.queries import Asked, Records, ask_addresses, query_reactor, why

log = Logger()

#: Seconds a query waits for each try (and tries): 4 s in all, not Twisted's 60, by the clock.
QUERY_TIMEOUT = (1, 3)

#: What each query last gave, by (type, name): a failed query's records stand in.
Known = dict[tuple[str, str], Records]


class NoRecords(Exception):
    """The name has no usable records: an authoritative none (NXDOMAIN, NODATA)."""


class QueryFailed(Exception):
    """Every query for the name failed (the reason, in words): its instances stay."""


@dataclass(frozen=True)
class Answer:
    """The instances a name gives now, and how long that holds (its shortest TTL)."""

    urls: tuple[str, ...]
    ttl: float
    #: The queries that failed while others answered (their last records stood in), in words.
    failed: tuple[str, ...] = ()
    #: What each query asked gave (or, failed, last gave): the next resolution's ``known``.
    known: Known = field(default_factory=dict)


def resolver(server: str | None, reactor: Any, clock: IReactorTime) -> Any:
    """The resolver for every name: ``--dns-server``'s, or the system's (hosts file first);
    its queries go over ``reactor``'s UDP and time out by ``clock``."""
    names = query_reactor(reactor, clock)
    if server is not None:
        host, _, port = server.rpartition(":")
        return client.Resolver(
            servers=[(host.strip("[]"), int(port))], reactor=names, timeout=QUERY_TIMEOUT
        )
    system = client.Resolver(resolv="/etc/resolv.conf", reactor=names, timeout=QUERY_TIMEOUT)
    return resolve.ResolverChain([hosts.Resolver(file=b"/etc/hosts"), system])


def close(resolver: Any) -> None:
    """Stop what a resolver keeps scheduled (the system one re-reads resolv.conf)."""
    for each in getattr(resolver, "resolvers", [resolver]):
        call = getattr(each, "_parseCall", None)
        if call is not None and call.active():
            call.cancel()


async def resolve_member(resolver: Any, member: str, known: Known | None = None) -> Answer:
    """The instances a ``dns+`` or ``dnssrv+`` member names now, a failed query's ``known``
    records standing in; raises ``NoRecords``, or ``QueryFailed`` when every query failed."""
    known = known if known is not None else {}
    kind, _, url = member.partition("+")
    parts = urlsplit(url)
    name = parts.hostname or ""
    asked: list[Asked] = []
    if kind == "dns":
        assert parts.port is not None
        asked += await ask_addresses(resolver, name)
        found = [(_url(parts, a, parts.port), ttl) for a, ttl in _records(asked, known)]
        return _answer(asked, known, found, f"{name} has no A or AAAA record")
    try:
        answers, _, _ = await resolver.lookupService(name)
    except DNSNameError:
        raise NoRecords(f"{name} does not exist (NXDOMAIN)") from None
    except CancelledError:
        raise
    except Exception:
        raise QueryFailed(f"SRV query for {name} {why(Failure())}") from None
    records = [a for a in answers if a.type == dns.SRV]
    found = [("", float(r.ttl)) for r in records]
    for record in records:
        target = await ask_addresses(resolver, str(record.payload.target))
        asked += target
        port = record.payload.port
        found += [(_url(parts, a, port), ttl) for a, ttl in _records(target, known)]
    return _answer(asked, known, found, f"{name} has no SRV record whose target has an address")


def _records(asked: Iterable[Asked], known: Known) -> Records:
    """What the queries give: each answered one's records, each failed one's last known."""
    return tuple(
        record
        for each in asked
        for record in (each.records if each.why is None else known.get((each.kind, each.name), ()))
    )


def _answer(asked: list[Asked], known: Known, found: list[tuple[str, float]], none: str) -> Answer:
    """The answer the queries make, with ``found``'s (url, ttl); "" urls count for the TTL."""
    failed = tuple(str(each) for each in asked if each.why is not None)
    if asked and len(failed) == len(asked):
        raise QueryFailed("; ".join(failed))
    urls = tuple(dict.fromkeys(url for url, _ in found if url))
    if not urls:
        raise NoRecords(none)
    now = {(each.kind, each.name): each.records for each in asked if each.why is None}
    was = {(e.kind, e.name): known.get((e.kind, e.name), ()) for e in asked if e.why is not None}
    return Answer(urls, min(ttl for _, ttl in found), failed, {**was, **now})


def _url(parts: Any, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{host}:{port}{parts.path}{fragment}"


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
        #: What each query last gave; the queries failing while others answer (said once).
        self._known: Known = {}
        self._failing: tuple[str, ...] = ()

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
        asking = ensureDeferred(resolve_member(self.resolver, self.member, self._known))
        self._asking = asking
        asking.addCallbacks(self._answered, self._failed)
        asking.addErrback(lambda failure: log.failure("DNS discovery error", failure))

    def _answered(self, answer: Answer) -> None:
        # The next time is set before the answer is applied: whoever the
        # change wakes finds it scheduled.
        self._asking = None
        self._backoff = self.least
        self._again(min(self.most, max(self.least, answer.ttl)))
        self._known = answer.known
        trouble = "; ".join(answer.failed) or None
        self.membership.found(self.role, self.member, answer.urls, trouble)
        self._in_part(answer.failed)

    def _in_part(self, failed: tuple[str, ...]) -> None:
        """Queries failing while others answer: said when that changes, not each time."""
        was, self._failing = self._failing, failed
        if failed and failed != was:
            log.warn(
                "{role}: {source}: {failed}; the queries that answered are used, and what "
                "the failed ones last gave",
                role=self.role,
                source=self.member,
                failed="; ".join(failed),
            )
        elif was and not failed:
            log.info(
                "{role}: {source}: every query answers again", role=self.role, source=self.member
            )

    def _failed(self, failure: Failure) -> None:
        self._asking = None
        if not self.running:
            return  # cancelled by stop
        self._again(self._backoff)
        self._backoff = min(self.most, self._backoff * 2)
        if failure.check(NoRecords):
            self.membership.found(self.role, self.member, ())
        elif failure.check(QueryFailed):
            self.membership.failed(self.role, self.member, failure.getErrorMessage())
        else:
            self.membership.failed(self.role, self.member, _reason(failure))

    def _again(self, delay: float) -> None:
        if self.running:
            self._next = self.clock.callLater(delay, self.resolve)


def _reason(failure: Failure) -> str:
    kind = getattr(failure.type, "__name__", "error")
    text = failure.getErrorMessage() or kind
    return text if kind in text else f"{kind}: {text}"
