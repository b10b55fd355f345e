"""``python -m nixl_twisted.testing``: serve a fake prefill/decode pair from a shell."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from nixl_twisted.testing.harness import start_pair


def main(argv: Sequence[str] | None = None) -> None:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    parser = argparse.ArgumentParser(description="Serve a fake vLLM prefill/decode pair.")
    parser.add_argument("--prefill-listen", default="tcp:8100:interface=127.0.0.1")
    parser.add_argument("--decode-listen", default="tcp:8200:interface=127.0.0.1")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--token-interval", type=float, default=0.05)
    args = parser.parse_args(argv)

    async def serve() -> None:
        pair = await start_pair(
            reactor,
            args.prefill_listen,
            args.decode_listen,
            tokens=args.tokens,
            token_interval=args.token_interval,
        )
        print(f"fake prefill listening on {pair.prefill.url}", flush=True)
        print(f"fake decode listening on {pair.decode.url}", flush=True)

    def failed(failure: Any) -> None:
        print(f"fake vLLM could not start: {failure.getErrorMessage()}", file=sys.stderr)
        reactor.stop()

    reactor.callWhenRunning(lambda: ensureDeferred(serve()).addErrback(failed))
    reactor.run()


if __name__ == "__main__":
    main()
