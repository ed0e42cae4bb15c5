// The status page of noisy-temp-server (served by server/dashboard.py). Plain browser
// JavaScript, no build step; charts by the vendored uPlot.
//
// Every REFRESH_MS it reads /health (no key), /v1/nts/status and /v1/nts/dashboard (with the
// key from sessionStorage when one was given) and redraws. State for tests and people:
// #status[data-state] is loading | ok | engine-down | unauthorized | unreachable | error, each
// chart's [data-points] is the number of non-null points it draws, and
// body[data-refreshes] counts the completed refreshes.
"use strict";

const REFRESH_MS = 5000;
const KL_MIN_SPAN_S = 120;
const KEY_STORAGE = "nts-api-key";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
const ALPHA_COLOR = "#111827";

const $ = (id) => document.getElementById(id);
const charts = {};
let timer = null;
let refreshes = 0;

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return value.toLocaleString("en");
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(digits - 1);
  return value.toPrecision(digits);
}

function plural(count, noun) {
  return `${fmt(count)} ${noun}${count === 1 ? "" : "s"}`;
}

function setState(state, text) {
  const pill = $("status");
  pill.dataset.state = state;
  pill.textContent = text;
}

function showBanner(kind, text) {
  const banner = $("banner");
  banner.hidden = !text;
  banner.dataset.kind = kind || "";
  banner.textContent = text || "";
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function getJson(path) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  return { status: response.status, body };
}

function errorMessage(body, fallback) {
  return (body && body.error && body.error.message) || fallback;
}

function facts(id, rows) {
  const list = $(id);
  list.replaceChildren();
  for (const [name, value, title] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    if (title) dt.title = title;
    const dd = document.createElement("dd");
    dd.textContent = value;
    list.append(dt, dd);
  }
}

// ------------------------------------------------------------------ cards

function renderPolicy(status) {
  $("model").textContent = status.model;
  $("policy-version").textContent = fmt(status.policy_version);
  const estimator = status.estimator || {};
  const rows = [["rule", status.rule]];
  const policy = status.policy || {};
  if (policy.fixed_temperature !== undefined) rows.push(["fixed T", fmt(policy.fixed_temperature)]);
  if (estimator.enabled === false) {
    rows.push(["source", `static (${estimator.origin || "no estimator"})`]);
  } else {
    rows.push(["source", "online estimator"]);
    rows.push(["positions seen", fmt(estimator.positions_seen)]);
    rows.push(["window", `${fmt(estimator.window_requests)} requests`]);
    const refit = estimator.last_refit_time;
    rows.push(["last refit", refit ? new Date(refit * 1000).toLocaleTimeString() : "never"]);
    rows.push(["estimator", estimator.healthy === false ? `error: ${estimator.last_error}` : "healthy"]);
  }
  rows.push(["adapter", adapterText(status.adapter), "the compensation adapter under the policy"]);
  const calibrated = status.adapter && status.adapter.calibrated_kl;
  if (calibrated) {
    rows.push([
      "adapter at calibration",
      calibratedKlText(calibrated),
      "mean KL(clean ‖ served) at T = 1 on the calibration's test prompts, without → with the " +
        "adapter, nats; the live figure is under KL to the clean model",
    ]);
  }
  facts("policy-facts", rows);
}

// What the adapter did at calibration: KL at T = 1 without → with it, and the share removed
// (or added, where it made things worse), in whole per cent.
function calibratedKlText(calibrated) {
  const without = calibrated.without_adapter;
  const text = `KL ${fmt(without)} → ${fmt(calibrated.with_adapter)}`;
  if (!(without > 0)) return text;
  const share = Math.round(100 * (1 - calibrated.with_adapter / without));
  return `${text} (${Math.abs(share)} % ${share >= 0 ? "removed" : "added"})`;
}

// The compensation adapter's path in force: folded into the weights, vLLM's LoRA, or none.
function adapterText(adapter) {
  if (!adapter || adapter.path === "none") return "none";
  const how = adapter.path === "folded" ? "folded into the weights" : "LoRA (vLLM)";
  return `${how} · rank ${fmt(adapter.rank)} · ${adapter.sha256.slice(0, 12)}…`;
}

function renderKl(dashboard) {
  const one = dashboard.shadow_kl.one;
  const served = dashboard.shadow_kl.served;
  const rows = [
    ["at T = 1", fmt(one.mean), "mean KL(clean ‖ served) per position, nats"],
    ["at served T*", fmt(served.mean), "mean KL(clean ‖ served at T*) per position, nats"],
  ];
  if (one.mean && served.mean !== null) {
    const gain = (1 - served.mean / one.mean) * 100;
    rows.push(["reduction", `${gain >= 0 ? "" : "+"}${fmt(Math.abs(gain))} %`]);
  }
  rows.push(["positions", `${fmt(one.positions)} / ${fmt(served.positions)} (T=1 / T*)`]);
  facts("kl-facts", rows);
}

function renderShadow(shadow) {
  if (!shadow || shadow.enabled === false) {
    facts("shadow-facts", [["state", "off (no clean model)"]]);
    return;
  }
  const perToken = shadow.seconds_per_scored_token;
  facts("shadow-facts", [
    ["sampled fraction", fmt(shadow.fraction)],
    ["offered / sampled", `${fmt(shadow.offered)} / ${fmt(shadow.sampled)}`],
    ["scored requests", fmt(shadow.scored)],
    ["scored tokens", fmt(shadow.tokens)],
    ["dropped", `${fmt(shadow.dropped_queue_full)} queue full, ${fmt(shadow.dropped_error)} errors`],
    ["queue", `${fmt(shadow.queue_depth)} / ${fmt(shadow.queue_size)}`],
    ["cost", perToken === null ? "–" : `${fmt(perToken * 1000)} ms per scored token`],
    ["scoring time", `${fmt(shadow.score_seconds_total)} s total`],
  ]);
}

// ------------------------------------------------------------------ step buckets

// A step bucket label ("0-7", "8-31", "32+") as the steps it covers, both ends included.
function bucketRange(label) {
  const [lo, hi] = label.split("-");
  return label.endsWith("+") ? [parseInt(lo, 10), Infinity] : [parseInt(lo, 10), parseInt(hi, 10)];
}

function bucket(label, value, steps) {
  const [lo, hi] = bucketRange(label);
  return { label, lo, hi, value, steps };
}

// The α series (policy in force) and one T* series per rule seen by the engine, each a list of
// buckets; a T* series has only the buckets where the engine applied that rule.
function stepSeries(status, dashboard) {
  const alpha = {
    label: "α",
    buckets: Object.entries(status.alpha_by_step_bucket).map(([label, value]) => bucket(label, value)),
  };
  const byRule = {};
  for (const row of dashboard.step_temperature) {
    const series = (byRule[row.rule] ||= { label: `T* (${row.rule})`, buckets: [] });
    series.buckets.push(bucket(row.step_bucket, row.t_mean, row.steps));
  }
  return { alpha, temperatures: Object.values(byRule) };
}

function valueAt(series, step) {
  const found = series.buckets.find((b) => b.lo <= step && step <= b.hi);
  return found ? found.value : null;
}

// x values: every bucket's first and last step; the open last bucket is drawn as long as the
// bucket before it (at least 8 steps).
function stepAxis(all) {
  const buckets = all.flatMap((s) => s.buckets);
  const starts = [...new Set(buckets.map((b) => b.lo))].sort((a, b) => a - b);
  const last = starts[starts.length - 1] || 0;
  const openEnd = last + Math.max(starts.length > 1 ? last - starts[starts.length - 2] : 16, 8);
  const xs = new Set([...starts, openEnd]);
  for (const b of buckets) xs.add(Math.min(b.hi, openEnd));
  return [...xs].sort((a, b) => a - b);
}

// Rows: the buckets of the policy in force and those the engine applied T* in (earlier
// policies may have had other buckets), by first step.
function renderBucketTable(status, series) {
  const labels = [...new Set([...Object.keys(status.alpha_by_step_bucket), ...series.temperatures.flatMap((s) => s.buckets.map((b) => b.label))])];
  labels.sort((a, b) => bucketRange(a)[0] - bucketRange(b)[0] || bucketRange(a)[1] - bucketRange(b)[1]);
  const head = $("bucket-table").tHead.rows[0];
  head.replaceChildren();
  for (const name of ["step bucket", "α", "σ²", ...series.temperatures.map((s) => `mean ${s.label}`)]) {
    const th = document.createElement("th");
    th.textContent = name;
    head.append(th);
  }
  const body = $("bucket-table").tBodies[0];
  body.replaceChildren();
  for (const label of labels) {
    const tr = document.createElement("tr");
    const inForce = label in status.alpha_by_step_bucket;
    const cells = [
      inForce ? label : `${label} (earlier policy)`,
      fmt(status.alpha_by_step_bucket[label]),
      fmt(status.sigma2_by_step_bucket[label]),
    ];
    for (const s of series.temperatures) {
      const found = s.buckets.find((b) => b.label === label);
      cells.push(found ? `${fmt(found.value)} (${plural(found.steps, "row")})` : "–");
    }
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    body.append(tr);
  }
}

// ------------------------------------------------------------------ charts

function chartWidth(element) {
  return Math.max(280, element.clientWidth);
}

// Draw (or redraw when the series changed) chart `id`; `countPoints` non-null values.
function draw(id, makeOptions, data, seriesKey) {
  const element = $(id);
  let chart = charts[id];
  if (!chart || chart.seriesKey !== seriesKey) {
    if (chart) chart.plot.destroy();
    const plot = new uPlot(makeOptions(chartWidth(element)), data, element);
    chart = charts[id] = { plot, seriesKey };
  } else {
    chart.plot.setData(data);
  }
  const points = data.slice(1).reduce((n, ys) => n + ys.filter((y) => y !== null).length, 0);
  element.dataset.points = String(points);
}

function stepsChartOptions(series) {
  return (width) => ({
    width,
    height: 260,
    legend: { live: true },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: false }, alpha: { range: (u, lo, hi) => [0, Math.max(hi * 1.15, 1e-6)] }, t: {} },
    axes: [
      { label: "generation step", stroke: "#374151", grid: { stroke: "#eef0f3" } },
      { scale: "alpha", label: "α", stroke: "#374151", grid: { stroke: "#eef0f3" }, size: 60 },
      { scale: "t", label: "T*", side: 1, stroke: "#374151", grid: { show: false }, size: 50 },
    ],
    series: [
      { label: "step" },
      { label: "α", scale: "alpha", stroke: ALPHA_COLOR, width: 2, dash: [6, 4], points: { show: false }, paths: uPlot.paths.stepped({ align: 1 }), value: (u, v) => fmt(v) },
      ...series.temperatures.map((s, i) => ({
        label: s.label,
        scale: "t",
        stroke: COLORS[i % COLORS.length],
        width: 2.5,
        points: { show: false },
        paths: uPlot.paths.stepped({ align: 1 }),
        value: (u, v) => fmt(v),
      })),
    ],
  });
}

// The chart shows T* in the buckets of the policy in force (the table shows all buckets).
function renderStepsChart(status, dashboard) {
  const series = stepSeries(status, dashboard);
  const current = new Set(Object.keys(status.alpha_by_step_bucket));
  const temperatures = series.temperatures
    .map((s) => ({ ...s, buckets: s.buckets.filter((b) => current.has(b.label)) }))
    .filter((s) => s.buckets.length);
  const xs = stepAxis([series.alpha]);
  const data = [xs, xs.map((x) => valueAt(series.alpha, x))];
  for (const s of temperatures) data.push(xs.map((x) => valueAt(s, x)));
  const key = temperatures.map((s) => s.label).join("|");
  draw("chart-steps", stepsChartOptions({ alpha: series.alpha, temperatures }), data, key);
  renderBucketTable(status, series);
}

function clockTime(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false, hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function klChartOptions(width) {
  const line = (label, stroke) => ({
    label, stroke, width: 2, spanGaps: true, points: { show: true, size: 6, fill: stroke },
    value: (u, v) => fmt(v),
  });
  return {
    width,
    height: 260,
    cursor: { drag: { x: false, y: false } },
    scales: { y: { range: (u, lo, hi) => [0, Math.max(hi * 1.15, 1e-6)] } },
    axes: [
      { stroke: "#374151", grid: { stroke: "#eef0f3" }, space: 70, values: (u, splits) => splits.map(clockTime) },
      { label: "KL (nats)", stroke: "#374151", grid: { stroke: "#eef0f3" }, size: 60 },
    ],
    series: [{ label: "time", value: (u, v) => (v === null ? "–" : clockTime(v)) }, line("at T = 1", COLORS[1]), line("at served T*", COLORS[0])],
  };
}

function renderKlChart(dashboard) {
  const history = dashboard.kl_history;
  const data = [history.map((p) => p.time), history.map((p) => p.kl_one), history.map((p) => p.kl_served)];
  draw("chart-kl", klChartOptions, data, "kl");
  if (history.length) {
    // At least the last KL_MIN_SPAN_S seconds, so a young history does not stretch over years.
    const first = history[0].time;
    const last = history[history.length - 1].time;
    charts["chart-kl"].plot.setScale("x", { min: Math.min(first, last - KL_MIN_SPAN_S), max: last + 5 });
  }
}

// ------------------------------------------------------------------ refresh loop

function askForKey(message) {
  clearTimeout(timer);
  timer = null;
  $("key-form").hidden = false;
  $("key-message").textContent = message;
  $("api-key").focus();
}

async function refresh() {
  timer = null;
  let health;
  try {
    health = await fetch("/health", { cache: "no-store" });
  } catch (_) {
    setState("unreachable", "server unreachable");
    showBanner("error", "The server does not answer; retrying.");
    schedule();
    return;
  }
  const [status, dashboard] = await Promise.all([getJson("/v1/nts/status"), getJson("/v1/nts/dashboard")]);
  if (status.status === 401 || dashboard.status === 401) {
    const hadKey = Boolean(sessionStorage.getItem(KEY_STORAGE));
    setState("unauthorized", hadKey ? "wrong API key" : "API key needed");
    showBanner("error", hadKey ? "The server refused this API key (401). Enter the right one." : "");
    askForKey(hadKey ? "That key was refused (401)." : "This server needs its API key to show its status.");
    return;
  }
  if (status.status !== 200 || dashboard.status !== 200) {
    setState("error", "error");
    showBanner("error", errorMessage(status.body || dashboard.body, `The server answered ${status.status}/${dashboard.status}.`));
    schedule();
    return;
  }
  render(status.body, dashboard.body);
  if (health.status === 200) {
    setState("ok", "serving");
    showBanner("", "");
  } else {
    let body = null;
    try { body = await health.json(); } catch (_) { body = null; }
    setState("engine-down", "engine down");
    const detail = errorMessage(body, "no detail").replace(/\.$/, "");
    showBanner("error", `The engine is down (/health ${health.status}): ${detail}. Numbers below are the last known.`);
  }
  refreshes += 1;
  document.body.dataset.refreshes = String(refreshes);
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  schedule();
}

function render(status, dashboard) {
  $("key-form").hidden = true;
  $("forget-key").hidden = !sessionStorage.getItem(KEY_STORAGE);
  renderPolicy(status);
  renderKl(dashboard);
  renderShadow(status.shadow);
  renderStepsChart(status, dashboard);
  renderKlChart(dashboard);
}

function schedule() {
  if (timer === null) timer = setTimeout(refresh, REFRESH_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("api-key").value = "";
  $("key-message").textContent = "checking…";
  refresh();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  location.reload();
});

window.addEventListener("resize", () => {
  for (const [id, chart] of Object.entries(charts)) chart.plot.setSize({ width: chartWidth($(id)), height: 260 });
});

refresh();
