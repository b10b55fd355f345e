"""Each DNS query on its own: a name fails only when all of its queries fail, said in words."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import defer
from twisted.internet.defer import Deferred, ensureDeferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.names import dns
from twisted.names.error import (
    DNSFormatError,
    DNSNameError,
    DNSNotImplementedError,
    DNSQueryRefusedError,
    DNSQueryTimeoutError,
    DNSServerError,
    DNSUnknownError,
)
from twisted.python.failure import Failure
from zope.interface import provider

from nixl_twisted.discovery.dns import Answer, DnsSource, NoRecords, QueryFailed, resolve_member
from nixl_twisted.discovery.membership import Membership
from nixl_twisted.discovery.queries import why


def reply(code: int) -> dns.Message:
    """A reply as Twisted Names hands it to the error it raises."""
    message = dns.Message(id=7, answer=True, rCode=code)
    message.queries = [dns.Query(b"decode.test", dns.AAAA)]
    return message


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (DNSQueryRefusedError(reply(dns.EREFUSED)), "refused by the server (REFUSED)"),
        (DNSServerError(reply(dns.ESERVER)), "failed at the server (SERVFAIL)"),
        (DNSFormatError(reply(dns.EFORMAT)), "refused as malformed by the server (FORMERR)"),
        (DNSNotImplementedError(reply(dns.ENOTIMP)), "not supported by the server (NOTIMP)"),
        (DNSNameError(reply(dns.ENAME)), "answered: no such name (NXDOMAIN)"),
        (DNSUnknownError(reply(9)), "failed with the server's error code 9"),
        (defer.TimeoutError("query"), "got no answer in time (timed out)"),
        (DNSQueryTimeoutError(7), "got no answer in time (timed out)"),
        (ConnectionRefusedError(), "could not reach the server (ConnectionRefusedError)"),
        (OSError("No domain name servers available"), "could not be asked (OSError: No domain"),
    ],
)
def test_why_a_query_failed_is_said_in_words_not_as_the_reply(error: Exception, words: str) -> None:
    said = why(Failure(error))
    assert said.startswith(words)
    assert "<Message" not in said


class Zone:
    """A resolver whose every (type, name) answers addresses or fails as told."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[str] | Exception] = {}

    def lookupAddress(self, name: str) -> Deferred[Any]:
        return self._lookup("A", name)

    def lookupIPV6Address(self, name: str) -> Deferred[Any]:
        return self._lookup("AAAA", name)

    def lookupService(self, name: str) -> Deferred[Any]:
        told = self.answers.get(("SRV", name), DNSNameError(name))
        if isinstance(told, Exception):
            return fail(told)
        records = []
        for each in told:
            target, port = each.split(":")
            payload = dns.Record_SRV(0, 0, int(port), target, ttl=5)
            records.append(dns.RRHeader(name, dns.SRV, ttl=5, payload=payload))
        return succeed((records, [], []))

    def _lookup(self, kind: str, name: str) -> Deferred[Any]:
        told = self.answers.get((kind, name), [])
        if isinstance(told, Exception):
            return fail(told)
        made = dns.Record_A if kind == "A" else dns.Record_AAAA
        code = dns.A if kind == "A" else dns.AAAA
        records = [dns.RRHeader(name, code, ttl=5, payload=made(a)) for a in told]
        return succeed((records, [], []))


def resolved(zone: Zone, member: str, known: Any = None) -> Answer:
    asking = ensureDeferred(resolve_member(zone, member, known))
    outcome: list[Any] = []
    asking.addBoth(outcome.append)
    (result,) = outcome
    if isinstance(result, Failure):
        result.raiseException()
    assert isinstance(result, Answer)
    return result


REFUSED = DNSQueryRefusedError(reply(dns.EREFUSED))


def test_a_refused_aaaa_query_leaves_the_a_records_and_says_which_failed() -> None:
    zone = Zone()
    zone.answers[("A", "decode.test")] = ["10.0.0.1", "10.0.0.2"]
    zone.answers[("AAAA", "decode.test")] = REFUSED
    answer = resolved(zone, "dns+http://decode.test:8200")
    assert answer.urls == ("http://10.0.0.1:8200", "http://10.0.0.2:8200")
    assert answer.failed == ("AAAA query for decode.test refused by the server (REFUSED)",)


def test_a_name_fails_only_when_every_query_fails_and_says_each_in_words() -> None:
    zone = Zone()
    zone.answers[("A", "decode.test")] = defer.TimeoutError("query")
    zone.answers[("AAAA", "decode.test")] = REFUSED
    with pytest.raises(QueryFailed) as failed:
        resolved(zone, "dns+http://decode.test:8200")
    assert str(failed.value) == (
        "A query for decode.test got no answer in time (timed out); "
        "AAAA query for decode.test refused by the server (REFUSED)"
    )


def test_a_failed_query_keeps_what_it_last_gave_while_the_other_answers() -> None:
    zone = Zone()
    zone.answers[("A", "decode.test")] = ["10.0.0.1"]
    zone.answers[("AAAA", "decode.test")] = ["fd00::1"]
    first = resolved(zone, "dns+http://decode.test:8200")
    assert first.urls == ("http://10.0.0.1:8200", "http://[fd00::1]:8200")
    zone.answers[("AAAA", "decode.test")] = DNSServerError(reply(dns.ESERVER))
    zone.answers[("A", "decode.test")] = ["10.0.0.3"]
    second = resolved(zone, "dns+http://decode.test:8200", first.known)
    assert second.urls == ("http://10.0.0.3:8200", "http://[fd00::1]:8200")
    assert second.failed == ("AAAA query for decode.test failed at the server (SERVFAIL)",)


def test_none_from_one_query_and_a_failure_with_nothing_known_is_none() -> None:
    zone = Zone()
    zone.answers[("AAAA", "decode.test")] = REFUSED  # and A: no record (NODATA)
    with pytest.raises(NoRecords):
        resolved(zone, "dns+http://decode.test:8200")


def test_an_srv_target_whose_queries_all_fail_leaves_the_others() -> None:
    zone = Zone()
    zone.answers[("SRV", "_http._tcp.p.test")] = ["p0.test:8100", "p1.test:8101"]
    zone.answers[("A", "p0.test")] = ["10.0.0.1"]
    zone.answers[("AAAA", "p0.test")] = REFUSED
    zone.answers[("A", "p1.test")] = REFUSED
    zone.answers[("AAAA", "p1.test")] = REFUSED
    answer = resolved(zone, "dnssrv+http://_http._tcp.p.test")
    assert answer.urls == ("http://10.0.0.1:8100",)
    assert len(answer.failed) == 3
    zone.answers[("SRV", "_http._tcp.p.test")] = REFUSED
    with pytest.raises(QueryFailed, match=r"^SRV query for _http._tcp.p.test refused by the"):
        resolved(zone, "dnssrv+http://_http._tcp.p.test")


@pytest.fixture
def said() -> Iterator[list[str]]:
    lines: list[str] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if str(event.get("log_namespace", "")).startswith("nixl_twisted.discovery"):
            lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def test_a_query_failing_while_the_other_answers_is_said_once_and_shown(said: list[str]) -> None:
    clock, zone, applied = Clock(), Zone(), []
    found = Membership(clock, lambda *change: applied.append(change[2]), grace=10)
    source = DnsSource("decode", "dns+http://d.test:8200", zone, clock, found, (1, 30))
    zone.answers[("A", "d.test")] = ["10.0.0.1"]
    zone.answers[("AAAA", "d.test")] = REFUSED
    source.start()
    for _ in range(5):
        clock.advance(5)  # asked again at each TTL
    assert applied == [("http://10.0.0.1:8200",)]
    assert said == [
        "decode: dns+http://d.test:8200: AAAA query for d.test refused by the server (REFUSED); "
        "the queries that answered are used, and what the failed ones last gave"
    ]
    (status,) = found.status()
    assert (status["state"], status["errors"]) == ("ok", 0)
    assert status["last_error"] == "AAAA query for d.test refused by the server (REFUSED)"

    zone.answers[("AAAA", "d.test")] = REFUSED  # (then both: the source fails, said once)
    zone.answers[("A", "d.test")] = REFUSED
    clock.advance(5)
    clock.advance(1)
    assert said[1:] == [
        "decode: dns+http://d.test:8200 failed, keeping its 1 known instances: "
        "A query for d.test refused by the server (REFUSED); "
        "AAAA query for d.test refused by the server (REFUSED)"
    ]
    zone.answers[("A", "d.test")] = ["10.0.0.1"]
    zone.answers[("AAAA", "d.test")] = []
    clock.advance(2)
    assert said[2:] == [
        "decode: dns+http://d.test:8200 answers again",
        "decode: dns+http://d.test:8200: every query answers again",
    ]
    assert found.status()[0]["last_error"] is None
    source.stop()
