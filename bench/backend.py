"""A fast fake vLLM for load: plain asyncio, just enough HTTP/1.1, no framework.

It plays prefill (``kv_transfer_params.do_remote_decode``) and decode like
``nixl_twisted.testing.FakeVLLM`` but checks nothing, so that it is never
the bottleneck of a benchmark. ``--processes N`` shares the port between N
processes (SO_REUSEPORT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import sys

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "bench",
    "remote_block_ids": [[1, 2, 3], [4, 5, 6]],
    "remote_request_id": "bench",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
PREFILL = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": PARAMS,
    }
).encode()
COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "hello " * 16, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
    }
).encode()
CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)


def _head(status: bytes, content_type: bytes, length: int | None) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\n"
    if length is None:
        return head + b"Transfer-Encoding: chunked\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % length


async def _serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: float
) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else b""
            if b"GET /health" in head[:20]:
                writer.write(_head(b"200 OK", b"text/plain", 0))
                continue
            request = json.loads(body) if body else {}
            kv = request.get("kv_transfer_params") or {}
            if kv.get("do_remote_decode"):
                writer.write(_head(b"200 OK", b"application/json", len(PREFILL)) + PREFILL)
            elif request.get("stream"):
                tokens = int(request.get("max_tokens") or 64)
                writer.write(_head(b"200 OK", b"text/event-stream", None))
                for index in range(tokens):
                    writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                    if interval:
                        await writer.drain()
                        await asyncio.sleep(interval)
                    elif index % 16 == 15:
                        await writer.drain()
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            else:
                writer.write(_head(b"200 OK", b"application/json", len(COMPLETION)) + COMPLETION)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _run(port: int, interval: float) -> None:
    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _serve(r, w, interval), "127.0.0.1", port, reuse_port=True, backlog=1024
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--token-interval", type=float, default=0.0)
    args = parser.parse_args(argv)
    workers = [
        multiprocessing.Process(target=_run, args=(args.port, args.token_interval), daemon=True)
        for _ in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    # Stopped with SIGTERM (as bench.run does), the parent must stop its
    # workers too, or they keep serving the port after the run.
    signal.signal(signal.SIGTERM, _stop)
    print(
        f"bench backend listening on 127.0.0.1:{args.port} ({args.processes} processes)", flush=True
    )
    try:
        for worker in workers:
            worker.join()
    except KeyboardInterrupt:
        pass
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
