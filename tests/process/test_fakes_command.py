"""``python -m nixl_twisted.testing --prefills N --decodes M``: one process, one ledger."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from nixl_twisted.kv.zmq_reactor import Frames, ZmqSocket
from nixl_twisted.testing.prefix_cache import prompt_tokens
from nixl_twisted.testing.process import WatchedProcess
from tests.process.support import TwistdCase, installed_env

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Every option of the command and the default its help must show.
OPTIONS = {
    "--prefills": "1",
    "--decodes": "1",
    "--prefill-port": "8100",
    "--decode-port": "8200",
    "--interface": "127.0.0.1",
    "--model": "fake-model",
    "--tokens": "23",
    "--token-interval": "0.05",
    "--max-num-seqs": "0",
    "--max-num-queued-reqs": "None",
    "--decode-hold-after": "None",
    "--fault": "[]",
    "--ledger": "None",
    "--kv-events": "False",
    "--bidirectional": "False",
    "--decoder-blocks-ttl": "480.0",
    "--streams-handle": "False",
    "--kv-load-failure-policy": "fail",
    "--kv-recompute-threshold": "0",
}
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


class FakesCommandTests(TwistdCase):
    async def fakes(
        self, prefills: int, decodes: int, *more: str
    ) -> tuple[WatchedProcess, dict[str, str]]:
        """The command on ports the OS picks, once it printed its twistd line; URLs by name."""
        process = self.spawn_fakes(
            "--prefills",
            str(prefills),
            "--decodes",
            str(decodes),
            "--prefill-port",
            "0",
            "--decode-port",
            "0",
            "--tokens",
            "4",
            "--token-interval",
            "0",
            *more,
        )
        await process.line_with(b"twistd -n ")  # printed once every instance listens
        return process, dict(re.findall(r"fake (\S+) listening on (\S+)", process.output.decode()))

    async def stop(self, process: WatchedProcess) -> None:
        """SIGTERM stops the fakes and the process exits 0."""
        os.kill(process.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        self.assertEqual(await process.ended, 0, process.output.decode())

    async def test_completions_whose_legs_cross_pairs_all_succeed(self) -> None:
        """What two one-pair processes (two ledgers) fail as KV-load failures."""
        process, urls = await self.fakes(2, 2)
        self.assertEqual(set(urls), {"prefill-0", "prefill-1", "decode-0", "decode-1"})
        # Decodes listed the other way round: round-robin on both pools sends
        # prefill-0's params to decode-1 and prefill-1's to decode-0.
        self.clock = Clock()
        proxy = self.start_proxy(
            [urls["prefill-0"], urls["prefill-1"]], [urls["decode-1"], urls["decode-0"]]
        )
        access = self.access_events()
        http = self.fresh_connections()

        for _ in range(4):
            response = await http.post(proxy.url + "/v1/completions", json=COMPLETION)
            body = await response.text()
            self.assertEqual(response.code, 200, body)
            self.assertIn("Hello from the fake", body)  # 4 tokens of decode's text

        name = {url: instance for instance, url in urls.items()}
        legs = [(name[event["prefill"]], name[event["decode"]]) for event in access]
        self.assertEqual(legs, [("prefill-0", "decode-1"), ("prefill-1", "decode-0")] * 2)
        await self.stop(process)

    async def test_with_bidirectional_a_decodes_handle_is_read_by_another_processs_prefill(
        self,
    ) -> None:
        directory = tempfile.mkdtemp(prefix="nixl-fake-ledger-")
        self.addCleanup(shutil.rmtree, directory)
        shared = ("--ledger", directory, "--bidirectional", "--decoder-blocks-ttl", "60")
        one, first = await self.fakes(1, 1, *shared)
        other, second = await self.fakes(1, 1, *shared)
        http = self.fresh_connections()

        async def legs(prefill: str, prompt: list[int], params: object) -> Any:
            lowered = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
            answer = await http.post(prefill + "/v1/completions", json=lowered)
            said = json.loads(await answer.text())
            if answer.code != 200:
                return answer.code, said
            leg = {"prompt": prompt, "kv_transfer_params": said["kv_transfer_params"]}
            answer = await http.post(first["decode-0"] + "/v1/completions", json=leg)
            return answer.code, json.loads(await answer.text())

        _, answer = await legs(first["prefill-0"], [5, 6, 7], {"do_remote_decode": True})
        handle = answer["kv_transfer_params"]
        self.assertEqual(handle["remote_num_tokens"], 3 + 4 - 1)
        following = [5, 6, 7, *range(1 << 40, (1 << 40) + 4), 9]  # (what decode held, then more)
        status, _ = await legs(second["prefill-0"], following, handle)
        self.assertEqual(status, 200)
        status, _ = await legs(second["prefill-0"], following, dict(handle, remote_request_id="x"))
        self.assertEqual(status, 500)  # (one no decode issued: vLLM's default policy fails it)
        await self.stop(other)
        await self.stop(one)

    async def test_the_printed_twistd_line_serves_them(self) -> None:
        process, urls = await self.fakes(2, 2)
        line = await process.line_with(b"twistd -n ")
        words = shlex.split(line.decode())
        self.assertEqual(
            words,
            [
                "twistd",
                "-n",
                "--pidfile=",
                "nixlproxy",
                "--listen",
                "tcp:8000",
                "--prefill",
                urls["prefill-0"],
                "--prefill",
                urls["prefill-1"],
                "--decode",
                urls["decode-0"],
                "--decode",
                urls["decode-1"],
            ],
        )
        args = words[words.index("nixlproxy") + 1 :]
        args[args.index("--listen") + 1] = "tcp:0:interface=127.0.0.1"  # not 8000: a free port
        proxy = self.spawn(*args)
        url = f"http://{await proxy.listening}"
        http = self.fresh_connections()

        for _ in range(4):
            response = await http.post(url + "/v1/completions", json=COMPLETION)
            body = await response.text()
            self.assertEqual(response.code, 200, body)

        await self.terminate(proxy)
        await self.stop(process)

    async def test_with_kv_events_each_says_its_ports_and_the_twistd_line_routes_on_them(
        self,
    ) -> None:
        process = self.spawn_fakes(
            *("--prefills", "2", "--prefill-port", "0", "--decode-port", "0"),
            *("--tokens", "4", "--token-interval", "0", "--kv-events"),
        )
        line = await process.line_with(b"twistd -n ")
        said = process.output.decode()
        urls = dict(re.findall(r"fake (\S+) listening on (\S+)", said))
        ports = {
            name: (events, replay)
            for name, events, replay in re.findall(
                r"fake (\S+) kv events on tcp://127\.0\.0\.1:(\d+), "
                r"replay on tcp://127\.0\.0\.1:(\d+)",
                said,
            )
        }
        self.assertEqual(set(ports), set(urls))
        declared = {
            name: f"{urls[name]}#kv-events={events}&kv-replay={replay}"
            for name, (events, replay) in ports.items()
        }
        words = shlex.split(line.decode())
        args = words[words.index("nixlproxy") + 1 :]
        self.assertEqual(
            args,
            [
                *("--listen", "tcp:8000", "--prefill-policy", "kv-aware"),
                *("--prefill", declared["prefill-0"], "--prefill", declared["prefill-1"]),
                *("--decode", declared["decode-0"]),
            ],
        )
        args[1] = "tcp:0:interface=127.0.0.1"
        proxy = self.spawn(*args, "--health-interval", "0")
        url = f"http://{await proxy.listening}"
        prompt = "A prompt long enough for a block of 128 tokens. " * 12
        response = await self.fresh_connections().post(
            url + "/v1/completions", json={"model": "fake-model", "prompt": prompt}
        )
        self.assertEqual(response.code, 200, await response.text())

        # Whichever prefill computed it kept its batch for replays: ask both from 0.
        stored = []
        for name in ("prefill-0", "prefill-1"):
            for payload in await replayed(int(ports[name][1])):
                stored += [e for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
        self.assertEqual(len(stored), 1, stored)
        self.assertEqual(stored[0]["token_ids"], prompt_tokens({"prompt": prompt})[:128])
        await self.terminate(proxy)
        await self.stop(process)

    async def test_model_names_what_every_instance_serves(self) -> None:
        process, urls = await self.fakes(1, 1, "--model", "Qwen/Qwen3-0.6B")
        http = self.fresh_connections()
        for url in urls.values():
            listed = await (await http.get(url + "/v1/models")).json()
            self.assertEqual([card["id"] for card in listed["data"]], ["Qwen/Qwen3-0.6B"])
        await self.stop(process)

    async def test_max_num_queued_reqs_0_refuses_every_generation_as_vllm_does(self) -> None:
        process, urls = await self.fakes(1, 1, "--max-num-seqs", "1", "--max-num-queued-reqs", "0")
        http = self.fresh_connections()
        for url in urls.values():
            response = await http.post(url + "/v1/completions", json=COMPLETION)
            body = await response.json()
            self.assertEqual(response.code, 503, body)
            self.assertEqual(body["error"]["type"], "Service Unavailable")
            self.assertIn("try again later or on a different instance", body["error"]["message"])
        await self.stop(process)

    async def test_a_port_in_use_is_said_and_exits_1(self) -> None:
        first, urls = await self.fakes(1, 1)
        taken = urls["decode-0"].rsplit(":", 1)[1]
        second = self.spawn_fakes("--prefill-port", "0", "--decode-port", taken)
        self.assertEqual(await second.ended, 1, second.output.decode())
        self.assertIn(
            f"fake vLLM could not start: Couldn't listen on 127.0.0.1:{taken}".encode(),
            second.output,
        )
        self.assertNotIn(b"listening on", second.output)
        await self.stop(first)

    async def test_fake_processes_given_one_ledger_serve_one_fleet(self) -> None:
        """Each process's fakes redeem what the other's issued: one fleet, as the proxy
        sees it (without --ledger, every crossing is a KV-load failure)."""
        ledger = tempfile.mkdtemp(prefix="nixl-ledger-")
        self.addCleanup(shutil.rmtree, ledger, True)
        first, ours = await self.fakes(1, 1, "--ledger", ledger)
        second, theirs = await self.fakes(1, 1, "--ledger", ledger)
        alone, apart = await self.fakes(1, 1)  # its own ledger: the control
        self.clock = Clock()
        proxy = self.start_proxy(
            [ours["prefill-0"], theirs["prefill-0"]], [theirs["decode-0"], ours["decode-0"]]
        )
        access = self.access_events()
        http = self.fresh_connections()
        for _ in range(2):
            response = await http.post(proxy.url + "/v1/completions", json=COMPLETION)
            self.assertEqual(response.code, 200, await response.text())
        sides = {
            url: side
            for side, urls in (("ours", ours), ("theirs", theirs))
            for url in urls.values()
        }
        crossed = [(sides[e["prefill"]], sides[e["decode"]]) for e in access]
        self.assertEqual(crossed, [("ours", "theirs"), ("theirs", "ours")])
        leg = {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}
        issued = await (await http.post(ours["prefill-0"] + "/v1/completions", json=leg)).json()
        decode_leg = {**COMPLETION, "kv_transfer_params": issued["kv_transfer_params"]}
        refused = await http.post(apart["decode-0"] + "/v1/completions", json=decode_leg)
        self.assertEqual(refused.code, 500)
        self.assertIn("no prefill issued these", (await refused.json())["error"]["message"])
        for process in (first, second, alone):
            await self.stop(process)

    async def test_a_fault_fails_one_instance_alone(self) -> None:
        process, urls = await self.fakes(1, 2, "--fault", "decode-1=fail-kv")
        self.assertIn(f"listening on {urls['decode-1']} (fault: fail-kv)".encode(), process.output)
        http = self.fresh_connections()
        leg = {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}
        issued = await (await http.post(urls["prefill-0"] + "/v1/completions", json=leg)).json()
        decode_leg = {**COMPLETION, "kv_transfer_params": issued["kv_transfer_params"]}
        failed = await http.post(urls["decode-1"] + "/v1/completions", json=decode_leg)
        self.assertEqual(failed.code, 500)
        self.assertIn("KV load failed", (await failed.json())["error"]["message"])
        served = await http.post(urls["decode-0"] + "/v1/completions", json=decode_leg)
        self.assertEqual(served.code, 200, await served.text())
        await self.stop(process)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--fault", "decode-1=fail-kv"], "--fault decode-1: no such instance here"),
        (["--fault", "decode-0=explode"], "no fault 'explode': one of fail-kv, hang, 500"),
        (["--fault", "decode-0"], "not NAME=FAULT: 'decode-0'"),
    ],
)
def test_a_fault_for_no_instance_or_of_no_kind_is_refused(args: list[str], said: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "nixl_twisted.testing", *args],
        cwd=tempfile.gettempdir(),
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 2 and said in ran.stderr, ran.stderr


def test_help_explains_every_option_and_shows_its_default() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "nixl_twisted.testing", "--help"],
        cwd=tempfile.gettempdir(),
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    listed = ran.stdout.partition("\noptions:\n")[2]
    # One entry per option: its line and the lines its help wraps onto.
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", listed) if entry]
    found = {entry.split()[0].rstrip(","): entry for entry in entries}
    assert set(found) == {"-h", *OPTIONS}, ran.stdout
    for option, default in OPTIONS.items():
        described, _, shown = found[option].rpartition(" (default: ")
        assert shown == f"{default})", found[option]
        # The option, its metavar, then at least two words of help.
        assert len(described.split()) >= 4, f"{option} has no help text: {found[option]!r}"


def test_the_testing_docs_name_every_option() -> None:
    page = (DOCS / "testing.md").read_text(encoding="utf-8")
    assert [option for option in OPTIONS if f"`{option}" not in page] == []


async def replayed(port: int) -> list[bytes]:
    """Every batch a fake's replay endpoint keeps, asked from sequence 0."""
    payloads: list[bytes] = []
    done: Deferred[None] = Deferred()

    def received(frames: Frames) -> None:
        if frames[1] == b"":  # the end marker's empty topic
            done.callback(None)
        else:
            payloads.append(frames[-1])

    dealer = ZmqSocket(reactor, zmq.DEALER, received)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send([b"", (0).to_bytes(8, "big")])
        await done
    finally:
        dealer.close()
    return payloads
