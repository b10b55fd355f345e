"""A man in the middle that spoils the KV handoff between the proxy and a vLLM instance.

Every request is passed to the instance (``--target``) as it is, but the
``kv_transfer_params`` of a JSON body are changed (``--set KEY=JSON``,
``--drop KEY``): in prefill's answers (``--rewrite answer``, the shim in front
of a prefill instance) or in the decode legs sent (``--rewrite request``, in
front of a decode instance, the proxy's metrics reads passed through). The
real checks of ``docs/performance.md``, "The handoff checked, and the silent
recompute caught"::

    # prefill's params unusable: the proxy refuses them, decode never sees them
    python -m bench.spoil_handoff --listen 9401 --target http://127.0.0.1:8104 \\
        --rewrite answer --set do_remote_prefill=false
    # params the proxy passes, that decode does not pull with: decode recomputes
    python -m bench.spoil_handoff --listen 9402 --target http://127.0.0.1:8200 \\
        --rewrite request --set do_remote_prefill=false
    twistd -n --pidfile= nixlproxy --listen tcp:9400 --prefill http://127.0.0.1:8104 \\
        --decode http://127.0.0.1:9402 --health-interval 3
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import treq
from twisted.internet import defer, endpoints, reactor
from twisted.web import resource, server
from twisted.web.http_headers import Headers

_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}


def spoiled(body: bytes, changes: dict[str, Any], dropped: list[str]) -> bytes:
    """``body`` with its ``kv_transfer_params`` changed, if it is a JSON object that has some."""
    try:
        whole = json.loads(body)
    except ValueError:
        return body
    if not isinstance(whole, dict) or not isinstance(whole.get("kv_transfer_params"), dict):
        return body
    params = whole["kv_transfer_params"]
    params.update(changes)
    for key in dropped:
        params.pop(key, None)
    return json.dumps(whole).encode()


class Spoiler(resource.Resource):
    isLeaf = True

    def __init__(self, target: str, rewrite: str, changes: dict[str, Any], dropped: list[str]):
        super().__init__()
        self.target = target.rstrip("/")
        self.rewrite = rewrite
        self.changes = changes
        self.dropped = dropped
        self.spoiled = 0

    def render(self, request: server.Request) -> int:
        defer.ensureDeferred(self._relay(request))
        return server.NOT_DONE_YET

    def _spoil(self, body: bytes) -> bytes:
        changed = spoiled(body, self.changes, self.dropped)
        if changed is not body:
            self.spoiled += 1
            print(f"spoiled {self.rewrite} {self.spoiled}", flush=True)
        return changed

    async def _relay(self, request: server.Request) -> None:
        assert request.content is not None
        headers = Headers(
            {k: v for k, v in request.requestHeaders.getAllRawHeaders() if k.lower() not in _HOP}
        )
        sent = request.content.read()
        if self.rewrite == "request" and sent:
            sent = self._spoil(sent)
        response = await treq.request(
            request.method.decode(),
            self.target + request.uri.decode(),
            headers=headers,
            data=sent or None,
            unbuffered=True,
        )
        request.setResponseCode(response.code)
        for name, values in response.headers.getAllRawHeaders():
            if name.lower() not in _HOP:
                request.responseHeaders.setRawHeaders(name, values)
        if self.rewrite == "answer" and request.method == b"POST":
            body = self._spoil(await response.content())
            request.setHeader(b"content-length", str(len(body)).encode())
            request.write(body)
        else:
            await treq.collect(response, request.write)  # (streams as they come)
        request.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    parser.add_argument("--target", required=True, help="the vLLM instance's URL")
    parser.add_argument("--rewrite", choices=("answer", "request"), required=True)
    parser.add_argument("--set", action="append", default=[], help="KEY=JSON; repeatable")
    parser.add_argument("--drop", action="append", default=[], help="KEY; repeatable")
    args = parser.parse_args()
    changes = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    site = server.Site(Spoiler(args.target, args.rewrite, changes, args.drop))
    endpoint = endpoints.TCP4ServerEndpoint(reactor, args.listen, interface="127.0.0.1")
    endpoint.listen(site)
    print(f"127.0.0.1:{args.listen} -> {args.target}: {args.rewrite} {changes} -{args.drop}")
    reactor.run()


if __name__ == "__main__":
    main()
