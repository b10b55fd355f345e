"""``--prefill-selector``/``--decode-selector``: Ready pods, listed then watched.

The reflector's loop, as client-go runs it: list the pods the selector
matches (following ``continue``), then watch from the list's
``resourceVersion`` with bookmarks; a watch that ends is started again from
the last version seen; ``410 Gone`` (on the request, or as an ``ERROR``
event) means that version is too old, and the pods are listed afresh.

A pod is an instance while it is Ready, has an IP and is not terminating;
its port is ``--kubernetes-port``, a number or the name of a container port.

No client library: the official ``kubernetes`` package is synchronous
(urllib3, a thread per watch) and ``kubernetes_asyncio`` needs asyncio's
loop; the watch is one streamed GET, which treq does in the reactor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import treq
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.config import DiscoveryConfig
from nixl_twisted.discovery import kubeconfig
from nixl_twisted.discovery.membership import Membership

log = Logger()

#: Seconds the API server keeps a watch open before ending it (we start another),
#: and the silence past which a watch is taken for dead (no event, no bookmark).
WATCH_SECONDS = 300
SILENCE = WATCH_SECONDS + 60
#: Pods asked per page of a list.
PAGE = 500
#: Seconds a list (each page, and its body) or a watch's headers may take.
REQUEST_SECONDS = 30.0
BACKOFF_LEAST, BACKOFF_MOST = 1.0, 30.0


class Gone(Exception):
    """410: the version a watch would start from is too old; list again."""


class WatchFailed(Exception):
    """The API server refused a request, or a watch broke."""


def source_name(found: DiscoveryConfig, selector: str) -> str:
    """How a selector is named as a source: ``kubernetes:NAMESPACE/SELECTOR``."""
    where = kubeconfig.namespace(found.namespace, found.kubeconfig, os.environ)
    return f"kubernetes:{where}/{selector}"


def instance_url(pod: dict[str, Any], port: str) -> str | None:
    """The pod's vLLM as an instance URL, if the pod is one now (Ready, not terminating)."""
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    number = port if port.isdigit() else _named_port(pod, port)
    if not ready or not ip or number is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{number}"


def _named_port(pod: dict[str, Any], name: str) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("containerPort"):
                return str(port["containerPort"])
    return None


class KubernetesSource:
    """One selector of one pool: its Ready pods, kept current by list and watch."""

    def __init__(
        self,
        role: str,
        source: str,
        found: DiscoveryConfig,
        reactor: Any,
        clock: IReactorTime,
        membership: Membership,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        self.source = source
        selector = found.selector(role)
        assert selector is not None
        self.selector = selector
        self.namespace = source.removeprefix("kubernetes:").split("/", 1)[0]
        self.port = found.port
        self.kubeconfig = found.kubeconfig
        self.reactor = reactor
        self.clock = clock
        self.membership = membership
        self.environ = dict(os.environ) if environ is None else environ
        self.pods: dict[str, dict[str, Any]] = {}
        self.version: str | None = None
        self.running = False
        self._loop: Deferred[None] | None = None
        self._http: HTTPClient | None = None
        self._access: kubeconfig.ApiAccess | None = None
        #: The current watch was accepted (then its end or break is no failure to back off).
        self._watched = False

    def start(self) -> None:
        self.running = True
        self.membership.add(self.role, self.source)
        self._loop = ensureDeferred(self._run())
        self._loop.addErrback(self._ended)

    def stop(self) -> None:
        self.running = False
        if self._loop is not None:
            self._loop.cancel()

    def _ended(self, failure: Failure) -> None:
        if not failure.check(CancelledError):
            log.failure("Kubernetes discovery stopped", failure)

    async def _run(self) -> None:
        backoff, gone = BACKOFF_LEAST, 0
        while self.running:
            if self._watched:  # (the last watch was accepted: from the least wait again)
                backoff, gone = BACKOFF_LEAST, 0
            started, self._watched = self.clock.seconds(), False
            try:
                if self.version is None:
                    await self._list()
                await self._watch()
                backoff, gone = BACKOFF_LEAST, 0
                if self.clock.seconds() - started < BACKOFF_LEAST:
                    await deferLater(self.clock, BACKOFF_LEAST)  # (a server ending at once)
            except Gone:
                log.info("{source}: resource version too old, listing again", source=self.source)
                self.version = None
                gone += 1
                if gone > 1:  # (a server that keeps saying so is not asked in a loop)
                    await deferLater(self.clock, min(BACKOFF_MOST, BACKOFF_LEAST * 2**gone))
            except (CancelledError, GeneratorExit):
                raise
            except Exception as error:
                # The next try is set before the failure is told: whoever it
                # wakes finds it scheduled.
                waiting: Deferred[None] = deferLater(self.clock, backoff)
                self.membership.failed(self.role, self.source, _reason(error))
                await waiting
                backoff = min(BACKOFF_MOST, backoff * 2)

    def _client(self) -> tuple[HTTPClient, kubeconfig.ApiAccess]:
        if self._http is None or self._access is None:
            self._access = kubeconfig.access(self.kubeconfig, self.environ)
            self._http = HTTPClient(self._access.agent(self.reactor))
        return self._http, self._access

    def _url(self, **query: str) -> str:
        _, access = self._client()
        args = urlencode({"labelSelector": self.selector, **query})
        return f"{access.server}/api/v1/namespaces/{self.namespace}/pods?{args}"

    def _headers(self) -> Headers:
        _, access = self._client()
        headers = Headers({"Accept": ["application/json"]})
        authorization = access.authorization()
        if authorization is not None:
            headers.addRawHeader("Authorization", authorization)
        return headers

    async def _list(self) -> None:
        http, _ = self._client()
        pods: dict[str, dict[str, Any]] = {}
        page: dict[str, str] = {"limit": str(PAGE)}
        while True:
            asked = http.get(self._url(**page), headers=self._headers())
            response = await asked.addTimeout(REQUEST_SECONDS, self.clock)
            body = await treq.content(response).addTimeout(REQUEST_SECONDS, self.clock)
            if response.code == 410:
                raise Gone()  # (a continue token too old: list from the start)
            if response.code != 200:
                raise _refused(response, body)
            listing = json.loads(body)
            for pod in listing.get("items") or []:
                pods[pod["metadata"]["name"]] = pod
            metadata = listing.get("metadata") or {}
            if not metadata.get("continue"):
                break
            page = {"limit": str(PAGE), "continue": metadata["continue"]}
        self.pods = pods
        self.version = str(metadata.get("resourceVersion") or "0")
        self._report()

    async def _watch(self) -> None:
        http, _ = self._client()
        assert self.version is not None
        url = self._url(
            watch="1",
            resourceVersion=self.version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(WATCH_SECONDS),
        )
        asked = http.get(url, headers=self._headers(), unbuffered=True)
        response: IResponse = await asked.addTimeout(REQUEST_SECONDS, self.clock)
        if response.code == 410:
            await treq.content(response).addTimeout(REQUEST_SECONDS, self.clock)
            raise Gone()
        if response.code != 200:
            body = await treq.content(response).addTimeout(REQUEST_SECONDS, self.clock)
            raise _refused(response, body)
        self._watched = True
        self._report()  # (watching again: what is known is current, the source answers)
        events = _Events(self._event, self.clock)
        response.deliverBody(events)
        await events.done

    def _event(self, event: dict[str, Any]) -> None:
        kind, thing = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if thing.get("code") == 410:
                raise Gone()
            raise WatchFailed(f"watch error {thing.get('code')}: {thing.get('message')}")
        metadata = thing.get("metadata") or {}
        if metadata.get("resourceVersion"):
            self.version = str(metadata["resourceVersion"])
        if kind in ("ADDED", "MODIFIED"):
            self.pods[metadata["name"]] = thing
        elif kind == "DELETED":
            self.pods.pop(str(metadata.get("name")), None)
        else:
            return  # BOOKMARK: only the version moves
        self._report()

    def _report(self) -> None:
        urls = [instance_url(pod, self.port) for pod in self.pods.values()]
        self.membership.found(self.role, self.source, [u for u in urls if u is not None])


class _Events(Protocol):
    """A watch's body: one JSON event per line, each handed on; silence too long is a failure."""

    def __init__(self, deliver: Callable[[dict[str, Any]], None], clock: IReactorTime) -> None:
        self._deliver = deliver
        self._clock = clock
        self._buffer = b""
        self._error: BaseException | None = None
        self.done: Deferred[None] = Deferred(lambda _: self._abort())
        self._silence: IDelayedCall = clock.callLater(SILENCE, self._silent)

    def dataReceived(self, data: bytes) -> None:
        if self._error is not None:
            return
        self._silence.reset(SILENCE)
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                self._deliver(json.loads(line))
            except Exception as error:
                self._error = (
                    error
                    if not isinstance(error, ValueError)
                    else WatchFailed(f"unreadable watch event: {error}")
                )
                self._abort()
                return

    def _silent(self) -> None:
        self._error = WatchFailed(f"watch silent for {SILENCE} s")
        self._abort()

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if self._silence.active():
            self._silence.cancel()
        if self.done.called:
            return
        if self._error is not None:
            self.done.errback(self._error)
        elif reason is not None and reason.check(ResponseDone):
            self.done.callback(None)  # the server ended the watch: start another
        else:
            self.done.errback(WatchFailed(f"watch broken: {reason.getErrorMessage()}"))


def _refused(response: IResponse, body: bytes) -> Exception:
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    return WatchFailed(f"the API server answered {response.code}: {message}")


def _reason(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return (
        text
        if isinstance(error, WatchFailed | kubeconfig.NoApiAccess)
        else f"{type(error).__name__}: {text}"
    )
