"""``StatusPage``: what the status page and its JSON say, read from the parts that know.

The full ``/healthcheck`` and ``/status.json`` are read from the same
places when asked (``BackendsView``, the queue, admission, tenants), never copied:
the JSON adds the backends by model, the last minutes' charts
(``observe.history``), the tenants against their limits and the recent
warning lines (``observe.recent_warnings``). Its shape is a documented,
stable contract (``docs/status-page.md``): fields are added, never renamed
or removed, within one ``STATUS_VERSION``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from twisted.web.iweb import IRequest

from nixl_twisted import __version__
from nixl_twisted.admission import Admission, Tenancy
from nixl_twisted.backends.instances import Instance
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.identity import ID, VERSION
from nixl_twisted.observe.history import INTERVAL, WINDOW, History
from nixl_twisted.observe.recent_warnings import RecentWarnings
from nixl_twisted.protocol import routes
from nixl_twisted.web.backends_view import BackendsView
from nixl_twisted.web.status_html import CSP, asset, render

#: The version of ``/status.json``'s shape: a new one only for a change that is not an addition.
STATUS_VERSION = 1

#: The page's script and style, by path: (file, content type).
_ASSETS = {
    routes.STATUS_SCRIPT: ("status.js", b"text/javascript; charset=utf-8"),
    routes.STATUS_STYLE: ("status.css", b"text/css; charset=utf-8"),
}


class StatusPage:
    """The proxy as ``/healthcheck`` in full and the status page show it."""

    def __init__(
        self,
        view: BackendsView,
        serving: Serving,
        admission: Admission,
        tenancy: Tenancy,
        history: History,
        warnings: RecentWarnings,
        worker: int | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        """``history`` and ``warnings``: the charts' samples and the log's lines, kept while
        the proxy runs; ``worker``: which one this is, under ``--workers``; ``replicas``:
        this replica of the fleet (``--replicas-redis``)."""
        self.view, self.serving, self.admission, self.tenancy = view, serving, admission, tenancy
        self.history, self.warnings, self.worker = history, warnings, worker
        self.replicas = replicas

    @property
    def ready(self) -> bool:
        """Both pools have an instance up, the proxy is not leaving, and with
        ``--replicas-redis`` it has reached Redis once (``fleet.first_contact``)."""
        ready = self.view.backends.ready() and not self.admission.leaving
        return ready and not self.waiting_for_redis

    @property
    def waiting_for_redis(self) -> bool:
        """With ``--replicas-redis``: Redis has not answered this replica yet."""
        return self.replicas is not None and not self.replicas.first.reached

    def healthcheck(self) -> dict[str, Any]:
        """The full ``/healthcheck`` (``protocol.md``)."""
        return {
            "ready": self.ready,
            "waiting_for": self.waiting_for(),
            "prefill_instances": len(self.view.backends.prefill),
            "decode_instances": len(self.view.backends.decode),
            "draining": self.admission.draining,
            "shutting_down": self.admission.leaving,
            "in_flight": self.admission.in_flight,
            "pid": os.getpid(),
            "instances": self.view.instances(),
            "sources": self.view.report.sources(),
            "queues": self.serving.queues(),
            "replicas": self.replicas.status() if self.replicas is not None else None,
        }

    def waiting_for(self) -> str | None:
        """What the proxy waits for before it is ready, when that is Redis (``"redis"``)."""
        return "redis" if self.waiting_for_redis else None

    def snapshot(self) -> dict[str, Any]:
        """``/status.json`` (``docs/status-page.md``); the charts sample from now on."""
        self.history.looked_at()
        said = self.healthcheck()
        return {
            "status_version": STATUS_VERSION,
            "proxy": {
                "id": ID,
                "protocol_version": VERSION,
                "version": __version__,
                "pid": said["pid"],
                "worker": self.worker,
                "time": round(time.time(), 3),
                "ready": said["ready"],
                "draining": said["draining"],
                "shutting_down": said["shutting_down"],
                "in_flight": said["in_flight"],
            },
            "models": self.models(said["queues"]),
            "instances": said["instances"],
            "sources": said["sources"],
            "queues": said["queues"],
            "replicas": said["replicas"],
            "tenants": self.tenancy.limits.usage(windows=self.tenancy.shared is None),
            "history": {
                "interval_seconds": INTERVAL,
                "window_seconds": WINDOW,
                "points": self.history.points(),
            },
            "ttft_last_minute": self.history.ttft_last_minute(),
            "reuse": self.serving.legs.reuse_status(),
            "warnings": self.warnings.newest_first(),
        }

    def answer(self, request: IRequest) -> bytes:
        """The page, its JSON, its script or its style, as ``request``'s path asks; never
        cached (the page is live), never framed, scripts and styles from the proxy alone."""
        path = request.path.decode("utf-8", "replace")
        request.setHeader(b"Cache-Control", b"no-store")
        request.setHeader(b"X-Content-Type-Options", b"nosniff")
        if path in _ASSETS:
            name, content_type = _ASSETS[path]
            request.setHeader(b"Content-Type", content_type)
            return asset(name)
        if path == routes.STATUS_JSON:
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps(self.snapshot()).encode("utf-8")
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        request.setHeader(b"Content-Security-Policy", CSP.encode("ascii"))
        return render(self.snapshot())

    def models(self, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each model with the instances of each pool that serve it, and its queue; instances
        that have not said what they serve (and no table names) under ``null``."""
        by_model: dict[str | None, dict[str, Any]] = {}
        for pool in self.view.backends.pools():
            for instance in pool.instances:
                for model in _served(instance):
                    entry = by_model.setdefault(
                        model, {"model": model, "prefill": [], "decode": [], "queue": None}
                    )
                    entry[pool.role].append(instance.url)
        for queue in queues:
            entry = by_model.setdefault(
                queue["model"],
                {"model": queue["model"], "prefill": [], "decode": [], "queue": None},
            )
            entry["queue"] = queue
        slots = self.serving.legs.slots
        for entry in by_model.values():
            entry["measured"] = None if slots is None else slots.rates_of(entry["model"])
        return sorted(by_model.values(), key=lambda m: (m["model"] is None, m["model"] or ""))


def _served(instance: Instance) -> list[str | None]:
    """What an instance serves, as far as is known: its own list, else a table's, else None."""
    known = sorted(instance.models) if instance.models is not None else sorted(instance.named)
    return list(known) if known else [None]
