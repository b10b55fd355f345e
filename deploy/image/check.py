"""``make image-check``: the built image serves, streams and drains, run by a real runtime.

Starts the fake vLLM instances of ``nixl_twisted.testing`` on this host, runs
the image on the host's network in front of them (read-only root filesystem,
no capabilities, its own unprivileged user), streams a chat completion
through it with the official OpenAI client, sends SIGTERM (the runtime's stop)
once the first tokens are in, and checks that the stream still ends whole,
that the proxy said it drained, and that it exited 0. Prints what it saw; exits
1 at the first thing that is not so.

    python deploy/image/check.py --runtime docker --image nixl-twisted:0.1.0
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from openai import OpenAI

#: Tokens each fake answer streams, one every TOKEN_INTERVAL s: a stream of
#: about 3 s, long enough to be stopped in the middle.
TOKENS = 60
TOKEN_INTERVAL = 0.05
#: Seconds anything may take (start, answer, drain) before the check fails.
DEADLINE = 60.0


class CheckFailed(Exception):
    """What the image did not do."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def lines_of(stream: Iterator[str]) -> queue.Queue[str | None]:
    """A process's output, line by line, read in a thread (None once it ends)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue[str | None], said: str, seen: list[str]) -> str:
    """The first line holding ``said``; every line read is kept in ``seen``."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise CheckFailed(f"nothing said {said!r} within {DEADLINE:g} s") from None
        if line is None:
            raise CheckFailed(f"the output ended before anything said {said!r}")
        seen.append(line)
        if said in line:
            return line


@contextmanager
def fakes(python: str) -> Iterator[tuple[list[str], list[str]]]:
    """One fake prefill and one fake decode on loopback: their URLs."""
    command = [python, "-m", "nixl_twisted.testing", "--prefill-port", "0"]
    command += ["--decode-port", "0", "--tokens", str(TOKENS)]
    command += ["--token-interval", str(TOKEN_INTERVAL)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines, seen = lines_of(process.stdout), list[str]()
        wait_for(lines, "serve them with nixlproxy", seen)
        said = [line.split() for line in seen if " listening on " in line]  # fake NAME ... URL
        yield (
            [words[-1] for words in said if words[1].startswith("prefill")],
            [words[-1] for words in said if words[1].startswith("decode")],
        )
    finally:
        process.terminate()
        process.wait(timeout=DEADLINE)


def check(runtime: Sequence[str], image: str, python: str) -> None:
    port, admin = free_port(), free_port()
    name = f"nixl-twisted-check-{os.getpid()}"
    with fakes(python) as (prefills, decodes):
        run = [*runtime, "run", "--detach", "--name", name, "--network", "host"]
        run += ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL"]
        run += ["--security-opt", "no-new-privileges", image]
        run += ["--listen", f"tcp:{port}:interface=127.0.0.1"]
        run += ["--admin-listen", f"tcp:{admin}:interface=127.0.0.1"]
        run += ["--shutdown-delay", "1", "--drain-timeout", "30"]
        for url in prefills:
            run += ["--prefill", url]
        for url in decodes:
            run += ["--decode", url]
        print("$", shlex.join(run), flush=True)
        subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
        try:
            drive(runtime, name, port)
        finally:
            subprocess.run([*runtime, "rm", "--force", name], capture_output=True, check=False)


def drive(runtime: Sequence[str], name: str, port: int) -> None:
    logs = subprocess.Popen(
        [*runtime, "logs", "--follow", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert logs.stdout is not None
    lines, seen = lines_of(logs.stdout), list[str]()
    try:
        print("proxy:", wait_for(lines, "nixlproxy listening on", seen).strip(), flush=True)
        user = subprocess.run(
            [*runtime, "exec", name, "id", "-u"], capture_output=True, text=True, check=True
        ).stdout.strip()
        print(f"proxy runs as uid {user}", flush=True)
        if user == "0":
            raise CheckFailed("the proxy runs as root")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=DEADLINE)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Say something long."}],
            stream=True,
            max_tokens=TOKENS,
        )
        text, finish, stopped = [], None, None
        for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if stopped is None and len(text) >= 5:
                # SIGTERM now, mid-stream; `stop` waits for the exit, so in a thread.
                stopped = threading.Thread(
                    target=subprocess.run,
                    args=([*runtime, "stop", "--time", str(int(DEADLINE)), name],),
                    kwargs={"capture_output": True, "check": True},
                )
                stopped.start()
                print(f"SIGTERM sent after {len(text)} chunks", flush=True)
        if stopped is None:
            raise CheckFailed(f"the stream ended after {len(text)} chunks, before SIGTERM")
        stopped.join(DEADLINE)
        print(f"stream: {len(text)} chunks, finish_reason {finish!r}", flush=True)
        if finish is None:
            raise CheckFailed("the stream ended without a finish_reason: cut by the stop")
        code = subprocess.run(
            [*runtime, "inspect", "--format", "{{.State.ExitCode}}", name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for line in iter(lines.get, None):
            seen.append(line)
        for line in seen:
            if "SIGTERM" in line or "drain" in line or "not ready" in line:
                print("proxy:", line.strip(), flush=True)
        print(f"exit code: {code}", flush=True)
        if not any("draining 1 request in flight" in line for line in seen):
            raise CheckFailed("the proxy did not say it drained the stream in flight")
        if any("drain timeout" in line for line in seen):
            raise CheckFailed("the drain timed out")
        if code != "0":
            raise CheckFailed(f"the proxy exited {code}, not 0")
    finally:
        logs.kill()
        logs.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", default="docker", help="docker, or podman and its options")
    parser.add_argument("--image", required=True)
    parser.add_argument("--python", default=sys.executable, help="runs the fakes")
    args = parser.parse_args(argv)
    try:
        check(shlex.split(args.runtime), args.image, args.python)
    except CheckFailed as failure:
        print(f"image-check: FAILED: {failure}", file=sys.stderr, flush=True)
        return 1
    print(f"image-check: {args.image} served a stream, drained it on SIGTERM and exited 0")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
