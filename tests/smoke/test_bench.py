"""The benchmark command keeps working (a smoke run; numbers are not asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_benchmark_run_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--seconds", "0.5", "--loads", "1",
         "--backend-processes", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| non-streaming completions, 1 connection |" in result.stdout
    assert "/s |" in result.stdout


def test_a_short_traced_run_sends_its_spans_to_the_collector() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--seconds", "0.5", "--loads", "1",
         "--backend-processes", "1", "--traced"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    received = re.search(r"spans the collector received, [^:]+: (\d+)", result.stdout)
    assert received is not None and int(received.group(1)) > 0, result.stdout


def test_a_short_memory_run_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--streams", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 20 |" in result.stdout


def test_a_short_routing_run_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.routing", "--only", "cache-aware, 2 prefills,",
         "--conversations", "3", "--turns", "2", "--concurrency", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\| cache-aware, 2 prefills, --workers 2 \| \d+\.\d%", result.stdout)


def test_the_routing_index_memory_run_prints_its_figures() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.routing", "--index-memory"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"prompts": 100000' in result.stdout and '"retained_bytes": ' in result.stdout


def test_a_backend_announces_one_port_for_all_workers_and_stops_them_all() -> None:
    """SIGTERM the moment readiness is announced: every worker stops, exit 0."""
    backend = subprocess.Popen(
        [sys.executable, "-m", "bench.backend", "--port", "0", "--processes", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
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
    result = subprocess.run(
        [sys.executable, "-m", "bench.ceiling", "--seconds", "0.3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for server in (
        "web-agent",
        "klein-agent",
        "web-treq",
        "klein-treq",
        "klein-upstream",
        "nixlproxy",
    ):
        assert f"| {server} | non-streaming completions, 64 connections |" in result.stdout
