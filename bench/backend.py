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
from multiprocessing.connection import Connection

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
#: A token's chunk as vLLM 0.32 writes it: its ``token_ids`` null unless asked
#: (``return_token_ids``), and the first one's ``prompt_token_ids`` the same.
CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"logprobs":null,'
    b'"finish_reason":null,"token_ids":%s}]%s}\n\n'
)
PROMPT_IDS = b"[1,2,3,4,5,6,7,8]"


def _chunk(index: int, ids: bool) -> bytes:
    """The ``index``-th token's chunk (an id of its own, when asked)."""
    token = b"[%d]" % (1000 + index) if ids else b"null"
    if index:
        return CHUNK % (token, b"")
    return CHUNK % (token, b',"prompt_token_ids":' + (PROMPT_IDS if ids else b"null"))


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
            if b"/render " in head[: head.find(b"\r\n")]:  # kv-aware's render: 8 token ids
                answer = {"request_id": "cmpl-bench", "token_ids": list(range(8))}
                raw = json.dumps(answer if b"/chat/" in head[:40] else [answer]).encode()
                writer.write(_head(b"200 OK", b"application/json", len(raw)) + raw)
                await writer.drain()
                continue
            kv = request.get("kv_transfer_params") or {}
            if kv.get("do_remote_decode"):
                writer.write(_head(b"200 OK", b"application/json", len(PREFILL)) + PREFILL)
            elif request.get("stream"):
                tokens = int(request.get("max_tokens") or 64)
                writer.write(_head(b"200 OK", b"text/event-stream", None))
                ids = request.get("return_token_ids") is True
                for index in range(tokens):
                    chunk = _chunk(index, ids)
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
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


def _run(port: int, interval: float, ready: Connection) -> None:
    # Forked with the parent's signals blocked: a worker stops on SIGTERM as usual.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _serve(r, w, interval), "127.0.0.1", port, reuse_port=True, backlog=1024
        )
        ready.send(port)
        ready.close()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


#: Forked, so that the workers are this process's own children (signalled and joined here).
_FORK = multiprocessing.get_context("fork")

#: What stops the parent: an operator's signal, or a worker that died.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


def _reserve(port: int) -> socket.socket:
    """Bind (not listen) the port, resolving 0 once so every worker shares one port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--token-interval", type=float, default=0.0)
    args = parser.parse_args(argv)
    # Blocked before anything else and collected with sigwait: a SIGTERM at
    # any moment from here on (even while readiness is being announced) is
    # handled by the one wait below, never by a handler raising mid-print.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    reserved = _reserve(args.port)
    port = reserved.getsockname()[1]
    pipes = [_FORK.Pipe(duplex=False) for _ in range(args.processes)]
    workers = [
        _FORK.Process(target=_run, args=(port, args.token_interval, sender), daemon=True)
        for _, sender in pipes
    ]
    code = 0
    try:
        for worker in workers:
            worker.start()
        for receiver, sender in pipes:
            sender.close()
            receiver.recv()  # EOFError if that worker died before it could listen
        # Announced once every worker listens: whoever reads it may connect.
        processes = args.processes
        print(f"bench backend listening on 127.0.0.1:{port} ({processes} processes)", flush=True)
        if signal.sigwait(_STOP_SIGNALS) == signal.SIGCHLD:
            code = 1  # a worker died: stop the rest rather than serve short
    finally:
        for worker in workers:
            if worker.pid is not None:
                worker.terminate()
        for worker in workers:
            if worker.pid is not None:
                worker.join()
        reserved.close()
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
