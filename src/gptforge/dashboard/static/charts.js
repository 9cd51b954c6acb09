// gptforge dashboard: the series (smoothing, thinning, skipped steps) and the training charts, drawn by plotly.js
// (rl.js draws the RL and SFT charts).
"use strict";

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

