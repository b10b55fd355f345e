"""Data-parallel ranks: URL#dp=N is N instances, each leg to one carries its rank header."""

from __future__ import annotations

from nixl_twisted.testing import FakeVLLM
from tests.memory.support import FULL_CHAT, Setup


def ranks(fake: FakeVLLM, role: str) -> list[str]:
    return [
        r.headers.getRawHeaders(b"x-data-parallel-rank", [b""])[0].decode()
        for r in fake.requests_for(role)
    ]


def test_each_rank_is_an_instance_and_each_leg_names_its_rank() -> None:
    # A fake's in-memory URL is http://{name}.memory.
    setup = Setup(prefill=["http://prefill-0.memory#dp=2"], decode=["http://decode-0.memory#dp=3"])
    decode = setup.decode.url
    backends = setup.proxy.service.backends
    assert backends.decode.urls == tuple(f"{decode}#rank={r}" for r in range(3))
    for _ in range(6):
        assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200

    assert ranks(setup.prefill, "prefill") == ["0", "1"] * 3
    assert ranks(setup.decode, "decode") == ["0", "1", "2"] * 2
    # Each rank has its own health, metrics and place in /healthcheck.
    health = setup.get("/healthcheck").answer().json()
    assert [i["rank"] for i in health["instances"]["decode"]] == [0, 1, 2]
    metrics = setup.metrics()
    assert f'instance="{decode}#rank=2",outcome="answered",pool="decode"}} 2.0' in metrics


def test_a_client_never_chooses_the_rank() -> None:
    setup = Setup(decode=["http://decode-0.memory#dp=2"])
    for _ in range(2):
        answer = setup.post(
            "/v1/chat/completions", FULL_CHAT, {"X-data-parallel-rank": "7"}
        ).answer()
        assert answer.status == 200
    sent = [r.headers.getRawHeaders(b"x-data-parallel-rank") for r in setup.prefill.requests]
    assert sent == [None, None]  # no #dp: no rank at all
    sent = [r.headers.getRawHeaders(b"x-data-parallel-rank") for r in setup.decode.requests]
    assert sent == [[b"0"], [b"1"]]  # the proxy's, once


def test_the_admin_api_adds_and_drains_all_ranks_at_once() -> None:
    setup = Setup(admin_token="t")
    admin = {"Authorization": "Bearer t"}
    url = setup.new_fake("decode-1").url + "#dp=2"
    answer = setup.post("/admin/backends", {"pool": "decode", "url": url}, admin).answer()
    assert answer.status == 201
    assert [i["rank"] for i in answer.json()["instances"]] == [0, 1]
    answer = setup.post("/admin/backends/drain", {"pool": "decode", "url": url}, admin).answer()
    assert (answer.status, len(answer.json()["instances"])) == (202, 2)
    assert setup.proxy.service.backends.decode.urls == (setup.decode.url,)
