// gptforge dashboard: polls the server's JSON API and hands the data to plotly.js.
// Every 2 s: GET /api/runs (list, state, progress), then for each selected run only the new lines of its
// metrics.jsonl (GET /api/runs/<id>/metrics?offset=N&file=F). Text from run files is always set with
// textContent, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const HIDDEN_POLL_MS = 10000;
const MAX_POINTS = 4000; // per trace on screen; longer series are thinned to per-bucket min and max
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf"];
const TRAIN_KEYS = ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "ms_per_iter"];

const S = {
  runs: new Map(),     // id -> summary from /api/runs
  data: new Map(),     // id -> metrics columns
  configs: new Map(),  // id -> {key, config}
  samples: new Map(),  // id -> {updated, list}
  selected: [],        // ids, in the order ticked
  focus: null,         // id shown in the details panel
  log: false,
  bpb: false,          // the loss chart in bits per byte (each evaluation's train_bpb, val_bpb)
  smoothing: 0.6,
  filter: "",
  configFilter: "",
  roots: [],
  lastOk: 0,
  tick: 0,
  dirty: true,
  initialised: false,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") node.setAttribute("style", v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// ---------- formatting ----------
function fmtNum(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return Number.isInteger(v) ? v.toLocaleString() : v.toFixed(digits);
}
function fmtDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h${String(m).padStart(2, "0")}m`;
  return `${m}m${String(sec).padStart(2, "0")}s`;
}
function fmtAgo(t, now) {
  if (!t) return "";
  const d = Math.max(0, now - t);
  if (d < 90) return `${Math.round(d)} s ago`;
  if (d < 5400) return `${Math.round(d / 60)} min ago`;
  if (d < 172800) return `${Math.round(d / 3600)} h ago`;
  return `${Math.round(d / 86400)} days ago`;
}
function colour(run) { return PALETTE[(run ? run.index : 0) % PALETTE.length]; }

// ---------- data ----------
function emptyData() {
  const train = { step: [] };
  for (const k of TRAIN_KEYS) train[k] = [];
  return {
    offset: 0, file: "", mark: "", missing: false, ended: false,
    train, eval: { step: [], val_loss: [], train_loss: [], val_bpb: [], train_bpb: [] },
    hellaswag: { step: [], acc: [], acc_norm: [] }, sample: [],
    skip: { step: [], loss: [], grad_norm: [], in_a_row: [] },  // steps skipped: loss or grad norm not finite
    extra: emptyExtra(),  // rl, rl_eval and chat records (rl.js)
  };
}

function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }

function addRecords(d, records) {
  for (const r of records) {
    if (r.kind === "train") {
      d.train.step.push(r.step);
      for (const k of TRAIN_KEYS) d.train[k].push(num(r[k]));
    } else if (r.kind === "eval") {
      d.eval.step.push(r.step);
      d.eval.val_loss.push(num(r.val_loss));
      d.eval.train_loss.push(num(r.train_loss));
      d.eval.val_bpb.push(num(r.val_bpb));  // null for runs from before bits per byte
      d.eval.train_bpb.push(num(r.train_bpb));
    } else if (r.kind === "hellaswag") {
      d.hellaswag.step.push(r.step);
      d.hellaswag.acc.push(num(r.acc));
      d.hellaswag.acc_norm.push(num(r.acc_norm));
    } else if (r.kind === "skip") {
      d.skip.step.push(r.step);
      d.skip.loss.push(num(r.loss));  // null: NaN or infinite (the server sends non-finite numbers as null)
      d.skip.grad_norm.push(num(r.grad_norm));
      d.skip.in_a_row.push(typeof r.in_a_row === "number" ? r.in_a_row : null);
    } else if (r.kind === "sample") {
      d.sample.push(r);
      if (d.sample.length > 50) d.sample.shift();
    } else if (r.kind === "end") {
      d.ended = true;
    } else {
      addExtraRecord(d, r);
    }
  }
}

async function getJSON(url) {
  const res = await fetch(url, { cache: "no-store" });
  const body = await res.json().catch(() => ({}));
  if (!res.ok) { const e = new Error(body.error || res.statusText); e.status = res.status; throw e; }
  return body;
}

const api = (id, what) => `/api/runs/${encodeURIComponent(id)}/${what}`;

const inflight = new Map();  // id -> promise: one metrics read per run at a time, or lines would repeat

function loadMetrics(id) {
  if (!inflight.has(id)) inflight.set(id, readMetrics(id).finally(() => inflight.delete(id)));
  return inflight.get(id);
}

async function readMetrics(id) {
  let d = S.data.get(id);
  if (!d) { d = emptyData(); S.data.set(id, d); }
  for (let i = 0; i < 100; i++) {  // a long file arrives in 4 MB pieces
    let r;
    try {
      const at = `offset=${d.offset}&file=${encodeURIComponent(d.file)}&mark=${encodeURIComponent(d.mark)}`;
      r = await getJSON(`${api(id, "metrics")}?${at}`);
    } catch (e) {
      if (e.status === 404) { if (!d.missing) { d.missing = true; S.dirty = true; } return; }
      throw e;
    }
    if (r.reset && d.offset > 0) {  // the file was started afresh (a new run or a resume): read it again
      const fresh = emptyData();
      S.data.set(id, fresh);
      d = fresh;
      S.dirty = true;
    }
    d.missing = false;
    if (r.records.length) { addRecords(d, r.records); S.dirty = true; }
    d.offset = r.offset;
    d.file = r.file;
    d.mark = r.mark || "";
    if (!r.more) return;
  }
}

async function loadConfig(id) {
  const run = S.runs.get(id);
  if (!run || !run.has_config) return;
  const key = `${run.started}`;
  const have = S.configs.get(id);
  if (have && have.key === key) return;
  try {
    S.configs.set(id, { key, config: await getJSON(api(id, "config")) });
    S.dirty = true;
  } catch (e) { /* config.json is being rewritten; next tick */ }
}

async function loadSamples(id) {
  const run = S.runs.get(id);
  if (!run || !run.has_samples) return;
  const have = S.samples.get(id);
  if (have && have.updated === run.updated) return;
  try {
    const r = await getJSON(`${api(id, "samples")}?limit=8`);
    S.samples.set(id, { updated: run.updated, list: r.samples });
    S.dirty = true;
  } catch (e) { /* next tick */ }
}

// ---------- polling ----------
async function tick() {
  try {
    const r = await getJSON("/api/runs");
    S.roots = r.roots;
    const ids = new Set();
    for (const run of r.runs) {
      ids.add(run.id);
      const old = S.runs.get(run.id);
      if (!old || JSON.stringify(old) !== JSON.stringify(run)) S.dirty = true;
      S.runs.set(run.id, run);
    }
    for (const id of [...S.runs.keys()]) if (!ids.has(id)) { S.runs.delete(id); S.dirty = true; }
    S.serverNow = r.now;
    if (!S.initialised) initialSelection();
    S.selected = S.selected.filter((id) => S.runs.has(id));
    if (S.focus && !S.selected.includes(S.focus)) S.focus = S.selected[0] || null;
    if (!S.focus) S.focus = S.selected[0] || null;
    await Promise.all(S.selected.map((id) => loadMetrics(id)));
    await Promise.all(S.selected.map((id) => loadConfig(id)));
    if (S.focus) await loadSamples(S.focus);
    S.lastOk = Date.now();
  } catch (e) {
    console.warn("dashboard poll failed:", e);
  }
  render();
  S.tick++;
  setTimeout(tick, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

function initialSelection() {
  S.initialised = true;
  const fromHash = readHash();
  if (fromHash.length) {
    S.selected = fromHash.filter((id) => S.runs.has(id));
  }
  if (!S.selected.length && S.runs.size) {  // the most recently updated run
    const newest = [...S.runs.values()].sort((a, b) => (b.updated || 0) - (a.updated || 0))[0];
    S.selected = [newest.id];
  }
}

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.has("log")) S.log = p.get("log") === "1";
  if (p.has("bpb")) S.bpb = p.get("bpb") === "1";
  if (p.has("smooth")) S.smoothing = Math.min(0.99, Math.max(0, Number(p.get("smooth")) || 0));
  if (p.has("focus")) S.focus = p.get("focus");
  $("logscale").checked = S.log;
  $("bpb").checked = S.bpb;
  $("smoothing").value = S.smoothing;
  $("smoothing-value").textContent = S.smoothing.toFixed(2);
  return (p.get("runs") || "").split(",").filter(Boolean);
}

function writeHash() {
  const p = new URLSearchParams();
  p.set("runs", S.selected.join(","));
  if (S.focus) p.set("focus", S.focus);
  p.set("log", S.log ? "1" : "0");
  if (S.bpb) p.set("bpb", "1");
  p.set("smooth", S.smoothing.toFixed(2));
  history.replaceState(null, "", `#${p.toString()}`);
}

// ---------- selection ----------
function toggleRun(id, only) {
  if (only) {
    S.selected = [id];
  } else if (S.selected.includes(id)) {
    S.selected = S.selected.filter((x) => x !== id);
  } else {
    S.selected = [...S.selected, id];
  }
  if (!S.selected.includes(S.focus)) S.focus = S.selected[0] || null;
  if (S.selected.includes(id) && only) S.focus = id;
  S.dirty = true;
  writeHash();
  render();
  Promise.all(S.selected.map((x) => Promise.all([loadMetrics(x), loadConfig(x)])))
    .then(() => (S.focus ? loadSamples(S.focus) : null))
    .then(render).catch(() => {});
}

// ---------- series helpers ----------
function smooth(ys, w) {
  if (!w) return ys;
  const out = new Array(ys.length);
  let last = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y === null) { out[i] = null; continue; }
    last = last * w + (1 - w) * y;
    n++;
    out[i] = last / (1 - Math.pow(w, n));  // debiased, as TensorBoard does
  }
  return out;
}

function thin(xs, ys) {  // at most MAX_POINTS points: each bucket keeps its min and max, so spikes stay visible
  if (xs.length <= MAX_POINTS) return [xs, ys];
  const buckets = Math.floor(MAX_POINTS / 2), size = xs.length / buckets, ox = [], oy = [];
  for (let b = 0; b < buckets; b++) {
    const lo = Math.floor(b * size), hi = Math.min(xs.length, Math.floor((b + 1) * size));
    let iMin = -1, iMax = -1;
    for (let i = lo; i < hi; i++) {
      if (ys[i] === null) continue;
      if (iMin < 0 || ys[i] < ys[iMin]) iMin = i;
      if (iMax < 0 || ys[i] > ys[iMax]) iMax = i;
    }
    if (iMin < 0) { ox.push(xs[lo]); oy.push(null); continue; }
    for (const i of iMin <= iMax ? [iMin, iMax] : [iMax, iMin]) {
      if (ox.length && ox[ox.length - 1] === xs[i]) continue;
      ox.push(xs[i]); oy.push(ys[i]);
    }
  }
  if (ox[ox.length - 1] !== xs[xs.length - 1]) { ox.push(xs[xs.length - 1]); oy.push(ys[ys.length - 1]); }
  return [ox, oy];
}

function line(run, x, y, extra) {
  const [tx, ty] = thin(x, y);
  return Object.assign({
    type: "scatter", mode: "lines", x: tx, y: ty, name: run.name, legendgroup: run.id,
    line: { color: colour(run), width: 1.8 }, connectgaps: false,
    hovertemplate: `${run.name}<br>step %{x}: %{y:.4g}<extra></extra>`,
  }, extra || {});
}

// A noisy train series (loss, tokens/s, MFU) smoothed by the slider, with its raw points drawn faintly behind
// while smoothing is on, so spikes stay visible. `name` is the smoothed trace's, `value` its hover format.
function smoothed(run, x, y, name, value) {
  const out = [];
  if (S.smoothing > 0) {
    out.push(line(run, x, y, { name: `${name} (raw)`, opacity: 0.25, hoverinfo: "skip", hovertemplate: undefined,
      line: { color: colour(run), width: 1 } }));
  }
  out.push(line(run, x, smooth(y, S.smoothing), { name,
    hovertemplate: `${name}<br>step %{x}: ${value}<extra></extra>` }));
  return out;
}

// Skipped steps: red x markers along the bottom of a chart (on a hidden 0..1 axis, so they sit at their step
// whatever the loss scale), each with its reason on hover.
function skipAxis() { return { overlaying: "y", range: [0, 1], fixedrange: true, visible: false }; }

function skipText(step, inARow) {
  return `step ${step} skipped: loss/grad norm not finite` + (inARow === null ? "" : ` (${inARow} in a row)`);
}

function skipTrace(run, sk) {
  const value = (v) => (v === null ? "not finite" : fmtNum(v, 4));
  return {
    type: "scatter", mode: "markers", x: sk.step.slice(), y: sk.step.map(() => 0.03), yaxis: "y2",
    name: `${run.name} skipped`, legendgroup: run.id, showlegend: false, cliponaxis: false,
    marker: { symbol: "x", size: 9, color: cssVar("--crashed"), line: { width: 1, color: cssVar("--crashed") } },
    text: sk.step.map((s, i) => skipText(s, sk.in_a_row[i])),
    customdata: sk.step.map((s, i) => `loss ${value(sk.loss[i])}, grad norm ${value(sk.grad_norm[i])}`),
    hovertemplate: `${run.name}<br>%{text}<br>%{customdata}<extra></extra>`,
  };
}

// ---------- charts ----------
function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function themeLayout() {
  const css = getComputedStyle(document.documentElement);
  const c = cssVar;
  return {
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    font: { family: css.fontFamily, size: 12, color: c("--text") },
    margin: { l: 60, r: 16, t: 8, b: 40 },
    xaxis: { title: { text: "step" }, gridcolor: c("--grid"), zerolinecolor: c("--grid"), linecolor: c("--border") },
    yaxis: { gridcolor: c("--grid"), zerolinecolor: c("--grid"), linecolor: c("--border") },
    hovermode: "closest", showlegend: false,
    hoverlabel: { namelength: -1 },
  };
}

const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
let syncing = false;

function draw(divId, traces, layoutExtra) {
  const div = $(divId);
  const base = themeLayout(), extra = layoutExtra || {};
  const layout = Object.assign({}, base, extra);
  layout.xaxis = Object.assign({}, base.xaxis, extra.xaxis || {});
  layout.yaxis = Object.assign({}, base.yaxis, extra.yaxis || {});
  layout.uirevision = S.selected.join(",");  // keep the user's zoom while new points arrive
  Plotly.react(div, traces, layout, PLOT_CONFIG);
  if (!div.dataset.synced) {  // zooming one chart's steps zooms them all
    div.dataset.synced = "1";
    div.on("plotly_relayout", (ev) => {
      if (syncing) return;
      const upd = {};
      if ("xaxis.range[0]" in ev) upd["xaxis.range"] = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
      else if (ev["xaxis.range"]) upd["xaxis.range"] = ev["xaxis.range"];
      else if (ev["xaxis.autorange"]) upd["xaxis.autorange"] = true;
      else return;
      syncing = true;
      const others = [...CHARTS, ...EXTRA_CHARTS].filter((id) => id !== divId && $(id).data);
      Promise.all(others.map((id) => Plotly.relayout($(id), upd))).finally(() => { syncing = false; });
    });
  }
}

// The loss chart's traces of a run: train loss (every logged step, smoothed) and val loss; with the bits-per-byte
// toggle each evaluation's train_bpb and val_bpb instead (a train step's loss has no byte count of its own).
function lossTraces(run, d) {
  const c = colour(run);
  const val = S.bpb ? d.eval.val_bpb : d.eval.val_loss;
  const dashed = line(run, d.eval.step, val, { name: `${run.name} val`, mode: "lines+markers",
    line: { color: c, width: 2, dash: "dash" }, marker: { size: 7, color: c, line: { color: cssVar("--panel"), width: 1.5 } },
    hovertemplate: `${run.name} val${S.bpb ? " bpb" : ""}<br>step %{x}: %{y:.4f}<extra></extra>` });
  if (!S.bpb) return [...smoothed(run, d.train.step, d.train.loss, `${run.name} train`, "%{y:.4f}"), dashed];
  const train = line(run, d.eval.step, d.eval.train_bpb, { name: `${run.name} train`, mode: "lines+markers",
    marker: { size: 5, color: c }, hovertemplate: `${run.name} train bpb<br>step %{x}: %{y:.4f}<extra></extra>` });
  return [train, dashed];
}

const CHARTS = ["chart-loss", "chart-lr", "chart-grad", "chart-tps", "chart-mfu", "chart-hellaswag"];

function selectedRuns() {
  return S.selected.map((id) => S.runs.get(id)).filter(Boolean);
}

function renderCharts() {
  const runs = selectedRuns();
  const multi = runs.length > 1;
  const loss = [], lr = [], grad = [], tps = [], mfu = [], hs = [], skips = [];
  for (const run of runs) {
    const d = S.data.get(run.id);
    if (!d) continue;
    const t = d.train, c = colour(run);
    loss.push(...lossTraces(run, d));
    if (d.skip.step.length) skips.push(skipTrace(run, d.skip));
    lr.push(line(run, t.step, t.lr, { hovertemplate: `${run.name}<br>step %{x}: %{y:.3e}<extra></extra>` }));
    grad.push(line(run, t.step, smooth(t.grad_norm, S.smoothing)));
    const rl = rlTrainTraces(run, d);
    lr.push(...rl.lr);
    grad.push(...rl.grad);
    tps.push(...smoothed(run, t.step, t.tokens_per_s, run.name, "%{y:,.0f} tok/s"));
    mfu.push(...smoothed(run, t.step, t.mfu.map((v) => (v === null ? null : v * 100)), run.name, "%{y:.2f}%"));
    if (d.hellaswag.step.length) {
      hs.push(line(run, d.hellaswag.step, d.hellaswag.acc_norm, { name: `${run.name} acc_norm`,
        mode: "lines+markers", marker: { size: 6, color: c },
        hovertemplate: `${run.name} acc_norm<br>step %{x}: %{y:.4f}<extra></extra>` }));
      hs.push(line(run, d.hellaswag.step, d.hellaswag.acc, { name: `${run.name} acc`, mode: "lines",
        line: { color: c, width: 1.2, dash: "dot" },
        hovertemplate: `${run.name} acc<br>step %{x}: %{y:.4f}<extra></extra>` }));
    }
  }
  renderExtraCharts(runs);
  // runs of `gptforge rl` alone: no loss, tokens/s or MFU to draw (their panels come back with a train run)
  const rlOnly = runs.length > 0 && runs.every((run) => {
    const d = S.data.get(run.id);
    return hasRl(d) && !d.train.step.length && !d.eval.step.length && !d.skip.step.length;
  });
  for (const id of ["chart-loss", "chart-tps", "chart-mfu"]) $(id).closest(".panel").hidden = rlOnly;
  const logType = S.log ? "log" : "linear";
  const legend = { showlegend: multi, legend: { orientation: "h", y: -0.18 } };
  $("loss-title").textContent = S.bpb ? "Bits per byte" : "Loss";
  $("loss-note").textContent = S.bpb
    ? "each evaluation's train (solid) and val (dashed, dots): the loss in bits over the bytes of text, across tokenizers"
    : "train (solid) and val (dashed, dots) against step";
  const lossAxis = { title: { text: S.bpb ? "bits per byte" : "loss" }, type: logType, uirevision: `${logType} ${S.bpb}` };
  if (!rlOnly) {
    draw("chart-loss", loss.concat(skips), Object.assign({ yaxis: lossAxis, yaxis2: skipAxis() }, multi ? legend : {},
      multi ? { margin: { l: 60, r: 16, t: 8, b: 70 } } : {}));
  }
  draw("chart-lr", lr, { yaxis: { exponentformat: "e", tickformat: ".1e" } });
  draw("chart-grad", grad.concat(skips), { yaxis: { type: logType, uirevision: `${logType}` }, yaxis2: skipAxis() });
  if (!rlOnly) {
    draw("chart-tps", tps, { yaxis: { tickformat: ",.0f" } });
    draw("chart-mfu", mfu, { yaxis: { ticksuffix: "%" } });
  }
  $("panel-hellaswag").hidden = hs.length === 0;
  if (hs.length) draw("chart-hellaswag", hs, { yaxis: { title: { text: "accuracy" } } });
}

// ---------- run list, cards, details ----------
function progress(run) {
  if (run.step === null || !run.max_iters) return null;
  return Math.max(0, Math.min(1, run.step / run.max_iters));
}

function renderRunList() {
  const list = $("run-list");
  const runs = [...S.runs.values()];
  $("run-count").textContent = runs.length ? `(${runs.length})` : "";
  list.replaceChildren();
  const f = S.filter.toLowerCase();
  for (const run of runs) {
    if (f && !run.name.toLowerCase().includes(f)) continue;
    const selected = S.selected.includes(run.id);
    const box = el("input", { type: "checkbox", title: "compare", "aria-label": `compare ${run.name}` });
    box.checked = selected;
    box.addEventListener("click", (ev) => { ev.stopPropagation(); toggleRun(run.id, false); });
    const p = progress(run);
    const sub = [el("span", { class: `badge ${run.state}` }, run.state), skipBadge(run)];
    if (run.step !== null) sub.push(el("span", {}, run.max_iters ? `${run.step}/${run.max_iters}` : `step ${run.step}`));
    if (run.state === "running" && run.eta_s !== null) sub.push(el("span", {}, `eta ${fmtDuration(run.eta_s)}`));
    if (run.best_val_loss !== null) sub.push(el("span", {}, `val ${fmtNum(run.best_val_loss, 3)}`));
    sub.push(...extraSub(run));
    const li = el("li", { class: `run${selected ? " selected" : ""}`, style: `--swatch:${colour(run)}`,
      "data-id": run.id, title: run.name },
      box,
      el("div", { class: "name" }, el("span", { class: "dot" }), run.name),
      el("div", { class: "sub" }, ...sub),
      p === null ? null : el("div", { class: "bar" }, el("div", { style: `width:${(p * 100).toFixed(1)}%` })));
    li.addEventListener("click", () => toggleRun(run.id, true));
    list.append(li);
  }
  $("roots").textContent = S.roots.length ? `Watching ${S.roots.join(", ")}` : "";
  $("empty").hidden = runs.length > 0;
  $("empty-roots").textContent = S.roots.join(", ");
}

function skipBadge(run) {  // "3 skipped" when the run skipped steps whose loss or grad norm was not finite
  if (!run.skipped) return null;
  const ls = run.last_skip;
  let title = `${run.skipped} step${run.skipped === 1 ? "" : "s"} skipped: loss or grad norm not finite, ` +
    "weights left unchanged";
  if (ls) {
    title += `; the last at step ${ls.step}`;
    if (Number.isFinite(ls.in_a_row)) title += `, ${ls.in_a_row} in a row`;
    if (Number.isFinite(ls.max_bad_steps)) title += ` (the run stops at ${ls.max_bad_steps} in a row)`;
  }
  return el("span", { class: "skips", title }, `${run.skipped} skipped`);
}

function stoppedByBadSteps(run) {  // train exits after max_bad_steps skips in a row, without an end line
  const ls = run.last_skip;
  return Boolean(ls && ls.step === run.step && Number.isFinite(ls.in_a_row) && Number.isFinite(ls.max_bad_steps)
    && ls.in_a_row >= ls.max_bad_steps);
}

function stat(label, value) { return el("div", { class: "stat" }, el("span", {}, label), el("b", {}, value)); }

function last(arr) {
  for (let i = arr.length - 1; i >= 0; i--) if (arr[i] !== null) return arr[i];
  return null;
}

function lowest(arr) {
  const values = arr.filter((v) => v !== null);
  return values.length ? Math.min(...values) : null;
}

function renderCards() {
  const cards = $("cards");
  cards.replaceChildren();
  const now = S.serverNow || Date.now() / 1000;
  for (const run of selectedRuns()) {
    const d = S.data.get(run.id) || emptyData();
    const p = progress(run);
    const left = run.max_iters ? `step ${fmtNum(run.step ?? 0)} / ${fmtNum(run.max_iters)}` : `step ${run.step ?? "–"}`;
    let right = p === null ? "" : `${(p * 100).toFixed(1)}%`;
    if (run.state === "running" && run.eta_s !== null) right += ` · eta ${fmtDuration(run.eta_s)}`;
    const titleTip = {
      running: "a line was written recently",
      finished: run.rl ? "the run wrote its end line: max_steps reached" : "the last evaluation reached max_iters",
      stopped: "interrupted: a checkpoint was saved after the last line (--init_from=resume continues it)",
      crashed: "no new line for a while and no checkpoint after the last one",
      missing: "metrics.jsonl is gone: the folder was deleted or moved",
    }[run.state] || "";
    const tip = (run.state === "running" || run.state === "crashed") && stoppedByBadSteps(run)
      ? `training stopped: ${run.last_skip.in_a_row} steps in a row had a loss or grad norm that was not finite ` +
        "(--max_bad_steps); the last good checkpoint is intact" : titleTip;
    const tps = last(d.train.tokens_per_s), mfu = last(d.train.mfu);
    const updated = stat("updated", run.updated ? fmtAgo(run.updated, now) : "–");
    const stats = rlStats(run, d, updated) || [
      stat("loss", fmtNum(run.loss, 4)),
      S.bpb ? stat("val bpb", fmtNum(last(d.eval.val_bpb), 4)) : stat("val loss", fmtNum(run.val_loss, 4)),
      S.bpb ? stat("best val bpb", fmtNum(lowest(d.eval.val_bpb), 4)) : stat("best val", fmtNum(run.best_val_loss, 4)),
      stat("tokens/s", tps === null ? "–" : Math.round(tps).toLocaleString()),
      stat("mfu", mfu === null ? "–" : `${(mfu * 100).toFixed(1)}%`),
      chatStat(run, d), updated];
    cards.append(el("div", { class: "card", style: `--swatch:${colour(run)}`, "data-id": run.id },
      el("div", { class: "title" }, el("strong", { title: run.name }, run.name),
        el("span", { class: "badges" }, skipBadge(run),
          el("span", { class: `badge ${run.state}`, title: tip }, run.state))),
      p === null ? null : el("div", { class: "bar" }, el("div", { style: `width:${(p * 100).toFixed(1)}%` })),
      el("div", { class: "progress-text" }, el("span", {}, left), el("span", {}, right)),
      el("div", { class: "stats" }, ...stats)));
  }
}

function renderDetails() {
  const focus = $("focus");
  const runs = selectedRuns();
  $("details").hidden = runs.length === 0;
  focus.replaceChildren(...runs.map((r) => el("option", { value: r.id }, r.name)));
  if (S.focus) focus.value = S.focus;
  const run = S.runs.get(S.focus);
  // samples
  const box = $("samples");
  const d = run && S.data.get(run.id);
  const got = run && run.has_samples ? S.samples.get(run.id) : undefined;  // a resume may empty the file again
  let list = got?.list || [];
  if (!list.length && d) list = d.sample.slice(-8);
  if (!list.length) {
    // loading only until the first answer: a file without a readable sample is no samples
    const every = run && S.configs.get(run.id)?.config?.sample_interval;  // on, but not reached yet
    box.replaceChildren(el("p", { class: "muted" }, !run ? "" : run.has_samples && !got ? "Loading samples…"
      : every > 0 ? `no samples yet (every ${every} steps)` : run.rl ? "no samples (gptforge rl writes none)"
      : "no samples (enable with --sample_interval)"));
  } else {
    const items = [];
    for (const s of [...list].reverse()) {
      const texts = sampleTexts(s);
      const meta = [s.step !== undefined ? `step ${s.step}` : null, s.time ? new Date(s.time * 1000).toLocaleTimeString() : null]
        .filter(Boolean).join(" · ");
      for (const t of texts) items.push(el("div", { class: "sample" }, el("div", { class: "meta" }, meta || "sample"), el("pre", {}, t)));
    }
    box.replaceChildren(...items);
  }
  // config
  const cfg = run && S.configs.get(run.id)?.config;
  const table = $("config");
  if (!cfg) {
    table.replaceChildren(el("tr", {}, el("td", { class: "muted" }, run ? "No config.json." : "")));
  } else {
    const f = S.configFilter.toLowerCase();
    table.replaceChildren(...Object.keys(cfg).filter((k) => !f || k.toLowerCase().includes(f))
      .map((k) => el("tr", {}, el("th", {}, k), el("td", {}, JSON.stringify(cfg[k])))));
  }
  // differences between the selected runs' configs
  const withCfg = runs.filter((r) => S.configs.get(r.id)?.config);
  const wrap = $("diff-wrap");
  wrap.hidden = withCfg.length < 2;
  if (withCfg.length >= 2) {
    const cfgs = withCfg.map((r) => S.configs.get(r.id).config);
    const keys = [...new Set(cfgs.flatMap((c) => Object.keys(c)))].sort();
    const differ = keys.filter((k) => new Set(cfgs.map((c) => JSON.stringify(c[k]))).size > 1);
    const head = el("thead", {}, el("tr", {}, el("th", {}, "key"),
      ...withCfg.map((r) => el("th", { style: `color:${colour(r)}` }, r.name))));
    const rows = differ.length ? differ.map((k) => el("tr", {}, el("th", {}, k),
      ...cfgs.map((c) => el("td", {}, c[k] === undefined ? "–" : JSON.stringify(c[k])))))
      : [el("tr", {}, el("td", { colspan: withCfg.length + 1, class: "muted" }, "The configs are identical."))];
    $("config-diff").replaceChildren(head, el("tbody", {}, ...rows));
  }
}

function sampleTexts(s) {
  for (const k of ["texts", "samples"]) if (Array.isArray(s[k])) return s[k].map(String);
  for (const k of ["text", "sample", "completion"]) if (typeof s[k] === "string") return [s[k]];
  const rest = Object.fromEntries(Object.entries(s).filter(([k]) => !["step", "time", "kind"].includes(k)));
  return [JSON.stringify(rest, null, 1)];
}

function renderLive() {
  const live = $("live");
  const age = (Date.now() - S.lastOk) / 1000;
  const ok = S.lastOk && age < 3 * POLL_MS / 1000 + 5;
  live.className = `live ${ok ? "ok" : "down"}`;
  live.textContent = ok ? "live" : S.lastOk ? "server unreachable, retrying…" : "connecting…";
}

function render() {
  renderLive();
  if (!S.dirty || typeof Plotly === "undefined") return;
  S.dirty = false;
  renderRunList();
  renderCards();
  renderDetails();
  renderCharts();
  document.body.dataset.ready = "1";
}

// ---------- controls ----------
function init() {
  readHash();
  $("logscale").addEventListener("change", (e) => { S.log = e.target.checked; S.dirty = true; writeHash(); render(); });
  $("bpb").addEventListener("change", (e) => { S.bpb = e.target.checked; S.dirty = true; writeHash(); render(); });
  $("smoothing").addEventListener("input", (e) => {
    S.smoothing = Number(e.target.value);
    $("smoothing-value").textContent = S.smoothing.toFixed(2);
    S.dirty = true; writeHash(); render();
  });
  $("run-filter").addEventListener("input", (e) => { S.filter = e.target.value; S.dirty = true; render(); });
  $("config-filter").addEventListener("input", (e) => { S.configFilter = e.target.value; S.dirty = true; render(); });
  $("focus").addEventListener("change", (e) => {
    S.focus = e.target.value; S.dirty = true; writeHash();
    loadSamples(S.focus).then(render);
    render();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) { S.dirty = true; render(); } });
  tick();
}

init();
