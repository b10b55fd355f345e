"""Several models behind one proxy: each request to instances that serve its ``model``."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import formatEvent

from nixl_twisted.backends.instances import Instance
from nixl_twisted.protocol import routes
from nixl_twisted.testing import FakeVLLM
from tests.memory.support import Setup


def chat(model: str | None, content: str = "hi") -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return body


def legs(fake: FakeVLLM) -> int:
    """The legs a fake served (its health checks and ``/v1/models`` reads aside)."""
    return sum(1 for request in fake.requests if request.method == "POST")


def two_models(**settings: Any) -> Setup:
    """Two models, each its own prefill and decode instance, as ``[models.NAME]`` lists them."""
    table = {
        "llama": {"prefill": ["http://prefill-0.memory"], "decode": ["http://decode-0.memory"]},
        "qwen": {"prefill": ["http://prefill-1.memory"], "decode": ["http://decode-1.memory"]},
    }
    return Setup(prefills=2, decodes=2, prefill=[], decode=[], models=table, **settings)


def test_two_models_are_routed_to_their_own_pools() -> None:
    setup = two_models()
    for model in ("llama", "qwen", "llama", "qwen", "llama"):
        assert setup.post(routes.CHAT_COMPLETIONS, chat(model)).answer().status == 200
    assert [legs(f) for f in setup.prefills] == [3, 2]
    assert [legs(f) for f in setup.decodes] == [3, 2]
    models = setup.get(routes.MODELS).answer()
    assert [card["id"] for card in models.json()["data"]] == ["llama", "qwen"]
    assert [legs(f) for f in setup.decodes] == [3, 2]  # (answered by the proxy itself)


def test_an_unknown_model_is_404_in_the_routes_shape_and_none_is_sent() -> None:
    setup = two_models()
    answer = setup.post(routes.CHAT_COMPLETIONS, chat("mistral")).answer()
    assert answer.status == 404
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")
    assert error["message"] == "The model `mistral` does not exist."
    messages = {"model": "mistral", "max_tokens": 2, "messages": chat(None)["messages"]}
    anthropic = setup.post(routes.MESSAGES, messages).answer()
    assert anthropic.status == 404
    assert anthropic.json()["error"]["type"] == "not_found_error"
    assert anthropic.json()["type"] == "error"
    assert sum(legs(f) for f in [*setup.prefills, *setup.decodes]) == 0


def test_no_model_is_400_while_several_are_served() -> None:
    setup = two_models()
    answer = setup.post(routes.CHAT_COMPLETIONS, chat(None)).answer()
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["code"] == "model_required"
    assert "llama, qwen" in error["message"]


def test_the_health_loop_learns_what_each_instance_serves_lora_adapters_included() -> None:
    setup = Setup(prefills=2, decodes=3, health_interval=5, start=False)
    for fake, model in zip([*setup.prefills, *setup.decodes], ["llama", "qwen"] * 3, strict=False):
        fake.model = model
    setup.decodes[2].model = "llama"
    setup.decodes[2].adapters = ("sql-lora",)
    setup.prefills[0].adapters = ("sql-lora",)
    setup.proxy.start()
    setup.settle(setup.proxy.service.checks.first_round())

    listed = setup.get(routes.MODELS).answer().json()["data"]
    assert [card["id"] for card in listed] == ["llama", "qwen", "sql-lora"]
    assert listed[2]["parent"] == "llama"
    # decode-0 and decode-2 serve llama; only decode-2 its adapter; decode-1 qwen.
    for _ in range(4):
        assert setup.post(routes.CHAT_COMPLETIONS, chat("llama")).answer().status == 200
    assert setup.post(routes.CHAT_COMPLETIONS, chat("sql-lora")).answer().status == 200
    assert setup.post(routes.CHAT_COMPLETIONS, chat("qwen")).answer().status == 200
    assert [legs(f) for f in setup.decodes] == [2, 1, 3]
    assert [legs(f) for f in setup.prefills] == [5, 1]
    assert all(f.model_reads == 1 for f in [*setup.prefills, *setup.decodes])  # (one round)
    assert setup.post(routes.CHAT_COMPLETIONS, chat("mistral")).answer().status == 404

    # tokenize goes to an instance of the model it names, too.
    said = setup.post(routes.TOKENIZE, {"model": "qwen", "prompt": "hi"}).answer()
    assert said.status == 200
    assert [r.path for r in setup.decodes[1].requests if r.method == "POST"][-1] == "/tokenize"


def test_an_instance_listed_under_a_model_it_does_not_serve_takes_none_of_its_requests(
    logged: list[dict[str, Any]],
) -> None:
    setup = two_models(health_interval=5, start=False)
    for fake, model in zip([*setup.prefills, *setup.decodes], ["llama", "qwen"] * 2, strict=True):
        fake.model = model
    setup.decodes[1].model = "mistral"  # (listed under qwen: a wrong URL in the table)
    setup.proxy.start()
    setup.settle(setup.proxy.service.checks.first_round())

    answer = setup.post(routes.CHAT_COMPLETIONS, chat("qwen")).answer()
    assert answer.status == 404  # (vLLM would have refused it: not sent)
    assert answer.json()["error"]["code"] == "model_not_found"
    assert setup.post(routes.CHAT_COMPLETIONS, chat("llama")).answer().status == 200
    assert [legs(f) for f in setup.decodes] == [1, 0]
    listed = setup.get(routes.MODELS).answer().json()["data"]
    assert [card["id"] for card in listed] == ["llama", "mistral"]  # (what they said)
    decodes = setup.get("/healthcheck").answer().json()["instances"]["decode"]
    assert [(d["models"], d["not_serving"]) for d in decodes] == [
        (["llama"], []),
        (["mistral"], ["qwen"]),
    ]
    (warned,) = [formatEvent(e) for e in logged if "is listed under" in e.get("log_format", "")]
    assert warned == (
        "http://decode-1.memory is listed under [models.qwen] but serves mistral: "
        "it takes no qwen requests"
    )


def test_a_list_said_again_is_no_change_though_vllm_dates_each_answer(
    logged: list[dict[str, Any]],
) -> None:
    """vLLM's cards say ``created``: now. Only a change of models is logged and told."""
    setup = Setup(health_interval=5, start=False)
    setup.decode.adapters = ("sql-lora",)
    setup.proxy.start()
    backends = setup.proxy.service.backends
    setup.settle(setup.proxy.service.checks.first_round())
    told: list[Instance] = []
    backends.decode.on_change = told.append
    setup.settle(setup.proxy.service.checks.check_health())
    setup.decode.adapters = ("sql-lora", "chat-lora")
    setup.settle(setup.proxy.service.checks.check_health())
    serves = [e["models"] for e in logged if e.get("log_format") == "{url} serves {models}"]
    assert serves == ["fake-model, sql-lora", "fake-model, sql-lora, chat-lora"]
    assert told == [backends.decode.instances[0]]  # (the workers hear of the change alone)
    assert setup.decode.model_reads == 3


def test_an_adapter_without_a_prefill_instance_is_a_503_naming_the_model() -> None:
    setup = Setup(health_interval=5, start=False)
    setup.decode.adapters = ("sql-lora",)
    setup.proxy.start()
    setup.settle(setup.proxy.service.checks.first_round())
    answer = setup.post(routes.CHAT_COMPLETIONS, chat("sql-lora")).answer()
    assert answer.status == 503
    assert "no healthy prefill instance serving 'sql-lora'" in answer.json()["error"]["message"]


def test_a_models_own_rules_and_policies_apply_to_its_requests_only() -> None:
    table = {
        "llama": {"prefill": ["http://prefill-0.memory"], "decode": ["http://decode-0.memory"]},
        "qwen": {
            "prefill": ["http://prefill-1.memory"],
            "decode": ["http://decode-1.memory", "http://decode-2.memory"],
            "decode-only-below": 10_000,
            "decode-policy": "session",
        },
    }
    setup = Setup(prefills=2, decodes=3, prefill=[], decode=[], models=table)
    for _ in range(3):
        sent = dict(chat("qwen"), user="alice")
        assert setup.post(routes.CHAT_COMPLETIONS, sent).answer().status == 200
    assert setup.post(routes.CHAT_COMPLETIONS, chat("llama")).answer().status == 200
    assert [legs(f) for f in setup.prefills] == [1, 0]  # qwen's short prompts: decode only
    assert sorted(legs(f) for f in setup.decodes[1:]) == [0, 3]  # one session, one instance
    m = setup.scrape()
    decided = ("nixlproxy_routing_decisions_total", "decode", "session")
    assert sum(v for (name, labels), v in m.items() if (name, *_pool_policy(labels)) == decided)
    assert (
        m[
            (
                "nixlproxy_requests_total",
                _labels(route="/v1/chat/completions", status="200", model="qwen"),
            )
        ]
        == 3
    )
    assert (
        m[
            (
                "nixlproxy_requests_total",
                _labels(route="/v1/chat/completions", status="200", model="llama"),
            )
        ]
        == 1
    )


def _pool_policy(labels: tuple[tuple[str, str], ...]) -> tuple[str | None, str | None]:
    found = dict(labels)
    return found.get("pool"), found.get("policy")


def _labels(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_with_nothing_read_every_model_goes_where_it_did() -> None:
    """Health checks off: no instance has said what it serves; nothing is refused."""
    setup = Setup(decodes=2)
    for model in ("anything", "else"):
        assert setup.post(routes.CHAT_COMPLETIONS, chat(model)).answer().status == 200
    assert setup.post(routes.CHAT_COMPLETIONS, chat(None)).answer().status == 200
    setup.get(routes.MODELS).answer()
    assert sum(1 for f in setup.decodes for r in f.requests if r.path == "/v1/models") == 1


def test_with_no_healthy_decode_the_listing_is_relayed_not_refused_for_its_model() -> None:
    """Several models named, every decode instance down: GET /v1/models asks one anyway."""
    setup = two_models(health_interval=5, unhealthy_threshold=1, start=False)
    for fake in setup.decodes:
        fake.health_status = 503
    setup.proxy.start()
    setup.settle(setup.proxy.service.checks.first_round())
    answer = setup.get(routes.MODELS).answer()
    assert answer.status == 200  # (in panic, relayed; not a 400 model_required)
    assert answer.json()["data"][0]["id"] == "fake-model"


def test_a_stalled_model_list_keeps_the_instance_up_and_its_last_list() -> None:
    setup = Setup(health_interval=5, health_timeout=1, start=False)
    setup.proxy.start()
    backends = setup.proxy.service.backends
    setup.settle(setup.proxy.service.checks.first_round())
    (decode,) = backends.decode.instances
    assert decode.models is not None and list(decode.models) == ["fake-model"]
    setup.decode.models_stalled = True
    checked = setup.proxy.service.checks.check_health()
    setup.proxy.advance(1)  # (the read's own timeout; /health answered at once)
    setup.settle(checked)
    assert decode.healthy and decode.failures == 0
    assert list(decode.models) == ["fake-model"]
    assert setup.post(routes.CHAT_COMPLETIONS, chat("fake-model")).answer().status == 200


def test_a_table_member_the_admin_api_adds_back_serves_its_model_again() -> None:
    setup = two_models(admin_token="t")
    headers = {"Authorization": "Bearer t"}
    member = {"pool": "decode", "url": "http://decode-1.memory"}
    raw = json.dumps(member).encode()
    assert setup.proxy.request("DELETE", "/admin/backends", raw, headers).answer().status == 200
    assert setup.proxy.request("POST", "/admin/backends", raw, headers).answer().status == 201
    back = setup.proxy.service.backends.decode.find("http://decode-1.memory")
    assert back is not None and back.named == {"qwen"}
    assert setup.post(routes.CHAT_COMPLETIONS, chat("llama")).answer().status == 200
    assert legs(setup.decodes[1]) == 0  # (llama's legs stay on llama's instance)
