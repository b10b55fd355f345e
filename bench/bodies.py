"""The proxy's memory through a burst of big request bodies, and after it.

Sends ``--concurrent`` completions at once, each with a ``--megabytes`` MB
prompt, through a real ``twistd nixlproxy`` before the fast bench backend,
three bursts in a row. Reports the proxy's resident memory (VmRSS) before,
its peak during the bursts (sampled every 10 ms) and after, and how many
requests were answered 200 and how many refused with 503 (the
``--max-buffered-bodies`` bound).

``--keys N`` sends a short prompt and a ``logit_bias`` of N token ids
instead: JSON of many small values, which costs far more per byte once
parsed than one long string. ``times_body_size`` is the peak's rise above
``before`` over the bytes of one burst's bodies, when none was refused: with
``--concurrent 1``, what one body costs while it is in the proxy.

    python -m bench.bodies [--concurrent 8] [--megabytes 30 | --keys N] [-- PROXY OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from bench.memory import _rss_mb
from bench.run import _free_port, _pinned, _process, nixlproxy


async def _one(port: int, body: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    writer.write(head + body)
    await writer.drain()  # a refused body is still read (and dropped) by the proxy
    status = await reader.readline()
    await reader.read()
    writer.close()
    return int(status.split()[1]) if status else 0


async def _burst(port: int, pid: int, concurrent: int, body: bytes) -> tuple[list[int], float]:
    peak = _rss_mb(pid)
    sending = asyncio.gather(*(_one(port, body) for _ in range(concurrent)))
    while not sending.done():
        peak = max(peak, _rss_mb(pid))
        await asyncio.sleep(0.01)
    return list(sending.result()), peak


def completion(megabytes: int, keys: int | None) -> bytes:
    """A completion body: a ``megabytes`` MB prompt, or a short one and ``keys`` logit biases."""
    if keys is None:
        return json.dumps(
            {"model": "m", "prompt": "x" * (megabytes * 1024 * 1024), "max_tokens": 2}
        ).encode()
    bias = {str(token): 0 for token in range(keys)}
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "logit_bias": bias}).encode()


async def measure(port: int, pid: int, concurrent: int, body: bytes) -> dict[str, object]:
    before = _rss_mb(pid)
    statuses: list[int] = []
    peak = before
    for _ in range(3):
        codes, burst_peak = await _burst(port, pid, concurrent, body)
        statuses += codes
        peak = max(peak, burst_peak)
    await asyncio.sleep(0.5)  # let the last connections close
    body_mb = len(body) / (1024 * 1024)
    every_one_answered = statuses.count(200) == len(statuses)
    return {
        "body_mb": round(body_mb, 1),
        "before_mb": round(before, 1),
        "peak_mb": round(peak, 1),
        "after_mb": round(_rss_mb(pid), 1),
        "answered": statuses.count(200),
        "refused_503": statuses.count(503),
        "other": len(statuses) - statuses.count(200) - statuses.count(503),
        "times_body_size": (
            round((peak - before) / (body_mb * concurrent), 1) if every_one_answered else None
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=8)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--megabytes", type=int, default=30, help="MB of prompt per body")
    shape.add_argument("--keys", type=int, help="a short prompt and this many logit_bias keys")
    parser.add_argument("proxy_options", nargs="*", help="more twistd nixlproxy options")
    args = parser.parse_args(argv)
    backend_port = _free_port()
    backend = [sys.executable, "-m", "bench.backend", "--port", str(backend_port)]
    proxy = [
        "--health-interval",
        "0",
        "--access-log",
        "off",
        "--prefill",
        f"http://127.0.0.1:{backend_port}",
        "--decode",
        f"http://127.0.0.1:{backend_port}",
        *args.proxy_options,
    ]
    with _process(_pinned("1", backend), backend_port), nixlproxy(proxy, "0") as (running, url):
        port = int(url.rsplit(":", 1)[1])
        body = completion(args.megabytes, args.keys)
        result = asyncio.run(measure(port, running.process.pid, args.concurrent, body))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
