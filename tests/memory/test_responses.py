"""OpenAI's Responses API: follow-ups to the decode instance that holds a response, refusals."""

from __future__ import annotations

from tests.memory.support import Setup, assert_error


def create(setup: Setup) -> str:
    """A response made through the proxy (what ``responses.create(model, input)`` sends)."""
    answer = setup.post("/v1/responses", {"model": "m", "input": "x"}).answer()
    assert answer.status == 200
    return str(answer.json()["id"])


def test_follow_ups_go_to_the_decode_instance_that_holds_the_response() -> None:
    setup = Setup(decodes=3)
    made = [create(setup) for _ in range(3)]
    for response_id in made:
        again = setup.get(f"/v1/responses/{response_id}").answer()
        assert again.json()["id"] == response_id
    for decode in setup.decodes:  # each asked only for what it made
        asked = [r.path for r in decode.requests if r.role == "other"]
        assert asked == [f"/v1/responses/{i}" for i in decode.responses]


def test_an_unknown_response_is_asked_of_each_decode_then_404() -> None:
    setup = Setup(decodes=2)
    held = create(setup)
    setup.proxy.app.serving.responses = type(setup.proxy.app.serving.responses)()  # a restart
    answer = setup.get(f"/v1/responses/{held}").answer()
    assert answer.status == 200
    assert answer.json()["id"] == held
    missing = setup.proxy.request("POST", "/v1/responses/resp_nope/cancel").answer()
    assert missing.status == 404
    cancels = [r for d in setup.decodes for r in d.requests if r.path.endswith("nope/cancel")]
    assert len(cancels) == 2


def test_what_two_engines_cannot_do_is_a_400_before_any_backend() -> None:
    setup = Setup()
    for body, code in (
        (
            {"model": "m", "input": "x", "previous_response_id": "resp_1"},
            "previous_response_id_unsupported",
        ),
        ({"model": "m", "input": "x", "background": True}, "background_unsupported"),
    ):
        assert_error(setup.post("/v1/responses", body).answer(), 400, code)
    assert setup.prefill.requests == []
