// The console's operator actions: forms and buttons, each confirmed in a dialog that names what
// will happen, then POSTed with the session's CSRF token (console.js: api, h, fill, state).
"use strict";
// -- actions (operators; a viewer sees them disabled, and the server refuses them anyway) ------------------
// ``effects``: what the action does beyond what it names (the server's preview of it: the same
// words its answer will carry), listed under the sentence; none, nothing is listed.
function confirmAction(text, effects) {
  return new Promise((resolve) => {
    const dialog = $("confirm");
    $("confirm-text").textContent = text;
    fill($("confirm-effects"), (effects || []).map((e) => h("li", { text: e })));
    $("confirm-effects").hidden = !(effects || []).length;
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

// Asks the server what an action would do beyond its name (nothing changes); [] when it cannot tell.
async function previewOf(path, body) {
  const match = /^\/console\/api\/models\/([^/]+)\/(weights|rollout)(?:\/(\w+))?$/.exec(path);
  if (!match) return [];
  const action = match[2] === "weights" ? "weights" : match[3] || "start";
  try {
    const answer = await api("/console/api/models/" + match[1] + "/preview", { method: "POST", body: { action, body: body || {} } });
    return answer.ok ? answer.body.warnings || [] : [];
  } catch (e) { return []; }
}

async function act(text, path, body, resultEl, form) {
  if (!canAct()) return;
  const effects = await previewOf(path, body);
  if (!(await confirmAction(text, effects))) return;
  for (const err of (form || document).querySelectorAll(".field-error")) err.remove();
  resultEl.className = "result";
  resultEl.textContent = "working…";
  const result = await api(path, { method: "POST", body: body === undefined ? {} : body });
  if (result.ok) {
    const said = (result.body && result.body.warnings) || [];
    resultEl.textContent = "Done: " + text + (said.length ? " Also: " + said.join("; ") + "." : "");
  } else {
    const message = (result.body && result.body.error) || "HTTP " + result.status;
    resultEl.className = "result error";
    resultEl.textContent = message;
    if (result.status === 422 && form && result.body.fields) showFieldErrors(form, result.body.fields, message);
    if (result.status === 401) { showLogin("Your session ended: log in again, then send it again: what you typed is kept.", true); return; }
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
  const key = JSON.stringify([data.model, data.versions.map((v) => v.version + " " + v.state), r ? [r.state, r.step, r.started_at, r.needs_acknowledgement] : null, state.session.role]);
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
      ["acknowledge", "Acknowledge rollback", acknowledgeText(model), r.needs_acknowledgement ? [r.state] : []],
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
    h("label", { for: "ro-json", text: "Other fields (JSON), e.g. {\"baseline\": \"1\", \"max_latency_increase\": 0.3}" }),
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
