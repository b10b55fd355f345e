"""``FakeKubernetes`` against real HTTP clients: list and watch as the API server speaks them.

Each watch is read line by line as it arrives; a test waits on the fake's
``watching()`` (the watch has its headers) or on the next line, never on
time. Absence is shown by order: an event that should not exist would come
before the next one that must.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from treq import collect
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed
from twisted.web.iweb import IResponse

from nixl_twisted.testing.kubernetes import FakeKubernetes, LabelSelector

Json = dict[str, Any]


class Stream:
    """A watch's body, one JSON line at a time, and how it ended."""

    def __init__(self, response: IResponse) -> None:
        self._buffer = b""
        self._events: list[Json] = []
        self._waiting: list[Deferred[Json]] = []
        self._ending: list[Deferred[None]] = []
        self.outcome: Failure | bool | None = False  # False: not ended yet
        collect(response, self._received).addBoth(self._ended)

    def _received(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            event = json.loads(line)  # one whole JSON object a line, or this fails
            if self._waiting:
                self._waiting.pop(0).callback(event)
            else:
                self._events.append(event)

    def _ended(self, outcome: object) -> None:
        self.outcome = outcome if isinstance(outcome, Failure) else None
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.errback(AssertionError(f"the watch ended first: {self.outcome}"))
        ending, self._ending = self._ending, []
        for each_end in ending:
            each_end.callback(None)

    def next(self) -> Deferred[Json]:
        """The next event not taken yet: at once if it came, else when it does."""
        waiting: Deferred[Json] = Deferred()
        if self._events:
            waiting.callback(self._events.pop(0))
        elif self.outcome is not False:
            waiting.errback(AssertionError(f"the watch ended: {self.outcome}"))
        else:
            self._waiting.append(waiting)
        return waiting

    async def ended(self) -> Failure | None:
        """Once the body ends: None if it ended cleanly, else the client's failure."""
        if self.outcome is False:
            ending: Deferred[None] = Deferred()
            self._ending.append(ending)
            await ending
        assert not isinstance(self.outcome, bool)
        return self.outcome


class Wire(Protocol):
    """The bytes a server sends, to see what an HTTP client hides: the chunks."""

    def __init__(self) -> None:
        self.received = b""
        self.lost: Deferred[None] = Deferred()
        self._waiting: list[tuple[Callable[[bytes], bool], Deferred[None]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        ready = [w for w in self._waiting if w[0](self.received)]
        self._waiting = [w for w in self._waiting if w not in ready]
        for _, waiting in ready:
            waiting.callback(None)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost.callback(None)

    def until(self, enough: Callable[[bytes], bool]) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        if enough(self.received):
            waiting.callback(None)
        else:
            self._waiting.append((enough, waiting))
        return waiting


def chunks(received: bytes) -> list[bytes]:
    """The whole chunks of a chunked body after the head, in order."""
    body = received.split(b"\r\n\r\n", 1)[1]
    found = []
    while b"\r\n" in body:
        size, rest = body.split(b"\r\n", 1)
        length = int(size, 16)
        if len(rest) < length + 2:
            break
        found.append(rest[:length])
        body = rest[length + 2 :]
    return found


def names(pods: list[Json]) -> list[str]:
    return [pod["metadata"]["name"] for pod in pods]


def rv(thing: Json) -> int:
    return int(thing["metadata"]["resourceVersion"])


class FakeKubernetesTests(TestCase):
    timeout = 10  # seconds; each test takes a few milliseconds

    async def serving(self, **options: Any) -> FakeKubernetes:
        clock = options.pop("clock", None)
        kube = FakeKubernetes(**options)
        await kube.listen(reactor, clock=clock)
        self.addCleanup(kube.stop)
        self.http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        return kube

    async def get(
        self, kube: FakeKubernetes, namespace: str = "default", **params: str
    ) -> tuple[int, Json]:
        response = await self.http.get(
            f"{kube.url}/api/v1/namespaces/{namespace}/pods",
            params=params,
            headers=self.headers(kube),
        )
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        return response.code, json.loads(await response.content())

    def headers(self, kube: FakeKubernetes) -> dict[bytes | str, bytes | str]:
        return {} if kube.token is None else {"Authorization": f"Bearer {kube.token}"}

    async def listed(self, kube: FakeKubernetes, **params: str) -> list[str]:
        code, body = await self.get(kube, **params)
        self.assertEqual((code, body["kind"]), (200, "PodList"), body)
        return names(body["items"])

    async def watch(self, kube: FakeKubernetes, **params: str) -> Stream:
        """A watch that the fake has accepted, its headers received."""
        accepted = kube.watching()
        response = await self.http.get(
            f"{kube.url}/api/v1/namespaces/default/pods",
            params={"watch": "1", **params},
            headers=self.headers(kube),
            unbuffered=True,
        )
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        stream = Stream(response)
        self.assertEqual(
            await accepted, int(params.get("resourceVersion") or kube.resource_version)
        )
        return stream

    def cluster(self, kube: FakeKubernetes) -> None:
        """Prefills, decodes, and a pod of something else, with and without a role."""
        kube.add_pod("a", {"app": "vllm", "role": "prefill"}, "10.0.0.1")
        kube.add_pod("b", {"app": "vllm", "role": "decode"}, "10.0.0.2")
        kube.add_pod("c", {"app": "other"}, "10.0.0.3")
        kube.add_pod("d", {"app": "vllm"}, "10.0.0.4")

    async def test_a_list_is_a_pod_list_at_the_servers_resource_version(self) -> None:
        kube = await self.serving()
        code, empty = await self.get(kube)
        self.assertEqual((code, empty["items"]), (200, []))
        self.cluster(kube)
        kube.add_pod("elsewhere", {"app": "vllm"}, "10.0.9.9", namespace="other")
        code, body = await self.get(kube, labelSelector="app=vllm")
        self.assertEqual((body["kind"], body["apiVersion"]), ("PodList", "v1"))
        self.assertEqual(body["metadata"], {"resourceVersion": kube.resource_version})
        self.assertGreater(rv(body), rv(empty))
        self.assertEqual(names(body["items"]), ["a", "b", "d"])  # not the other namespace's
        # As the API server sends them, a list's items carry no kind of their own.
        self.assertNotIn("kind", body["items"][0])

    async def test_equality_based_selectors(self) -> None:
        kube = await self.serving()
        self.cluster(kube)
        self.assertEqual(await self.listed(kube), ["a", "b", "c", "d"])
        self.assertEqual(await self.listed(kube, labelSelector="app=vllm"), ["a", "b", "d"])
        self.assertEqual(await self.listed(kube, labelSelector="app==vllm,role=decode"), ["b"])
        # != also selects pods without the key, as the labels doc says.
        self.assertEqual(await self.listed(kube, labelSelector="role!=decode"), ["a", "c", "d"])
        self.assertEqual(
            await self.listed(kube, labelSelector="app = vllm , role != x"), list("abd")
        )

    async def test_set_based_selectors(self) -> None:
        kube = await self.serving()
        self.cluster(kube)
        self.assertEqual(
            await self.listed(kube, labelSelector="role in (prefill, decode)"), ["a", "b"]
        )
        self.assertEqual(
            await self.listed(kube, labelSelector="role notin (decode)"), ["a", "c", "d"]
        )
        self.assertEqual(await self.listed(kube, labelSelector="role"), ["a", "b"])
        self.assertEqual(await self.listed(kube, labelSelector="!role"), ["c", "d"])
        mixed = "app=vllm,role notin (prefill)"
        self.assertEqual(await self.listed(kube, labelSelector=mixed), ["b", "d"])

    async def test_a_selector_that_does_not_parse_is_a_bad_request(self) -> None:
        kube = await self.serving()
        for bad in ("role in ()", "role in (a b)", "a=b,", "=b", "a in x"):
            with self.assertRaises(ValueError):
                LabelSelector.parse(bad)
        code, body = await self.get(kube, labelSelector="role in ()")
        self.assertEqual(
            (code, body["kind"], body["reason"], body["code"]), (400, "Status", "BadRequest", 400)
        )

    async def test_limit_and_continue_page_through_one_consistent_snapshot(self) -> None:
        kube = await self.serving()
        for name in "edcba":
            kube.add_pod(name, {"app": "vllm"}, "10.0.0.1")
        code, first = await self.get(kube, limit="2")
        self.assertEqual(names(first["items"]), ["a", "b"])
        self.assertEqual(first["metadata"]["remainingItemCount"], 3)
        token = first["metadata"]["continue"]
        kube.add_pod("aa", {"app": "vllm"}, "10.0.0.9")  # after the snapshot: not in this list
        kube.delete_pod("c")
        code, second = await self.get(kube, limit="2", **{"continue": token})
        self.assertEqual(names(second["items"]), ["c", "d"])
        self.assertEqual(rv(second), rv(first))  # the same snapshot, page after page
        code, last = await self.get(kube, limit="2", **{"continue": second["metadata"]["continue"]})
        self.assertEqual((names(last["items"]), "continue" in last["metadata"]), (["e"], False))
        # With a selector the server fills each page with matches and counts nothing.
        code, filtered = await self.get(kube, limit="1", labelSelector="app=vllm")
        self.assertEqual(names(filtered["items"]), ["a"])
        self.assertNotIn("remainingItemCount", filtered["metadata"])

        kube.expire()  # the snapshot's history is gone: the token with it
        code, gone = await self.get(kube, limit="2", **{"continue": token})
        self.assertEqual((code, gone["reason"], gone["code"]), (410, "Expired", 410))

    async def test_a_watch_streams_added_modified_bookmark_deleted_in_order(self) -> None:
        kube = await self.serving()
        _, listed = await self.get(kube)
        stream = await self.watch(
            kube, resourceVersion=listed["metadata"]["resourceVersion"], allowWatchBookmarks="true"
        )
        self.assertEqual(kube.watches, 1)
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1", ports={"http": 8000})
        kube.set_ready("a", False)
        kube.set_ip("a", "10.0.0.7")
        kube.bookmark()
        kube.terminate("a")
        kube.delete_pod("a")

        added = await stream.next()
        self.assertEqual((added["type"], added["object"]["kind"]), ("ADDED", "Pod"))
        self.assertEqual(added["object"]["apiVersion"], "v1")
        unready = await stream.next()
        self.assertEqual(unready["type"], "MODIFIED")
        ready = [c for c in unready["object"]["status"]["conditions"] if c["type"] == "Ready"]
        self.assertEqual(ready[0]["status"], "False")
        moved = await stream.next()
        self.assertEqual(
            (moved["type"], moved["object"]["status"]["podIP"]), ("MODIFIED", "10.0.0.7")
        )
        bookmark = await stream.next()
        self.assertEqual(bookmark["type"], "BOOKMARK")
        # A Pod with nothing but its resourceVersion: the last change's.
        only = {"resourceVersion": moved["object"]["metadata"]["resourceVersion"]}
        self.assertEqual(bookmark["object"], {"kind": "Pod", "apiVersion": "v1", "metadata": only})
        terminating = await stream.next()
        self.assertEqual(terminating["type"], "MODIFIED")
        self.assertIn("deletionTimestamp", terminating["object"]["metadata"])
        deleted = await stream.next()
        self.assertEqual(deleted["type"], "DELETED")
        self.assertEqual(deleted["object"]["status"]["podIP"], "10.0.0.7")  # its last state
        self.assertEqual(str(rv(deleted["object"])), kube.resource_version)
        changes = [added, unready, moved, terminating, deleted]
        versions = [rv(event["object"]) for event in changes]
        self.assertEqual(versions, list(range(rv(listed) + 1, rv(listed) + 6)))

    async def test_on_the_wire_a_watch_is_chunked_json_one_event_a_line(self) -> None:
        kube = await self.serving()
        wire = Wire()
        port = int(kube.url.rsplit(":", 1)[1])
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), wire)
        transport = wire.transport
        assert transport is not None
        self.addCleanup(lambda: wire.lost)
        self.addCleanup(transport.loseConnection)
        accepted = kube.watching()
        path = f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={kube.resource_version}"
        transport.write(f"GET {path} HTTP/1.1\r\nHost: kubernetes\r\n\r\n".encode())
        await accepted
        await wire.until(lambda received: b"\r\n\r\n" in received)  # the head, before any event
        head = wire.received.split(b"\r\n\r\n")[0].split(b"\r\n")
        self.assertEqual(head[0], b"HTTP/1.1 200 OK")
        self.assertIn(b"Transfer-Encoding: chunked", head)
        self.assertIn(b"Content-Type: application/json", head)
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        kube.set_ready("a", False)
        await wire.until(lambda received: len(chunks(received)) == 2)
        for chunk, kind in zip(chunks(wire.received), ["ADDED", "MODIFIED"], strict=True):
            self.assertTrue(chunk.endswith(b"\n") and chunk.count(b"\n") == 1, chunk)
            self.assertEqual(json.loads(chunk)["type"], kind)

    async def test_bookmarks_go_only_to_watches_that_allowed_them(self) -> None:
        kube = await self.serving()
        stream = await self.watch(kube, resourceVersion=kube.resource_version)
        kube.bookmark()
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        self.assertEqual((await stream.next())["type"], "ADDED")  # no BOOKMARK before it

    async def test_labels_that_leave_a_selector_are_deleted_and_entering_ones_added(self) -> None:
        kube = await self.serving()
        self.cluster(kube)
        stream = await self.watch(
            kube, resourceVersion=kube.resource_version, labelSelector="role=decode"
        )
        kube.set_labels("b", {"app": "vllm", "role": "prefill"})
        left_at = int(kube.resource_version)
        kube.set_labels("a", {"app": "vllm", "role": "decode"})
        kube.set_labels("c", {"app": "other", "tier": "x"})  # never matched: nothing

        left = await stream.next()
        self.assertEqual((left["type"], left["object"]["metadata"]["name"]), ("DELETED", "b"))
        # The pod as it was (it matched then), at the resourceVersion of the change.
        self.assertEqual(left["object"]["metadata"]["labels"]["role"], "decode")
        self.assertEqual(rv(left["object"]), left_at)
        entered = await stream.next()
        self.assertEqual((entered["type"], entered["object"]["metadata"]["name"]), ("ADDED", "a"))
        kube.set_ready("a", False)
        self.assertEqual((await stream.next())["type"], "MODIFIED")  # c's change sent nothing

    async def test_a_watch_from_an_old_resource_version_replays_what_it_missed(self) -> None:
        kube = await self.serving()
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        start = kube.resource_version
        kube.add_pod("b", {"app": "vllm"}, "10.0.0.2")
        kube.set_ready("a", False)
        kube.delete_pod("b")
        stream = await self.watch(kube, resourceVersion=start)
        kube.add_pod("c", {"app": "vllm"}, "10.0.0.3")
        seen = [await stream.next() for _ in range(4)]
        self.assertEqual(
            [(e["type"], e["object"]["metadata"]["name"]) for e in seen],
            [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b"), ("ADDED", "c")],
        )

    async def test_a_watch_without_resource_version_starts_with_what_exists(self) -> None:
        kube = await self.serving()
        self.cluster(kube)
        stream = await self.watch(kube, labelSelector="app=vllm")
        first = [await stream.next() for _ in range(3)]
        self.assertEqual([e["type"] for e in first], ["ADDED"] * 3)
        self.assertEqual(names([e["object"] for e in first]), ["a", "b", "d"])

    async def test_an_expired_resource_version_is_410_gone(self) -> None:
        kube = await self.serving()
        old = kube.resource_version
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        kube.expire()
        code, body = await self.get(kube, watch="1", resourceVersion=old)
        self.assertEqual(
            body,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {old} ({kube.resource_version})",
                "reason": "Expired",
                "code": 410,
            },
        )
        self.assertEqual((code, kube.watches), (410, 0))
        # One from the future is refused too, as the watch cache does when it cannot catch up.
        ahead = str(int(kube.resource_version) + 5)
        code, body = await self.get(kube, watch="1", resourceVersion=ahead)
        self.assertEqual((code, body["reason"], body["code"]), (504, "Timeout", 504))
        # Relisting and watching from the list's resourceVersion works again.
        code, listed = await self.get(kube)
        await self.watch(kube, resourceVersion=listed["metadata"]["resourceVersion"])
        self.assertEqual(kube.watches, 1)

    async def test_an_open_watch_can_be_expired_with_an_error_event(self) -> None:
        kube = await self.serving()
        stream = await self.watch(kube, resourceVersion=kube.resource_version)
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        kube.expire(error_event=True)
        self.assertEqual((await stream.next())["type"], "ADDED")
        error = await stream.next()
        self.assertEqual(error["type"], "ERROR")
        self.assertEqual(
            (error["object"]["kind"], error["object"]["code"], error["object"]["reason"]),
            ("Status", 410, "Expired"),
        )
        self.assertIsNone(await stream.ended())  # ended cleanly, after the error
        self.assertEqual(kube.watches, 0)

    async def test_expired_as_event_answers_a_new_watch_as_the_watch_cache_does(self) -> None:
        kube = await self.serving(expired_as_event=True)
        old = kube.resource_version
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        kube.expire()
        response = await self.http.get(
            f"{kube.url}/api/v1/namespaces/default/pods",
            params={"watch": "true", "resourceVersion": old},
            unbuffered=True,
        )
        self.assertEqual(response.code, 200)
        stream = Stream(response)
        error = await stream.next()
        self.assertEqual((error["type"], error["object"]["code"]), ("ERROR", 410))
        self.assertIsNone(await stream.ended())
        self.assertEqual(kube.watches, 0)

    async def test_dropped_watches_end_in_a_lost_connection_not_a_clean_end(self) -> None:
        kube = await self.serving()
        stream = await self.watch(kube, resourceVersion=kube.resource_version)
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        self.assertEqual((await stream.next())["type"], "ADDED")
        kube.drop_watches()
        self.assertEqual(kube.watches, 0)
        outcome = await stream.ended()
        assert outcome is not None
        self.assertTrue(outcome.check(ResponseFailed), outcome)

    async def test_a_configured_token_is_required(self) -> None:
        kube = await self.serving(token="s3cret")
        response = await self.http.get(f"{kube.url}/api/v1/namespaces/default/pods")
        body = json.loads(await response.content())
        self.assertEqual(
            (response.code, body["kind"], body["reason"], body["code"]),
            (401, "Status", "Unauthorized", 401),
        )
        wrong_token: dict[bytes | str, bytes | str] = {"Authorization": "Bearer nope"}
        wrong = await self.http.get(
            f"{kube.url}/api/v1/namespaces/default/pods", headers=wrong_token
        )
        await wrong.content()
        self.assertEqual(wrong.code, 401)
        self.assertEqual(await self.listed(kube), [])
        self.assertEqual(
            [path for path, _ in kube.requests], ["/api/v1/namespaces/default/pods"] * 3
        )

    async def test_a_namespace_not_served_is_forbidden(self) -> None:
        kube = await self.serving(namespace="serving")
        code, body = await self.get(kube, namespace="other")
        self.assertEqual(
            (code, body["reason"], body["details"]), (403, "Forbidden", {"kind": "pods"})
        )
        code, body = await self.get(kube, namespace="serving")
        self.assertEqual(code, 200)

    async def test_timeout_seconds_ends_a_watch_cleanly_on_the_clock(self) -> None:
        clock = Clock()
        kube = await self.serving(clock=clock)
        stream = await self.watch(kube, resourceVersion=kube.resource_version, timeoutSeconds="5")
        clock.advance(4.9)
        kube.add_pod("a", {"app": "vllm"}, "10.0.0.1")
        self.assertEqual((await stream.next())["type"], "ADDED")  # still open
        self.assertEqual(kube.watches, 1)
        clock.advance(0.1)
        self.assertEqual(kube.watches, 0)
        self.assertIsNone(await stream.ended())
        self.assertEqual(kube.requests[-1][1]["timeoutSeconds"], ["5"])

    async def test_a_pod_has_the_fields_of_the_pod_v1_api_a_discovery_reads(self) -> None:
        # https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/
        kube = await self.serving()
        made = kube.add_pod("p", {"app": "vllm"}, "10.0.0.5", ports={"http": 8000, "kv": 5557})
        kube.terminate("p")
        kube.add_pod("pending", {}, "", ready=False)
        _, body = await self.get(kube)
        pod, pending = body["items"]
        metadata = pod["metadata"]
        self.assertEqual(
            (metadata["name"], metadata["namespace"], metadata["labels"]),
            ("p", "default", {"app": "vllm"}),
        )
        self.assertEqual(metadata["uid"], made["metadata"]["uid"])
        self.assertGreater(rv(pod), rv(made))  # terminating is a change of its own
        self.assertRegex(metadata["deletionTimestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        self.assertEqual(metadata["deletionGracePeriodSeconds"], 30)
        self.assertNotIn("deletionTimestamp", made["metadata"])
        self.assertEqual(
            pod["spec"]["containers"][0]["ports"],
            [
                {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                {"name": "kv", "containerPort": 5557, "protocol": "TCP"},
            ],
        )
        status = pod["status"]
        self.assertEqual((status["phase"], status["podIP"]), ("Running", "10.0.0.5"))
        self.assertEqual(status["podIPs"], [{"ip": "10.0.0.5"}])
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        self.assertEqual((conditions["Ready"], conditions["ContainersReady"]), ("True", "True"))
        # Not ready, no IP yet, no ports declared: fields absent, as the API omits them.
        self.assertNotIn("podIP", pending["status"])
        self.assertNotIn("ports", pending["spec"]["containers"][0])
        ready = [c["status"] for c in pending["status"]["conditions"] if c["type"] == "Ready"]
        self.assertEqual(ready, ["False"])
