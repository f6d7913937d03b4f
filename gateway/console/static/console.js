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
// ``keep``: the session ended under the page (it expired, or ended on the server): the page stays
// as it is, hidden, so whatever was typed into a form is still there after the next login.
function showLogin(message, keep) {
  state.session = null;
  stopPolling();
  $("login").hidden = false;
  if (keep && state.route && $("page").childNodes.length) $("page").hidden = true;
  else { fill($("page"), ); $("page").hidden = false; }
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
  if ($("page").hidden && state.route) { $("page").hidden = false; refresh(); }  // back where the session ended
  else route();
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
  if (path.startsWith("model/")) {
    const [model, version] = path.slice(6).split("/version/");
    if (version !== undefined) return { page: "version", model: decodeURIComponent(model), version: decodeURIComponent(version), params };
    return { page: "model", model: decodeURIComponent(model), params };
  }
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
      version: "/console/api/models/" + encodeURIComponent(current.model || "") + "/versions/" + encodeURIComponent(current.version || ""),
      audit: "/console/api/audit?" + auditQuery(current.params) }[current.page];
    const result = await api(url);
    if (current !== state.route) return;
    if (result.status === 401) { showLogin("Your session ended: log in again. The page is kept as it was.", true); return; }
    if (result.status === 404 && (current.page === "model" || current.page === "version") && result.body && result.body.not_found) {
      state.data = result.body;
      state.lastOk = Date.now();
      state.failing = null;
      drawNotFound(current, result.body);
    } else {
      if (!result.ok) throw new Error((result.body && result.body.error) || "HTTP " + result.status);
      state.data = result.body;
      state.lastOk = Date.now();
      state.failing = result.body.store_up === false ? "the state store is down" : null;
      draw(current, result.body);
    }
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
  else if (current.page === "version") drawVersion(data);
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

function tags(versions, model) {
  return versions.map((v) => model
    ? h("a", { class: "tag state-" + v.state, title: v.reason || "", href: versionHref(model, v.version) }, v.version + " " + v.state)
    : h("span", { class: "tag state-" + v.state, title: v.reason || "" }, v.version + " " + v.state));
}
const versionHref = (model, version) => modelHref(model) + "/version/" + encodeURIComponent(version);

// -- Overview ----------------------------------------------------------------------------------------
function drawOverview(data) {
  const attention = data.attention.length
    ? h("ul", { class: "attention" }, data.attention.map(attentionItem))
    : h("p", { class: "muted", text: "Nothing needs attention." });
  const rows = data.models.map((m) => {
    const window = m.live_window || {};
    const live = Object.entries(m.live || {}).map(([v, l]) => h("div", {}, "v" + v + ": " + l.rps.toFixed(2) +
      " req/s, errors " + pct(l.error_rate) + " (" + l.requests + " in " + Math.round(window.seconds || 0) + " s)"));
    const servers = (m.servers || []).map((s) => h("div", {}, (s.fleet === "default" ? "" : s.fleet + "/") + s.server +
      ": " + (s.ready.length ? s.ready.join(", ") : "none READY") + (s.ejected ? " (ejected)" : s.up === false ? " (down)" : "")));
    const policy = m.policy;
    const routes = policy ? [
      (policy.rules || []).length ? (policy.rules.length + " header rule(s)") : null,
      policy.sticky_header ? "sticky on " + policy.sticky_header : null,
      policy.shadow ? "shadow to " + (policy.shadow.version || JSON.stringify(policy.shadow)) : null,
      policy.sequence_affinity === true ? "sequence affinity" : null].filter(Boolean).join("; ") || "weights only" : "Triton's default";
    const r = m.rollout;
    return h("tr", { "data-model": m.name },
      h("th", { scope: "row" }, h("a", { href: modelHref(m.name), text: m.name })),
      h("td", {}, tags(m.versions), servers),
      h("td", {}, policy ? weightsBar(policy.weights, "weights of " + m.name) : h("span", { class: "muted", text: "no policy" })),
      h("td", { text: routes }),
      h("td", { class: "live-cell" }, live.length ? live : h("span", { class: "muted", text: "no traffic" }),
        window.label ? h("div", { class: "muted window", text: window.label }) : null),
      h("td", {}, r ? [h("strong", { text: r.state }), " step " + (r.step + 1) + " of " + (r.steps || []).length +
        ", canary " + r.canary] : h("span", { class: "muted", text: "none" })));
  });
  fill($("page"), 
    h("h1", { text: "Overview" }),
    h("section", { class: "panel", "aria-labelledby": "attention-title" }, h("h2", { id: "attention-title", text: "Needs attention" }), attention),
    h("p", { class: "muted", text: "Live: each model's current interval (its rollout's own while one runs, else the last " +
      data.window_s + " s), never reaching back before its weights last changed; from " + data.rates_from + "." }),
    table(["Model", "Versions (Triton) and servers", "Weights", "Routes", "Live", "Rollout"], rows));
}

// A finished rollback stays here until an operator acknowledges it (audited).
function attentionItem(a) {
  const result = h("span", { class: "result", role: "status" });
  return h("li", { class: a.level }, a.model ? h("a", { href: modelHref(a.model), text: a.text }) : a.text,
    a.acknowledge ? [" ", h("button", { type: "button", class: "ack", "data-acknowledge": a.model, disabled: !canAct(),
      onclick: () => act(acknowledgeText(a.model), "/console/api/models/" + encodeURIComponent(a.model) + "/rollout/acknowledge",
        {}, result) }, "Acknowledge"), result] : null);
}
const acknowledgeText = (model) => "Acknowledge the rollback of " + model + ": it leaves Needs attention, and the audit trail records who saw it.";

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
    table(["When", "Model", "Actor", "Via", "Action", "Reason", "Changes"], data.events.map((e) => h("tr", { "data-id": e.id },
      h("td", { text: stamp(e.at) }), h("td", {}, h("a", { href: modelHref(e.model), text: e.model })),
      h("td", { text: e.actor }), h("td", { text: "via: " + e.via }), h("td", { text: e.action }),
      h("td", { class: "reason", text: e.reason || "" }), h("td", { class: "changes" }, changeList(e.changes)))), "Newest first"),
    h("div", { class: "pager" },
      h("button", { type: "button", disabled: page === 0, onclick: () => go(page - 1), text: "Newer" }),
      h("span", { text: "page " + (page + 1) }),
      h("button", { type: "button", disabled: !data.more, onclick: () => go(page + 1), text: "Older" }),
      data.scan_limit ? h("span", { class: "muted", text: "filters search the newest " + data.scan_limit + " events" }) : null));
}

// An audit entry's before and after as what changed: removed struck out, added underlined.
function changeList(changes) {
  if (!changes || !changes.length) return h("span", { class: "muted", text: "–" });
  return h("ul", { class: "diff" }, changes.map((c) => h("li", { class: c.change, "data-path": c.path },
    h("code", { text: c.path }), " ",
    c.change === "added" ? h("ins", { text: shown(c.after) }) :
      c.change === "removed" ? h("del", { text: shown(c.before) }) :
        [h("del", { text: shown(c.before) }), " → ", h("ins", { text: shown(c.after) })])));
}
// JSON with a space after each comma and colon, so a long value wraps between its fields
const shown = (value) => (typeof value === "string" ? value : JSON.stringify(value).replace(/([,:])(?=\S)/g, "$1 "));

// -- Not found -----------------------------------------------------------------------------------------
function drawNotFound(current, data) {
  for (const chart of state.charts.values()) chart.plot.destroy();
  state.charts.clear();
  state.actionsFor = null;
  const what = current.page === "version" ? "Version " + current.version + " of " + current.model : "Model " + current.model;
  fill($("page"), h("h1", {}, what),
    h("section", { class: "panel notfound", id: "not-found", role: "alert" }, h("h2", { text: "Not found" }),
      h("p", { text: data.error }),
      data.known && data.known.length ? h("p", { id: "known" }, current.page === "version" ? "Its versions: " : "Models: ",
        data.known.flatMap((k, i) => [i ? ", " : "",
          h("a", { href: current.page === "version" ? versionHref(current.model, k) : modelHref(k), text: k })])) : null,
      h("p", { class: "muted", text: "Nothing here can be changed: every action needs a model Triton knows." })));
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
        h("dt", { text: "sequence affinity" }), h("dd", { text: policy.sequence_affinity === "auto"
          ? "auto (on where Triton batches the model's sequences)" : policy.sequence_affinity ? "on" : "off" }),
        h("dt", { text: "updated" }), h("dd", { text: stamp(policy.updated_at) }))]
      : h("p", { class: "muted", text: "No routing policy: requests go to Triton's default version." }),
    h("h3", { text: "Versions on Triton" }), h("div", { id: "version-tags" }, tags(data.versions, data.model)),
    h("p", { class: "muted", text: "Each version's page shows what differs from the stable version." })),
    r ? rolloutPanel(data, r) : h("section", { class: "panel" }, h("h2", { text: "Rollout" }), h("p", { class: "muted", text: "No rollout." })),
    pastRollouts(data));
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
    verdictTable(verdicts));
}

// Each interval's verdict: per metric its numbers and, beside them, what they mean in words.
function verdictTable(verdicts) {
  return table(["When", "Step", "Outcome", "Evidence (numbers and words)", "Reason"], verdicts.slice().reverse().map((v) => h("tr", {},
    h("td", { text: time(v.at) }), h("td", { class: "num", text: (v.step ?? 0) + 1 }), h("td", { text: v.outcome }),
    h("td", { class: "evidence" }, (v.metrics || []).map((m) => h("div", { class: "metric", "data-metric": m.name },
      h("strong", { text: m.name + ": " + m.verdict }),
      m.effect === null || m.effect === undefined ? null : h("span", { class: "numbers", text: " effect " + num(m.effect) +
        " (95% " + num(m.low) + " to " + num(m.high) + "), e-value " + num(m.e_value) + " of " + num(m.e_threshold) + " needed" }),
      m.words ? h("p", { class: "words", text: m.words }) : null))),
    h("td", { class: "reason", text: v.reason }))));
}

// Finished rollouts kept by the store: what ran, how it ended and why, with its verdicts.
function pastRollouts(data) {
  const past = data.history || [];
  return h("section", { class: "panel", id: "past-rollouts" }, h("h2", { text: "Past rollouts" }),
    past.length ? table(["Started", "Canary vs stable", "Ended", "Verdicts", "Why"], past.map((p) => {
      const outcomes = (p.verdicts || []).map((v) => v.outcome);
      const counts = [...new Set(outcomes)].map((o) => outcomes.filter((x) => x === o).length + " " + o).join(", ");
      return h("tr", { "data-started": p.started_at },
        h("td", { text: stamp(p.started_at) }), h("td", { text: p.canary + " vs " + p.stable }),
        h("td", {}, h("strong", { text: p.state }), " at step " + (p.step + 1) + " of " + p.steps.length +
          (p.acknowledged ? ", acknowledged by " + p.acknowledged.by : "")),
        h("td", {}, counts || "none", (p.verdicts || []).length ? h("details", {}, h("summary", { text: "show" }),
          verdictTable((p.verdicts || []).slice().sort((a, b) => a.at - b.at))) : null),
        h("td", { class: "reason", text: p.reason }));
    }), "Newest first; each kept with its verdicts and the judge's evidence")
      : h("p", { class: "muted", text: "No finished rollout kept for this model." }));
}

// The verdicts kept by the console's timeline (every interval) merged with the rollout record's own.
function historyVerdicts(data) {
  const byAt = new Map();
  for (const i of (data.timeline && data.timeline.intervals) || []) byAt.set(i.at, i.verdict);
  if (data.rollout) for (const v of data.rollout.verdicts || []) byAt.set(v.at, v);
  return [...byAt.values()].filter((v) => !data.rollout || v.at >= data.rollout.started_at).sort((a, b) => a.at - b.at);
}

// -- Version -------------------------------------------------------------------------------------------
// One version: its state on Triton (an unloaded one points to loading it) and what differs from the
// stable version: Triton's configuration, field by field, and the files where the gateway reads the
// model repository.
function drawVersion(data) {
  const model = data.model, version = data.version;
  const result = h("p", { class: "result", role: "status" });
  const st = data.state || { state: "UNKNOWN", reason: "" };
  const ready = st.state === "READY";
  const load = h("button", { type: "button", id: "action-load-version", class: "primary", disabled: !canAct(),
    onclick: () => act("Load version " + version + " of " + model + " beside the serving versions.",
      "/console/api/models/" + encodeURIComponent(model) + "/versions/" + encodeURIComponent(version) + "/load", {}, result) },
  "Load version " + version);
  const cfg = data.config || {}, files = data.files || {};
  fill($("page"), h("h1", {}, "Version ", h("span", { id: "version-name", text: version }), " of ",
    h("a", { href: modelHref(model), text: model })),
  h("section", { class: "panel", id: "version-state" }, h("h2", { text: "On Triton" }),
    h("p", {}, h("span", { class: "tag state-" + st.state, text: st.state }), st.reason ? " " + st.reason : ""),
    ready ? null : h("div", { id: "load-hint", class: "why" }, h("p", { text: data.load_hint }), load, result)),
  h("section", { class: "panel", id: "differences" }, h("h2", { text: "What differs from " + (data.against ? "version " + data.against : "the stable") }),
    h("p", { class: "muted", text: data.against_why || "" }),
    h("h3", { text: "Triton configuration" }),
    cfg.note ? h("p", { id: "config-note", text: cfg.note }) : null,
    (cfg.fields || []).length ? table(["Field", "This version", "Version " + data.against, "In words"], cfg.fields.map((f) => h("tr", { "data-field": f.field },
      h("th", { scope: "row", text: f.field }), h("td", { text: f.canary }), h("td", { text: f.stable }), h("td", { class: "reason", text: f.words })))) : null,
    (cfg.all || []).length ? h("details", {}, h("summary", { text: "every configuration field that differs (" + cfg.all.length + ")" }), changeList(cfg.all)) : null,
    h("h3", { text: "Files" }),
    files.readable ? [
      h("p", { id: "files-summary", text: files.summary }),
      (files.differing || []).length ? table(["File", "Change"], files.differing.map((f) => h("tr", { "data-file": f.path },
        h("td", {}, h("code", { text: f.path })), h("td", { text: f.change })))) : null]
      : h("p", { class: "muted", id: "files-summary", text: files.why || "the gateway does not read the model repository" })));
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
