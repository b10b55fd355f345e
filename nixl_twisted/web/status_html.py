"""The status page as HTML: the fleet, tenants and warnings as tables, readable without a script.

Rendered from ``/status.json``'s own value (``StatusPage.snapshot``), every
piece of data through ``html.escape``: instance URLs, model and tenant names
and log lines come from outside. ``status.js`` then refreshes the same
tables from the JSON and draws the charts; ``status.css`` lays them out for
a narrow screen too. Nothing is loaded from anywhere but the proxy
(``CSP``), so the page works in an air-gapped cluster.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from importlib.resources import files
from typing import Any

#: Scripts, styles and fetches from the proxy alone; no frames, no plugins, no inline code
#: (``data:`` images: the page's empty icon, so that no browser asks for /favicon.ico).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

#: The instance table's columns, as ``status.js`` fills them too.
COLUMNS = (
    "pool",
    "instance",
    "state",
    "from",
    "legs",
    "running",
    "waiting",
    "KV use",
    "KV events",
    "last error",
)


def asset(name: str) -> bytes:
    """``status.js`` or ``status.css``, as shipped in the package."""
    return files("nixl_twisted.web").joinpath("static").joinpath(name).read_bytes()


def _e(value: object) -> str:
    return escape("—" if value is None else str(value), quote=True)


def _row(cells: Iterable[object], attributes: str = "") -> str:
    return f"<tr{attributes}>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>"


def _table(head: Iterable[str], rows: list[str], table_id: str | None = None) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    named = "" if table_id is None else f' id="{table_id}"'
    return f"<table{named}><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def state_of(instance: dict[str, Any]) -> str:
    """An instance's state as the page says it: ``draining``, ``ejected`` (after failed legs
    in a row), else ``up``, ``down``, ``pending``."""
    if instance["draining"]:
        return "draining"
    return "ejected" if instance.get("ejected") else str(instance["state"])


def cells(pool: str, instance: dict[str, Any]) -> list[object]:
    """An instance's row, in ``COLUMNS``' order."""
    load = instance.get("load") or {}
    usage = load.get("kv_cache_usage")
    events = instance.get("kv_events")
    cap = instance.get("max_in_flight")
    legs = f"{instance['in_flight']}/{cap}" if cap is not None else str(instance["in_flight"])
    fleet = instance.get("fleet_cap")
    if fleet and fleet["held"] != fleet["highest"]:  # (--replicas-redis: the replicas differ)
        legs += (
            f" (replicas' caps differ: {fleet['held'] or 'none'} to {fleet['highest'] or 'none'})"
        )
    came = ", ".join([instance["source"], *instance.get("discovered_by", [])])
    kv = None
    if events is not None:
        kv = f"{events['blocks']} blocks" + (" (stale)" if events.get("state") == "stale" else "")
    return [
        pool,
        instance["url"],
        state_of(instance),
        came,
        legs,
        _number(load.get("running")),
        _number(load.get("waiting")),
        None if usage is None else f"{usage * 100:.0f}%",
        kv,
        instance.get("last_error"),
    ]


def _number(value: float | None) -> str | None:
    return None if value is None else f"{value:g}"


def _backends(status: dict[str, Any]) -> str:
    found = {(pool, i["url"]): i for pool, listed in status["instances"].items() for i in listed}
    parts = []
    for model in status["models"]:
        name = model["model"]
        title = "any model (not said yet)" if name is None else name
        queue = model.get("queue")
        waiting = (
            f"{queue['waiting']} waiting, the longest {queue['longest_seconds']} s"
            if queue
            else "nothing waiting"
        )
        rows = []
        for pool in ("prefill", "decode"):
            for url in model[pool]:
                instance = found[(pool, url)]
                state = state_of(instance)
                attributes = (
                    f' class="instance state-{_e(state)}" data-pool="{_e(pool)}"'
                    f' data-url="{_e(url)}"'
                )
                rows.append(_row(cells(pool, instance), attributes))
        parts.append(
            f'<section class="model"><h3>{_e(title)}</h3><p class="queue">queue: {_e(waiting)}</p>'
            f"{_measured(model.get('measured'))}{_table(COLUMNS, rows)}</section>"
        )
    return "".join(parts) or "<p>no instance</p>"


def _measured(measured: dict[str, float | None] | None) -> str:
    """The rates the queue measured for a model, and a new request's predicted first token
    (nothing while not measured)."""
    if not measured or measured["decode_drain_rate"] is None:
        return ""

    def ms(seconds: float | None) -> str:
        return "\u2014" if seconds is None else f"{round(seconds * 1000)} ms"

    said = (
        f"measured: {measured['decode_drain_rate']:.1f} decode slots freed/s, prefill "
        f"{ms(measured['prefill_seconds'])}, first byte {ms(measured['first_byte_seconds'])}; "
        f"a new request's first token predicted in "
        f"{ms(measured['predicted_first_token_seconds'])}"
    )
    return f'<p class="measured">{_e(said)}</p>'


def _tenants(status: dict[str, Any]) -> str:
    def against(used: object, limit: int) -> str:
        return f"{'—' if used is None else used}/{limit or '∞'}"

    rows = [
        _row(
            [
                t["tenant"],
                against(t["in_flight"], t["max_in_flight"]),
                against(t["requests_last_minute"], t["requests_per_minute"]),
                against(t["tokens_last_minute"], t["tokens_per_minute"]),
                t["refused_last_minute"],
            ],
            ' class="tenant"',
        )
        for t in status["tenants"]
    ]
    head = ("tenant", "in flight", "requests/min", "tokens/min", "refused (1 min)")
    return _table(head, rows, "tenant-table")


def _replicas(status: dict[str, Any]) -> str:
    replicas = status.get("replicas")
    if replicas is None:
        return "<p>One process: no --replicas-redis.</p>"
    said = "shared" if replicas["shared"] else "ALONE (Redis does not answer: static shares)"
    if not replicas.get("reached", True):
        said = f"NOT READY: Redis not reached since the start ({replicas.get('problem')})"
    rows = [
        _row(
            [
                r["id"],
                r["host"],
                r["pid"],
                r["worker"],
                "this one" if r["id"] == replicas["id"] else "",
            ],
            ' class="replica"',
        )
        for r in replicas["seen"]
    ]
    head = ("replica", "host", "pid", "worker", "")
    return f"<p>{_e(replicas['redis'])}: {_e(said)}</p>" + _table(head, rows, "replica-table")


def reuse_line(reuse: dict[str, Any]) -> str:
    """Multi-turn reuse in a line: off, or its lookups and handles by outcome."""
    if not reuse["on"]:
        off = reuse["handles"].get("off")
        if off:  # (decode pins blocks nobody reads: worth saying)
            return f"off; yet decode answered {off} handles (bidirectional_kv_xfer is on)"
        return "off"

    def counts(named: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(named.items())) or "none yet"

    where = "in Redis, for every replica" if reuse["shared"] else "here"
    return (
        f"on (handles for {reuse['lifetime_seconds']:g} s, kept {where}; "
        f"{reuse['kept_here']} held by this process): lookups {counts(reuse['lookups'])}; "
        f"handles {counts(reuse['handles'])}; {reuse['tokens_read']} prompt tokens read back"
    )


def _summary(status: dict[str, Any]) -> str:
    proxy = status["proxy"]
    said = [
        "ready" if proxy["ready"] else "NOT READY",
        f"{proxy['in_flight']} in flight",
        f"pid {proxy['pid']}",
    ]
    if proxy["worker"] is not None:
        said.append(f"worker {proxy['worker']}")
    if proxy["draining"]:
        said.append("draining")
    return " · ".join(said)


def render(status: dict[str, Any]) -> bytes:
    """The whole page, as of ``status`` (``StatusPage.snapshot``)."""
    warnings = "".join(
        f'<li class="level-{_e(w["level"])}">{_e(w["line"])}</li>' for w in status["warnings"]
    )
    ready = "ready" if status["proxy"]["ready"] else "not-ready"
    page = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nixlproxy status</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/status.css">
</head>
<body>
<header><h1>nixlproxy</h1><p id="summary" class="{ready}">{_e(_summary(status))}</p>
<p id="updated">as of page load</p></header>
<main>
<section id="backends"><h2>Backends</h2><div id="models">{_backends(status)}</div></section>
<section id="charts"><h2>Last minutes</h2>
<noscript><p>The charts need JavaScript; the tables are as of this page's load.</p></noscript>
<div id="chart-area"></div></section>
<section id="tenants"><h2>Tenants</h2>{_tenants(status)}</section>
<section id="replicas"><h2>Replicas</h2>{_replicas(status)}</section>
<section id="reuse"><h2>Multi-turn reuse</h2>
<p id="reuse-line">{_e(reuse_line(status["reuse"]))}</p></section>
<section id="warnings"><h2>Recent warnings</h2><ol id="warning-lines">{warnings}</ol></section>
</main>
<script src="/status.js"></script>
</body>
</html>
"""
    return page.encode("utf-8")
