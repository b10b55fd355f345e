"""``FakeKubernetes``: the pods of a Kubernetes API server, on loopback, for tests of discovery.

It answers ``GET /api/v1/namespaces/{ns}/pods`` as kube-apiserver does: a
``PodList`` (``labelSelector``, ``limit`` and ``continue``), or with
``watch=1`` a stream of newline-delimited watch events (``resourceVersion``,
``allowWatchBookmarks``, ``timeoutSeconds``). It fails as a real one does:
401 and 403 ``Status`` bodies, a too old resourceVersion as HTTP 410 or as an
``ERROR`` event, a stream cut mid-body. Every change is kept, so a watch from
an old resourceVersion replays what it missed. Shapes come from the
Kubernetes docs and kube-apiserver's code, never from the proxy:

- https://kubernetes.io/docs/reference/using-api/api-concepts/ (list then
  watch, 410 Gone, bookmarks, ``limit``/``continue``);
- https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/
  (selectors);
- ``k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go``
  (``convertToWatchEvent``: which event a watch sees when labels change).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IDelayedCall, IListeningPort, IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from nixl_twisted.testing.site import FakeSite, netloc

Pod = dict[str, Any]

_PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods")
_TOKEN = re.compile(r"!=|==|=|!|\(|\)|,|[A-Za-z0-9_./-]+")
_NAME = re.compile(r"[A-Za-z0-9_./-]+")
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool, as the server parses
GRACE_SECONDS = 30  # a pod's default terminationGracePeriodSeconds
#: A running pod's conditions; Ready and ContainersReady follow ``ready``.
CONDITIONS = (
    "PodReadyToStartContainers",
    "Initialized",
    "Ready",
    "ContainersReady",
    "PodScheduled",
)


def status(code: int, reason: str, message: str, **more: Any) -> dict[str, Any]:
    """A ``Status`` failure as kube-apiserver writes one (a body, or an ERROR event's object)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        **more,
        "code": code,
    }


@dataclass(frozen=True)
class _Requirement:
    key: str
    operator: str  # in, notin, exists, !
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        if self.operator == "exists":
            return self.key in labels
        if self.operator == "!":
            return self.key not in labels
        value = labels.get(self.key)
        # != and notin also match a pod without the key, as the labels doc says.
        return (value in self.values) == (self.operator == "in")


class LabelSelector:
    """A ``labelSelector`` query: equality-based and set-based requirements, ANDed."""

    def __init__(self, requirements: Iterable[_Requirement] = ()) -> None:
        self.requirements = tuple(requirements)

    def matches(self, labels: dict[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """``a=b,c!=d,e in (x,y),f notin (z),g,!h``; ValueError says what is wrong."""
        tokens: list[str] = []
        position = 0
        while position < len(text):
            if text[position].isspace():
                position += 1
                continue
            match = _TOKEN.match(text, position)
            if match is None:
                raise ValueError(f"unable to parse requirement: unexpected {text[position]!r}")
            tokens.append(match.group())
            position = match.end()
        requirements = []
        at = 0
        while at < len(tokens):
            requirement, at = _requirement(tokens, at)
            requirements.append(requirement)
            if at < len(tokens):
                if tokens[at] != ",":
                    raise ValueError(f"found {tokens[at]!r}, expected: ','")
                at += 1
                if at == len(tokens):
                    raise ValueError("found '', expected: identifier after ','")
        return cls(requirements)


def _requirement(tokens: list[str], at: int) -> tuple[_Requirement, int]:
    def name(index: int) -> str:
        token = tokens[index] if index < len(tokens) else ""
        if not _NAME.fullmatch(token):
            raise ValueError(f"found {token!r}, expected: identifier")
        return token

    if tokens[at] == "!":
        return _Requirement(name(at + 1), "!"), at + 2
    key = name(at)
    operator = tokens[at + 1] if at + 1 < len(tokens) else ","
    if operator == ",":
        return _Requirement(key, "exists"), at + 1
    if operator in ("=", "==", "!="):
        kind = "notin" if operator == "!=" else "in"
        value = tokens[at + 2] if at + 2 < len(tokens) else ","
        if value == ",":  # ``a=`` selects an empty value
            return _Requirement(key, kind, frozenset({""})), at + 2
        kind = "notin" if operator == "!=" else "in"
        return _Requirement(key, kind, frozenset({name(at + 2)})), at + 3
    if operator not in ("in", "notin") or tokens[at + 2 : at + 3] != ["("]:
        raise ValueError(f"found {operator!r}, expected: in, notin, =, ==, !=, ',' or end")
    values: set[str] = set()
    at += 3
    while tokens[at : at + 1] != [")"]:
        values.add(name(at))
        at += 1
        if tokens[at : at + 1] == [","]:
            at += 1
        elif tokens[at : at + 1] != [")"]:
            found = tokens[at] if at < len(tokens) else ""
            raise ValueError(f"found {found!r}, expected: ',' or ')'")
    if not values:
        raise ValueError(f"for 'in', 'notin' operators, values set can't be empty ({key})")
    return _Requirement(key, operator, frozenset(values)), at + 1


@dataclass
class _Change:
    """One write, as the watch cache keeps it: the object after, and the one before."""

    rv: int
    pod: Pod | None  # None: deleted
    previous: Pod | None  # None: created


@dataclass
class _Watch:
    request: Request
    selector: LabelSelector
    bookmarks: bool
    rv: int  # the last resourceVersion this watch was sent
    timeout: IDelayedCall | None = None


def _event(change: _Change, namespace: str, selector: LabelSelector) -> tuple[str, Pod] | None:
    """What ``cache_watcher.go``'s convertToWatchEvent makes of a change for one watch."""

    def seen(pod: Pod | None) -> bool:
        return (
            pod is not None
            and pod["metadata"]["namespace"] == namespace
            and selector.matches(pod["metadata"]["labels"])
        )

    now, before = seen(change.pod), seen(change.previous)
    if now and change.pod is not None:
        return ("MODIFIED" if before else "ADDED"), _typed(change.pod)
    if before and change.previous is not None:
        gone = _typed(copy.deepcopy(change.previous))  # as it was, at the change's version
        gone["metadata"]["resourceVersion"] = str(change.rv)
        return "DELETED", gone
    return None


def _typed(pod: Pod) -> Pod:
    """A pod as a watch event carries it; items of a ``PodList`` carry no kind of their own."""
    return {"kind": "Pod", "apiVersion": "v1", **pod}


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _first(args: dict[str, list[str]], name: str) -> str:
    return args.get(name, [""])[0]


class _Refused(Exception):
    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(answer["message"])
        self.status = answer


def _answer(request: Request, body: dict[str, Any]) -> bytes:
    request.setResponseCode(body.get("code", 200))
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


class _Watches:
    """The watches open now: each one's stream, its timeout, and how it ends."""

    def __init__(self) -> None:
        self.open: list[_Watch] = []
        self.waiting: list[Deferred[int]] = []

    def accept(self, watch: _Watch, clock: IReactorTime | None, timeout: int) -> None:
        """The watch is live: it ends in ``timeout`` seconds; whoever waited for one learns so."""
        self.open.append(watch)
        watch.request.notifyFinish().addBoth(lambda _: self.forget(watch))
        if timeout > 0 and clock is not None:
            watch.timeout = clock.callLater(timeout, self.end, watch)
        waiting, self.waiting = self.waiting, []
        for each in waiting:
            each.callback(watch.rv)

    def send(self, watch: _Watch, kind: str, thing: dict[str, Any], track: bool = True) -> None:
        """One event, one line, one chunk."""
        line = json.dumps({"type": kind, "object": thing}, separators=(",", ":"))
        watch.request.write(line.encode() + b"\n")
        if track:
            watch.rv = int(thing["metadata"]["resourceVersion"])

    def end(self, watch: _Watch) -> None:
        """End a watch cleanly: the last chunk, as at ``timeoutSeconds``."""
        self.forget(watch)
        if not watch.request.finished and not watch.request._disconnected:
            watch.request.finish()

    def drop(self, watch: _Watch) -> None:
        """Abort the watch's connection: no last chunk, a stream cut short."""
        self.forget(watch)
        channel = watch.request.channel
        if channel is not None and channel.transport is not None:
            channel.transport.abortConnection()  # type: ignore[attr-defined]

    def forget(self, watch: _Watch) -> None:
        if watch in self.open:
            self.open.remove(watch)
        if watch.timeout is not None and watch.timeout.active():
            watch.timeout.cancel()


class _PodsResource(Resource):
    """The HTTP side: authentication, the route, a list or a watch; the fake keeps the state."""

    isLeaf = True

    def __init__(self, fake: FakeKubernetes) -> None:
        super().__init__()
        self._fake = fake

    def render_GET(self, request: Request) -> bytes | int:
        fake = self._fake
        path = request.path.decode()
        args = {k.decode(): [v.decode() for v in vs] for k, vs in (request.args or {}).items()}
        fake.requests.append((path, args))
        expected = f"Bearer {fake.token}".encode()
        if fake.token is not None and request.getHeader(b"authorization") != expected:
            return _answer(request, status(401, "Unauthorized", "Unauthorized"))
        route = _PODS.fullmatch(path)
        if route is None:
            message = "the server could not find the requested resource"
            return _answer(request, status(404, "NotFound", message, details={}))
        watch = _first(args, "watch") in _TRUE
        if route.group(1) != fake.namespace:
            message = (
                f'pods is forbidden: User "system:serviceaccount:{fake.namespace}:default" '
                f'cannot {"watch" if watch else "list"} resource "pods" in API group "" '
                f'in the namespace "{route.group(1)}"'
            )
            return _answer(request, status(403, "Forbidden", message, details={"kind": "pods"}))
        try:
            selector = LabelSelector.parse(_first(args, "labelSelector"))
            if watch:
                return self._watch(request, selector, args)
            return _answer(request, self._list(selector, args))
        except _Refused as refused:
            return _answer(request, refused.status)
        except ValueError as error:
            return _answer(request, status(400, "BadRequest", str(error)))

    def _list(self, selector: LabelSelector, args: dict[str, list[str]]) -> dict[str, Any]:
        fake = self._fake
        limit = int(_first(args, "limit") or 0)
        rv, after = fake._rv, ""
        if token := _first(args, "continue"):
            try:
                place = json.loads(base64.urlsafe_b64decode(token))
                rv, after = int(place["rv"]), str(place["start"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"continue key is not valid: {error}") from None
            if rv < fake._expired_before:
                message = (
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter."
                )
                raise _Refused(status(410, "Expired", message))
        pods = [
            pod
            for name, pod in sorted(fake._state_at(rv).items())
            if name >= after
            and pod["metadata"]["namespace"] == fake.namespace
            and selector.matches(pod["metadata"]["labels"])
        ]
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if 0 < limit < len(pods):
            last = pods[limit - 1]["metadata"]["name"]
            place = {"v": "meta.k8s.io/v1", "rv": rv, "start": last + "\x00"}
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps(place).encode()).decode()
            if not selector.requirements:  # the server counts what remains only when unfiltered
                metadata["remainingItemCount"] = len(pods) - limit
            pods = pods[:limit]
        return {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": pods}

    def _watch(
        self, request: Request, selector: LabelSelector, args: dict[str, list[str]]
    ) -> int | bytes:
        fake = self._fake
        asked = _first(args, "resourceVersion")
        timeout = int(_first(args, "timeoutSeconds") or 0)
        watch = _Watch(request, selector, _first(args, "allowWatchBookmarks") in _TRUE, fake._rv)
        if asked in ("", "0"):
            # No resourceVersion, or "0": synthetic ADDED events for what exists, then changes.
            backlog = [_Change(fake._rv, pod, None) for _, pod in sorted(fake._pods.items())]
        else:
            watch.rv = int(asked)
            if watch.rv > fake._rv:
                message = f"Too large resource version: {watch.rv}, current: {fake._rv}"
                cause = {
                    "reason": "ResourceVersionTooLarge",
                    "message": "Too large resource version",
                }
                details = {"causes": [cause], "retryAfterSeconds": 1}
                raise _Refused(status(504, "Timeout", message, details=details))
            if watch.rv < fake._expired_before and not fake.expired_as_event:
                raise _Refused(fake._too_old(watch.rv))
            backlog = [change for change in fake._history if change.rv > watch.rv]
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Cache-Control", b"no-cache, private")
        request.write(b"")  # the headers now, as the API server flushes them before any event
        if watch.rv < fake._expired_before:  # expired_as_event: the watch cache's answer
            fake._watches.send(watch, "ERROR", fake._too_old(watch.rv), track=False)
            request.finish()
            return NOT_DONE_YET
        for change in backlog:
            if event := _event(change, fake.namespace, selector):
                fake._watches.send(watch, *event)
        watch.rv = int(asked or 0) or fake._rv
        fake._watches.accept(watch, fake._clock, timeout)
        return NOT_DONE_YET


class FakeKubernetes:
    """The pods part of a Kubernetes API server, on loopback, changed by tests while it runs.

    A label change is what the API server's watch cache makes of it: a watch
    whose selector matched the pod before and not after gets ``DELETED`` (the
    pod as it was, at the new resourceVersion), one that starts to match gets
    ``ADDED``. A watch from an expired resourceVersion gets HTTP 410, or, with
    ``expired_as_event``, a 200 stream with one ``ERROR`` event as the watch
    cache answers it. Only ``namespace`` is served (others are 403); pod names
    are unique across namespaces here.
    """

    def __init__(
        self,
        namespace: str = "default",
        token: str | None = None,
        *,
        expired_as_event: bool = False,
    ) -> None:
        self.namespace = namespace
        #: A bearer token every request must carry, if set.
        self.token = token
        #: Answer a watch from an expired resourceVersion with an ERROR event, not HTTP 410.
        self.expired_as_event = expired_as_event
        #: Every request: its path and query arguments, in order.
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        #: ``http://127.0.0.1:PORT`` once listening.
        self.url = ""
        self.site = FakeSite(_PodsResource(self))
        self._port: IListeningPort | None = None
        self._clock: IReactorTime | None = None
        self._rv = 1
        self._expired_before = 0  # a watch from an older resourceVersion gets 410
        self._pods: dict[str, Pod] = {}
        self._history: list[_Change] = []
        self._watches = _Watches()

    async def listen(self, reactor: Any = None, clock: IReactorTime | None = None) -> str:
        """Serve on ``tcp:0:interface=127.0.0.1``; ``timeoutSeconds`` counts on ``clock``."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self._clock = clock or reactor
        self._port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(self.site)
        host = self._port.getHost()
        assert isinstance(host, IPv4Address | IPv6Address)
        self.url = f"http://{netloc(host)}"
        return self.url

    def stop(self) -> Deferred[None]:
        """Stop listening and close every connection, open watches with them."""
        for watch in list(self._watches.open):
            self._watches.forget(watch)
        port, self._port = self._port, None
        return self.site.stop(port).addCallback(lambda _: None)

    @property
    def resource_version(self) -> str:
        """The server's resourceVersion now: what a list made now would carry."""
        return str(self._rv)

    @property
    def watches(self) -> int:
        """Watches open now."""
        return len(self._watches.open)

    def watching(self) -> Deferred[int]:
        """Fires, with the resourceVersion it starts from, once the next watch has its headers."""
        waiting: Deferred[int] = Deferred()
        self._watches.waiting.append(waiting)
        return waiting

    # Changes made by tests.

    def add_pod(
        self,
        name: str,
        labels: dict[str, str],
        ip: str,
        ready: bool = True,
        ports: dict[str, int] | None = None,
        namespace: str | None = None,
    ) -> Pod:
        """A running pod (``ip`` "" for none yet, ``ports`` None for none declared): ADDED."""
        if name in self._pods:
            raise ValueError(f"pod {name!r} exists already")
        now = _timestamp(self._now())
        pod = _running_pod(name, namespace or self.namespace, labels, ports, now)
        _set_ip(pod, ip)
        _set_ready(pod, ready, now)
        self._write(None, pod)
        return copy.deepcopy(pod)

    def set_ready(self, name: str, ready: bool) -> None:
        """The Ready condition (and ContainersReady) becomes ``ready``: MODIFIED."""
        now = _timestamp(self._now())
        self._update(name, lambda pod: _set_ready(pod, ready, now))

    def set_ip(self, name: str, ip: str) -> None:
        """``status.podIP`` and ``podIPs`` become ``ip`` ("" removes them): MODIFIED."""
        self._update(name, lambda pod: _set_ip(pod, ip))

    def set_labels(self, name: str, labels: dict[str, str]) -> None:
        """New labels: MODIFIED, or ADDED/DELETED to a watch whose selector they enter/leave."""
        self._update(name, lambda pod: pod["metadata"].__setitem__("labels", dict(labels)))

    def terminate(self, name: str) -> None:
        """Graceful deletion begins: ``deletionTimestamp`` set, the pod still listed: MODIFIED."""

        def terminating(pod: Pod) -> None:
            pod["metadata"]["deletionTimestamp"] = _timestamp(self._now() + GRACE_SECONDS)
            pod["metadata"]["deletionGracePeriodSeconds"] = GRACE_SECONDS

        self._update(name, terminating)

    def delete_pod(self, name: str) -> None:
        """The pod is gone: DELETED, carrying its last state."""
        self._write(self._existing(name), None)

    def bookmark(self) -> None:
        """A BOOKMARK at the current resourceVersion to every watch that allowed bookmarks."""
        for watch in list(self._watches.open):
            if watch.bookmarks:
                self._watches.send(watch, "BOOKMARK", _bookmark(self._rv))

    def expire(self, error_event: bool = False) -> None:
        """Every resourceVersion older than now's becomes too old to watch from (HTTP 410).

        With ``error_event``, open watches also receive an ERROR event with a
        410 ``Status`` and are ended, as a watch whose history was compacted.
        """
        self._expired_before = self._rv
        if not error_event:
            return
        for watch in list(self._watches.open):
            self._watches.send(watch, "ERROR", self._too_old(watch.rv), track=False)
            self._watches.end(watch)

    def drop_watches(self) -> None:
        """Abort every open watch's connection mid-stream, as a restarting API server would."""
        for watch in list(self._watches.open):
            self._watches.drop(watch)

    # The state, and what watches see of it.

    def _now(self) -> float:
        return self._clock.seconds() if self._clock is not None else time.time()

    def _existing(self, name: str) -> Pod:
        try:
            return self._pods[name]
        except KeyError:
            raise KeyError(f"no pod {name!r}") from None

    def _update(self, name: str, change: Callable[[Pod], None]) -> None:
        previous = self._existing(name)
        pod = copy.deepcopy(previous)
        change(pod)
        self._write(previous, pod)

    def _write(self, previous: Pod | None, pod: Pod | None) -> None:
        self._rv += 1
        if pod is not None:
            pod["metadata"]["resourceVersion"] = str(self._rv)
            self._pods[pod["metadata"]["name"]] = pod
        elif previous is not None:
            del self._pods[previous["metadata"]["name"]]
        change = _Change(self._rv, pod, previous)
        self._history.append(change)
        for watch in list(self._watches.open):
            if event := _event(change, self.namespace, watch.selector):
                self._watches.send(watch, *event)

    def _state_at(self, rv: int) -> dict[str, Pod]:
        """The pods as they were at ``rv``, from the history: a list page's consistent snapshot."""
        pods: dict[str, Pod] = {}
        for change in self._history:
            if change.rv > rv:
                break
            if change.pod is not None:
                pods[change.pod["metadata"]["name"]] = change.pod
            elif change.previous is not None:
                pods.pop(change.previous["metadata"]["name"], None)
        return pods

    def _too_old(self, rv: int) -> dict[str, Any]:
        message = f"too old resource version: {rv} ({self._expired_before})"
        return status(410, "Expired", message)


def _running_pod(
    name: str, namespace: str, labels: dict[str, str], ports: dict[str, int] | None, now: str
) -> Pod:
    """A pod the kubelet reports running, one container, ready; no resourceVersion yet."""
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:latest"}
    if ports is not None:
        container["ports"] = [
            {"name": port, "containerPort": number, "protocol": "TCP"}
            for port, number in ports.items()
        ]
    pod: Pod = {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "resourceVersion": "",
            "creationTimestamp": now,
            "labels": dict(labels),
        },
        "spec": {"containers": [container], "restartPolicy": "Always"},
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": kind,
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": now,
                }
                for kind in CONDITIONS
            ],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": now}},
                }
            ],
            "startTime": now,
        },
    }
    return pod


def _bookmark(rv: int) -> dict[str, Any]:
    """A BOOKMARK's object: a Pod with nothing but its resourceVersion."""
    return {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}}


def _set_ip(pod: Pod, ip: str) -> None:
    pod["status"].pop("podIP", None)
    pod["status"].pop("podIPs", None)
    if ip:
        pod["status"]["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]


def _set_ready(pod: Pod, ready: bool, now: str) -> None:
    value = "True" if ready else "False"
    for condition in pod["status"]["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady") and condition["status"] != value:
            condition["status"] = value
            condition["lastTransitionTime"] = now
    for container in pod["status"]["containerStatuses"]:
        container["ready"] = ready


__all__ = ["FakeKubernetes", "LabelSelector", "Pod", "status"]
