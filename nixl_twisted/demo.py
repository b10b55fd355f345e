"""The demo of the main job: a streaming chat completion through the proxy.

Starts a fake prefill/decode pair (``python -m nixl_twisted.testing``) and a
real ``twistd nixlproxy`` on loopback ports the OS picks, sends one streaming
chat completion with the official ``openai`` client, prints its tokens as
they arrive, and stops what it started. No GPU and no vLLM needed.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

#: ``twistd`` run by this very interpreter, wherever its script was installed.
TWISTD = (sys.executable, "-c", "from twisted.scripts.twistd import run; run()")

_URL = re.compile(r"listening on (http://)?(?P<address>\S+)")


class DemoFailed(RuntimeError):
    """A demo process did not start, or the request failed."""


def _lines(stream: IO[str]) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(
    lines: queue.Queue[str | None], marker: str, count: int, deadline: float
) -> list[str]:
    """Addresses from the first ``count`` lines that say ``marker``."""
    found: list[str] = []
    seen: list[str] = []
    while len(found) < count:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise DemoFailed(f"timed out waiting for {marker!r}:\n" + "".join(seen)) from None
        if line is None:
            raise DemoFailed(f"process exited before {marker!r}:\n" + "".join(seen))
        seen.append(line)
        if marker in line:
            match = _URL.search(line)
            if match:
                found.append(match.group("address"))
    return found


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="tokens to generate")
    parser.add_argument("--token-interval", type=float, default=0.05, help="seconds between tokens")
    parser.add_argument(
        "--prompt", default="Explain disaggregated prefill and decode in one sentence."
    )
    args = parser.parse_args(argv)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    processes: list[subprocess.Popen[str]] = []
    try:
        fakes = subprocess.Popen(
            [
                sys.executable, "-m", "nixl_twisted.testing",
                "--prefill-listen", "tcp:0:interface=127.0.0.1",
                "--decode-listen", "tcp:0:interface=127.0.0.1",
                "--tokens", str(args.tokens),
                "--token-interval", str(args.token_interval),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        processes.append(fakes)
        prefill, decode = _wait_for(_lines(fakes.stdout), "listening on", 2, start + 30)  # type: ignore[arg-type]
        print(f"fake prefill instance: http://{prefill}")
        print(f"fake decode instance:  http://{decode}")

        proxy = subprocess.Popen(
            [
                *TWISTD, "-n", "--pidfile=", "nixlproxy",
                "--listen", "tcp:0:interface=127.0.0.1",
                "--prefill", f"http://{prefill}", "--decode", f"http://{decode}",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        processes.append(proxy)
        (address,) = _wait_for(_lines(proxy.stdout), "nixlproxy listening on", 1, start + 30)  # type: ignore[arg-type]
        print(f"twistd nixlproxy:      http://{address}")
        print(f"\nuser> {args.prompt}\nassistant> ", end="", flush=True)
        _chat(f"http://{address}/v1", args.prompt)
        print()
        return 0
    except DemoFailed as error:
        print(f"\ndemo failed: {error}", file=sys.stderr)
        return 1
    finally:
        for process in reversed(processes):
            _stop(process)


def _chat(base_url: str, prompt: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo-key", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": prompt}],
        stream=True,
    )
    received = 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                received += 1
                print(choice.delta.content, end="", flush=True)
    if not received:
        raise DemoFailed("the stream carried no tokens")


if __name__ == "__main__":
    raise SystemExit(main())
