"""The benchmark commands keep working (smoke runs; numbers are not asserted).

Each runs by request count, never for a time: a load given 0.3 s can answer
nothing on a busy machine, a load given 20 requests answers 20 however slow
it is. A failure shows the command, how it ended and all it wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.smoke.support import ROOT, Ran, run

#: Above each command's own timeout (support.run's), so that its message wins.
pytestmark = pytest.mark.timeout(270)

PYTHON = sys.executable


def short_run(*options: str) -> Ran:
    """``bench.run``'s first load, 20 requests, one backend process, with ``options``."""
    first = ["--requests", "20", "--loads", "1", "--backend-processes", "1"]
    return run([PYTHON, "-m", "bench.run", *first, *options])


@pytest.mark.parametrize(
    "keys", [pytest.param([], id="keys-off"), pytest.param(["--api-key", "k1"], id="keys-on")]
)
def test_a_short_benchmark_run_prints_its_table(keys: list[str]) -> None:
    """Keys on, a request the proxy refused (a 401) would be an error, and exit 1."""
    ran = short_run(*keys)
    row = "| non-streaming completions, 1 connection | "
    assert ran.code == 0 and row in ran.stdout and "/s |" in ran.stdout, ran.why(
        f"exit 0 and a table row starting {row!r}"
    )


def test_a_short_run_of_the_streaming_loads_through_two_workers_with_the_load_niced() -> None:
    """``--only 3 4``: just the two streaming loads; ``--nice-load``: the load started by nice."""
    ran = short_run("--only", "3", "4", "--workers", "2", "--nice-load", "10")
    row = r"^\| streaming chat, 64 tokens [^|]+\| [\d.]+/s \|"
    rows = re.findall(row, ran.stdout, re.MULTILINE)
    assert ran.code == 0 and len(rows) == 2 and "non-streaming" not in ran.stdout, ran.why(
        "exit 0 and a row for each streaming load, none for the others"
    )


def test_a_short_traced_run_sends_its_spans_to_the_collector() -> None:
    ran = short_run("--traced")
    received = re.search(r"spans the collector received, [^:]+: (\d+)", ran.stdout)
    assert ran.code == 0 and received is not None and int(received.group(1)) > 0, ran.why(
        "exit 0 and 'spans the collector received, LOAD: N' with N > 0"
    )


def test_a_short_calls_run_prints_calls_per_request() -> None:
    ran = run([PYTHON, "-m", "bench.calls", "--few", "10", "--many", "30"])
    row = re.search(r"\| non-streaming \| ([\d,]+) \|", ran.stdout)
    assert ran.code == 0 and row is not None and int(row.group(1).replace(",", "")) > 0, ran.why(
        "exit 0 and '| non-streaming | N |' with N > 0"
    )


def test_a_short_calls_run_of_the_floor_prints_calls_per_token_and_its_functions() -> None:
    # (the design's floor, Klein and treq; the per-stream gap below runs the bare one)
    command = [PYTHON, "-m", "bench.calls", "--floor", "klein-upstream", "--few", "10"]
    command += ["--many", "30"]
    ran = run([*command, "--tokens", "4", "8", "--top", "3"])
    row = re.search(r"\| per token \(4 -> 8\) \| ([\d,.]+) \|", ran.stdout)
    functions = re.findall(r"^\| `[^`]+` \| [\d.]+ \| -?[\d.]+ \|$", ran.stdout, re.MULTILINE)
    assert ran.code == 0 and row is not None and float(row.group(1).replace(",", "")) > 0, ran.why(
        "exit 0 and '| per token (4 -> 8) | N |' with N > 0"
    )
    assert len(functions) == 3, ran.why("three rows of functions called per token")


def test_a_short_calls_run_prints_the_per_stream_gap_between_the_proxy_and_the_floor() -> None:
    command = [PYTHON, "-m", "bench.calls", "--few", "10", "--many", "30", "--tokens", "4", "8"]
    ran = run([*command, "--top-per-stream", "2", "--per-stream-gap", "3"])
    at_zero = r"^\| per stream \(at 0 tokens\) \| -?[\d,]+ \|$"
    per_stream = re.findall(at_zero, ran.stdout, re.MULTILINE)
    ranked = re.findall(r"^\| `[^`]+` \| -?[\d.]+ \| -?[\d.]+ \|$", ran.stdout, re.MULTILINE)
    gaps = re.findall(
        r"^\| `[^`]+` \| -?[\d.]+ \| -?[\d.]+ \| [+-][\d.]+ \|$", ran.stdout, re.MULTILINE
    )
    assert ran.code == 0 and len(per_stream) == 2, ran.why(
        "exit 0 and a per-stream row for the proxy and for the floor"
    )
    assert len(ranked) == 2 and len(gaps) == 3, ran.why(
        "two functions per stream and three rows of proxy minus floor"
    )


def test_a_short_memory_run_prints_its_table() -> None:
    ran = run([PYTHON, "-m", "bench.memory", "--streams", "20"])
    assert ran.code == 0 and "| 20 |" in ran.stdout, ran.why("exit 0 and a row for 20 streams")


def test_a_short_bodies_run_of_many_keys_says_what_a_body_costs() -> None:
    ran = run([PYTHON, "-m", "bench.bodies", "--concurrent", "1", "--keys", "1000"])
    result = json.loads(ran.stdout.strip().splitlines()[-1]) if ran.code == 0 else {}
    answered = result.get("answered") == 3 and isinstance(result.get("times_body_size"), float)
    assert answered, ran.why("exit 0 and JSON with answered: 3 and a times_body_size")


def test_a_short_routing_run_prints_its_table() -> None:
    ran = run(
        [
            PYTHON,
            "-m",
            "bench.routing",
            "--only",
            "cache-aware, 2 prefills,",
            "--conversations",
            "3",
            "--turns",
            "2",
            "--concurrency",
            "2",
        ]
    )
    row = r"\| cache-aware, 2 prefills, --workers 2 \| \d+\.\d%"
    assert ran.code == 0 and re.search(row, ran.stdout), ran.why(
        f"exit 0 and a row matching {row!r}"
    )


def test_a_short_mixed_routing_run_at_a_count_prints_each_policy_against_the_ideal() -> None:
    ran = run(
        [
            PYTHON,
            "-m",
            "bench.routing",
            "--workload",
            "mixed",
            "--prefills",
            "2",
            "--only",
            "kv-aware",
            "--conversations",
            "3",
            "--turns",
            "2",
            "--documents",
            "1",
            "--doc-words",
            "100",
            "--concurrency",
            "2",
        ]
    )
    # hit rate, its share of the ideal's, ..., each instance's legs, the busiest's share
    row = (
        r"\| kv-aware, 2 prefills \| \d+\.\d% \| \d\.\d{3} \| .* "
        r"\| \[\d+, \d+\] \| \d\.\d\d \| [\d,]+ \| 0 \|"
    )
    assert ran.code == 0 and re.search(row, ran.stdout), ran.why(
        f"exit 0 and a row matching {row!r}"
    )


def test_a_replicas_routing_run_prints_one_proxy_against_two_sharing_a_view() -> None:
    """Two proxies at random, alone and through a redis-server the run starts and stops."""
    ran = run(
        [PYTHON, "-m", "bench.routing", "--shapes", "documents", "--seeds", "1", "--replicas", "2"]
    )
    rate = r"\d\.\d{3} \(\d\.\d{3}\)"
    row = rf"\| documents \| 2 \| 1 \| kv-aware \| \d\.\d{{3}} \| {rate} \| {rate} \| {rate} \| "
    assert ran.code == 0 and re.search(row, ran.stdout) and "failed" not in ran.stdout, ran.why(
        f"exit 0, a row matching {row!r} and nothing failed"
    )


def test_a_short_route_view_run_prints_what_the_view_costs() -> None:
    ran = run([PYTHON, "-m", "bench.route_view", "--trips", "20"])
    row = r"\| told to applied by another replica, p50 \| \d+\.\d\d ms \|"
    assert ran.code == 0 and re.search(row, ran.stdout), ran.why(
        f"exit 0 and a row matching {row!r}"
    )


def test_a_short_decide_run_prints_its_row_and_fails_nothing() -> None:
    """Run a only: the other runs need the proxy's conditional disaggregation options."""
    ran = run(
        [
            PYTHON,
            "-m",
            "bench.decide",
            "--only",
            "a",
            "--requests",
            "12",
            "--concurrency",
            "4",
            "--turns",
            "2",
        ]
    )
    ms = r"\d+\.\d+ / \d+\.\d+ ms"
    row = rf"\| a: rules off \(always P/D\) \| {ms} \| {ms} \| {ms} \| {ms} \| (-|\d+\.\d%) \| 0 \|"
    assert ran.code == 0 and re.search(row, ran.stdout), ran.why(
        f"exit 0 and a row matching {row!r}"
    )


def test_the_routing_index_memory_run_prints_its_figures() -> None:
    ran = run([PYTHON, "-m", "bench.routing", "--index-memory"])
    figures = '"prompts": 100000' in ran.stdout and '"retained_bytes": ' in ran.stdout
    assert ran.code == 0 and figures, ran.why("exit 0 and its JSON: prompts and retained_bytes")


def test_a_backend_announces_one_port_for_all_workers_and_stops_them_all() -> None:
    """SIGTERM the moment readiness is announced: every worker stops, exit 0."""
    backend = subprocess.Popen(
        [sys.executable, "-m", "bench.backend", "--port", "0", "--processes", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert backend.stdout is not None
        line = backend.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match is not None, line
        children_file = Path(f"/proc/{backend.pid}/task/{backend.pid}/children")
        workers = [int(pid) for pid in children_file.read_text().split()]
        assert len(workers) == 2
        # Announced only once both listen, on the one port 0 was resolved to.
        assert {_listening_port(pid) for pid in workers} == {int(match.group(1))}
    finally:
        backend.terminate()
        backend.wait(timeout=30)
    assert backend.returncode == 0
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []


def _listening_port(pid: int) -> int | None:
    """The TCP port a process listens on, from /proc."""
    inodes = {
        target[len("socket:[") : -1]
        for target in (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
        if target.startswith("socket:[")
    }
    for row in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            return int(fields[1].split(":")[1], 16)
    return None


def test_a_short_ceiling_run_prints_its_table() -> None:
    # 64 requests: one on each connection of the 64-connection load.
    ran = run([PYTHON, "-m", "bench.ceiling", "--requests", "64"])
    kinds = ("web-agent", "klein-agent", "web-treq", "klein-treq", "klein-upstream", "nixlproxy")
    rows = [f"| {kind} | non-streaming completions, 64 connections |" for kind in kinds]
    assert ran.code == 0 and all(row in ran.stdout for row in rows), ran.why(
        "exit 0 and a 64-connection row for each of " + ", ".join(kinds)
    )


def test_a_short_stream_ceiling_run_prints_a_row_per_server_and_load() -> None:
    # 64 streams: one on each connection of each 64-connection load.
    ran = run([PYTHON, "-m", "bench.stream_ceiling", "--requests", "64"])
    loads = ("64 tokens back to back, 64 connections", "64 tokens at 5 ms, 64 connections")
    rows = [
        rf"\| {kind} \| streaming chat, {load} \| [\d.]+/s \| [\d.]+ \| [\d.]+ \| [-+][\d.]+ ms "
        r"\| [-+][\d.]+ ms \| 0 \|"
        for kind in ("web-agent", "klein-upstream", "nixlproxy")
        for load in loads
    ]
    assert ran.code == 0 and all(re.search(row, ran.stdout) for row in rows), ran.why(
        "exit 0 and, for web-agent, klein-upstream and nixlproxy, a row per streaming load with "
        "streams/s, CPU per stream and per token, TTFT added and no error"
    )
    collections = re.findall(
        r"^\| nixlproxy \| streaming chat, [^|]+ \| \d+ \| [\d.]+ \| \d+ \|$",
        ran.stdout,
        re.MULTILINE,
    )
    assert len(collections) == 2, ran.why("the proxy's full collections during each load")


def test_a_short_overload_run_serves_every_arrival_of_each_load() -> None:
    """By count: 8 arrivals per load, on fakes fast enough that a load takes a moment;
    through today's proxy, each served (no refusal), its TTFT measured and its access
    line counted among the proxy's log lines."""
    ran = run(
        [
            PYTHON,
            "-m",
            "bench.overload",
            *("--requests", "8", "--tokens", "4"),
            *("--token-interval", "0.005", "--prefill-cost", "0.00005"),
        ]
    )
    rows = {
        load: re.search(
            rf"\| {load} \| [\d.]+/s \| 8 \| [^|]+ \| [\d.]+ / [\d.]+ s \| - \| 0 \| "
            r".* \| (\d+) \((\d+)\) \|",
            ran.stdout,
        )
        for load in ("0.5x", "1x", "2x", "3x")
    }
    access_lines = {
        load: int(found.group(1)) - int(found.group(2)) if found else None
        for load, found in rows.items()
    }
    assert ran.code == 0 and "capacity: " in ran.stdout, ran.why("exit 0, the fleet's capacity")
    assert access_lines == dict.fromkeys(rows, 8), ran.why(
        "a row per load: 8 requests, all served, a TTFT, 8 access lines"
    )


def test_a_short_rolling_restart_run_replaces_each_replica_and_prints_its_row() -> None:
    """By count: 12 arrivals through two replicas sharing a redis-server the run starts, each
    replaced in turn from half a second in (the row's figures are not asserted)."""
    ran = run(
        [
            PYTHON,
            "-m",
            "bench.rolling",
            *("--roll", "--requests", "12", "--replicas", "2", "--roll-at", "0.5"),
            *("--tokens", "4", "--token-interval", "0.01"),
        ]
    )
    row = re.search(r"^\| rolling restart \| 12 \| \d+ \|", ran.stdout, re.MULTILINE)
    replaced = re.findall(r"^  replica \d: SIGTERM at [\d.]+ s, exit 0 ", ran.stdout, re.MULTILINE)
    assert ran.code == 0 and row is not None and len(replaced) == 2, ran.why(
        "exit 0, the row of 12 requests, and each of the two replicas replaced and exited 0"
    )


def test_a_short_goodput_run_prints_a_row_through_two_replicas_sharing_redis() -> None:
    """By count: 12 arrivals at the decode capacity of small fakes, through two replicas
    sharing a redis-server the run starts, each arrival with its first-token target."""
    ran = run(
        [
            *(PYTHON, "-m", "bench.goodput", "--smoke", "--shapes", "mixed"),
            *("--replicas", "2", "--shared", "--targets", "1000:0.5,10000:0.5"),
        ]
    )
    row = re.search(
        r"^\| mixed \| 2 shared \| 1x \| 16/s \| 16/s \| [\d.]+/s \| [\d.]+/s \(\d+%\) "
        r"\| \d+% \(1 s: \d+%, 10 s: \d+%\) \| 0% \(0 of 0\) \| 0 \| \d+% \| [\d.]+ / [\d.]+ "
        r"\| [\d.]+ : 1 \| [\d.]+ / [\d.]+ s \|$",
        ran.stdout,
        re.MULTILINE,
    )
    assert ran.code == 0 and row is not None, ran.why(
        "exit 0, and the row: 12 served, late by target, nothing refused"
    )
