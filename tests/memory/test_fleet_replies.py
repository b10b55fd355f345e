"""``--replicas-redis`` reads each value Redis answers before using it: a reply that does not
parse is Redis not answering (the replica goes on alone), never a request left hanging or a
slot held for nobody. Redis here is a stand-in whose replies the test writes."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet import queue_scripts, scripts
from nixl_twisted.fleet.replicas import Replicas
from tests.memory.support import CHAT, Setup

REDIS = "redis://127.0.0.1:1/0"


class ScriptedLink:
    """In place of the connection to Redis: each script asked waits for the test's reply."""

    open = True

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[Any], Deferred[Any]]] = []

    def eval(self, script: str, keys: list[str], args: list[Any]) -> Deferred[Any]:
        asked: Deferred[Any] = Deferred()
        self.asked.append((script, args, asked))
        return asked

    def answer(self, script: str, reply: object) -> list[Any]:
        """Reply to the oldest call of ``script`` not answered yet; its arguments."""
        for each, args, asked in self.asked:
            if each == script and not asked.called:
                asked.callback(reply)
                return args
        raise AssertionError(f"no call of that script waits (asked: {len(self.asked)})")


def shared(setup: Setup) -> tuple[Replicas, ScriptedLink]:
    """The proxy's replica, shared through a Redis the test speaks for."""
    replicas = setup.proxy.service.getServiceNamed("replicas")
    assert isinstance(replicas, Replicas)
    link = ScriptedLink()
    replicas.link = link  # type: ignore[assignment]
    replicas.beat()
    link.asked[0][2].callback([0, 0, [replicas.id, "{}"], [], 0, [], 0])  # (new: written back)
    link.answer(scripts.RESTORE, [[], 0])
    assert replicas.is_shared
    return replicas, link


def test_a_placement_whose_answer_holds_no_number_is_served_alone_its_slots_given_back() -> None:
    setup = Setup(decode_max_in_flight=1, replicas_redis=REDIS)
    replicas, link = shared(setup)
    decode = setup.proxy.service.backends.decode.instances[0]
    prefill = setup.proxy.service.backends.prefill.instances[0]
    client = setup.post("/v1/chat/completions", CHAT)
    # (its prefill slot, taken here while Redis is asked; its decode slot comes after)
    assert (prefill.in_flight, decode.in_flight) == (1, 0)
    slots = [f"decode|{decode.url}", "many"]  # a count someone else wrote
    link.answer(queue_scripts.PLACE, [queue_scripts.GRANTED, "", slots, 0, [], 7])
    setup.proxy.flush()
    assert client.answer().status == 200  # served alone, at its share of the cap
    assert (prefill.in_flight, decode.in_flight) == (0, 0)
    assert not replicas.is_shared
    fallbacks = replicas.metrics.fallbacks.labels(reason="wrong_reply")._value.get()
    assert fallbacks == 1


def test_a_placement_answer_of_another_shape_is_served_alone() -> None:
    setup = Setup(decode_max_in_flight=1, replicas_redis=REDIS)
    replicas, link = shared(setup)
    decode = setup.proxy.service.backends.decode.instances[0]
    client = setup.post("/v1/chat/completions", CHAT)
    link.answer(queue_scripts.PLACE, [queue_scripts.QUEUED, "no place", [], "x", ["soon"], 7])
    setup.proxy.flush()
    assert client.answer().status == 200
    assert (decode.in_flight, replicas.is_shared) == (0, False)


def test_a_model_only_a_client_named_waits_in_the_queue_of_those_that_name_none() -> None:
    setup = Setup(decodes=2, decode_max_in_flight=1, replicas_redis=REDIS)
    _, link = shared(setup)
    said, _ = setup.proxy.service.backends.decode.instances
    said.models = {"m": {"id": "m"}}  # (the other has not said what it serves)
    setup.post("/v1/chat/completions", dict(CHAT, model="chosen-by-the-client"))
    setup.post("/v1/chat/completions", CHAT)
    placed = [args[2] for script, args, _ in link.asked if script == queue_scripts.PLACE]
    assert placed == ["", "m"]  # (its name is no key in Redis; a served model's is)


def test_a_request_after_the_replicas_stopped_waits_alone_and_is_served_once() -> None:
    """Stopping, the replica tells each part it is alone: a request that comes after waits
    in this replica's own queue (its ``entered`` told), no ``PLACE`` sent, served once."""
    setup = Setup(decode_max_in_flight=1, replicas_redis=REDIS)
    setup.proxy.service.getServiceNamed("replicas").startService()  # (to be stopped)
    replicas, link = shared(setup)
    replicas.stopService()
    asked = len(link.asked)
    held = setup.held_stream()
    slots = setup.proxy.app.serving.legs.slots
    assert slots is not None
    waits = slots.entered()
    client = setup.post("/v1/chat/completions", CHAT)
    assert waits.called
    setup.decode.release()
    setup.proxy.flush()
    assert (held.answer().status, client.answer().status) == (200, 200)
    assert len(setup.decode.requests_for("decode")) == 2
    assert queue_scripts.PLACE not in [script for script, _, _ in link.asked[asked:]]
