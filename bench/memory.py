"""The proxy's memory with many idle open streams: 0, 250, 500 and 1,000.

Each stream gets its first token and then nothing (the fake decode waits an
hour between tokens), so the proxy holds the stream open with nothing to do.
Reports the proxy's resident memory (VmRSS) at each count and per stream.

    python -m bench.memory
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from bench.load import request_bytes
from bench.run import _free_port, _pinned, _process, nixlproxy


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _open_streams(port: int, count: int) -> list[asyncio.StreamWriter]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 2,
    }
    request = request_bytes("/v1/chat/completions", body)

    async def one() -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readuntil(b"\n\n")  # the first token is here
        return writer

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def measure(port: int, pid: int, counts: Sequence[int]) -> list[tuple[int, float]]:
    results = [(0, _rss_mb(pid))]
    writers: list[asyncio.StreamWriter] = []
    for count in counts:
        writers += await _open_streams(port, count - len(writers))
        results.append((count, _rss_mb(pid)))
    for writer in writers:
        writer.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[250, 500, 1000])
    args = parser.parse_args(argv)
    backend_port = _free_port()
    backend = [
        sys.executable,
        "-m",
        "bench.backend",
        "--port",
        str(backend_port),
        "--token-interval",
        "3600",
    ]
    proxy = [
        "--health-interval",
        "0",
        "--stream-idle-timeout",
        "7200",
        "--max-in-flight",
        "100000",
        "--prefill",
        f"http://127.0.0.1:{backend_port}",
        "--decode",
        f"http://127.0.0.1:{backend_port}",
    ]
    with (
        _process(_pinned("1", backend), backend_port),
        nixlproxy(proxy, "0") as (running, url),
    ):
        started = time.monotonic()
        proxy_port = int(url.rsplit(":", 1)[1])
        results = asyncio.run(measure(proxy_port, running.process.pid, args.streams))
    baseline = results[0][1]
    print("| idle streams | proxy RSS | per stream |")
    print("|---|---|---|")
    for count, rss in results:
        per = f"{(rss - baseline) * 1024 / count:.1f} KB" if count else "-"
        print(f"| {count} | {rss:.1f} MB | {per} |")
    print(f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
