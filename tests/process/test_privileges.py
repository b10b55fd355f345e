"""``twistd --uid/--gid nixlproxy``: a port below 1024 bound as root, then served as nobody.

After twistd sheds privileges the new user may not read Python's library
(here it lives in root's home); whatever the proxy imported only when first
serving would then fail (``nixl_twisted.run.startup.preload`` imports it first).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nixl_twisted.testing import TwistdProtocol
from nixl_twisted.testing.process import TwistdFailed
from tests.process.support import TwistdCase, installed_env
from tests.support import CHAT, sse_events

#: ``nobody`` on Linux; numeric, so no passwd entry is looked up to shed privileges.
NOBODY = "65534"


def free_privileged_port() -> int:
    """A port below 1024 that nothing has bound at 127.0.0.1 (only root may bind one)."""
    for port in range(1023, 0, -1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("every port below 1024 at 127.0.0.1 is taken")


class ShedPrivilegesTests(TwistdCase):
    if os.geteuid() != 0:
        skip = "twistd --uid/--gid needs root to bind a port below 1024 and to change user"

    async def test_a_privileged_port_then_completions_and_streams_as_nobody(self) -> None:
        await self.start(tokens=3)
        port = free_privileged_port()
        process = self.spawn(
            "--listen",
            f"tcp:{port}:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            twistd_args=["--uid", NOBODY, "--gid", NOBODY],
        )
        # Said once the first health round answered: under the new user.
        self.assertEqual(await process.listening, f"127.0.0.1:{port}")
        self.assertIn(f"set uid/gid {NOBODY}/{NOBODY}".encode(), process.output)
        url = f"http://127.0.0.1:{port}"

        health = await self.http.get(url + "/healthcheck")
        body = await health.content()
        self.assertEqual(health.code, 200, process.output.decode())
        ready = json.loads(body)
        self.assertTrue(ready["ready"], ready)
        self.assertEqual(Path(f"/proc/{ready['pid']}").stat().st_uid, int(NOBODY))

        completion = await self.http.post(
            url + "/v1/completions", json={"model": "fake-model", "prompt": "hi"}
        )
        answer = json.loads(await completion.content())
        self.assertEqual(completion.code, 200, answer)
        self.assertEqual(answer["object"], "text_completion")

        stream = await self.http.post(
            url + "/v1/chat/completions", json=dict(CHAT, stream=True), unbuffered=True
        )
        self.assertEqual(stream.code, 200)
        self.assertEqual(sse_events(await stream.content())[-1], "[DONE]")
        self.assertEqual(len(self.ledger.redeemed), 2)

        await self.terminate(process)
        self.assertNotIn(b"Unhandled error", process.output)
        self.assertNotIn(b"marked down", process.output)


class KeysFileAsNobodyTests(TwistdCase):
    """The keys are read as root, before the change of user; the new user must read them again."""

    if os.geteuid() != 0:
        skip = "twistd --uid/--gid needs root to change user"

    def spawn_as_nobody(self, keys: str) -> TwistdProtocol:
        return self.spawn_keyed(keys, twistd_args=["--uid", NOBODY, "--gid", NOBODY])

    async def test_a_keys_file_only_root_reads_is_refused_at_start(self) -> None:
        """Read once as root, it would never be read again: a key taken out would keep working."""
        await self.start()
        keys = self.keys_file("sk-a team-a\n", mode=0o600)
        process = self.spawn_as_nobody(keys)
        with self.assertRaises(TwistdFailed):
            await process.listening
        self.assertEqual(await process.ended, 1, process.output.decode())
        self.assertIn(
            f"nixlproxy: --api-keys-file: {keys} cannot be read as uid {NOBODY}, the user twistd "
            "--uid serves as: the proxy could not read it again, and a key taken out of it "
            "would keep working until a restart".encode(),
            process.output,
        )
        self.assertNotIn(b"Traceback", process.output)

    async def test_a_key_taken_out_of_a_file_the_new_user_reads_is_refused(self) -> None:
        await self.start()
        keys = self.keys_file("sk-old team-a\n", mode=0o640, group=int(NOBODY))
        process = self.spawn_as_nobody(keys)
        url = f"http://{await process.listening}"
        await self.revoke_by_sighup(process, url, keys, mode=0o640, group=int(NOBODY))
        self.assertNotIn(b"cannot be used", process.output)
        await self.terminate(process)


@pytest.mark.skipif(os.geteuid() != 0, reason="twistd --uid needs root")
def test_workers_the_new_user_cannot_run_are_refused_at_start_not_left_unstarted() -> None:
    """The supervisor binds and makes its metrics directory as root; its workers would run as
    the new user, who cannot write there (nor, here, run Python): it exits, saying why."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from twisted.scripts.twistd import run; run()",
            "-n",
            "--pidfile=",
            "--uid",
            NOBODY,
            "--gid",
            NOBODY,
            "nixlproxy",
            "--workers",
            "2",
            "--listen",
            f"tcp:{free_privileged_port()}:interface=127.0.0.1",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:1",
        ],
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "nixlproxy: --workers as this user: cannot" in result.stdout + result.stderr
