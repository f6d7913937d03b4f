// The console's charts (uPlot): each rollout's evidence, canary vs reference. Loaded before
// console.js, whose helpers (h, fill, $, state, pct, num, PALETTE, COLORS) it uses at run time.
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
  // thresholds: the ceiling the judge applies (max_error_rate, null = its default 0.01: RolloutSpec.error_rate_ceiling)
  const floor = r.spec.judge === "statistical" ? r.spec.max_error_rate_increase : (r.spec.max_error_rate ?? 0.01);
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
