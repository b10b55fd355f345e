"""Python calls per request in the proxy's reactor thread: a figure the machine cannot move.

Requests per second on a shared two-core machine move by a third between
two runs of the same build; the number of Python calls a request costs
does not. This runs a real ``twistd nixlproxy`` under cProfile (``twistd
--profile --profiler=cprofile --savestats``) in front of the fast fake
backend, twice per load: ``--few`` requests, then ``--many``. The slope
between the two (calls more, over requests more) is the calls one request
costs, with the start and the stop cancelled out.

    python -m bench.calls                       # non-streaming and streaming
    python -m bench.calls --proxy-arg=--access-log=off
    python -m bench.calls --readers             # every reader of a request at once:
        # cache-aware on both pools, a decode-only rule, a client key whose tenant's
        # tokens per minute count (and so a stream that asks for its usage)
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from bench.run import _free_port, _pinned, _process
from nixl_twisted.testing.process import Twistd

#: ``--readers``: the options that make every reader of a request read it.
READERS = (
    "--prefill-policy=cache-aware",
    "--decode-policy=cache-aware",
    "--decode-only-below=1",  # (evaluated, never met: both legs run)
    "--tenant-tokens-per-minute=1000000000",
    "--api-key=bench-key",
)


def calls(backend: str, requests: int, stream: bool, proxy_args: Sequence[str]) -> int:
    """The Python calls a profiled proxy made serving ``requests`` (4 connections)."""
    with tempfile.TemporaryDirectory(prefix="nixlproxy-calls-") as folder:
        return _profiled(os.path.join(folder, "profile"), backend, requests, stream, proxy_args)


def _profiled(
    stats: str, backend: str, requests: int, stream: bool, proxy_args: Sequence[str]
) -> int:
    args = ["--health-interval", "0", "--prefill", backend, "--decode", backend, *proxy_args]
    key = next((a.partition("=")[2] for a in proxy_args if a.startswith("--api-key=")), None)
    twistd_args = [f"--profile={stats}", "--profiler=cprofile", "--savestats"]
    proxy = Twistd(["--listen", "tcp:0:interface=127.0.0.1", *args], twistd_args=twistd_args)
    try:
        url = f"http://{proxy.address()}"
        load = [sys.executable, "-m", "bench.load", "--url", url, "--connections", "4"]
        load += ["--requests", str(requests), *(["--stream"] if stream else [])]
        load += ["--api-key", key] if key is not None else []
        subprocess.run(_pinned("1", load), check=True, stdout=subprocess.DEVNULL)
    finally:
        proxy.stop(timeout=30)
    return int(pstats.Stats(stats).total_calls)  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--few", type=int, default=500, help="requests of the first run")
    parser.add_argument("--many", type=int, default=2500, help="requests of the second run")
    parser.add_argument("--proxy-arg", action="append", default=[], help="one more option")
    parser.add_argument("--readers", action="store_true", help="every reader of a request on")
    args = parser.parse_args(argv)
    proxy_args = [*args.proxy_arg, *(READERS if args.readers else ())]
    port = _free_port()
    backend = [sys.executable, "-m", "bench.backend", "--port", str(port)]
    with _process(_pinned("1", backend), port):
        url = f"http://127.0.0.1:{port}"
        print("| load | calls per request |\n|---|---|")
        for name, stream in (("non-streaming", False), ("streaming, 64 tokens", True)):
            few = calls(url, args.few, stream, proxy_args)
            many = calls(url, args.many, stream, proxy_args)
            print(f"| {name} | {(many - few) / (args.many - args.few):,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
