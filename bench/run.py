"""One command for the four loads of issue 5, against the proxy and direct to decode.

The proxy (a real ``twistd nixlproxy``) is pinned to core 0; the fast fake
backends and the load generator to the other cores (``taskset``). Every
process listens on loopback and is stopped at the end. Prints a table with
the ratios to the direct baseline, the proxy's CPU seconds per 1,000
requests and its peak RSS.

    python -m bench.run                 # 8 s per load, as in docs/performance.md
    python -m bench.run --repeat 3      # medians of three runs of each load
    python -m bench.run --requests 20   # a smoke run: 20 requests per load, however slow
    python -m bench.run --traced        # every request traced, to a collector process
    python -m bench.run --api-key k1    # client keys on: the proxy checks k1 on every request
    python -m bench.run --only 3 4 --workers 2 --nice-load 10
        # the two streaming loads through two workers, the load generator niced
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nixl_twisted.run.workers import TWISTD
from nixl_twisted.testing.process import Twistd

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The proxy the benches start (``nixlproxy``): this interpreter's twistd, run from here
#: (this tree), unless a bench's ``--proxy-python`` names another build's virtualenv; then
#: run from ``/``, so that it imports the package installed there, not this tree's.
PROXY_TWISTD: tuple[str, ...] = TWISTD
PROXY_CWD: str | None = None


@dataclass(frozen=True)
class Load:
    name: str
    connections: int
    stream: bool
    token_interval: float = 0.0


@dataclass(frozen=True)
class Length:
    """How long each load runs: ``seconds``, or until ``requests`` were answered.

    By count, every row answers something on however slow a machine (the
    smoke tests' choice); by time, rows of different speed are comparable.
    """

    seconds: float = 8.0
    requests: int | None = None

    def options(self) -> list[str]:
        """``bench.load``'s options for it."""
        if self.requests is not None:
            return ["--requests", str(self.requests)]
        return ["--seconds", str(self.seconds)]


def add_length_options(parser: argparse.ArgumentParser) -> None:
    """``--seconds`` or ``--requests``, for every bench that runs ``bench.load``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seconds", type=float, default=8.0, help="run each load this long")
    group.add_argument(
        "--requests",
        type=int,
        help="instead: send this many requests in each load, however long that takes",
    )


def length_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Length:
    """The options' ``Length``; a count below 1 is the user's error, said as argparse says it."""
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    return Length(args.seconds, args.requests)


LOADS = (
    Load("non-streaming completions, 1 connection", 1, False),
    Load("non-streaming completions, 64 connections", 64, False),
    Load("streaming chat, 64 tokens back to back, 64 connections", 64, True),
    Load("streaming chat, 64 tokens at 5 ms, 64 connections", 64, True, 0.005),
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def other_cores() -> str:
    """The cores besides the proxy's core 0, in ``taskset``'s form: the backends' and the load's."""
    cores = os.cpu_count() or 2
    return "1" if cores == 2 else f"1-{cores - 1}"


def _pinned(cores: str, command: Sequence[str]) -> list[str]:
    return ["taskset", "-c", cores, *command] if shutil.which("taskset") else list(command)


@contextmanager
def served_fakes(command: Sequence[str]) -> Iterator[dict[str, list[str]]]:
    """A child process serving fakes (pinned off the proxy's core), and the URLs it prints."""
    process = subprocess.Popen(_pinned("1", command), stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield json.loads(process.stdout.readline())
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:  # (a starved machine): the next run needs the core
            process.kill()
            process.wait()


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port}")


@contextmanager
def _process(
    command: Sequence[str], port: int, output: Any = subprocess.DEVNULL
) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(list(command), stdout=output, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, time.monotonic() + 30)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _load(
    url: str,
    load: Load,
    length: Length,
    cores: str,
    api_key: str | None = None,
    nice: int = 0,
) -> dict[str, Any]:
    """``bench.load`` pinned to ``cores``; ``nice`` above 0 lowers its priority (``nice -n``)."""
    command = [
        sys.executable,
        "-m",
        "bench.load",
        "--url",
        url,
        "--connections",
        str(load.connections),
        *length.options(),
    ]
    if load.stream:
        command.append("--stream")
    if api_key is not None:
        command += ["--api-key", api_key]
    lowered = ["nice", "-n", str(nice)] if nice else []
    out = subprocess.run(
        _pinned(cores, [*lowered, *command]), capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        # Its traceback, not only "returned non-zero exit status 1".
        raise RuntimeError(f"{' '.join(command)} exited {out.returncode}:\n{out.stderr}")
    return dict(json.loads(out.stdout))


def _cores(cores: str) -> set[int]:
    """``taskset``'s list (``0``, ``0-1``, ``1,3``) as a set of core numbers."""
    found: set[int] = set()
    for part in cores.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


@contextmanager
def nixlproxy(args: Sequence[str], cores: str, workers: int = 1) -> Iterator[tuple[Twistd, str]]:
    """A real ``twistd nixlproxy`` pinned to ``cores``, and its URL once every worker listens.

    Its log goes to a pipe the helper drains (with --logfile=/dev/null
    twistd would rotate, that is rename, the device at 1 MB).
    """
    # This process reads the proxy's log (to learn its address, then to drain
    # the pipe): it must never wake on the proxy's own cores.
    proxy_cores = _cores(cores)
    elsewhere = set(range(os.cpu_count() or 2)) - proxy_cores
    if elsewhere and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, elsewhere)
    proxy = Twistd(
        ["--listen", "tcp:0:interface=127.0.0.1", *args],
        prefix=_pinned(cores, []),
        twistd=PROXY_TWISTD,
        cwd=PROXY_CWD,
    )
    try:
        yield proxy, f"http://{proxy.address(count=workers)}"
    finally:
        proxy.stop(timeout=15)


def _descendants(pid: int) -> list[int]:
    """A process and all its children (the --workers of a proxy)."""
    found = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as children:
            for child in children.read().split():
                found += _descendants(int(child))
    except OSError:
        pass
    return found


@contextmanager
def _collector(cores: str, traced: bool) -> Iterator[tuple[list[str], dict[str, int]]]:
    """With ``traced``: a collector process, the proxy's options to trace to it, and
    (once it stopped) what it received."""
    received: dict[str, int] = {}
    if not traced:
        yield [], received
        return
    port = _free_port()
    command = [sys.executable, "-m", "bench.collector", "--port", str(port)]
    with _process(_pinned(cores, command), port, subprocess.PIPE) as collector:
        yield ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces"], received
    assert collector.stdout is not None
    received.update(json.loads(collector.stdout.read() or "{}"))


def measure(
    load: Load,
    length: Length,
    backend_processes: int,
    workers: int = 1,
    proxy_args: Sequence[str] = (),
    traced: bool = False,
    api_key: str | None = None,
    nice_load: int = 0,
) -> dict[str, Any]:
    """One load direct to the backend, then through a proxy started for it.

    ``api_key``: the proxy requires it (``--api-key``) and the load sends it
    to the proxy alone (the backend checks nothing; its baseline is unchanged).
    ``nice_load``: the load generator's niceness on both sides, so that
    ``--workers`` sharing its core get the core first.
    """
    cores = os.cpu_count() or 2
    others = other_cores()
    proxy_cores = "0" if workers == 1 else f"0-{min(workers, cores) - 1}"
    backend_port = _free_port()
    backend = [
        sys.executable,
        "-m",
        "bench.backend",
        "--port",
        str(backend_port),
        "--processes",
        str(backend_processes),
        "--token-interval",
        str(load.token_interval),
    ]
    proxy = [
        "--health-interval",
        "0",
        "--prefill",
        f"http://127.0.0.1:{backend_port}",
        "--decode",
        f"http://127.0.0.1:{backend_port}",
        "--workers",
        str(workers),
        *(["--api-key", api_key] if api_key is not None else []),
        *proxy_args,
    ]
    with (
        _process(_pinned(others, backend), backend_port),
        _collector(others, traced) as (tracing, spans),
    ):
        direct = _load(f"http://127.0.0.1:{backend_port}", load, length, others, nice=nice_load)
        with nixlproxy([*proxy, *tracing], proxy_cores, workers) as (running, url):
            pids = _descendants(running.process.pid)
            cpu_before = sum(_cpu_seconds(pid) for pid in pids)
            proxied = _load(url, load, length, others, api_key, nice_load)
            cpu = sum(_cpu_seconds(pid) for pid in pids) - cpu_before
            rss = max(_peak_rss_mb(pid) for pid in pids)
    requests = max(1, proxied["requests"])
    return {
        "load": load.name,
        "direct": direct,
        "proxy": proxied,
        "cpu_s_per_1000": round(cpu / requests * 1000, 3),
        "peak_rss_mb": round(rss, 1),
        **({"spans": spans.get("spans", 0)} if traced else {}),
    }


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g} ms"


def _added(proxy: float | None, direct: float | None) -> str:
    return "-" if proxy is None or direct is None else f"{proxy - direct:+.2f} ms"


def _pair(row: dict[str, Any], key: str) -> str:
    """``direct / proxy`` for one latency."""
    direct, proxy = row["direct"][key], row["proxy"][key]
    return "-" if direct is None and proxy is None else f"{_ms(direct)} / {_ms(proxy)}"


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over repeated runs of one load (``--repeat``)."""

    def median(values: list[Any]) -> Any:
        present = [value for value in values if value is not None]
        return round(statistics.median(present), 3) if present else None

    merged: dict[str, Any] = {"load": runs[0]["load"], "runs": len(runs)}
    for side in ("direct", "proxy"):
        merged[side] = {key: median([run[side][key] for run in runs]) for key in runs[0][side]}
        # An error in any run must not be hidden by the median.
        merged[side]["errors"] = max(run[side]["errors"] for run in runs)
    for key in ("cpu_s_per_1000", "peak_rss_mb", "spans"):
        if key in runs[0]:
            merged[key] = median([run[key] for run in runs])
    return merged


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| load | direct | proxy | ratio | p50 added | p99 direct / proxy | TTFT p50 added "
        "| TTFT p99 direct / proxy | gap p50 direct / proxy | gap p99 direct / proxy "
        "| CPU s/1k | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        d, p = row["direct"], row["proxy"]
        lines.append(
            f"| {row['load']} | {d['per_second']}/s | {p['per_second']}/s "
            f"| {_ratio(p['per_second'], d['per_second'])} | {_added(p['p50_ms'], d['p50_ms'])} "
            f"| {_pair(row, 'p99_ms')} | {_added(p['ttft_p50_ms'], d['ttft_p50_ms'])} "
            f"| {_pair(row, 'ttft_p99_ms')} | {_pair(row, 'gap_p50_ms')} "
            f"| {_pair(row, 'gap_p99_ms')} | {row['cpu_s_per_1000']} | {row['peak_rss_mb']} MB |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_length_options(parser)
    parser.add_argument("--backend-processes", type=int, default=2)
    parser.add_argument("--loads", type=int, default=len(LOADS), help="run the first N loads")
    parser.add_argument(
        "--only",
        type=int,
        nargs="+",
        choices=range(1, len(LOADS) + 1),
        metavar="LOAD",
        help="instead: run these loads (1 to 4, in the table's order), e.g. --only 3 4",
    )
    parser.add_argument("--json", action="store_true", help="print the raw results too")
    parser.add_argument("--workers", type=int, default=1, help="the proxy's --workers")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each load N times and report the medians"
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more twistd nixlproxy option, e.g. --proxy-arg=--access-log=off",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="start the proxy with this client key (--api-key) and send it "
        "(Authorization: Bearer KEY) on every proxied request",
    )
    parser.add_argument(
        "--nice-load",
        type=int,
        default=0,
        metavar="N",
        help="run the load generator at niceness N (nice -n N), e.g. beside --workers 2",
    )
    parser.add_argument(
        "--traced",
        action="store_true",
        help="trace every request to a collector process (bench.collector) on the other cores",
    )
    args = parser.parse_args(argv)
    length = length_of(parser, args)
    if args.nice_load < 0:
        parser.error("--nice-load must be 0 or more (a load above the proxy would starve it)")
    chosen = [LOADS[n - 1] for n in args.only] if args.only else LOADS[: args.loads]
    rows = [
        median_row(
            [
                measure(
                    load,
                    length,
                    args.backend_processes,
                    args.workers,
                    args.proxy_arg,
                    args.traced,
                    args.api_key,
                    args.nice_load,
                )
                for _ in range(args.repeat)
            ]
        )
        for load in chosen
    ]
    print(table(rows))
    for row in rows:
        if "spans" in row:
            print(f"spans the collector received, {row['load']}: {row['spans']:g}")
    if args.json:
        print(json.dumps(rows, indent=2))
    failed = [row for row in rows if row["proxy"]["errors"] or not row["proxy"]["requests"]]
    for row in failed:
        print(f"failed: {row['load']}: {failure(row['proxy'])}", file=sys.stderr)
    return 1 if failed else 0


def failure(result: dict[str, Any]) -> str:
    """Why a row of ``bench.load`` results fails the run, in words."""
    answered, errors = result["requests"], result["errors"]
    return f"{answered} answered, {errors} errors (not 200, or a connection lost)"


if __name__ == "__main__":
    raise SystemExit(main())
