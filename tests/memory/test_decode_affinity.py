"""Decode affinity for conversations: ``--decode-policy cache-aware`` already keeps one.

Issue 37 asked that a conversation's turns go to the decode instance that
served it while that instance has room (its prefix cache may still hold the
conversation's KV). The decode pool's ``cache-aware`` does this with the same
conversation key as prefill's: nothing new was built; this shows it.
"""

from __future__ import annotations

from typing import Any

from tests.memory.support import Setup


def _turns(topic: str, count: int) -> list[dict[str, Any]]:
    """The bodies of one conversation's ``count`` turns, each repeating the history."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"You answer questions about {topic}. " * 8}
    ]
    bodies = []
    for turn in range(count):
        messages = [*messages, {"role": "user", "content": f"question {turn} on {topic}"}]
        bodies.append({"model": "fake-model", "messages": messages})
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}]
    return bodies


def _decode_of(setup: Setup, body: dict[str, Any]) -> int:
    """The index of the decode instance that served ``body`` (answered 200)."""
    counts = [len(d.requests) for d in setup.decodes]
    assert setup.post("/v1/chat/completions", body).answer().status == 200
    (index,) = [i for i, d in enumerate(setup.decodes) if len(d.requests) > counts[i]]
    return index


def test_each_conversations_turns_stay_on_one_decode_instance() -> None:
    setup = Setup(decodes=3, decode_policy="cache-aware")
    # (Five, not a multiple of three: round-robin would look sticky.)
    topics = [f"topic-{n}" for n in range(5)]
    served: dict[str, set[str]] = {}
    for turn in range(3):
        for topic in topics:
            index = _decode_of(setup, _turns(topic, 3)[turn])
            served.setdefault(topic, set()).add(setup.decodes[index].name)
    assert all(len(names) == 1 for names in served.values()), served
    assert len(set().union(*served.values())) > 1  # (and conversations spread)


def test_a_turn_moves_on_when_its_instance_has_no_room_and_stays_where_it_went() -> None:
    setup = Setup(decodes=2, decode_policy="cache-aware", decode_max_in_flight=1)
    turns = _turns("capped", 4)

    home = _decode_of(setup, turns[0])
    # The next turn streams, held, on its instance: that one is now at its cap ...
    held = setup.held_stream(setup.decodes[home], body=dict(turns[1], stream=True))
    assert len(setup.decodes[home].requests) == 2
    # ... so the turn after goes to the instance with room, at once (no wait) ...
    away = _decode_of(setup, turns[2])
    assert away != home
    setup.decodes[home].release()
    setup.proxy.flush()
    assert held.answer().complete
    # ... and the conversation stays there: its newest KV is there now.
    assert _decode_of(setup, turns[3]) == away
