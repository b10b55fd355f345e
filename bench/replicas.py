"""Several replicas of the proxy before one fleet of fakes with a capacity: ``bench.overload``'s
open loop, each tenant's clients reaching one replica more than the others.

R ``twistd nixlproxy`` replicas (each with ``--tenant-header``, the caps at
the engines' ``--max-num-seqs``, the queue and the tenants' weights, as
``bench.overload --caps``), and, with ``--shared``, ``--replicas-redis`` on a
real ``redis-server`` started for each load; without it, each replica on its
own, its caps whole (``--split`` gives each replica the cap over R, the static
split). Tenant ``a``'s requests go to replica 0 and ``b``'s to replica 1 (with
``--pinned`` probability; the rest to another replica at random, seeded); with
``--skew`` S instead, S of all requests go to replica 0 whatever their tenant.

The table is ``bench.overload``'s. ``--kill-at T`` sends SIGKILL to replica 0
T seconds into the load and prints the goodput of the survivors per second
after it; the arrivals aimed at replica 0 go to the others from
``--failover`` seconds after the kill on (a Service's endpoints without the
dead pod; until then they find nothing listening). ``--redis-stop T1,T2``
stops Redis at T1 and starts it again at T2, and prints the requests
waiting inside the decode engines each second (the most sampled in it).

    python -m bench.replicas --shared --loads 3           # two replicas, one fleet
    python -m bench.replicas --split --loads 3            # each replica the cap / 2
    python -m bench.replicas --shared --loads 1.2 --skew 0.8
    python -m bench.replicas --shared --replicas 2 --loads 1 --kill-at 10 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

from bench import open_loop
from bench.overload import (
    HEADER,
    TENANT_HEADER,
    TENANTS,
    Fleet,
    arguments,
    caps_options,
    fakes,
    row,
    summary,
)
from bench.overload_targets import Log, nixlproxy


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[tuple[str, subprocess.Popen[bytes], list[str]]]:
    """A real redis-server on a free port, nothing saved: its URL, process and command."""
    port = _free_port()
    folder = tempfile.mkdtemp(prefix="bench-redis-")
    command = [
        shutil.which("redis-server") or "redis-server",
        *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
        *("--dir", folder),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.02)
    try:
        yield f"redis://127.0.0.1:{port}/0", process, command
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def proxies(
    stack: ExitStack,
    urls: dict[str, list[str]],
    options: Sequence[str],
    replicas: int,
    shared: bool,
) -> tuple[list[tuple[str, Log]], tuple[str, subprocess.Popen[bytes], list[str]] | None]:
    """``replicas`` proxies with ``options`` before the fakes at ``urls`` (with ``shared``,
    on a real Redis started for them), stopped when ``stack`` closes; each one's URL and
    log, its load begun, and Redis's URL, process and command."""
    redis = stack.enter_context(redis_server()) if shared else None
    if redis is not None:
        options = [*options, "--replicas-redis", redis[0]]
    targets = [stack.enter_context(nixlproxy(options).serving(urls)) for _ in range(replicas)]
    for _, log in targets:
        log.load_begins()
    return targets, redis


def aimed(
    planned: Sequence[open_loop.Arrival],
    replicas: int,
    pinned: float,
    skew: float | None,
    seed: int,
    gone: float | None = None,
) -> list[open_loop.Arrival]:
    """Each arrival given its replica: its tenant's (``a``: 0, ``b``: 1) with probability
    ``pinned``, else another at random; with ``skew``, replica 0 with that probability;
    from ``gone`` seconds on, replica 0's to another at random (it died)."""
    rng = random.Random(seed)
    homes = {tenant: n % replicas for n, tenant in enumerate(TENANTS)}
    made = []
    for arrival in planned:
        if skew is not None:
            home = 0 if rng.random() < skew else rng.randrange(1, replicas) if replicas > 1 else 0
        elif rng.random() < pinned or replicas == 1:
            home = homes[arrival.tenant]
        else:
            home = rng.choice([r for r in range(replicas) if r != homes[arrival.tenant]])
        if gone is not None and arrival.at >= gone and home == 0 and replicas > 1:
            home = rng.randrange(1, replicas)
        made.append(replace(arrival, target=home))
    return made


def measure(
    fleet: Fleet, factor: float, args: argparse.Namespace, seed: int, folder: str
) -> dict[str, Any]:
    rate = factor * fleet.capacity
    planned = open_loop.arrivals(rate, list(TENANTS), seed, fleet.body, args.seconds, args.requests)
    gone = None if args.kill_at is None else args.kill_at + args.failover
    planned = aimed(planned, args.replicas, args.pinned, args.skew, seed, gone)
    window = args.seconds if args.requests is None else planned[-1].at
    cap = fleet.max_num_seqs if not args.split else max(1, fleet.max_num_seqs // args.replicas)
    options = [
        *("--tenant-header", TENANT_HEADER),
        *caps_options(cap, args.queue_size, args.queue_timeout, folder),
        *args.proxy_arg,
    ]
    with ExitStack() as stack:
        urls = stack.enter_context(fakes(fleet))
        targets, redis = proxies(stack, urls, options, args.replicas, args.shared)
        started: list[subprocess.Popen[bytes]] = []  # (a Redis started again: stopped at the end)
        stack.callback(_stop_all, started)
        events = _events(args, targets, redis, started)
        outcomes, gauges, elapsed = asyncio.run(
            open_loop.run(
                [url for url, _ in targets], planned, urls, TENANT_HEADER, args.client_timeout
            )
        )
        for timer in events:
            timer.cancel()
            timer.join()
    said = summary(outcomes, gauges, window, fleet.capacity, args.ttft_bound)
    result: dict[str, Any] = {"load": factor, "offered": round(rate, 2), **said}
    result["elapsed_s"] = round(elapsed, 1)
    result["log_lines"] = result["log_lines_not_access"] = 0
    if args.kill_at is not None:
        result["after_kill"] = _per_second(outcomes, planned, args.kill_at, fleet.capacity)
    if args.redis_stop:
        result["decode_waiting_each_second"] = _each_second(gauges.waiting.get("decode", []))
    return result


def _each_second(samples: Sequence[float], every: float = 0.25) -> list[int]:
    """The most sampled in each second of the load."""
    per = max(1, round(1 / every))
    return [int(max(samples[i : i + per])) for i in range(0, len(samples), per)]


def _stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
        process.wait(10)


def _events(
    args: argparse.Namespace,
    targets: Sequence[tuple[str, Any]],
    redis: tuple[str, subprocess.Popen[bytes], list[str]] | None,
    started: list[subprocess.Popen[bytes]],
) -> list[threading.Timer]:
    """What happens to the fleet during the load: a replica killed, Redis stopped (and each
    Redis started again put in ``started``)."""
    timers = []
    if args.kill_at is not None:
        victim = targets[0][1].process
        timers.append(threading.Timer(args.kill_at, lambda: os.kill(victim.pid, signal.SIGKILL)))
    if args.redis_stop and redis is not None:
        stop, start = (float(t) for t in args.redis_stop.split(","))
        process_box = [redis[1]]

        def stopped() -> None:
            process_box[0].send_signal(signal.SIGTERM)

        def again() -> None:
            process_box[0] = subprocess.Popen(
                redis[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            started.append(process_box[0])

        timers += [threading.Timer(stop, stopped), threading.Timer(start, again)]
    for timer in timers:
        timer.start()
    return timers


def _per_second(
    outcomes: Sequence[open_loop.Outcome],
    planned: Sequence[open_loop.Arrival],
    kill_at: float,
    capacity: float,
) -> list[float]:
    """The survivors' first tokens each second after the kill, as a share of capacity."""
    firsts = [o.first_at for o, a in zip(outcomes, planned, strict=True) if o.served and o.first_at]
    seconds = int(max(firsts, default=kill_at) - kill_at) + 1
    counts = [0] * max(0, seconds)
    for at in firsts:
        if at is not None and at >= kill_at:
            counts[int(at - kill_at)] += 1
    return [round(c / capacity, 2) for c in counts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shared", action="store_true", help="--replicas-redis on a real Redis")
    parser.add_argument("--split", action="store_true", help="each replica the cap / replicas")
    parser.add_argument("--pinned", type=float, default=0.9, help="a tenant's share to its own")
    parser.add_argument("--skew", type=float, help="this share of all to replica 0 instead")
    parser.add_argument("--kill-at", type=float, metavar="SECONDS", help="SIGKILL replica 0")
    parser.add_argument(
        "--failover",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="after the kill, replica 0's arrivals go to the others",
    )
    parser.add_argument("--redis-stop", metavar="T1,T2", help="stop Redis at T1, start at T2")
    args = parser.parse_args(argv)
    fleet = Fleet.of(args)
    if args.serve_fakes:
        from bench.overload import serve_fakes

        serve_fakes(fleet)
        return 0
    how = "shared through Redis" if args.shared else "split" if args.split else "each alone"
    print(fleet.describe())
    print(f"{args.replicas} replicas, caps {how}; tenants' clients pinned {args.pinned:g}")
    print(HEADER, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for factor in [float(x) for x in args.loads.split(",")]:
            for run in range(1, args.repeat + 1):
                result = measure(fleet, factor, args, args.seed + run - 1, folder)
                results.append(result)
                print(row(result, run, args.repeat), flush=True)
                if "after_kill" in result:
                    print(f"  after the kill, goodput per second: {result['after_kill']}")
                if "decode_waiting_each_second" in result:
                    waiting = result["decode_waiting_each_second"]
                    print(f"  waiting inside the decode engines, each second: {waiting}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
