"""``--workers 2`` acts as one proxy: metrics, admin changes, health and logs agree; a killed
supervisor's metrics directory goes at the next start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from treq.client import HTTPClient

from nixl_twisted.run.workers import METRICS_PREFIX, remove_stale_metrics
from tests.process.support import TwistdCase
from tests.support import CHAT, Arrivals, real_redis

ADMIN: dict[bytes | str, bytes | str] = {"Authorization": "Bearer t"}


def chat_requests(exposition: bytes) -> float:
    total = 0.0
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "nixlproxy_requests_total" and (
                labels["route"],
                labels["status"],
            ) == ("/v1/chat/completions", "200"):
                total += sample.value  # (whatever the model: health checks read the fake's)
    return total


async def chats(
    http: HTTPClient,
    address: str,
    times: int,
    headers: dict[bytes | str, bytes | str] | None = None,
) -> tuple[list[int], set[int]]:
    """``times`` chat requests (with ``headers``), each followed by a health check on a
    new connection: the chats' status codes, and the pids of the workers that answered
    the checks."""
    codes, pids = [], set()
    url = f"http://{address}/v1/chat/completions"
    for _ in range(times):
        response = await http.post(url, json=CHAT, headers=headers)
        codes.append(response.code)
        await response.content()
        health = await http.get(f"http://{address}/healthcheck")
        pids.add(json.loads(await health.content())["pid"])
    return codes, pids


def test_a_killed_supervisors_metrics_directory_goes_at_the_next_start(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f"{METRICS_PREFIX}{gone.stdout.strip()}-abcd"
    live = tmp_path / f"{METRICS_PREFIX}{os.getpid()}-efgh"
    other = tmp_path / "nixlproxy-metrics-notapid"
    for directory in (stale, live, other):
        directory.mkdir()
    remove_stale_metrics(str(tmp_path))
    assert (stale.exists(), live.exists(), other.exists()) == (False, True, True)


class WorkersActAsOneTests(TwistdCase):
    async def test_metrics_report_the_whole_proxy_on_either_port(self) -> None:
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--metrics-listen",
            "tcp:0:interface=127.0.0.1",
        )
        (metrics_address,) = re.findall(rb"workers share (\S+)", process.output)[1:]
        http = self.fresh_connections()
        codes, pids = await chats(http, address, 20)
        self.assertEqual((set(codes), len(pids)), ({200}, 2))  # both workers served

        counts = []
        for _ in range(10):
            scrape = await http.get(f"http://{metrics_address.decode()}/metrics")
            counts.append(chat_requests(await scrape.content()))
        self.assertEqual(counts, [20.0] * 10)  # summed over workers, every scrape
        self.assertIn(b"[worker 0 ", process.output)
        self.assertIn(b"[worker 1 ", process.output)
        await self.terminate(process)

    async def test_an_admin_change_reaches_every_worker_before_its_answer(self) -> None:
        await self.start(decodes=2)
        old, new = self.decodes
        process, address = await self.spawn_workers(
            "--prefill", self.prefill.url, "--decode", old.url, "--admin-token", "t"
        )
        url = f"http://{address}"
        http = self.fresh_connections()
        added = await http.post(
            url + "/admin/backends", json={"pool": "decode", "url": new.url}, headers=ADMIN
        )
        self.assertEqual(added.code, 201)
        await added.content()
        removed = await http.delete(
            url + "/admin/backends", json={"pool": "decode", "url": old.url}, headers=ADMIN
        )
        self.assertEqual(removed.code, 200)
        await removed.content()

        codes, pids = await chats(http, address, 50)
        self.assertEqual((set(codes), len(pids)), ({200}, 2))
        self.assertEqual((len(old.requests), len(new.requests)), (0, 50))
        await self.terminate(process)

    async def test_healthcheck_says_the_same_whichever_worker_answers(self) -> None:
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--health-interval",
            "0.2",
            "--unhealthy-threshold",
            "1",
        )
        http = self.fresh_connections()

        async def readiness(times: int = 20) -> tuple[set[Any], set[int]]:
            seen, pids = set(), set()
            for _ in range(times):
                response = await http.get(f"http://{address}/healthcheck")
                report = json.loads(await response.content())
                seen.add((response.code, report["ready"]))
                pids.add(report["pid"])
            return seen, pids

        await process.said(b"is up (from the supervisor)", times=4)  # both pools, both workers
        seen, pids = await readiness()
        self.assertEqual((seen, len(pids)), ({(200, True)}, 2))
        await self.decode.stop()
        await process.said(b"is down (from the supervisor)", times=2)
        seen, pids = await readiness()
        self.assertEqual((seen, len(pids)), ({(503, False)}, 2))
        await self.terminate(process)

    async def test_an_admin_endpoint_is_shared_by_the_workers(self) -> None:
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--admin-listen",
            "tcp:0:interface=127.0.0.1",
        )
        (admin,) = re.findall(rb"workers share (\S+)", process.output)[1:]
        http = self.fresh_connections()
        pids, said = set(), set()
        # The kernel hands each new connection to a worker by a hash of its ports: both
        # answer within a few, and 200 all to one would be a chance of 2**-199.
        for _ in range(200):
            full = json.loads(
                await (await http.get(f"http://{admin.decode()}/healthcheck")).content()
            )
            pids.add(full["pid"])
            short = await (await http.get(f"http://{address}/healthcheck")).content()
            said.add(short)
            if len(pids) == 2 and len(said) >= 1:
                break
        self.assertEqual(len(pids), 2)  # both workers serve the admin endpoint
        self.assertEqual(said, {b'{"ready": true}'})
        await self.terminate(process)


class SharedLimitsAcrossWorkersTests(TwistdCase):
    async def test_workers_hold_a_tenant_to_one_limit_through_redis(self) -> None:
        redis = await real_redis(self)
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--tenant-header",
            "x-team",
            "--tenant-requests-per-minute",
            "10",
            "--limits-redis",
            redis.url,
        )
        http = self.fresh_connections()
        codes, pids = await chats(http, address, 20, headers={"x-team": "a"})
        self.assertEqual(len(pids), 2)  # both workers served
        self.assertEqual(sorted(codes), [200] * 10 + [429] * 10)  # one limit, not one each
        await self.terminate(process)


class WorkersShareCapsTests(TwistdCase):
    async def test_the_workers_hold_an_instance_to_its_cap_together(self) -> None:
        await self.start()
        self.decode.hold_answers()
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--decode-max-in-flight",
            "2",
            "--queue-size",
            "0",  # (past the slots, refused at once: each request's fate is seen)
        )
        http = self.fresh_connections()
        # Each of the two workers takes one of the cap's two slots, whatever it is sent.
        scrape = await http.get(f"http://{address}/metrics")
        shares = [
            sample.value
            for family in text_string_to_metric_families((await scrape.content()).decode())
            for sample in family.samples
            if sample.name == "nixlproxy_backend_max_in_flight"
            and sample.labels["pool"] == "decode"
        ]
        self.assertEqual(shares, [1.0])
        # Eight requests at once: each is held at decode, or refused (503 queue_full).
        seen = Arrivals()

        def held(_: object = None) -> None:
            seen.put("held")
            self.decode.stream_held().addCallback(held)

        self.decode.stream_held().addCallback(held)
        url = f"http://{address}/v1/chat/completions"
        sent = [http.post(url, json=CHAT) for _ in range(8)]
        answers: list[Any] = []  # (treq's responses)

        def answered(response: Any) -> Any:
            answers.append(response)
            seen.put("answered")
            return response

        for posted in sent:
            posted.addCallback(answered)
        fates = [await seen.next() for _ in range(8)]
        self.assertIn(fates.count("held"), (1, 2))  # (2 when both workers were sent one)
        self.assertEqual(self.decode.running, fates.count("held"))
        refused = list(answers)
        self.assertEqual({response.code for response in refused}, {503})
        for response in refused:
            self.assertIn(b'"queue_full"', await response.content())
        self.decode.release()
        for posted in sent:  # (each fired: its response is the list's)
            await posted
        served = [response for response in answers if response not in refused]
        self.assertEqual([response.code for response in served], [200] * fates.count("held"))
        for response in served:
            await response.content()
        await self.terminate(process)
