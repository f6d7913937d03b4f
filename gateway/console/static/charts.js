// The console's charts (uPlot): each rollout's evidence, canary vs reference. Loaded before
// console.js, whose helpers (h, fill, $, state, pct, num, PALETTE, COLORS) it uses at run time.
//
// The evidence view is a list of panels (EVIDENCE_PANELS), each a function of the page's data and
// a shared context (the verdicts, the weight changes, labels): a new kind of evidence is one more
// function in the list. Every chart marks each weight change with a dashed line, pads a short time
// axis to a few intervals around its points (one point is not a two-year axis), and says what it
// drew in data attributes (drawn series, marks, the axes' spans) for the reader's tools and tests.
"use strict";
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

// Dashed vertical lines where the weights changed, labelled with the canary's new share.
function drawMarks(u, marks, box) {
  const ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
  let drawn = 0;
  ctx.save();
  ctx.strokeStyle = COLORS.floor;
  ctx.fillStyle = COLORS.floor;
  ctx.setLineDash([4, 4]);
  ctx.lineWidth = 1;
  ctx.font = Math.round(11 * devicePixelRatio) + "px system-ui, sans-serif";
  for (const mark of marks) {
    if (mark.at < u.scales.x.min || mark.at > u.scales.x.max) continue;
    const x = Math.round(u.valToPos(mark.at, "x", true));
    ctx.beginPath();
    ctx.moveTo(x, top);
    ctx.lineTo(x, bottom);
    ctx.stroke();
    ctx.fillText(mark.label, x + 3 * devicePixelRatio, top + 12 * devicePixelRatio);
    drawn += 1;
  }
  ctx.restore();
  box.dataset.marks = String(drawn);
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
  if (entry && entry.signature === signature) { entry.marks = opts.marks || []; entry.plot.setData(data, true); return; }
  if (entry) entry.plot.destroy();
  fill(plotEl, );
  const width = Math.max(280, plotEl.clientWidth || box.clientWidth || 500);
  const pad = opts.pad || 0;
  const made = { signature, marks: opts.marks || [] };
  const yScale = opts.log ? { distr: 3 } : { auto: true, range: opts.yRange };
  const plot = new uPlot({
    width, height: 220, series: [{ label: "time" }, ...series], bands: opts.bands || [],
    // from the rollout's start to its last point or weight change; a short span (one point, a
    // few) is widened to a few intervals around it: never a two-year axis
    // (read from the data: uPlot hands a single point's range over as a thousand days wide)
    scales: { x: { time: true, range: (u) => {
      const times = u.data[0].concat(made.marks.map((m) => m.at), opts.start ? [opts.start] : []);
      const low = Math.min(...times), high = Math.max(...times);
      return high - low < 4 * pad ? [low - 2 * pad, high + 2 * pad] : [low - pad / 2, high + pad / 2];
    } },
      y: yScale },
    axes: [{}, { size: 60, values: opts.format ? (u, ticks) => ticks.map(opts.format) : undefined }],
    legend: { live: false },
    hooks: { draw: [(u) => {  // what was drawn, for the reader and for the tests
      box.dataset.drawn = u.series.slice(1).filter((s) => s.show).map((s, i) =>
        s.label + ":" + u.data[i + 1].filter((v) => v !== null && v !== undefined).length).join(",");
      box.dataset.xspan = String(Math.round(u.scales.x.max - u.scales.x.min));
      box.dataset.ymax = String(u.scales.y.max);
      drawMarks(u, made.marks, box);
    }] },
  }, data, plotEl);
  made.plot = plot;
  state.charts.set(id, made);
}

function line(label, color, extra = {}) {
  return { label, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 5 }, ...extra };
}
function band(label, color) { return { label, stroke: color, width: 1, dash: [2, 4], points: { show: false }, spanGaps: true }; }

// The y range of a latency panel: from 0 to a little above the largest value it shows, so a p99
// spike drawn elsewhere never flattens the medians here.
function tightRange(values) {
  const shown = values.flat().filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  const top = shown.length ? Math.max(...shown) : 1;
  return () => [0, top > 0 ? top * 1.15 : 1];
}

const percentFmt = (v) => (v === null ? "" : (v * 100).toFixed(1) + "%");

// -- the evidence panels -----------------------------------------------------------------------------
function errorRatePanel(data, c) {
  const r = c.rollout, verdicts = c.verdicts;
  const errC = verdicts.map((v) => wilson(v.canary_errors || 0, v.canary_requests || 0));
  const errR = verdicts.map((v) => wilson(Math.round((v.stable_error_rate || 0) * (v.stable_requests || 0)), v.stable_requests || 0));
  // thresholds: the ceiling the judge applies (max_error_rate, null = its default 0.01: RolloutSpec.error_rate_ceiling)
  const floor = r.spec.judge === "statistical" ? r.spec.max_error_rate_increase : (r.spec.max_error_rate ?? 0.01);
  chart("chart-error-rate", "Error rate per interval (5xx)", "dotted: 95% interval; grey: " +
    (r.spec.judge === "statistical" ? "reference + the floor (" + pct(floor) + ")" : "the limit") + "; dashed lines: weight changes",
  [line(c.canaryLabel, COLORS.canary, c.canaryDash), band(c.canaryLabel + " low", COLORS.canary), band(c.canaryLabel + " high", COLORS.canary),
    line(c.refLabel, COLORS.reference), band(c.refLabel + " low", COLORS.reference), band(c.refLabel + " high", COLORS.reference),
    line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
  [verdicts.map((v) => v.at), errC.map((e) => e[0]), errC.map((e) => e[1]), errC.map((e) => e[2]), errR.map((e) => e[0]), errR.map((e) => e[1]),
    errR.map((e) => e[2]), errR.map((e) => (r.spec.judge === "statistical" ? (e[0] ?? 0) + floor : floor))],
  { format: percentFmt, marks: c.marks, pad: c.pad, start: c.start });
}

function clientErrorPanel(data, c) {
  const r = c.rollout;
  const intervals = c.intervals.filter((i) => i.client);
  const cx = intervals.map((i) => (i.client.canary_n !== undefined ? wilson(i.client.canary_4xx, i.client.canary_n) : [i.client.canary_rate, null, null]));
  const rx = intervals.map((i) => (i.client.reference_n !== undefined ? wilson(i.client.reference_4xx, i.client.reference_n) : [i.client.reference_rate, null, null]));
  const clientFloor = r.spec.max_client_error_rate_increase ?? (r.spec.judge === "statistical" ? 0.01 : 0.05);
  chart("chart-client-errors", "4xx rate per interval", "the judge's own counts; dotted: 95% interval; grey: reference + the floor (" + pct(clientFloor) + ")",
    [line(c.canaryLabel, COLORS.canary, c.canaryDash), band(c.canaryLabel + " low", COLORS.canary), band(c.canaryLabel + " high", COLORS.canary),
      line(c.refLabel, COLORS.reference), band(c.refLabel + " low", COLORS.reference), band(c.refLabel + " high", COLORS.reference),
      line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
    [intervals.map((i) => i.at), cx.map((e) => e[0]), cx.map((e) => e[1]), cx.map((e) => e[2]), rx.map((e) => e[0]),
      rx.map((e) => e[1]), rx.map((e) => e[2]), rx.map((e) => (e[0] ?? 0) + clientFloor)], { format: percentFmt, marks: c.marks, pad: c.pad, start: c.start });
}

// Latency in two panels: p50 and p90 on a scale of their own (a median's shift stays visible
// whatever the tail does), and p99 apart.
function latencyPanels(data, c) {
  const lat = c.intervals.filter((i) => i.canary || i.reference);
  const q = (side, name) => lat.map((i) => (i[side] ? i[side][name] : null));
  const xs = lat.map((i) => i.at);
  const body = [q("canary", "p50_ms"), q("canary", "p90_ms"), q("reference", "p50_ms"), q("reference", "p90_ms")];
  chart("chart-latency", "Latency p50 and p90 (ms)", "over each interval; canary dashed; p99 in the next panel, on its own scale",
    [line(c.canaryLabel + " p50", COLORS.canary, { dash: [8, 4] }), line(c.canaryLabel + " p90", COLORS.canary, { dash: [4, 4], width: 1.5 }),
      line(c.refLabel + " p50", COLORS.reference), line(c.refLabel + " p90", COLORS.reference, { width: 1.5 })],
    [xs, ...body], { marks: c.marks, pad: c.pad, start: c.start, yRange: tightRange(body) });
  const tail = [q("canary", "p99_ms"), q("reference", "p99_ms")];
  chart("chart-latency-p99", "Latency p99 (ms)", "the slowest 1% of each interval; canary dashed",
    [line(c.canaryLabel + " p99", COLORS.canary, { dash: [1, 3], width: 1.5 }), line(c.refLabel + " p99", COLORS.reference, { width: 1 })],
    [xs, ...tail], { marks: c.marks, pad: c.pad, start: c.start, yRange: tightRange(tail) });
}

// Triton's own view (issue 34): each version's time in Triton per request over time, stacked:
// the filled part is its queue, the line above it queue + compute (from Triton's statistics).
function tritonPanel(data, c) {
  const inTriton = c.verdicts.filter((v) => v.attribution && v.attribution.canary && v.attribution.reference);
  const part = (side) => inTriton.map((v) => v.attribution[side].queue_ms);
  const total = (side) => inTriton.map((v) => { const s = v.attribution[side];
    return s.queue_ms === null && s.compute_ms === null ? null : (s.queue_ms || 0) + (s.compute_ms || 0); });
  chart("chart-triton", "In Triton: queue + compute per request (ms)", "Triton's own statistics per interval: " +
    "filled, the queue; the line above it, queue + compute. " + ((inTriton[inTriton.length - 1] || {}).attribution || {}).summary,
  [line(c.canaryLabel + " queue", COLORS.canary, { ...c.canaryDash, fill: COLORS.canary + "40" }),
    line(c.canaryLabel + " queue + compute", COLORS.canary, c.canaryDash),
    line(c.refLabel + " queue", COLORS.reference, { fill: COLORS.reference + "40" }),
    line(c.refLabel + " queue + compute", COLORS.reference)],
  [inTriton.map((v) => v.at), part("canary"), total("canary"), part("reference"), total("reference")],
  { marks: c.marks, pad: c.pad, start: c.start });
}

// The statistical judge's accumulated effect per metric, and the e-values.
function effectPanels(data, c) {
  const judged = c.verdicts.filter((v) => (v.metrics || []).length);
  const names = [...new Set(judged.flatMap((v) => v.metrics.map((m) => m.name)))].filter((n) => !n.startsWith("check:"));
  for (const name of names) {
    const pick = (field) => judged.map((v) => { const m = v.metrics.find((x) => x.name === name); return m ? m[field] : null; });
    chart("chart-effect-" + name, "Accumulated effect: " + name, "canary minus reference, with its 95% interval, against the floor",
      [line("effect", COLORS.canary, c.canaryDash), band("95% low", COLORS.canary), band("95% high", COLORS.canary),
        line("floor", COLORS.floor, { dash: [2, 2], points: { show: false } })],
      [judged.map((v) => v.at), pick("effect"), pick("low"), pick("high"), pick("floor")],
      { format: name.includes("rate") ? percentFmt : (v) => (v === null ? "" : (v * 100).toFixed(0) + "%"), marks: c.marks, pad: c.pad, start: c.start });
  }
  if (names.length) {
    const series = names.map((n, i) => line("e-value " + n, PALETTE[(i + 1) % PALETTE.length], i === 1 ? { dash: [6, 3] } : i === 2 ? { dash: [1, 3] } : {}));
    const needed = judged.map((v) => (v.metrics.find((m) => m.e_threshold) || {}).e_threshold || null);
    chart("chart-evalue", "E-value against the one needed", "log scale; a metric fails once its e-value passes the grey line (and the floor)",
      [...series, line("needed", COLORS.floor, { dash: [2, 2], points: { show: false } })],
      [judged.map((v) => v.at), ...names.map((n) => judged.map((v) => { const m = v.metrics.find((x) => x.name === n); return m ? Math.max(m.e_value, 1e-3) : null; })), needed],
      { log: true, format: (v) => (v === null ? "" : num(v, 2)), marks: c.marks, pad: c.pad, start: c.start });
  }
}

function weightsPanel(data, c) {
  const r = c.rollout;
  const kept = c.weights;
  const versions = [...new Set(kept.flatMap((w) => Object.keys(w.weights)))];
  const wx = kept.map((w) => w.at);
  if (kept.length) { wx.push(Math.max(Date.now() / 1000, wx[wx.length - 1])); }
  chart("chart-weights", "Traffic weights over time (%)", "as the rollout set them",
    versions.map((v) => line("version " + v + (v === r.canary ? " (canary)" : ""), v === r.canary ? COLORS.canary : PALETTE[(versions.indexOf(v) + 2) % PALETTE.length],
      { paths: uPlot.paths.stepped({ align: 1 }), ...(v === r.canary ? c.canaryDash : {}) })),
    [wx, ...versions.map((v) => { const ys = kept.map((w) => w.weights[v] ?? 0); if (kept.length) ys.push(ys[ys.length - 1]); return ys; })],
    { marks: c.marks, pad: c.pad, start: c.start });
}

const EVIDENCE_PANELS = [errorRatePanel, clientErrorPanel, latencyPanels, tritonPanel, effectPanels, weightsPanel];

function drawCharts(data) {
  const slot = $("charts-slot");
  const r = data.rollout;
  if (!r) { fill(slot, ); state.charts.clear(); return; }
  if (!$("charts")) fill(slot, h("h2", { text: "Evidence" }),
    h("p", { class: "muted", text: "Canary: orange, dashed, marked ●; reference (" + (r.baseline ? "baseline " + r.baseline : "stable " + r.stable) +
      "): blue, solid; dashed grey lines: where the weights changed. Latency, 4xx counts and weights over time kept by this replica; rates from " +
      data.rates_from + "." }),
    h("div", { class: "charts", id: "charts" }));
  const weights = ((data.timeline && data.timeline.weights) || []).filter((w) => w.at >= r.started_at);
  const context = {
    rollout: r, verdicts: historyVerdicts(data), weights,
    intervals: ((data.timeline && data.timeline.intervals) || []).filter((i) => i.at >= r.started_at),
    canaryLabel: "canary " + r.canary, refLabel: "reference " + (r.baseline || r.stable), canaryDash: { dash: [8, 4] },
    pad: Math.max(1, Number(r.spec.interval_s) || 30), start: r.started_at,
    // every change after the first weights (the start): the canary's new share
    marks: weights.slice(1).map((w) => ({ at: w.at, label: "canary " + (w.weights[r.canary] ?? 0) + "%" })),
  };
  for (const panel of EVIDENCE_PANELS) panel(data, context);
}
