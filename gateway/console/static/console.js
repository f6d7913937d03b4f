// The triton-gateway SRE console. Plain JavaScript, no build step: every page is drawn with DOM
// calls (text goes in as text nodes, never as HTML), read from /console/api/* every 2 s while the
// tab is visible, and every change is a POST carrying the session's CSRF token.
"use strict";

const POLL_MS = 2000;
const COLORS = { reference: "#0072B2", canary: "#D55E00", floor: "#555555" };
const PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"];
const state = { session: null, route: null, timer: null, lastOk: null, failing: null, charts: new Map(),
  actionsFor: null, data: null };

// -- DOM helpers: text is always a text node ------------------------------------------------------
function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = String(value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}
const $ = (id) => document.getElementById(id);
function fill(el, ...children) {  // replaceChildren, with arrays flattened and nothing for null
  el.replaceChildren(...children.flat(2).filter((c) => c !== null && c !== undefined && c !== false));
}
const time = (at) => (at ? new Date(at * 1000).toLocaleTimeString() : "");
const stamp = (at) => (at ? new Date(at * 1000).toLocaleString() : "");
const pct = (x, digits = 2) => (x === null || x === undefined ? "–" : (x * 100).toFixed(digits) + "%");
const num = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toPrecision(digits));
const modelHref = (name) => "#/model/" + encodeURIComponent(name);
const canAct = () => state.session && state.session.role === "operator";

// -- the server ----------------------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  if (options.method && options.method !== "GET" && state.session) headers["X-CSRF-Token"] = state.session.csrf;
  const response = await fetch(path, { method: options.method || "GET", headers, credentials: "same-origin",
    cache: "no-store", body: options.body === undefined ? undefined : JSON.stringify(options.body) });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  return { status: response.status, ok: response.ok, body };
}

// -- login -----------------------------------------------------------------------------------------
function showLogin(message) {
  state.session = null;
  stopPolling();
  $("login").hidden = false;
  fill($("page"), );
  $("who").textContent = "";
  $("logout").hidden = true;
  $("nav").hidden = true;
  $("login-error").textContent = message || "";
  $("token").focus();
}

async function login(event) {
  event.preventDefault();
  const token = $("token").value;
  $("token").value = "";  // the page keeps no token
  let result;
  try { result = await api("/console/login", { method: "POST", body: { token } }); }
  catch (e) { $("login-error").textContent = "the gateway did not answer: " + e.message; return; }
  if (!result.ok) {
    $("login-error").textContent = "Login failed: " + ((result.body && result.body.error) || "HTTP " + result.status);
    $("token").focus();
    return;
  }
  startSession(result.body);
}

function startSession(session) {
  state.session = session;
  $("login").hidden = true;
  $("nav").hidden = false;
  $("who").textContent = session.actor + " (" + session.role + (session.role === "viewer" ? ", read-only" : "") + ")";
  $("logout").hidden = false;
  route();
}

async function logout() {
  await api("/console/logout", { method: "POST", body: {} });
  showLogin("Logged out.");
}

// -- routing and live updates ------------------------------------------------------------------------
function parseRoute() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  if (path.startsWith("model/")) return { page: "model", model: decodeURIComponent(path.slice(6)), params };
  if (path === "fleets" || path === "audit") return { page: path, params };
  return { page: "overview", params };
}

function route() {
  if (!state.session) return;
  state.route = parseRoute();
  state.actionsFor = null;
  for (const chart of state.charts.values()) chart.plot.destroy();
  state.charts.clear();
  for (const link of document.querySelectorAll("#nav a")) {
    if (link.dataset.page === state.route.page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  fill($("page"), h("p", { class: "muted", text: "Loading…" }));
  refresh();
}

function stopPolling() { clearTimeout(state.timer); state.timer = null; }

function schedule() {
  stopPolling();
  if (!document.hidden && state.session) state.timer = setTimeout(refresh, POLL_MS);
}

async function refresh() {
  stopPolling();
  const current = state.route;
  try {
    const url = { overview: "/console/api/overview", fleets: "/console/api/fleets",
      model: "/console/api/models/" + encodeURIComponent(current.model || ""),
      audit: "/console/api/audit?" + auditQuery(current.params) }[current.page];
    const result = await api(url);
    if (current !== state.route) return;
    if (result.status === 401) { showLogin("Your session ended: log in again."); return; }
    if (!result.ok) throw new Error((result.body && result.body.error) || "HTTP " + result.status);
    state.data = result.body;
    state.lastOk = Date.now();
    state.failing = result.body.store_up === false ? "the state store is down" : null;
    draw(current, result.body);
  } catch (e) {
    state.failing = e.message || String(e);
  }
  showFreshness();
  schedule();
}

function showFreshness() {
  const banner = $("stale");
  if (state.failing) {
    banner.hidden = false;
    banner.textContent = "Stale data: " + state.failing + (state.lastOk ? "; last update " +
      new Date(state.lastOk).toLocaleTimeString() : "") + ".";
  } else {
    banner.hidden = true;
  }
  $("live").textContent = document.hidden ? "paused (tab hidden)" :
    "live, every " + POLL_MS / 1000 + " s" + (state.lastOk ? " · updated " + new Date(state.lastOk).toLocaleTimeString() : "");
}

function draw(current, data) {
  if (current.page === "overview") drawOverview(data);
  else if (current.page === "fleets") drawFleets(data);
  else if (current.page === "audit") drawAudit(data, current.params);
  else drawModel(data);
}

// -- shared pieces -----------------------------------------------------------------------------------
function weightsBar(weights, label) {
  const entries = Object.entries(weights || {}).filter(([, w]) => w > 0);
  const bar = h("div", { class: "bar", role: "img", "aria-label": label + ": " +
    (entries.map(([v, w]) => "version " + v + " " + w + "%").join(", ") || "no weights") });
  entries.forEach(([version, weight], i) => {
    const seg = h("div", { class: "seg c" + (i % PALETTE.length), "data-version": version,
      title: "version " + version + ": " + weight + "%" }, version + ": " + weight + "%");
    seg.style.width = weight + "%";
    bar.append(seg);
  });
  return bar;
}

function table(headers, rows, caption) {
  return h("div", { class: "scroll" }, h("table", {}, caption ? h("caption", { class: "muted", text: caption }) : null,
    h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", text: t })))),
    h("tbody", {}, rows)));
}

function tags(versions) {
  return versions.map((v) => h("span", { class: "tag state-" + v.state, title: v.reason || "" }, v.version + " " + v.state));
}

// -- Overview ----------------------------------------------------------------------------------------
function drawOverview(data) {
  const attention = data.attention.length
    ? h("ul", { class: "attention" }, data.attention.map((a) => h("li", { class: a.level },
      a.model ? h("a", { href: modelHref(a.model), text: a.text }) : a.text)))
    : h("p", { class: "muted", text: "Nothing needs attention." });
  const rows = data.models.map((m) => {
    const live = Object.entries(m.live || {}).map(([v, l]) => h("div", {}, "v" + v + ": " + l.rps.toFixed(2) +
      " req/s, errors " + pct(l.error_rate)));
    const servers = (m.servers || []).map((s) => h("div", {}, (s.fleet === "default" ? "" : s.fleet + "/") + s.server +
      ": " + (s.ready.length ? s.ready.join(", ") : "none READY") + (s.ejected ? " (ejected)" : s.up === false ? " (down)" : "")));
    const policy = m.policy;
    const routes = policy ? [
      (policy.rules || []).length ? (policy.rules.length + " header rule(s)") : null,
      policy.sticky_header ? "sticky on " + policy.sticky_header : null,
      policy.shadow ? "shadow to " + (policy.shadow.version || JSON.stringify(policy.shadow)) : null,
      policy.sequence_affinity ? "sequence affinity" : null].filter(Boolean).join("; ") || "weights only" : "Triton's default";
    const r = m.rollout;
    return h("tr", { "data-model": m.name },
      h("th", { scope: "row" }, h("a", { href: modelHref(m.name), text: m.name })),
      h("td", {}, tags(m.versions), servers),
      h("td", {}, policy ? weightsBar(policy.weights, "weights of " + m.name) : h("span", { class: "muted", text: "no policy" })),
      h("td", { text: routes }),
      h("td", {}, live.length ? live : h("span", { class: "muted", text: "no traffic" })),
      h("td", {}, r ? [h("strong", { text: r.state }), " step " + (r.step + 1) + " of " + (r.steps || []).length +
        ", canary " + r.canary] : h("span", { class: "muted", text: "none" })));
  });
  fill($("page"), 
    h("h1", { text: "Overview" }),
    h("section", { class: "panel", "aria-labelledby": "attention-title" }, h("h2", { id: "attention-title", text: "Needs attention" }), attention),
    h("p", { class: "muted", text: "Live rates over the last " + data.window_s / 60 + " minutes, from " + data.rates_from + "." }),
    table(["Model", "Versions (Triton) and servers", "Weights", "Routes", "Live", "Rollout"], rows));
}

// -- Fleets ------------------------------------------------------------------------------------------
function drawFleets(data) {
  const sections = Object.entries(data.fleets).map(([fleet, servers]) => h("section", { class: "panel" },
    h("h2", { text: "Fleet " + fleet }),
    table(["Server", "Health", "In flight", "Queued", "Requests", "Errors", "Ejections", "Loaded versions"],
      servers.map((s) => h("tr", {},
        h("th", { scope: "row", text: s.server }),
        h("td", { text: (s.ejected ? "ejected" : s.up ? "up" : "down") + (s.in_service ? "" : ", out of service") +
          (s.last_error ? " (" + s.last_error + ")" : "") }),
        h("td", { class: "num", text: s.inflight }), h("td", { class: "num", text: s.queued }),
        h("td", { class: "num", text: s.requests }), h("td", { class: "num", text: s.errors }),
        h("td", { class: "num", text: s.ejections }),
        h("td", {}, Object.entries(s.ready || {}).map(([m, vs]) => h("div", {}, m + ": " + vs.join(", ")))))))));
  fill($("page"), h("h1", { text: "Fleets" }), sections);
}

// -- Audit -------------------------------------------------------------------------------------------
function auditQuery(params) {
  const q = new URLSearchParams();
  for (const key of ["model", "actor", "action", "page"]) if (params && params.get(key)) q.set(key, params.get(key));
  return q.toString();
}

function drawAudit(data, params) {
  if (!$("audit-form")) {
    const field = (name, label) => [h("label", { for: "audit-" + name, text: label }),
      h("input", { id: "audit-" + name, name, value: params.get(name) || "", autocomplete: "off" })];
    const form = h("form", { id: "audit-form", class: "row", role: "search", onsubmit: (e) => {
      e.preventDefault();
      const q = new URLSearchParams();
      for (const name of ["model", "actor", "action"]) if (form.elements[name].value) q.set(name, form.elements[name].value);
      location.hash = "#/audit?" + q.toString();
    } }, h("div", {}, field("model", "Model")), h("div", {}, field("actor", "Actor")),
    h("div", {}, field("action", "Action")), h("div", {}, h("button", { type: "submit", class: "primary", text: "Filter" })));
    fill($("page"), h("h1", { text: "Audit trail" }), form, h("div", { id: "audit-body" }));
  }
  const page = data.page;
  const go = (p) => { const q = new URLSearchParams(auditQuery(params)); q.set("page", p); location.hash = "#/audit?" + q; };
  fill($("audit-body"), 
    table(["When", "Model", "Actor", "Via", "Action", "Reason"], data.events.map((e) => h("tr", { "data-id": e.id },
      h("td", { text: stamp(e.at) }), h("td", {}, h("a", { href: modelHref(e.model), text: e.model })),
      h("td", { text: e.actor }), h("td", { text: "via: " + e.via }), h("td", { text: e.action }),
      h("td", { text: e.reason || "" }))), "Newest first"),
    h("div", { class: "pager" },
      h("button", { type: "button", disabled: page === 0, onclick: () => go(page - 1), text: "Newer" }),
      h("span", { text: "page " + (page + 1) }),
      h("button", { type: "button", disabled: !data.more, onclick: () => go(page + 1), text: "Older" }),
      data.scan_limit ? h("span", { class: "muted", text: "filters search the newest " + data.scan_limit + " events" }) : null));
}

// -- Model ---------------------------------------------------------------------------------------------
function drawModel(data) {
  const r = data.rollout;
  let shell = $("model-data");
  if (!shell) {
    shell = h("div", { id: "model-data" });
    fill($("page"), h("h1", {}, "Model ", h("span", { id: "model-name", text: data.model })),
      h("div", { id: "why-slot" }), shell, h("div", { id: "charts-slot" }), h("div", { id: "actions-slot" }));
  }
  fill($("why-slot"), data.why ? h("p", { id: "why", class: "why" + (r && /roll/.test(r.state) ? " bad" : ""),
    text: data.why }) : "");
  const policy = data.policy;
  fill(shell, 
    h("section", { class: "panel", id: "policy" }, h("h2", { text: "Policy" }), policy ? [
      weightsBar(policy.weights, "weights of " + data.model),
      h("dl", { class: "kv" },
        h("dt", { text: "revision" }), h("dd", { id: "policy-revision", text: policy.revision }),
        h("dt", { text: "weights" }), h("dd", { id: "policy-weights", text: Object.entries(policy.weights).map(([v, w]) => v + ": " + w + "%").join(", ") }),
        h("dt", { text: "sticky header" }), h("dd", { text: policy.sticky_header || "none" }),
        h("dt", { text: "rules" }), h("dd", {}, (policy.rules || []).length ? h("pre", { text: JSON.stringify(policy.rules, null, 1) }) : "none"),
        h("dt", { text: "shadow" }), h("dd", { text: policy.shadow ? JSON.stringify(policy.shadow) : "none" }),
        h("dt", { text: "sequence affinity" }), h("dd", { text: policy.sequence_affinity ? "on" : "off" }),
        h("dt", { text: "updated" }), h("dd", { text: stamp(policy.updated_at) }))]
      : h("p", { class: "muted", text: "No routing policy: requests go to Triton's default version." }),
    h("h3", { text: "Versions on Triton" }), h("div", {}, tags(data.versions))),
    r ? rolloutPanel(data, r) : h("section", { class: "panel" }, h("h2", { text: "Rollout" }), h("p", { class: "muted", text: "No rollout." })));
  drawCharts(data);
  drawActions(data);
}

function rolloutPanel(data, r) {
  const actual = data.policy ? data.policy.weights[r.canary] || 0 : 0;
  // when each step began: the history's moves into a step (a start, an advance, a resume)
  const entered = {};
  for (const move of r.history || []) if (move.to === "progressing" && !(move.step in entered)) entered[move.step] = move.at;
  const active = ["progressing", "paused"].includes(r.state);
  const ended = active ? Date.now() / 1000 : r.last_transition_at;
  const track = h("ol", { class: "steps", "aria-label": "rollout steps" }, r.steps.map((percent, i) => {
    const current = i === r.step && active;
    const done = i < r.step || r.state === "promoted";
    const until = entered[i + 1] || (i <= r.step ? ended : null);
    return h("li", { class: current ? "current" : done ? "done" : "", "aria-current": current ? "step" : null },
      "step " + (i + 1) + ": " + percent + "%",
      current ? h("div", { text: "set " + percent + "%, actual " + actual + "%" }) : null,
      entered[i] !== undefined && until ? h("div", { class: "muted", text: Math.max(0, Math.round(until - entered[i])) + " s at this step" }) : null);
  }));
  const hooks = r.hooks || {};
  const gates = (r.spec.gates || []).map((g) => h("div", {}, "gate " + g.at + ": " + g.url + " (on failure: " + g.on_failure + ")"));
  const webhooks = (r.spec.webhooks || []).length ? h("div", {}, "webhooks: " + r.spec.webhooks.length + ", delivered " +
    (hooks.delivered || 0) + ", failed " + (hooks.failures || 0) + ", queued " + (hooks.queued || 0) +
    (hooks.last_error ? "; last error at " + time(hooks.last_error_at) + ": " + hooks.last_error : "")) : null;
  const verdicts = historyVerdicts(data);
  return h("section", { class: "panel", id: "rollout" },
    h("h2", { text: "Rollout" }),
    h("p", {}, "state ", h("strong", { id: "rollout-state", text: r.state }), ", canary " + r.canary + " vs " +
      (r.baseline ? "baseline " + r.baseline : "stable " + r.stable) + ", judge " + r.spec.judge + ", interval " + r.spec.interval_s + " s"),
    h("p", { id: "rollout-reason", class: "muted", text: r.reason }),
    track,
    h("p", {}, "weights set by the rollout: " + Object.entries(r.weights).map(([v, w]) => v + " " + w + "%").join(", ") +
      "; the policy shows " + (data.policy ? Object.entries(data.policy.weights).map(([v, w]) => v + " " + w + "%").join(", ") : "nothing") +
      (r.applied ? "" : " (" + r.apply_reason + ")")),
    gates.length || webhooks ? h("div", {}, h("h3", { text: "Gates and webhooks" }), gates, webhooks) : null,
    h("h3", { text: "Verdict history" }),
    table(["When", "Step", "Outcome", "Metrics", "Reason"], verdicts.slice().reverse().map((v) => h("tr", {},
      h("td", { text: time(v.at) }), h("td", { class: "num", text: (v.step ?? 0) + 1 }), h("td", { text: v.outcome }),
      h("td", {}, (v.metrics || []).map((m) => h("div", {}, m.name + ": " + m.verdict + (m.effect === null ? "" :
        " (effect " + num(m.effect) + ", 95% " + num(m.low) + " to " + num(m.high) + ", e " + num(m.e_value) + "/" + num(m.e_threshold) + ")")))),
      h("td", { text: v.reason })))));
}

// The verdicts kept by the console's timeline (every interval) merged with the rollout record's own.
function historyVerdicts(data) {
  const byAt = new Map();
  for (const i of (data.timeline && data.timeline.intervals) || []) byAt.set(i.at, i.verdict);
  if (data.rollout) for (const v of data.rollout.verdicts || []) byAt.set(v.at, v);
  return [...byAt.values()].filter((v) => !data.rollout || v.at >= data.rollout.started_at).sort((a, b) => a.at - b.at);
}

// -- charts (uPlot) ------------------------------------------------------------------------------------
function wilson(x, n) {
  if (!n) return [null, null, null];
  const z = 1.96, p = x / n, d = 1 + z * z / n;
  const centre = (p + z * z / (2 * n)) / d, half = z * Math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d;
  return [p, Math.max(0, centre - half), Math.min(1, centre + half)];
}

function chartBox(id, title, note) {
  let box = $(id);
  if (!box) {
    box = h("figure", { class: "chart", id, "aria-labelledby": id + "-title" },
      h("h3", { id: id + "-title", text: title }), h("div", { class: "plot" }), h("figcaption", { class: "muted", text: note || "" }));
    $("charts").append(box);
  }
  return box;
}

function chart(id, title, note, series, data, opts = {}) {
  const box = chartBox(id, title, note);
  const plotEl = box.querySelector(".plot");
  const hasData = data[0].length > 0;
  const signature = series.map((s) => s.label).join("|") + (opts.log ? "log" : "");
  let entry = state.charts.get(id);
  if (!hasData) {
    if (entry) { entry.plot.destroy(); state.charts.delete(id); }
    fill(plotEl, h("p", { class: "empty", text: "No intervals judged yet." }));
    box.dataset.drawn = "";
    return;
  }
  if (entry && entry.signature === signature) { entry.plot.setData(data); return; }
  if (entry) entry.plot.destroy();
  fill(plotEl, );
  const width = Math.max(280, plotEl.clientWidth || box.clientWidth || 500);
  const plot = new uPlot({
    width, height: 220, series: [{ label: "time" }, ...series], bands: opts.bands || [],
    scales: { x: { time: true }, y: opts.log ? { distr: 3 } : { auto: true } },
    axes: [{}, { size: 60, values: opts.format ? (u, ticks) => ticks.map(opts.format) : undefined }],
    legend: { live: false },
    hooks: { draw: [(u) => {  // what was drawn, for the reader and for the tests
      box.dataset.drawn = u.series.slice(1).filter((s) => s.show).map((s, i) =>
        s.label + ":" + u.data[i + 1].filter((v) => v !== null && v !== undefined).length).join(",");
    }] },
  }, data, plotEl);
  state.charts.set(id, { plot, signature });
}

function line(label, color, extra = {}) {
  return { label, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 5 }, ...extra };
}
function band(label, color) { return { label, stroke: color, width: 1, dash: [2, 4], points: { show: false }, spanGaps: true }; }

function drawCharts(data) {
  const slot = $("charts-slot");
  const r = data.rollout;
  if (!r) { fill(slot, ); state.charts.clear(); return; }
  if (!$("charts")) fill(slot, h("h2", { text: "Evidence" }),
    h("p", { class: "muted", text: "Canary: orange, dashed, marked ●; reference (" + (r.baseline ? "baseline " + r.baseline : "stable " + r.stable) +
      "): blue, solid. Latency, 4xx counts and weights over time kept by this replica; rates from " + data.rates_from + "." }),
    h("div", { class: "charts", id: "charts" }));
  const verdicts = historyVerdicts(data);
  const xs = verdicts.map((v) => v.at);
  const canaryLabel = "canary " + r.canary, refLabel = "reference " + (r.baseline || r.stable);
  const canaryDash = { dash: [8, 4] };
  const percentFmt = (v) => (v === null ? "" : (v * 100).toFixed(1) + "%");
  // error rate per interval, with 95% (Wilson) bands and the floor above the reference
  const errC = verdicts.map((v) => wilson(v.canary_errors || 0, v.canary_requests || 0));
  const errR = verdicts.map((v) => wilson(Math.round((v.stable_error_rate || 0) * (v.stable_requests || 0)), v.stable_requests || 0));
  const floor = r.spec.judge === "statistical" ? r.spec.max_error_rate_increase : r.spec.max_error_rate;
  chart("chart-error-rate", "Error rate per interval (5xx)", "dotted: 95% interval; grey: " +
    (r.spec.judge === "statistical" ? "reference + the floor (" + pct(floor) + ")" : "the limit"),
  [line(canaryLabel, COLORS.canary, canaryDash), band(canaryLabel + " low", COLORS.canary), band(canaryLabel + " high", COLORS.canary),
    line(refLabel, COLORS.reference), band(refLabel + " low", COLORS.reference), band(refLabel + " high", COLORS.reference),
    line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
  [xs, errC.map((e) => e[0]), errC.map((e) => e[1]), errC.map((e) => e[2]), errR.map((e) => e[0]), errR.map((e) => e[1]),
    errR.map((e) => e[2]), errR.map((e) => (r.spec.judge === "statistical" ? (e[0] ?? 0) + floor : floor))],
  { format: percentFmt });
  // 4xx rate per interval (the judge's counts kept by the timeline)
  const intervals = ((data.timeline && data.timeline.intervals) || []).filter((i) => i.at >= r.started_at && i.client);
  const cx = intervals.map((i) => (i.client.canary_n !== undefined ? wilson(i.client.canary_4xx, i.client.canary_n) : [i.client.canary_rate, null, null]));
  const rx = intervals.map((i) => (i.client.reference_n !== undefined ? wilson(i.client.reference_4xx, i.client.reference_n) : [i.client.reference_rate, null, null]));
  const clientFloor = r.spec.max_client_error_rate_increase ?? (r.spec.judge === "statistical" ? 0.01 : 0.05);
  chart("chart-client-rate", "4xx rate per interval", "dotted: 95% interval; grey: reference + the floor (" + pct(clientFloor) + ")",
    [line(canaryLabel, COLORS.canary, canaryDash), band(canaryLabel + " low", COLORS.canary), band(canaryLabel + " high", COLORS.canary),
      line(refLabel, COLORS.reference), band(refLabel + " low", COLORS.reference), band(refLabel + " high", COLORS.reference),
      line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
    [intervals.map((i) => i.at), cx.map((e) => e[0]), cx.map((e) => e[1]), cx.map((e) => e[2]), rx.map((e) => e[0]),
      rx.map((e) => e[1]), rx.map((e) => e[2]), rx.map((e) => (e[0] ?? 0) + clientFloor)], { format: percentFmt });
  // latency quantiles over time
  const lat = ((data.timeline && data.timeline.intervals) || []).filter((i) => i.at >= r.started_at && (i.canary || i.reference));
  const q = (side, name) => lat.map((i) => (i[side] ? i[side][name] : null));
  chart("chart-latency", "Latency p50 / p90 / p99 (ms)", "over each interval; canary dashed",
    [line(canaryLabel + " p50", COLORS.canary, { dash: [8, 4] }), line(canaryLabel + " p90", COLORS.canary, { dash: [4, 4], width: 1.5 }),
      line(canaryLabel + " p99", COLORS.canary, { dash: [1, 3], width: 1.5 }),
      line(refLabel + " p50", COLORS.reference), line(refLabel + " p90", COLORS.reference, { width: 1.5 }),
      line(refLabel + " p99", COLORS.reference, { width: 1 })],
    [lat.map((i) => i.at), q("canary", "p50_ms"), q("canary", "p90_ms"), q("canary", "p99_ms"), q("reference", "p50_ms"),
      q("reference", "p90_ms"), q("reference", "p99_ms")]);
  // the statistical judge's accumulated effect per metric, and the e-values
  const judged = verdicts.filter((v) => (v.metrics || []).length);
  const names = [...new Set(judged.flatMap((v) => v.metrics.map((m) => m.name)))].filter((n) => !n.startsWith("check:"));
  for (const name of names) {
    const pick = (field) => judged.map((v) => { const m = v.metrics.find((x) => x.name === name); return m ? m[field] : null; });
    chart("chart-effect-" + name, "Accumulated effect: " + name, "canary minus reference, with its 95% interval, against the floor",
      [line("effect", COLORS.canary, canaryDash), band("95% low", COLORS.canary), band("95% high", COLORS.canary),
        line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
      [judged.map((v) => v.at), pick("effect"), pick("low"), pick("high"), pick("floor")],
      { format: name.includes("rate") ? percentFmt : (v) => (v === null ? "" : (v * 100).toFixed(0) + "%") });
  }
  if (names.length) {
    const series = names.map((n, i) => line("e-value " + n, PALETTE[(i + 1) % PALETTE.length], i === 1 ? { dash: [6, 3] } : i === 2 ? { dash: [1, 3] } : {}));
    const needed = judged.map((v) => (v.metrics.find((m) => m.e_threshold) || {}).e_threshold || null);
    chart("chart-evalue", "E-value against the one needed", "log scale; a metric fails once its e-value passes the grey line (and the floor)",
      [...series, line("needed", COLORS.floor, { dash: [2, 2], points: { show: false } })],
      [judged.map((v) => v.at), ...names.map((n) => judged.map((v) => { const m = v.metrics.find((x) => x.name === n); return m ? Math.max(m.e_value, 1e-3) : null; })), needed],
      { log: true, format: (v) => (v === null ? "" : num(v, 2)) });
  }
  // weights over time
  const kept = ((data.timeline && data.timeline.weights) || []).filter((w) => w.at >= r.started_at);
  const versions = [...new Set(kept.flatMap((w) => Object.keys(w.weights)))];
  const wx = kept.map((w) => w.at);
  if (kept.length) { wx.push(Date.now() / 1000); }
  chart("chart-weights", "Traffic weights over time (%)", "as the rollout set them",
    versions.map((v) => line("version " + v + (v === r.canary ? " (canary)" : ""), v === r.canary ? COLORS.canary : PALETTE[(versions.indexOf(v) + 2) % PALETTE.length],
      { paths: uPlot.paths.stepped({ align: 1 }), ...(v === r.canary ? canaryDash : {}) })),
    [wx, ...versions.map((v) => { const ys = kept.map((w) => w.weights[v] ?? 0); if (kept.length) ys.push(ys[ys.length - 1]); return ys; })]);
}

// -- actions (operators; a viewer sees them disabled, and the server refuses them anyway) ------------------
function confirmAction(text) {
  return new Promise((resolve) => {
    const dialog = $("confirm");
    $("confirm-text").textContent = text;
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

async function act(text, path, body, resultEl, form) {
  if (!canAct()) return;
  if (!(await confirmAction(text))) return;
  for (const err of (form || document).querySelectorAll(".field-error")) err.remove();
  resultEl.className = "result";
  resultEl.textContent = "working…";
  const result = await api(path, { method: "POST", body: body === undefined ? {} : body });
  if (result.ok) {
    resultEl.textContent = "Done: " + text;
  } else {
    const message = (result.body && result.body.error) || "HTTP " + result.status;
    resultEl.className = "result error";
    resultEl.textContent = message;
    if (result.status === 422 && form && result.body.fields) showFieldErrors(form, result.body.fields, message);
    if (result.status === 401) { showLogin("Your session ended: log in again."); return; }
  }
  refresh();
}

function showFieldErrors(form, fields, message) {
  for (const [field, msg] of Object.entries(fields)) {
    const input = form.querySelector('[data-field="' + CSS.escape(field) + '"]') || form.querySelector('[data-field="json"]');
    if (!input) continue;
    const id = input.id + "-error";
    const note = h("span", { class: "field-error", id, role: "alert", text: field + ": " + msg });
    input.setAttribute("aria-describedby", id);
    input.insertAdjacentElement("afterend", note);
  }
}

function describeWeights(model, weights) {
  const parts = Object.entries(weights).filter(([, w]) => w > 0).map(([v, w]) => w + "% of " + model + " to version " + v);
  return "Send " + parts.join(" and ") + ".";
}

function drawActions(data) {
  const r = data.rollout;
  const versions = data.versions.map((v) => v.version);
  const key = JSON.stringify([data.model, data.versions.map((v) => v.version + " " + v.state), r ? [r.state, r.step, r.started_at] : null, state.session.role]);
  if (state.actionsFor === key) return;
  const slot = $("actions-slot");
  if (slot.contains(document.activeElement) && document.activeElement.tagName !== "BUTTON" && state.actionsFor) return;  // never under the user's typing
  state.actionsFor = key;
  const disabled = !canAct();
  const model = data.model;
  const base = "/console/api/models/" + encodeURIComponent(model);
  const note = disabled ? h("p", { class: "muted", text: "Read-only: your token is a viewer's. Actions are disabled (and refused by the server)." }) : null;
  // rollout commands
  const rolloutBox = h("div", { class: "box", id: "rollout-actions" }, h("h3", { text: "Rollout" }));
  const rolloutResult = h("p", { class: "result", role: "status" });
  if (r) {
    const next = r.step + 1 >= r.steps.length ? 100 : r.steps[r.step + 1];
    const commands = [
      ["promote", "Promote", "Promote the rollout of " + model + ": send " + next + "% of " + model + " to version " + r.canary + " now.", ["progressing", "paused"]],
      ["pause", "Pause", "Pause the rollout of " + model + " at its current weights.", ["progressing"]],
      ["resume", "Resume", "Resume the rollout of " + model + ": its weights (" + Object.entries(r.weights).map(([v, w]) => w + "% to version " + v).join(", ") + ") apply again.", ["paused"]],
      ["abort", "Abort", "Abort the rollout of " + model + ": send 100% of " + model + " to version " + r.stable + ".", ["progressing", "paused", "rolling_back"]],
      ["retry", "Retry", "Start the rollout of version " + r.canary + " of " + model + " again with the same spec (retry).", ["rolled_back", "aborted"]],
    ];
    for (const [command, label, text, states] of commands) {
      rolloutBox.append(h("button", { type: "button", id: "action-" + command, disabled: disabled || !states.includes(r.state),
        onclick: () => act(text, base + "/rollout/" + command, {}, rolloutResult) }, label));
    }
  } else {
    rolloutBox.append(h("p", { class: "muted", text: "No rollout to command." }));
  }
  rolloutBox.append(rolloutResult);
  // weights
  const weightVersions = [...new Set([...versions, ...Object.keys((data.policy && data.policy.weights) || {})])];
  const weightsResult = h("p", { class: "result", role: "status" });
  const weightsForm = h("form", { id: "weights-form", "aria-labelledby": "weights-title" }, h("h3", { id: "weights-title", text: "Set weights" }),
    h("div", { class: "row" }, weightVersions.map((v, i) => h("div", {},
      h("label", { for: "weight-" + i, text: "version " + v + " (%)" }),
      h("input", { id: "weight-" + i, type: "number", min: 0, max: 100, step: "any", "data-version": v, "data-field": "weights",
        value: (data.policy && data.policy.weights[v]) || 0, disabled })))),
    h("label", { for: "weights-reason", text: "Reason" }),
    h("input", { id: "weights-reason", name: "reason", "data-field": "reason", maxlength: 1000, disabled }),
    h("button", { type: "submit", class: "primary", disabled, text: "Set weights" }), weightsResult);
  weightsForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const weights = {};
    for (const input of weightsForm.querySelectorAll("input[data-version]")) {
      const w = Number(input.value);
      if (w > 0) weights[input.dataset.version] = w;
    }
    const reason = weightsForm.elements.reason.value || null;
    act(describeWeights(model, weights), base + "/weights", { weights, reason }, weightsResult, weightsForm);
  });
  // start a rollout
  const startResult = h("p", { class: "result", role: "status" });
  const select = (id, field, options, empty) => h("select", { id, "data-field": field, disabled },
    empty ? h("option", { value: "", text: empty }) : null, options.map((v) => h("option", { value: v, text: v })));
  const startForm = h("form", { id: "rollout-form", "aria-labelledby": "rollout-form-title" }, h("h3", { id: "rollout-form-title", text: "Start a rollout" }),
    h("div", { class: "row" },
      h("div", {}, h("label", { for: "ro-canary", text: "Canary version" }), select("ro-canary", "canary", versions.slice().reverse())),
      h("div", {}, h("label", { for: "ro-stable", text: "Stable version" }), select("ro-stable", "stable", versions, "heaviest now"))),
    h("div", { class: "row" },
      h("div", {}, h("label", { for: "ro-steps", text: "Steps (% of traffic, comma separated)" }),
        h("input", { id: "ro-steps", "data-field": "steps", value: "5, 20, 50, 100", disabled })),
      h("div", {}, h("label", { for: "ro-interval", text: "Interval (s)" }),
        h("input", { id: "ro-interval", "data-field": "interval_s", type: "number", min: 1, step: "any", value: 30, disabled })),
      h("div", {}, h("label", { for: "ro-judge", text: "Judge" }), select("ro-judge", "judge", ["statistical", "thresholds"]))),
    h("label", { for: "ro-json", text: "Other fields (JSON), e.g. {\"min_requests\": 20}" }),
    h("textarea", { id: "ro-json", "data-field": "json", spellcheck: "false", disabled }, "{}"),
    h("button", { type: "submit", class: "primary", disabled, text: "Start rollout" }), startResult);
  startForm.addEventListener("submit", (e) => {
    e.preventDefault();
    for (const err of startForm.querySelectorAll(".field-error")) err.remove();
    let extra;
    try { extra = JSON.parse($("ro-json").value || "{}"); } catch (err) {
      showFieldErrors(startForm, { json: "not valid JSON: " + err.message }); return;
    }
    const spec = { ...extra, canary: $("ro-canary").value, judge: $("ro-judge").value,
      steps: $("ro-steps").value.split(",").map((s) => s.trim()).filter(Boolean).map(Number),
      interval_s: Number($("ro-interval").value) };
    if ($("ro-stable").value) spec.stable = $("ro-stable").value;
    act("Start a rollout of " + model + ": send " + spec.steps[0] + "% of " + model + " to version " + spec.canary +
      " first, then " + spec.steps.slice(1).join("%, ") + (spec.steps.length > 1 ? "%" : "") + ", one step per " + spec.interval_s + " s if healthy.",
    base + "/rollout", spec, startResult, startForm);
  });
  // versions
  const versionResult = h("p", { class: "result", role: "status" });
  const loadInput = h("input", { id: "load-version", inputmode: "numeric", "data-field": "version", disabled });
  const versionBox = h("div", { class: "box", id: "version-actions" }, h("h3", { text: "Versions" }),
    h("label", { for: "load-version", text: "Load version" }), loadInput,
    h("button", { type: "button", id: "action-load", disabled, onclick: () => act("Load version " + loadInput.value + " of " + model +
      " beside the serving versions.", base + "/versions/" + encodeURIComponent(loadInput.value) + "/load", {}, versionResult) }, "Load"),
    h("div", {}, data.versions.filter((v) => v.state === "READY").map((v) => h("button", { type: "button", disabled,
      "data-unload": v.version, onclick: () => act("Drain and unload version " + v.version + " of " + model + ".",
        base + "/versions/" + encodeURIComponent(v.version) + "/unload", {}, versionResult) }, "Unload " + v.version))),
    versionResult);
  fill(slot, h("h2", { text: "Actions" }), note, h("div", { class: "actions" }, rolloutBox, weightsForm, startForm, versionBox));
}

// -- start -------------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", async () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  window.addEventListener("hashchange", route);
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) { stopPolling(); showFreshness(); } else if (state.session) refresh();
  });
  window.addEventListener("resize", () => {
    for (const [id, entry] of state.charts) {
      const el = $(id);
      if (el) entry.plot.setSize({ width: Math.max(280, el.querySelector(".plot").clientWidth), height: 220 });
    }
  });
  const result = await api("/console/api/session").catch(() => null);
  if (result && result.ok && result.body.actor) startSession(result.body);
  else showLogin();
});
