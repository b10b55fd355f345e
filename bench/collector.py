"""An OTLP/HTTP collector process for ``bench.run --traced``: the spans it got, at SIGTERM.

    python -m bench.collector --port 4318

Serves ``nixl_twisted.testing.FakeCollector`` (it decodes every export, as a
collector does) and, when terminated, prints ``{"spans": N, "exports": M}``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    from nixl_twisted.testing import FakeCollector

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    collector = FakeCollector()

    def report() -> None:
        print(json.dumps({"spans": len(collector.spans), "exports": collector.exports}), flush=True)

    reactor.addSystemEventTrigger("before", "shutdown", report)  # SIGTERM stops the reactor
    reactor.callWhenRunning(
        lambda: ensureDeferred(collector.listen(f"tcp:{args.port}:interface=127.0.0.1"))
    )
    reactor.run()


if __name__ == "__main__":
    main()
