"""A whole proxy in memory, past its caps: /metrics says each pool's saturation as the
queue and the legs make it, and counts a refusal against the pool that was full."""

from __future__ import annotations

from typing import Any

from nixl_twisted.protocol import routes
from tests.memory.support import CHAT, Setup, assert_error


def capped(**settings: Any) -> Setup:
    """One prefill and one decode instance, two may wait 5 s."""
    return Setup(**{"queue_size": 2, "queue_timeout": 5, **settings})


def pools(setup: Setup, name: str) -> dict[str, float]:
    """One ``nixlproxy_pool_*`` metric, by pool (one model: the fakes' ``fake-model``)."""
    return {
        dict(labels)["pool"]: value
        for (said, labels), value in setup.scrape().items()
        if said == name
    }


def test_requests_waiting_for_decode_raise_its_saturation_and_its_refusals() -> None:
    setup = capped(decode_max_in_flight=1, prefill_max_in_flight=1)
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    ready = setup.post(routes.CHAT_COMPLETIONS, CHAT)  # prefilled ahead, ready for decode
    setup.proxy.flush()
    waiting = [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(2)]
    setup.proxy.flush()
    # One decode slot taken, three waiting for it (one prefilled, two held back by how far
    # prefill may run ahead); prefill answered: its slot is free.
    assert pools(setup, "nixlproxy_pool_saturation") == {"decode": 4.0, "prefill": 0.0}
    assert_error(setup.post(routes.CHAT_COMPLETIONS, CHAT).answer(), 503, "queue_full")
    setup.proxy.advance(5)
    for client in waiting:
        assert_error(client.answer(), 503, "queue_timeout")
    assert pools(setup, "nixlproxy_pool_refused_total") == {"decode": 3.0}
    assert pools(setup, "nixlproxy_pool_saturation") == {"decode": 2.0, "prefill": 0.0}
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().status == ready.answer().status == 200
    assert pools(setup, "nixlproxy_pool_saturation") == {"decode": 0.0, "prefill": 0.0}


def test_requests_waiting_for_prefill_count_there_and_hold_no_decode_slot() -> None:
    setup = capped(decode_max_in_flight=2, prefill_max_in_flight=1)
    setup.prefill.hold_answers()
    clients = [setup.post(routes.CHAT_COMPLETIONS, CHAT)]
    setup.proxy.flush()
    clients += [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(2)]
    setup.proxy.flush()
    assert pools(setup, "nixlproxy_pool_queued") == {"decode": 0.0, "prefill": 2.0}
    # (none holds a decode slot while prefill runs, the first included)
    assert pools(setup, "nixlproxy_pool_saturation") == {"decode": 0.0, "prefill": 3.0}
    assert_error(setup.post(routes.CHAT_COMPLETIONS, CHAT).answer(), 503, "queue_full")
    assert pools(setup, "nixlproxy_pool_refused_total") == {"prefill": 1.0}
    for _ in clients:  # (each prefill answered in turn lets the next one go)
        setup.prefill.release()
        setup.proxy.flush()
    assert [client.answer().status for client in clients] == [200, 200, 200]
