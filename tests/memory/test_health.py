"""Instances that die and come back: passive marks, active checks, retries, 503s."""

from __future__ import annotations

from twisted.internet.defer import gatherResults

from nixl_twisted.backends.health import BACKOFF_BASE
from tests.memory.support import FULL_CHAT, Setup, assert_error


def completion(setup: Setup) -> int:
    return setup.post("/v1/chat/completions", FULL_CHAT).answer().status


# -- instances that die ----------------------------------------------------------


def test_a_dead_decode_is_retried_elsewhere_then_left_out() -> None:
    setup = Setup(decodes=2, unhealthy_threshold=1)
    setup.proxy.stop_serving(setup.decodes[1])
    codes = [completion(setup) for _ in range(4)]
    assert codes == [200] * 4
    # The one attempt on the dead instance was retried on the live one
    # with the same kv_transfer_params; after that it is out of rotation.
    assert len(setup.decodes[0].requests) == 4
    assert len(setup.ledger.redeemed) == 4
    (live, down) = setup.proxy.service.backends.decode.instances
    assert live.healthy
    assert not down.healthy


def test_an_instance_comes_back_when_its_health_checks_pass() -> None:
    setup = Setup(prefills=2, unhealthy_threshold=1)
    dead = setup.prefills[1]
    setup.proxy.stop_serving(dead)
    for _ in range(3):
        assert completion(setup) == 200
    backends = setup.proxy.service.backends
    assert not backends.prefill.instances[1].healthy

    setup.proxy.serve(dead)
    setup.settle(setup.proxy.service.checks.check_health())
    assert not backends.prefill.instances[1].healthy  # two in a row bring it back
    setup.settle(setup.proxy.service.checks.check_health())
    assert backends.prefill.instances[1].healthy
    for _ in range(4):
        assert completion(setup) == 200
    assert len(dead.requests) == 2


def test_the_first_round_runs_at_startup_then_on_the_interval() -> None:
    setup = Setup(health_interval=5)
    fakes = (setup.prefill, setup.decode)
    setup.settle(setup.proxy.service.checks.first_round())
    assert [f.health_checks for f in fakes] == [1, 1]  # before any interval
    checked = gatherResults([f.next_health_check() for f in fakes])
    setup.proxy.advance(5)
    setup.settle(checked)
    assert [f.health_checks for f in fakes] == [2, 2]


def test_a_failing_health_check_takes_an_instance_out() -> None:
    setup = Setup(decodes=2, unhealthy_threshold=1)
    setup.decodes[1].health_status = 503
    backends = setup.proxy.service.backends
    setup.settle(setup.proxy.service.checks.check_health())
    assert [i.healthy for i in backends.decode.instances] == [True, False]
    for _ in range(4):
        assert completion(setup) == 200
    assert setup.decodes[1].requests == []


def test_when_every_decode_is_down_legs_still_go_to_it() -> None:
    setup = Setup(unhealthy_threshold=1)
    setup.decode.health_status = 503
    backends = setup.proxy.service.backends
    setup.settle(setup.proxy.service.checks.check_health())
    assert not backends.decode.instances[0].healthy

    health = setup.get("/healthcheck").answer()
    assert health.status == 503
    report = health.json()
    assert not report["ready"]
    assert (report["prefill_instances"], report["decode_instances"]) == (1, 1)
    assert report["instances"]["decode"][0]["state"] == "down"
    assert "health check failed" in report["instances"]["decode"][0]["last_error"]

    # Panic: its /health says 503, but it may still serve; refusing all would be worse.
    assert completion(setup) == 200
    assert len(setup.decode.requests) == 1
    assert backends.decode.panicking
    assert 'nixlproxy_panic_legs_total{pool="decode"} 1.0' in setup.metrics()


def test_a_dead_pool_in_panic_answers_502_not_a_hang() -> None:
    setup = Setup(unhealthy_threshold=1)
    setup.proxy.stop_serving(setup.decode)
    setup.settle(setup.proxy.service.checks.check_health())
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert_error(answer, 502, "decode_unreachable")
    assert setup.get("/v1/models").answer().status == 502


def test_models_skips_an_unhealthy_decode() -> None:
    setup = Setup(decodes=2, unhealthy_threshold=1)
    setup.decodes[0].health_status = 500
    setup.settle(setup.proxy.service.checks.check_health())
    for _ in range(3):
        assert setup.get("/v1/models").answer().status == 200
    assert setup.decodes[0].health_checks == 1
    assert setup.decodes[1].health_checks == 1


def test_after_its_backoff_a_down_instance_gets_another_try() -> None:
    setup = Setup(decodes=2, unhealthy_threshold=1)
    setup.decodes[1].health_status = 503
    backends = setup.proxy.service.backends
    setup.settle(setup.proxy.service.checks.check_health())
    setup.decodes[1].health_status = 200
    setup.proxy.advance(BACKOFF_BASE)
    for _ in range(2):
        assert completion(setup) == 200
    assert len(setup.decodes[1].requests) == 1
    trial = backends.decode.instances[1]
    assert (trial.healthy, trial.successes) == (False, 1)  # one of the two


# -- retries ---------------------------------------------------------------------


def test_prefill_503_is_retried_on_the_next_instance() -> None:
    setup = Setup(prefills=2)
    setup.prefills[0].crash_next(503, "engine restarting")
    assert completion(setup) == 200
    assert [len(p.requests) for p in setup.prefills] == [1, 1]
    assert len(setup.decode.requests) == 1


def test_prefill_retries_are_bounded() -> None:
    setup = Setup(prefills=3, prefill_retries=1)
    for prefill in setup.prefills:
        prefill.crash_next(502)
    assert_error(setup.post("/v1/chat/completions", FULL_CHAT).answer(), 502, "prefill_failed")
    assert [len(p.requests) for p in setup.prefills] == [1, 1, 0]
    assert setup.decode.requests == []


def test_prefill_4xx_and_plain_500_are_never_retried() -> None:
    setup = Setup(prefills=2)
    setup.prefills[0].refuse_next(400)
    assert completion(setup) == 400
    setup.prefills[1].crash_next(500)
    assert completion(setup) == 502
    assert [len(p.requests) for p in setup.prefills] == [1, 1]
    assert setup.decode.requests == []


def test_decode_error_answers_are_not_retried() -> None:
    setup = Setup(decodes=2)
    setup.decodes[0].crash_next(500, "KV load failed")
    assert completion(setup) == 500
    assert [len(d.requests) for d in setup.decodes] == [1, 0]
    # One request's KV-load failure does not take the instance away.
    assert setup.proxy.service.backends.decode.instances[0].healthy


# -- readiness at startup --------------------------------------------------------


def readiness(setup: Setup) -> tuple[int, bool]:
    answer = setup.get("/healthcheck").answer()
    return answer.status, answer.json()["ready"]


def test_with_every_backend_dead_it_is_never_ready_and_never_flaps() -> None:
    setup = Setup(health_interval=5, start=False)
    for fake in (setup.prefill, setup.decode):
        setup.proxy.stop_serving(fake)
    # Before the first round has answered: not known to be up, so not ready.
    assert readiness(setup) == (503, False)
    setup.proxy.start()
    setup.settle(setup.proxy.service.checks.first_round())
    seen = []
    for _ in range(12):  # a minute of rounds, each settled: down, backoffs past
        seen.append(readiness(setup))
        setup.proxy.advance(5)
        setup.settle(setup.proxy.service.checks.check_health())
    assert set(seen) == {(503, False)}


def test_ready_once_the_first_round_answers() -> None:
    setup = Setup(health_interval=5)
    setup.settle(setup.proxy.service.checks.first_round())
    assert readiness(setup) == (200, True)
