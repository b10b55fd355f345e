// nixlproxy's status page: refreshes the server-rendered tables from /status.json
// every two seconds and draws the last minutes as small SVG charts.
// Data is only ever set as text (textContent) or as an attribute, never as markup:
// instance URLs, model and tenant names and log lines come from outside.
"use strict";

(function () {
  var EVERY_MS = 2000;
  var SVG = "http://www.w3.org/2000/svg";
  var COLUMNS = 10;

  function el(name, text, className) {
    var node = document.createElement(name);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function dash(value) {
    return value === null || value === undefined ? "\u2014" : String(value);
  }

  function number(value) {
    return value === null || value === undefined ? null : String(Math.round(value * 1000) / 1000);
  }

  function seconds(value) {
    return value === null || value === undefined ? "\u2014" : Math.round(value * 1000) + " ms";
  }

  function stateOf(instance) {
    if (instance.draining) return "draining";
    return instance.ejected ? "ejected" : String(instance.state);
  }

  // An instance's row, in the order of status_html.COLUMNS.
  function cells(pool, instance) {
    var load = instance.load || {};
    var cap = instance.max_in_flight;
    var events = instance.kv_events;
    var kv = null;
    if (events) kv = events.blocks + " blocks" + (events.state === "stale" ? " (stale)" : "");
    var usage = load.kv_cache_usage;
    var legs = cap === null || cap === undefined ? String(instance.in_flight) : instance.in_flight + "/" + cap;
    var fleet = instance.fleet_cap;
    if (fleet && fleet.held !== fleet.highest) {
      legs += " (replicas' caps differ: " + (fleet.held || "none") + " to " + (fleet.highest || "none") + ")";
    }
    return [
      pool,
      instance.url,
      stateOf(instance),
      [instance.source].concat(instance.discovered_by || []).join(", "),
      legs,
      number(load.running),
      number(load.waiting),
      usage === null || usage === undefined ? null : Math.round(usage * 100) + "%",
      kv,
      instance.last_error
    ];
  }

  function row(values, className) {
    var tr = el("tr", null, className);
    values.forEach(function (value) { tr.appendChild(el("td", dash(value))); });
    return tr;
  }

  function table(head, rows, id) {
    var t = el("table");
    if (id) t.id = id;
    var thead = el("thead");
    var tr = el("tr");
    head.forEach(function (h) { tr.appendChild(el("th", h)); });
    thead.appendChild(tr);
    t.appendChild(thead);
    var body = el("tbody");
    rows.forEach(function (r) { body.appendChild(r); });
    t.appendChild(body);
    return t;
  }

  function backends(status) {
    var found = {};
    ["prefill", "decode"].forEach(function (pool) {
      (status.instances[pool] || []).forEach(function (i) { found[pool + " " + i.url] = i; });
    });
    var models = document.getElementById("models");
    var head = Array.prototype.map.call(
      models.querySelectorAll("table thead th"), function (th) { return th.textContent; }
    ).slice(0, COLUMNS);
    var fresh = document.createDocumentFragment();
    status.models.forEach(function (model) {
      var section = el("section", null, "model");
      section.appendChild(el("h3", model.model === null ? "any model (not said yet)" : model.model));
      var q = model.queue;
      section.appendChild(el("p", "queue: " + (q ? q.waiting + " waiting, the longest " +
        q.longest_seconds + " s" : "nothing waiting"), "queue"));
      var m = model.measured;
      if (m && m.decode_drain_rate !== null) {
        section.appendChild(el("p", "measured: " + m.decode_drain_rate.toFixed(1) +
          " decode slots freed/s, prefill " + seconds(m.prefill_seconds) + ", first byte " +
          seconds(m.first_byte_seconds) + "; a new request's first token predicted in " +
          seconds(m.predicted_first_token_seconds), "measured"));
      }
      var rows = [];
      ["prefill", "decode"].forEach(function (pool) {
        model[pool].forEach(function (url) {
          var instance = found[pool + " " + url];
          var tr = row(cells(pool, instance), "instance state-" + stateOf(instance));
          tr.setAttribute("data-pool", pool);
          tr.setAttribute("data-url", url);
          rows.push(tr);
        });
      });
      section.appendChild(table(head, rows));
      fresh.appendChild(section);
    });
    if (!status.models.length) fresh.appendChild(el("p", "no instance"));
    models.replaceChildren(fresh);
  }

  function tenants(status) {
    function against(used, limit) { return dash(used) + "/" + (limit ? limit : "\u221e"); }
    var old = document.getElementById("tenant-table");
    var head = Array.prototype.map.call(old.querySelectorAll("thead th"),
      function (th) { return th.textContent; });
    var rows = status.tenants.map(function (t) {
      return row([t.tenant, against(t.in_flight, t.max_in_flight),
        against(t.requests_last_minute, t.requests_per_minute),
        against(t.tokens_last_minute, t.tokens_per_minute), t.refused_last_minute], "tenant");
    });
    old.replaceWith(table(head, rows, "tenant-table"));
  }

  function reuse(status) {
    var r = status.reuse, line;
    function counts(named) {
      var said = Object.keys(named).sort().map(function (k) { return k + " " + named[k]; });
      return said.length ? said.join(", ") : "none yet";
    }
    if (!r.on) {
      line = r.handles.off ? "off; yet decode answered " + r.handles.off +
        " handles (bidirectional_kv_xfer is on)" : "off";
    } else {
      line = "on (handles for " + r.lifetime_seconds + " s, kept " +
        (r.shared ? "in Redis, for every replica" : "here") + "; " + r.kept_here +
        " held by this process): lookups " + counts(r.lookups) + "; handles " +
        counts(r.handles) + "; " + r.tokens_read + " prompt tokens read back";
    }
    document.getElementById("reuse-line").textContent = line;
  }

  function warnings(status) {
    var list = document.getElementById("warning-lines");
    list.replaceChildren.apply(list, status.warnings.map(function (w) {
      return el("li", w.line, "level-" + w.level);
    }));
  }

  function summary(status) {
    var p = status.proxy;
    var said = [p.ready ? "ready" : "NOT READY", p.in_flight + " in flight", "pid " + p.pid];
    if (p.worker !== null) said.push("worker " + p.worker);
    if (p.draining) said.push("draining");
    var node = document.getElementById("summary");
    node.textContent = said.join(" \u00b7 ");
    node.className = p.ready ? "ready" : "not-ready";
    var updated = document.getElementById("updated");
    updated.textContent = "updated " + new Date(p.time * 1000).toLocaleTimeString();
    updated.className = "";
  }

  // Series by name from the points: pick(point) gives a value, or an object of named values.
  function series(points, pick) {
    var out = {};
    points.forEach(function (point, index) {
      var value = pick(point);
      var named = value !== null && typeof value === "object" ? value : { "": value };
      Object.keys(named).forEach(function (name) {
        if (!out[name]) out[name] = points.map(function () { return null; });
        out[name][index] = named[name];
      });
    });
    return out;
  }

  function chart(title, unit, points, pick) {
    var figure = el("figure", null, "chart");
    figure.appendChild(el("figcaption", title));
    var width = 300, height = 80;
    var svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", title);
    var all = series(points, pick);
    var names = Object.keys(all).sort();
    var top = 0;
    names.forEach(function (n) {
      all[n].forEach(function (v) { if (v !== null && v > top) top = v; });
    });
    top = top > 0 ? top * 1.1 : 1;
    var legend = el("ul", null, "legend");
    names.forEach(function (name, k) {
      var values = all[name];
      var step = values.length > 1 ? width / (values.length - 1) : width;
      var path = "";
      values.forEach(function (v, i) {
        if (v === null) return;
        var x = (i * step).toFixed(1), y = (height - (v / top) * (height - 4) - 2).toFixed(1);
        path += (path && values[i - 1] !== null ? " L" : " M") + x + " " + y;
      });
      var line = document.createElementNS(SVG, "path");
      line.setAttribute("d", path.trim() || "M0 " + height);
      line.setAttribute("class", "series series-" + (k % 6));
      svg.appendChild(line);
      var last = null;
      for (var i = values.length - 1; i >= 0; i--) if (values[i] !== null) { last = values[i]; break; }
      legend.appendChild(el("li", (name ? name + ": " : "") + dash(number(last)) + unit,
        "series-" + (k % 6)));
    });
    if (!names.length) legend.appendChild(el("li", "none"));
    figure.appendChild(svg);
    figure.appendChild(legend);
    return figure;
  }

  function charts(status) {
    var p = status.history.points;
    var area = document.getElementById("chart-area");
    area.replaceChildren(
      chart("requests per second", "/s", p, function (x) { return x.requests_per_second; }),
      chart("first token p50 / p99", " s", p, function (x) {
        return { p50: x.first_token_p50, p99: x.first_token_p99 };
      }),
      chart("handoff p50 / p99", " s", p, function (x) {
        return { p50: x.handoff_p50, p99: x.handoff_p99 };
      }),
      chart("decode-only share, by reason", "", p, function (x) { return x.decode_only; }),
      chart("prefix-cache hit rate, by policy", "", p, function (x) { return x.prefix_hit_rate; }),
      chart("refusals per second, by reason", "/s", p, function (x) { return x.refused_per_second; }),
      chart("first tokens on time, share by tenant class", "", p, function (x) {
        return x.ttft_on_time;
      })
    );
  }

  function refresh() {
    fetch("/status.json", { cache: "no-store", credentials: "same-origin" })
      .then(function (answer) {
        if (!answer.ok) throw new Error("HTTP " + answer.status);
        return answer.json();
      })
      .then(function (status) {
        summary(status);
        backends(status);
        charts(status);
        tenants(status);
        reuse(status);
        warnings(status);
      })
      .catch(function (error) {
        var node = document.getElementById("updated");
        node.textContent = "not updated: " + error.message;
        node.className = "stale";
      })
      .then(function () { window.setTimeout(refresh, EVERY_MS); });
  }

  refresh();
})();
