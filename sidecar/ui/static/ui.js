// pdwatch live page: reads the sidecar's JSON API, draws it, and does it again every few seconds.
// Plain browser JavaScript (no build step); charts by the vendored uPlot (ui/vendor/README.md).
"use strict";

(function () {
  // ---- errors: kept where a test (or a person in devtools) can read them ------------------------
  const errors = [];
  const consoleError = console.error.bind(console);
  console.error = (...args) => { errors.push(args.map(String).join(" ")); consoleError(...args); };
  window.addEventListener("error", (e) => errors.push(String(e.message || e)));
  window.addEventListener("unhandledrejection", (e) => errors.push(String(e.reason)));

  // ---- settings from the page's query string ----------------------------------------------------
  const params = new URLSearchParams(location.search);
  const num = (name, dflt, lo, hi) => {
    const v = Number(params.get(name));
    return Number.isFinite(v) && v > 0 ? Math.min(Math.max(v, lo), hi) : dflt;
  };
  const REFRESH_S = num("refresh", 2, 0.5, 300);
  const WINDOW_S = num("window", 600, 30, 600); // the sidecar keeps 10 minutes of history
  const ROWS = Math.round(num("rows", 200, 10, 2000)); // the stuck table never grows past this
  // A link per trace to a trace store, e.g. ?trace_url=https://jaeger.example/trace/{trace_id}
  const TRACE_URL = params.get("trace_url") || "";
  const ROLE_ORDER = { prefill: 0, decode: 1, unified: 2 };
  const STAGE_COLORS = { bootstrap: "#8c6bb1", queued: "#f2a541", prefill: "#2f7ed8", transfer: "#17a2b8",
                         decode: "#3cb371" };
  const GPU_COLORS = ["#2f7ed8", "#e8743b", "#19a979", "#945ecf", "#13a4b4", "#bf399e", "#6c8893", "#ee6868"];
  const RED = "#d62728";

  const state = { filter: "", open: new Set(), details: new Map(), charts: new Map(), renders: 0, paused: false,
                  timer: null, inflight: false, lastDraw: 0 };
  const ui = { state, errors, charts: state.charts, refresh: () => refresh(), firstRenderMs: null,
               lastRenderMs: null };
  window.pdwatchUI = ui;

  // ---- small helpers ----------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k === "style") el.style.cssText = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(el.dataset, v);
      else el.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  function dur(s) {
    if (s === null || s === undefined || !Number.isFinite(s)) return "–";
    if (s < 10) return `${s.toFixed(1)} s`;
    if (s < 120) return `${Math.round(s)} s`;
    if (s < 7200) return `${Math.floor(s / 60)}m ${String(Math.round(s % 60)).padStart(2, "0")}s`;
    return `${Math.floor(s / 3600)}h ${String(Math.round((s % 3600) / 60)).padStart(2, "0")}m`;
  }
  const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "–");
  const pct = (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)} %`);
  const shortId = (id) => `${id.slice(0, 8)}…${id.slice(-4)}`;

  class HttpError extends Error {
    constructor(path, status, text) {
      super(`${path} answered ${status}${text ? ": " + text.slice(0, 160) : ""}`);
      this.status = status;
    }
  }
  async function getJSON(path) {
    // Relative paths: "api/v1/…" from /ui is /api/v1/…, and stays right under a proxy's prefix.
    const r = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
    if (!r.ok) throw new HttpError(path, r.status, await r.text().catch(() => ""));
    return r.json();
  }
  function traceLink(id) {
    return TRACE_URL ? TRACE_URL.split("{trace_id}").join(encodeURIComponent(id)) : null;
  }

  // ---- the refresh loop -------------------------------------------------------------------------
  async function refresh() {
    if (state.inflight) { state.again = true; return; } // e.g. a new filter while a refresh runs
    state.inflight = true;
    state.again = false;
    clearTimeout(state.timer);
    const t0 = performance.now();
    try {
      const q = new URLSearchParams({ limit: String(ROWS), q: state.filter });
      const [summary, diagnosis, history, stuck] = await Promise.all([
        getJSON("api/v1/summary"), getJSON("api/v1/diagnosis"),
        getJSON(`api/v1/history?seconds=${WINDOW_S}`), getJSON(`ui/api/stuck?${q}`),
      ]);
      await Promise.all([...state.open].map(loadDetail));
      render(summary, diagnosis, history, stuck);
      const ms = performance.now() - t0;
      ui.lastRenderMs = ms;
      state.renders += 1;
      if (ui.firstRenderMs === null) ui.firstRenderMs = performance.now();
      // The marker tests and the bench wait for: a full render is on screen.
      document.documentElement.dataset.renders = String(state.renders);
      setStatus(`sidecar time ${clock(summary.at_unix_s)} · ${summary.tracked_legs} open legs tracked · ` +
                `drawn in ${Math.round(ms)} ms · every ${REFRESH_S} s`);
      banner(null);
    } catch (e) {
      banner(e.status === 401
        ? "The sidecar wants its bearer token (PDWATCH_TOKEN): open this page through something that adds " +
          "the Authorization header (see docs/ui.md)."
        : `Cannot read the sidecar: ${e.message || e}`);
    } finally {
      state.inflight = false;
      if (!state.paused) state.timer = setTimeout(refresh, state.again ? 0 : REFRESH_S * 1000);
    }
  }

  async function loadDetail(id) {
    try {
      state.details.set(id, await getJSON(`api/v1/requests/${id}`));
    } catch (e) {
      state.details.set(id, { trace_id: id, error: e.status === 404 ? "the sidecar no longer knows this request"
                                                                      : String(e.message || e) });
    }
  }

  function setStatus(text) { $("status").textContent = text; }
  function banner(text) {
    const b = $("banner");
    b.hidden = !text;
    b.textContent = text || "";
  }

  function render(summary, diagnosis, history, stuck) {
    renderClusters(summary);
    renderDiagnosis(diagnosis);
    renderStuck(stuck);
    renderInstances(summary, history);
  }

  // ---- clusters and diagnosis -------------------------------------------------------------------
  function renderClusters(summary) {
    const cards = Object.entries(summary.clusters || {}).map(([name, cl]) => {
      let ok = 0, open = 0;
      for (const byOutcome of Object.values(cl.finished || {})) ok += byOutcome.ok || 0;
      for (const byStage of Object.values(cl.open || {})) for (const n of Object.values(byStage)) open += n;
      const reasons = Object.entries(cl.stuck_by_reason || {}).map(([r, n]) => `${r} ${n}`).join(", ");
      return h("div", { class: `cluster${cl.stuck ? " has-stuck" : ""}` },
        h("div", { class: "name", text: name }),
        h("div", {}, h("b", { text: cl.stuck }), " stuck", reasons ? ` (by reason: ${reasons})` : ""),
        h("div", {}, h("b", { text: open }), " open · ", h("b", { text: ok }), " finished ok"),
        h("div", { class: cl.flowing ? "ok" : "warn", text: cl.flowing ? "others flowing" : "nothing finished ok lately" }));
    });
    $("clusters").replaceChildren(...cards);
  }

  function renderDiagnosis(verdicts) {
    const root = $("diagnosis");
    if (!verdicts.length) {
      root.replaceChildren(h("p", { class: "muted", text: "No cluster reports to this sidecar yet." }));
      return;
    }
    root.replaceChildren(...verdicts.map((v) => {
      if (!v.family) {
        return h("div", { class: "verdict none" },
          h("div", { class: "family" }, `${v.cluster}: no failure suspected`),
          (v.evidence || []).length ? h("ul", {}, v.evidence.map((s) => h("li", { text: s }))) : null);
      }
      const others = (v.findings || []).slice(1);
      return h("div", { class: "verdict", dataset: { family: v.family } },
        h("div", { class: "family" }, h("span", { class: "cl", text: v.cluster }),
          h("span", { class: "fam", text: v.family.replace(/_/g, " ") }),
          h("span", { class: "conf" }, h("span", { class: "confbar", style: `width:${Math.round(v.confidence * 100)}%` }),
            h("span", { class: "conftext", text: `confidence ${v.confidence.toFixed(2)}` }))),
        h("ul", { class: "evidence" }, (v.evidence || []).map((s) => h("li", { text: s }))),
        h("div", { class: "action" }, h("b", { text: "Action: " }), v.action),
        Array.isArray(v.contrast) && v.contrast.length ? contrastTable(v.contrast) : null,
        Array.isArray(v.captures) && v.captures.length ? captures(v.captures) : null,
        others.length ? h("details", { class: "others" }, h("summary", { text: `also considered (${others.length})` }),
          others.map((f) => h("div", { class: "finding" },
            h("b", { text: `${f.family.replace(/_/g, " ")} ` }), `(${f.confidence.toFixed(2)})`,
            h("ul", {}, (f.evidence || []).map((s) => h("li", { text: s })))))) : null);
    }));
  }

  function contrastTable(rows) {
    const frac = (x) => (typeof x === "number" ? pct(x) : x ?? "–");
    return h("div", { class: "contrast" }, h("div", { class: "sub", text: "What the stuck legs share, against those that flow" }),
      h("table", {}, h("thead", {}, h("tr", {}, ["attribute", "value", "stuck", "flowing"].map((t) => h("th", { text: t })))),
        h("tbody", {}, rows.map((r) => h("tr", {}, h("td", { text: r.attribute ?? "" }), h("td", { text: r.value ?? "" }),
          h("td", { text: frac(r.stuck) }), h("td", { text: frac(r.flowing) }))))));
  }

  function captures(list) {
    return h("details", { class: "captures" }, h("summary", { text: `stacks of stuck engines (${list.length})` }),
      list.map((c) => {
        if (typeof c === "string") return h("pre", { text: c });
        const head = ["pd_instance", "role", "pid", "tp_rank", "thread", "at_unix_s"]
          .filter((k) => c[k] !== undefined && c[k] !== null).map((k) => `${k} ${k === "at_unix_s" ? clock(c[k]) : c[k]}`);
        const body = c.stack ?? c.text ?? c.stacks ?? c.threads;
        return h("div", { class: "capture" }, h("div", { class: "sub", text: head.join(" · ") }),
          h("pre", { text: typeof body === "string" ? body : JSON.stringify(body ?? c, null, 2) }));
      }));
  }

  // ---- stuck legs -------------------------------------------------------------------------------
  function renderStuck(page) {
    $("stuck-count").textContent = page.total ? `${page.total}` : "none";
    const chips = [
      ...page.by_stage.map((g) => chip(`${g.role} ${g.stage}`, g.stuck, `${g.role} ${g.stage}`, g.cluster)),
      ...Object.entries(page.by_reason).map(([r, n]) => chip(r, n, r)),
    ];
    $("stuck-chips").replaceChildren(...chips);
    const body = $("stuck-body");
    const rows = [];
    const placed = new Set();
    for (const s of page.legs) {
      const isOpen = state.open.has(s.trace_id);
      rows.push(stuckRow(s, isOpen));
      if (isOpen && !placed.has(s.trace_id)) {
        placed.add(s.trace_id);
        rows.push(waterfallRow(s.trace_id));
      }
    }
    if (!page.legs.length) {
      rows.push(h("tr", { class: "empty" }, h("td", { colspan: 8,
        text: page.total ? "no stuck leg matches the filter" : "nothing is stuck" })));
    }
    body.replaceChildren(...rows);
    const more = $("stuck-more");
    const hidden = page.matched - page.legs.length;
    more.hidden = hidden <= 0 && page.matched === page.total;
    more.textContent = (page.matched !== page.total ? `${page.matched} of ${page.total} match the filter. ` : "") +
      (hidden > 0 ? `Showing the oldest ${page.legs.length}; ${hidden} more: narrow the filter to see them.` : "");
  }

  function chip(label, n, filterText, cluster) {
    return h("button", { type: "button", class: "chip", title: cluster ? `cluster ${cluster}` : null,
                         onclick: () => setFilter(state.filter === filterText ? "" : filterText) },
      label, h("b", { text: ` ${n}` }));
  }

  function setFilter(text) {
    state.filter = text;
    $("filter").value = text;
    refresh();
  }

  function stuckRow(s, isOpen) {
    const ratio = s.threshold_s > 0 ? s.stage_age_s / s.threshold_s : 0;
    const toggle = () => toggleWaterfall(s.trace_id);
    return h("tr", { class: `leg${isOpen ? " expanded" : ""}`, tabindex: "0", dataset: { traceId: s.trace_id, role: s.role },
                     title: s.why || "", onclick: toggle,
                     onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(); } } },
      h("td", { class: "mono" }, h("span", { class: "caret", text: isOpen ? "▾ " : "▸ " }), s.trace_id),
      h("td", { text: s.role }),
      h("td", {}, h("span", { class: "stage-dot", style: `background:${STAGE_COLORS[s.stage] || "#888"}` }), s.stage),
      h("td", { class: "age" },
        h("span", { class: "agebar" }, h("span", { style: `width:${Math.min(100, ratio * 25).toFixed(1)}%` })),
        `${dur(s.stage_age_s)} / ${dur(s.threshold_s)}`),
      h("td", {}, h("span", { class: `reason r-${s.reason}`, text: s.reason }),
        s.others_flowing ? null : h("span", { class: "muted", text: " (nothing flows)" })),
      h("td", { text: s.pd_instance }),
      h("td", { class: "mono small", text: s.peer || "–" }),
      h("td", { text: s.cluster }));
  }

  async function toggleWaterfall(id) {
    if (state.open.has(id)) {
      state.open.delete(id);
      state.details.delete(id);
      document.querySelectorAll(`tr.waterfall-row[data-trace-id="${id}"]`).forEach((r) => r.remove());
      document.querySelectorAll(`tr.leg[data-trace-id="${id}"]`).forEach((r) => {
        r.classList.remove("expanded");
        r.querySelector(".caret").textContent = "▸ ";
      });
      return;
    }
    state.open.add(id);
    const first = document.querySelector(`tr.leg[data-trace-id="${id}"]`);
    if (!first) return;
    document.querySelectorAll(`tr.leg[data-trace-id="${id}"]`).forEach((r) => {
      r.classList.add("expanded");
      r.querySelector(".caret").textContent = "▾ ";
    });
    first.after(waterfallRow(id));
    await loadDetail(id);
    // A refresh may have redrawn the table meanwhile: replace whichever row holds this waterfall now.
    if (state.open.has(id)) {
      document.querySelectorAll(`tr.waterfall-row[data-trace-id="${id}"]`).forEach((r) => r.replaceWith(waterfallRow(id)));
    }
  }

  // ---- the two-leg waterfall ----------------------------------------------------------------------
  function waterfallRow(id) {
    return h("tr", { class: "waterfall-row", dataset: { traceId: id } },
      h("td", { colspan: 8 }, waterfall(id, state.details.get(id))));
  }

  function waterfall(id, detail) {
    const link = traceLink(id);
    const head = h("div", { class: "wf-head" }, h("b", { text: "trace " }), h("span", { class: "mono", text: id }),
      link ? h("a", { href: link, target: "_blank", rel: "noopener", text: " open in the trace store ↗" }) : null,
      h("span", { class: "muted mono", text: ` · pdwatch trace ${id}` }));
    if (!detail) return h("div", { class: "waterfall loading", dataset: { traceId: id } }, head, h("p", { class: "muted", text: "loading…" }));
    if (detail.error) return h("div", { class: "waterfall", dataset: { traceId: id } }, head, h("p", { class: "warn", text: detail.error }));
    // "Now" in the engines' time: an open leg's stage entry plus its age (what the sidecar judged).
    const nows = detail.legs.filter((l) => l.state === "open" && l.stage_since_unix_s != null)
      .map((l) => l.stage_since_unix_s + l.stage_age_s);
    const starts = [], ends = [...nows];
    for (const leg of detail.legs) {
      if (leg.arrived_unix_s != null) starts.push(leg.arrived_unix_s);
      if (leg.ended_unix_s != null) ends.push(leg.ended_unix_s);
      for (const s of leg.stages) { starts.push(s.start_unix_s); ends.push(s.end_unix_s); }
      if (leg.stage_since_unix_s != null) starts.push(leg.stage_since_unix_s);
    }
    const now = nows.length ? Math.max(...nows) : Math.max(...ends);
    const t0 = Math.min(...starts), t1 = Math.max(now, ...ends);
    const span = Math.max(t1 - t0, 1e-3);
    const x = (t) => `${(((t - t0) / span) * 100).toFixed(3)}%`;
    const w = (a, b) => `${Math.max(((b - a) / span) * 100, 0).toFixed(3)}%`;
    const rows = [];
    for (const leg of detail.legs) {
      const title = leg.state === "open" ? (leg.stuck ? `open · STUCK (${leg.reason})` : "open") : `done: ${leg.outcome}`;
      rows.push(h("div", { class: `wf-leg${leg.stuck ? " stuck" : ""}` },
        h("div", { class: "wf-label" }, h("b", { text: leg.role }), ` @ ${leg.pd_instance}`),
        h("div", { class: "wf-track" }, h("div", { class: "wf-span", style: `left:${x(leg.arrived_unix_s ?? t0)};width:${w(leg.arrived_unix_s ?? t0, leg.ended_unix_s ?? now)}` })),
        h("div", { class: "wf-note", text: title, title: leg.why || "" })));
      if (leg.stuck && leg.why) {
        rows.push(h("div", { class: "wf-why" }, `${leg.role} @ ${leg.pd_instance}: ${leg.why}`,
          leg.peer ? ` · peer ${leg.peer}` : "", leg.error ? ` · engine error: ${leg.error}` : ""));
      }
      for (const s of leg.stages) {
        rows.push(stageRow(s.stage, s.start_unix_s, s.end_unix_s, { error: s.error }));
      }
      if (leg.state === "open" && leg.stage_since_unix_s != null) {
        rows.push(stageRow(leg.stage, leg.stage_since_unix_s, now,
          { open: true, stuck: leg.stuck, threshold: leg.threshold_s, age: leg.stage_age_s }));
      }
    }
    function stageRow(stage, a, b, o) {
      const bar = h("div", { class: `wf-bar${o.open ? " open" : ""}${o.stuck ? " stuck" : ""}${o.error ? " error" : ""}`,
                             style: `left:${x(a)};width:${w(a, b)};--c:${STAGE_COLORS[stage] || "#888"}`,
                             title: `${stage}: ${dur(b - a)}${o.error ? ` — ${o.error}` : ""}` });
      const marks = [];
      if (o.open && o.threshold != null && a + o.threshold <= t1) {
        marks.push(h("div", { class: "wf-threshold", style: `left:${x(a + o.threshold)}`, title: `threshold ${dur(o.threshold)}` }));
      }
      const note = o.open
        ? `${dur(o.age ?? b - a)} so far${o.threshold != null ? ` (threshold ${dur(o.threshold)})` : ""}${o.stuck ? " STUCK" : ""}`
        : `${dur(b - a)}${o.error ? ` — ${o.error}` : ""}`;
      return h("div", { class: "wf-stage" }, h("div", { class: "wf-label", text: `  ${stage}` }),
        h("div", { class: "wf-track" }, bar, ...marks), h("div", { class: `wf-note${o.stuck ? " bad" : ""}`, text: note }));
    }
    const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) =>
      h("span", { class: "wf-tick", style: `left:${f * 100}%`, text: `+${dur(f * span)}` }));
    return h("div", { class: "waterfall", dataset: { traceId: id } }, head,
      h("div", { class: "wf-grid" }, rows,
        h("div", { class: "wf-stage axis" }, h("div", { class: "wf-label", text: clock(t0) }),
          h("div", { class: "wf-track" }, ticks), h("div", { class: "wf-note", text: "engine time" }))));
  }

  // ---- instances and their charts ---------------------------------------------------------------
  function renderInstances(summary, history) {
    $("window-label").textContent = `last ${dur(WINDOW_S)}`;
    const byKey = new Map();
    for (const s of history.instances || []) byKey.set(`${s.cluster}/${s.pd_instance}`, s);
    const insts = [...(summary.instances || [])].sort((a, b) =>
      a.cluster.localeCompare(b.cluster) || (ROLE_ORDER[a.role] ?? 9) - (ROLE_ORDER[b.role] ?? 9) ||
      a.pd_instance.localeCompare(b.pd_instance));
    const root = $("instances");
    const seen = new Set();
    // Restarts are marked on every instance of the cluster: a peer's restart is often the cause.
    const restarts = new Map();
    for (const inst of insts) {
      for (const t of inst.restart_times_unix_s || []) {
        if (!restarts.has(inst.cluster)) restarts.set(inst.cluster, []);
        restarts.get(inst.cluster).push({ t, name: inst.pd_instance });
      }
    }
    for (const inst of insts) {
      const key = `${inst.cluster}/${inst.pd_instance}`;
      seen.add(key);
      let card = root.querySelector(`.instance[data-key="${CSS.escape(key)}"]`);
      if (!card) {
        card = h("div", { class: "instance", dataset: { key } }, h("div", { class: "inst-head" }),
          h("div", { class: "charts" }));
      }
      root.append(card); // keeps the sorted order
      card.querySelector(".inst-head").replaceWith(instanceHead(inst, byKey.get(key)));
      drawCharts(card.querySelector(".charts"), key, inst, byKey.get(key), restarts.get(inst.cluster) || []);
    }
    for (const card of [...root.children]) {
      if (!seen.has(card.dataset.key)) {
        for (const name of [...state.charts.keys()]) {
          if (name.startsWith(card.dataset.key + "|")) { state.charts.get(name).destroy(); state.charts.delete(name); }
        }
        card.remove();
      }
    }
    if (!insts.length) root.replaceChildren(h("p", { class: "muted", text: "No engine has sent a heartbeat yet." }));
  }

  function instanceHead(inst, series) {
    const ranks = inst.ranks || [];
    const hbAge = ranks.reduce((m, r) => (r.heartbeat_age_s != null ? Math.max(m, r.heartbeat_age_s) : m), 0);
    const open = Object.values(inst.open || {}).reduce((a, b) => a + b, 0);
    const stuckNow = series && series.stuck.length ? series.stuck[series.stuck.length - 1] : 0;
    const loop = inst.loop_frozen ? ["bad", "loop frozen"] : inst.loop_stalled ? ["warn", "loop stalled"] : ["ok", "loop advancing"];
    const last = inst.restart_times_unix_s && inst.restart_times_unix_s.length
      ? inst.restart_times_unix_s[inst.restart_times_unix_s.length - 1] : null;
    return h("div", { class: "inst-head" },
      h("span", { class: "inst-name", text: inst.pd_instance }),
      h("span", { class: `role role-${inst.role}`, text: inst.role }),
      h("span", { class: "muted", text: inst.cluster }),
      h("span", { class: `badge ${inst.up ? "ok" : "bad"}`, text: inst.up ? "up" : "DOWN" }),
      h("span", { class: `badge ${loop[0]}`, text: loop[1] }),
      h("span", { class: "badge plain", text: `heartbeat ${dur(hbAge)} ago` }),
      h("span", { class: "badge plain" }, h("b", { text: open }), " open"),
      h("span", { class: `badge ${stuckNow ? "bad" : "plain"}` }, h("b", { text: stuckNow }), " stuck"),
      h("span", { class: `badge ${inst.restarts ? "warn" : "plain"}`,
                  text: `${inst.restarts} restart${inst.restarts === 1 ? "" : "s"}${last ? `, last ${clock(last)}` : ""}` }));
  }

  // Bands (instance down, loop frozen) under the series; restarts as red lines over them.
  function marksPlugin(marks) {
    const bandsAt = (u, list, color) => {
      for (const [a, b] of list) {
        const x0 = u.valToPos(a, "x", true), x1 = u.valToPos(b, "x", true);
        u.ctx.fillStyle = color;
        u.ctx.fillRect(x0, u.bbox.top, Math.max(x1 - x0, 1), u.bbox.height);
      }
    };
    return {
      hooks: {
        drawClear: [(u) => {
          u.ctx.save();
          bandsAt(u, marks.current.down, "rgba(120,120,120,0.25)");
          bandsAt(u, marks.current.frozen, "rgba(242,165,65,0.25)");
          u.ctx.restore();
        }],
        draw: [(u) => {
          const { ctx } = u;
          ctx.save();
          ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
          ctx.font = `${11 * devicePixelRatio}px sans-serif`;
          for (const r of marks.current.restarts) {
            const xp = u.valToPos(r.t, "x", true);
            if (xp < u.bbox.left || xp > u.bbox.left + u.bbox.width) continue;
            ctx.strokeStyle = ctx.fillStyle = r.own ? RED : "rgba(214,39,40,0.45)";
            ctx.lineWidth = (r.own ? 2 : 1.5) * devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(xp, u.bbox.top);
            ctx.lineTo(xp, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.fillText(r.label, xp + 3 * devicePixelRatio, u.bbox.top + 11 * devicePixelRatio);
          }
          ctx.restore();
        }],
      },
    };
  }

  function runs(t, flags) {
    // [start, end] of each run of true values: a sample stands for the time up to the next one.
    const out = [];
    let start = null;
    for (let i = 0; i < t.length; i++) {
      if (flags[i] && start === null) start = t[i];
      if (!flags[i] && start !== null) { out.push([start, t[i]]); start = null; }
    }
    if (start !== null) out.push([start, t[t.length - 1]]);
    return out;
  }

  function drawCharts(box, key, inst, series, restarts) {
    if (!series || !series.t.length) {
      if (!box.querySelector(".muted")) box.replaceChildren(h("p", { class: "muted", text: "no history yet" }));
      return;
    }
    box.querySelector("p.muted")?.remove();
    const t = series.t;
    const marks = { restarts: restarts.filter((r) => r.t >= t[0] - 1)
                      .map((r) => ({ t: r.t, own: r.name === inst.pd_instance, label: r.name === inst.pd_instance ? "restart" : `${r.name} restart` })),
                    down: runs(t, series.up.map((u) => !u)), frozen: runs(t, series.loop_frozen) };
    const stages = Object.keys(series.open).sort((a, b) => stageRank(inst.role, a) - stageRank(inst.role, b));
    const rate = series.finished_ok.map((v, i) => {
      if (i === 0) return null;
      const d = v - series.finished_ok[i - 1], dt = t[i] - t[i - 1];
      return d >= 0 && dt > 0 ? d / dt : null;
    });
    const specs = [
      { name: "legs", title: "open legs by stage, and stuck",
        series: [...stages.map((s) => ({ label: s, stroke: STAGE_COLORS[s] || "#888", width: 1.5 })),
                 { label: "stuck", stroke: RED, width: 2.5 }],
        data: [...stages.map((s) => series.open[s]), series.stuck] },
      { name: "flow", title: "finished ok per second",
        series: [{ label: "ok/s", stroke: "#19a979", fill: "rgba(25,169,121,0.12)", width: 1.5 }], data: [rate] },
    ];
    if (series.gpus.length) {
      specs.push({ name: "util", title: "GPU utilization %", range: [0, 100],
        series: series.gpus.map((g, i) => ({ label: `GPU ${g.gpu}`, stroke: GPU_COLORS[i % GPU_COLORS.length], width: 1.5 })),
        data: series.gpus.map((g) => g.utilization.map((v) => (v == null ? null : v * 100))) });
      const limit = Math.max(0, ...series.gpus.map((g) => g.power_limit_w || 0));
      specs.push({ name: "power", title: `GPU power W${limit ? ` (limit ${Math.round(limit)} W dashed)` : ""}`,
        range: [0, limit ? limit * 1.05 : null],
        series: [...series.gpus.map((g, i) => ({ label: `GPU ${g.gpu}`, stroke: GPU_COLORS[i % GPU_COLORS.length], width: 1.5 })),
                 ...(limit ? [{ label: "limit", stroke: "#555", dash: [6, 4], width: 1 }] : [])],
        data: [...series.gpus.map((g) => g.power_w), ...(limit ? [t.map(() => limit)] : [])] });
    } else {
      specs.push({ name: "nogpu", empty: "no GPU telemetry joined to this instance" });
    }
    const want = new Set(specs.map((s) => `${key}|${s.name}|${s.series ? s.series.map((x) => x.label).join(",") : ""}`));
    for (const [name, chart] of [...state.charts]) {
      if (name.startsWith(key + "|") && !want.has(name)) { chart.destroy(); state.charts.delete(name); }
    }
    const kept = [];
    for (const spec of specs) {
      if (spec.empty) { kept.push(h("div", { class: "chart empty", text: spec.empty })); continue; }
      const id = `${key}|${spec.name}|${spec.series.map((x) => x.label).join(",")}`;
      let chart = state.charts.get(id);
      const data = [t, ...spec.data];
      if (chart) {
        chart._marks.current = marks;
        chart.setData(data);
        kept.push(chart._pdwatchBox);
        continue;
      }
      const holder = h("div", { class: "chart", dataset: { chart: spec.name } }, h("div", { class: "chart-title", text: spec.title }));
      const ref = { current: marks };
      const width = Math.max(260, (box.clientWidth || 1200) / Math.min(specs.length, 4) - 16);
      chart = new uPlot({
        width, height: 150, plugins: [marksPlugin(ref)], legend: { live: true },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: spec.range ? { range: (u, lo, hi) => [spec.range[0], spec.range[1] ?? Math.max(hi, 1)] }
                                              : { range: (u, lo, hi) => [0, Math.max(hi * 1.1, 1)] } },
        axes: [{ stroke: "#555", grid: { stroke: "#eee" } }, { stroke: "#555", grid: { stroke: "#eee" }, size: 44 }],
        series: [{}, ...spec.series.map((s) => ({ ...s, points: { show: false }, spanGaps: false }))],
      }, data, holder);
      chart._marks = ref;
      chart._pdwatchBox = holder;
      state.charts.set(id, chart);
      kept.push(holder);
    }
    box.replaceChildren(...kept);
  }

  function stageRank(role, stage) {
    const order = { prefill: ["bootstrap", "queued", "prefill", "transfer"], decode: ["bootstrap", "transfer", "queued", "decode"],
                    unified: ["queued", "prefill", "decode"] }[role] || [];
    const i = order.indexOf(stage);
    return i < 0 ? 99 : i;
  }

  // Charts follow the window's width.
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const chart of state.charts.values()) {
        const box = chart._pdwatchBox.parentElement;
        if (!box) continue;
        const n = box.children.length || 1;
        chart.setSize({ width: Math.max(260, box.clientWidth / Math.min(n, 4) - 16), height: 150 });
      }
    }, 150);
  });

  // ---- controls ---------------------------------------------------------------------------------
  let filterTimer = null;
  $("filter").addEventListener("input", (e) => {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(() => { state.filter = e.target.value.trim(); refresh(); }, 250);
  });
  $("pause").addEventListener("click", (e) => {
    state.paused = !state.paused;
    e.target.textContent = state.paused ? "resume" : "pause";
    if (state.paused) clearTimeout(state.timer); else refresh();
  });

  refresh();
})();
