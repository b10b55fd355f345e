"""Where an instance publishes its KV events, by asking it: vLLM's ``GET /kv_event_sources``.

vLLM answers with each ready data-parallel rank's publisher configuration,
keyed by rank (``{"0": {"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
...}}``), each rank's ports already offset by its rank; ``{}`` when its
events are off. ``read_sources`` reads an answer into a rank's endpoints
(the instance's own host put in for ``*``, ``0.0.0.0`` and ``::``, where
vLLM binds every interface) or the reason none can be subscribed to;
``EventSources`` asks each instance when it joins, again when told (it
restarted) and, after a failure or an answer with no publisher for it,
with a backoff from 1 s doubling to a minute.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred, TimeoutError, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.upstream import Upstream, read_body
from nixl_twisted.config.values import MAX_RANKS
from nixl_twisted.kv.stream import Endpoints

log = Logger()

#: The most bytes an answer may have: each rank's entry is about 220 bytes, so
#: ``MAX_RANKS`` ranks fit (the most one ``#dp=N`` may declare).
MAX_ANSWER = 256 * 1024
#: The most characters one endpoint may have (a host name and a port fit well within).
MAX_ENDPOINT = 300
#: Seconds before asking again after a failure, or an answer with no publisher for
#: the instance: the first wait, doubled each time up to the last.
FIRST_WAIT = 1.0
LAST_WAIT = 60.0
#: Hosts vLLM binds every interface on: the instance's own host is reached instead.
_ANY = ("*", "0.0.0.0", "::", "[::]", "")

#: A rank's endpoints, or why it has none the proxy can subscribe to.
Said = Endpoints | str


class SourcesError(ValueError):
    """An answer that is not vLLM's ``/kv_event_sources`` (the reason: its text)."""


def _endpoint(value: object, host: str) -> str:
    """A ZeroMQ endpoint to connect to, or ``SourcesError`` / ``_Unusable`` saying why not."""
    if not isinstance(value, str) or not value or len(value) > MAX_ENDPOINT:
        raise SourcesError(f"an endpoint is a string of at most {MAX_ENDPOINT} characters")
    if value.startswith(("ipc://", "inproc://")):
        raise _Unusable(f"it publishes on {value}, which only its own machine reaches")
    if not value.startswith("tcp://"):
        raise SourcesError(f"endpoint {value!r} is not tcp://HOST:PORT")
    where, _, port = value[len("tcp://") :].rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SourcesError(f"endpoint {value!r} has no port")
    if where in _ANY:
        where = host
    return f"tcp://{where}:{int(port)}"


class _Unusable(Exception):
    """A publisher the proxy cannot subscribe to (the reason: its text)."""


def _publisher(config: object, host: str) -> Said:
    if not isinstance(config, dict):
        raise SourcesError(f"a rank's publisher is an object, not {type(config).__name__}")
    if config.get("enable_kv_cache_events") is not True or config.get("publisher") != "zmq":
        return "its KV events are off (enable_kv_cache_events, publisher zmq)"
    try:
        events = _endpoint(config.get("endpoint"), host)
    except _Unusable as why:
        return str(why)
    replay = config.get("replay_endpoint")
    try:
        return Endpoints(events, None if replay is None else _endpoint(replay, host))
    except _Unusable:
        return Endpoints(events)  # (live events without replays: gaps then clear)


def read_sources(body: bytes, host: str) -> dict[int, Said]:
    """Each rank's endpoints (or why none) from an answer; ``SourcesError`` if it is not one."""
    if len(body) > MAX_ANSWER:
        raise SourcesError(f"an answer of more than {MAX_ANSWER} bytes")
    try:
        answer = json.loads(body)
    except ValueError:
        raise SourcesError("the answer is not JSON") from None
    if not isinstance(answer, dict):
        raise SourcesError(f"the answer is an object of ranks, not {type(answer).__name__}")
    if len(answer) > MAX_RANKS:
        raise SourcesError(f"{len(answer)} ranks (at most {MAX_RANKS})")
    ranks: dict[int, Said] = {}
    for key, config in answer.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise SourcesError(f"rank {key!r} is not a number")
        ranks[int(key)] = _publisher(config, host)
    return ranks


def for_rank(ranks: dict[int, Said], rank: int | None) -> Said:
    """What an answer says for one instance: its rank's, or the one rank's if it has none."""
    if not ranks:
        return "its KV events are off (it lists no publisher)"
    if rank is None:
        if len(ranks) == 1:
            return next(iter(ranks.values()))
        return f"it has {len(ranks)} data-parallel ranks: give its URL #dp={len(ranks)}"
    if rank not in ranks:
        return f"rank {rank} is not among the ranks it lists ({', '.join(map(str, sorted(ranks)))})"
    return ranks[rank]


def refusal(where: Endpoints, own: str, allowed: AllowedBackends) -> str | None:
    """Why an answered host other than the instance's own may not be subscribed to, if so.

    An answer is the instance's word, not the operator's: a host it names
    is held to ``--allowed-backends`` as a ``#kv-events=tcp://HOST:PORT``
    of a discovered instance is.
    """
    for endpoint in (where.events, where.replay):
        host = (endpoint or "").removeprefix("tcp://").rpartition(":")[0]
        if endpoint is not None and host != own:
            refused = allowed.refusal(f"http://{host}/")
            if refused is not None:
                return f"{endpoint}: {refused}"
    return None


@dataclass
class _Asked:
    """One instance's answer (shared by its ranks) and when to ask again."""

    ranks: dict[int, Said] | None = None
    error: str | None = None
    asking: Deferred[None] | None = None
    due: float = 0.0
    wait: float = FIRST_WAIT
    times: int = 0


def _host(instance: Instance) -> str:
    host = urlsplit(instance.base).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class EventSources:
    """Each instance asked where it publishes; ``changed`` told when an answer arrives."""

    def __init__(
        self,
        client: Upstream,
        clock: IReactorTime,
        changed: Callable[[], object],
        timeout: float = 5.0,
        allowed: AllowedBackends | None = None,
    ) -> None:
        self.client = client
        self.clock = clock
        self.changed = changed
        self.timeout = timeout
        self.allowed = allowed if allowed is not None else AllowedBackends()
        self._asked: dict[str, _Asked] = {}

    def said(self, instance: Instance) -> Said | None:
        """Its rank's endpoints, or why none (None: not answered yet); asks when due."""
        asked = self._asked.setdefault(instance.base, _Asked())
        if asked.asking is None and self.clock.seconds() >= asked.due:
            self._ask(instance, asked)
        said = self._said(asked, instance)
        if isinstance(said, str) and asked.asking is None and asked.due == float("inf"):
            self._later(asked)  # (its rank was not ready, say: asked again, later)
        return said

    def _said(self, asked: _Asked, instance: Instance) -> Said | None:
        if asked.ranks is None:
            return None
        said = for_rank(asked.ranks, instance.rank)
        if isinstance(said, Endpoints):
            refused = refusal(said, _host(instance), self.allowed)
            if refused is not None:
                return refused
        return said

    def again(self, base: str) -> None:
        """Ask it again at the next look (it restarted: its publisher may have moved)."""
        asked = self._asked.get(base)
        if asked is not None and asked.asking is None:
            asked.due, asked.wait = 0.0, FIRST_WAIT

    def keep(self, bases: Collection[str]) -> None:
        """Forget the instances not among ``bases`` (they left), cancelling their asking."""
        for base in set(self._asked).difference(bases):
            asking = self._asked.pop(base).asking
            if asking is not None:
                asking.cancel()

    def status(self, instance: Instance) -> dict[str, Any]:
        """What ``/healthcheck`` says of the asking: its state, and why it has no stream."""
        asked = self._asked.get(instance.base, _Asked())
        said = self._said(asked, instance)
        if isinstance(said, Endpoints):
            state = "found"
        elif said is not None:
            state = "off"
        else:
            state = "asking" if asked.error is None else "unanswered"
        return {
            "found": "asked",
            "asked": state,
            "reason": said if isinstance(said, str) else asked.error,
            "asks": asked.times,
        }

    def close(self) -> None:
        self.keep(())

    def _ask(self, instance: Instance, asked: _Asked) -> None:
        base, host = instance.base, _host(instance)

        async def ask() -> dict[int, Said]:
            response = await self.client.get(base + "/kv_event_sources", Headers())
            body = await read_body(response, MAX_ANSWER)
            if response.code != 200:
                raise SourcesError(f"GET /kv_event_sources answered HTTP {response.code}")
            return read_sources(body, host)

        asked.times += 1
        asking = ensureDeferred(ask()).addTimeout(self.timeout, self.clock)
        asked.asking = asking  # type: ignore[assignment]

        def answered(ranks: dict[int, Said]) -> None:
            asked.ranks, asked.error = ranks, None
            if any(isinstance(said, Endpoints) for said in ranks.values()):
                asked.due = float("inf")  # until told again (its wait is kept till then)
            else:
                self._later(asked)

        def failed(failure: Failure) -> None:
            if failure.check(TimeoutError):
                asked.error = f"GET /kv_event_sources got no answer in {self.timeout:g} s"
            else:
                asked.error = f"GET /kv_event_sources: {failure.getErrorMessage()}"
            log.debug("{base}: {error}", base=base, error=asked.error)
            self._later(asked)

        def done(_: object) -> None:
            asked.asking = None
            if self._asked.get(base) is asked:
                self.changed()

        asking.addCallbacks(answered, failed).addBoth(done)
        asking.addErrback(lambda failure: log.failure("asking {base}", failure, base=base))

    def _later(self, asked: _Asked) -> None:
        asked.due = self.clock.seconds() + asked.wait
        asked.wait = min(asked.wait * 2, LAST_WAIT)
