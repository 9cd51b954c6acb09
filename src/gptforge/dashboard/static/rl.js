// gptforge dashboard: the charts of `gptforge rl` runs ("rl" records: reward, pass rates, answer length, sampled
// tokens/s, KL; "rl_eval" records: held-out pass@1 overall and per task kind) and of SFT's held-out accuracy per
// kind ("chat" records). Loaded after data.js and charts.js and before app.js, whose helpers (num, smooth, line,
// smoothed, draw, colour, el, stat, fmtNum, last, $, S) these functions call once the page runs. A panel shows only while a selected run has its
// records, so a pretraining run's page is as before.
"use strict";

const EXTRA_CHARTS = ["chart-rl-reward", "chart-rl-eval", "chart-rl-length", "chart-rl-tps", "chart-rl-kl",
  "chart-chat"];
const RL_KEYS = ["reward", "pass_at_1", "answer_tokens", "sampled_tokens_per_s", "loss", "kl", "grad_norm", "lr"];
const DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"];  // per run, when several are shown

// ---------- data ----------
function byKind() {  // one row per evaluation; kinds[k] is aligned with step (null before the kind first appears)
  return { step: [], overall: [], ended: [], pass_at_k: [], k: null, kinds: {} };
}

function emptyExtra() {
  const rl = { step: [], pass_at_k: [], k: null };
  for (const k of RL_KEYS) rl[k] = [];
  return { rl, rlEval: byKind(), chat: byKind() };
}

// pass@G of a record: the key is named after the run's group size (pass_at_8); [G, value] or [null, null]
function passAtK(r) {
  for (const key of Object.keys(r)) {
    const m = /^pass_at_(\d+)$/.exec(key);
    if (m && m[1] !== "1") return [Number(m[1]), num(r[key])];
  }
  return [null, null];
}

function addKindRow(t, r, overall, prefix) {
  const n = t.step.length;
  for (const key of Object.keys(r)) {
    if (key.startsWith(prefix) && key.length > prefix.length && !t.kinds[key.slice(prefix.length)]) {
      t.kinds[key.slice(prefix.length)] = { value: new Array(n).fill(null), calls: new Array(n).fill(null) };
    }
  }
  t.step.push(r.step);
  t.overall.push(num(r[overall]));
  t.ended.push(num(r.ended));
  const [k, v] = passAtK(r);
  if (k !== null) t.k = k;
  t.pass_at_k.push(v);
  for (const [kind, col] of Object.entries(t.kinds)) {
    col.value.push(num(r[prefix + kind]));
    col.calls.push(num(r[`calls_${kind}`]));  // chat with tools: the share of answers that called one
  }
}

// The records app.js's addRecords does not know; d.extra holds their columns.
function addExtraRecord(d, r) {
  const x = d.extra;
  if (r.kind === "rl") {
    x.rl.step.push(r.step);
    for (const k of RL_KEYS) x.rl[k].push(num(r[k]));
    const [k, v] = passAtK(r);
    if (k !== null) x.rl.k = k;
    x.rl.pass_at_k.push(v);
  } else if (r.kind === "rl_eval" && Object.keys(r).some((k) => k.startsWith("pass_at_"))) {
    addKindRow(x.rlEval, r, "pass_at_1", "pass_at_1_");  // an empty one ({}): no held-out problems to score
  } else if (r.kind === "chat") {
    addKindRow(x.chat, r, "acc", "acc_");
  }
}

function hasRl(d) { return Boolean(d && (d.extra.rl.step.length || d.extra.rlEval.step.length)); }

// ---------- traces ----------
const pct = (v) => (v === null ? "–" : `${(v * 100).toFixed(0)}%`);

function rewardTraces(run, rl) {
  const c = colour(run);
  const out = smoothed(run, rl.step, rl.reward, `${run.name} reward`, "%{y:.3f}");
  out.push(line(run, rl.step, smooth(rl.pass_at_1, S.smoothing), { name: `${run.name} pass@1`,
    line: { color: c, width: 1.4, dash: "dot" }, hovertemplate: `${run.name} pass@1<br>step %{x}: %{y:.3f}<extra></extra>` }));
  if (rl.k !== null) {
    const name = `${run.name} pass@${rl.k}`;
    out.push(line(run, rl.step, smooth(rl.pass_at_k, S.smoothing), { name, line: { color: c, width: 1.4, dash: "dash" },
      hovertemplate: `${name}<br>step %{x}: %{y:.3f}<extra></extra>` }));
  }
  return out;
}

// Held-out accuracy of a run: overall (its colour, thick, dots), pass@k when measured (dashed), and a line per
// task kind (a colour per kind, the same in every run and none of theirs; a dash per run when several are shown).
function kindTraces(run, t, n, kinds, label) {
  const c = colour(run), dash = DASHES[n % DASHES.length];
  const out = [line(run, t.step, t.overall, { name: `${run.name} overall`, mode: "lines+markers",
    line: { color: c, width: 2.6 }, marker: { size: 7, color: c }, customdata: t.ended.map(pct),
    hovertemplate: `${run.name} ${label}<br>step %{x}: %{y:.3f} (ended %{customdata})<extra></extra>` })];
  if (t.k !== null && t.pass_at_k.some((v) => v !== null)) {
    out.push(line(run, t.step, t.pass_at_k, { name: `${run.name} pass@${t.k}`, mode: "lines+markers",
      line: { color: c, width: 1.6, dash: "dash" }, marker: { size: 5, color: c },
      hovertemplate: `${run.name} pass@${t.k}<br>step %{x}: %{y:.3f}<extra></extra>` }));
  }
  for (const [kind, col] of Object.entries(t.kinds).sort(([a], [b]) => a.localeCompare(b))) {
    const kc = kinds.colours[kinds.names.indexOf(kind) % kinds.colours.length];
    const calls = col.calls.some((v) => v !== null) ? " (calls a tool: %{customdata})" : "";
    out.push(line(run, t.step, col.value, { name: `${run.name} ${kind}`, mode: "lines+markers",
      line: { color: kc, width: 1.4, dash }, marker: { size: 5, color: kc }, customdata: col.calls.map(pct),
      hovertemplate: `${run.name} ${kind}<br>step %{x}: %{y:.3f}${calls}<extra></extra>` }));
  }
  return out;
}

function showChart(id, traces, layout) {  // draw, or hide the panel (and forget an earlier run's traces)
  const div = $(id);
  div.closest(".panel").hidden = traces.length === 0;
  if (traces.length) draw(id, traces, layout);
  else if (div.data) { Plotly.purge(div); delete div.dataset.synced; }
}

// ---------- charts ----------
function renderExtraCharts(runs) {
  const got = runs.map((run) => [run, S.data.get(run.id)?.extra]).filter(([, x]) => x);
  const reward = [], evals = [], length = [], tps = [], kl = [], chat = [];
  const free = PALETTE.filter((c) => !runs.some((run) => colour(run) === c));
  const kindsOf = (t) => ({ names: [...new Set(got.flatMap(([, x]) => Object.keys(x[t].kinds)))].sort(),
    colours: free.length ? free : PALETTE });
  const evalKinds = kindsOf("rlEval"), chatKinds = kindsOf("chat");
  const ks = new Set();
  got.forEach(([run, x], n) => {
    const rl = x.rl;
    if (rl.step.length) {
      reward.push(...rewardTraces(run, rl));
      if (rl.k !== null) ks.add(rl.k);
      length.push(...smoothed(run, rl.step, rl.answer_tokens, run.name, "%{y:.1f} tokens"));
      tps.push(...smoothed(run, rl.step, rl.sampled_tokens_per_s, run.name, "%{y:,.0f} tok/s"));
      if (rl.kl.some((v) => v)) kl.push(line(run, rl.step, smooth(rl.kl, S.smoothing), { hovertemplate:
        `${run.name}<br>step %{x}: %{y:.3e}<extra></extra>` }));
    }
    if (x.rlEval.step.length) evals.push(...kindTraces(run, x.rlEval, n, evalKinds, "held-out pass@1"));
    if (x.chat.step.length) chat.push(...kindTraces(run, x.chat, n, chatKinds, "held-out accuracy"));
  });
  const k = ks.size === 1 ? `pass@${[...ks][0]}` : "pass@G";
  $("rl-reward-note").textContent = `mean reward (solid), pass@1 (dotted) and ${k} (dashed) of each step's answers`;
  const legend = { showlegend: true, margin: { l: 60, r: 16, t: 8, b: 80 },  // side by side; a click hides one line
    legend: { orientation: "h", y: -0.25, traceorder: "normal", groupclick: "toggleitem" } };
  const rate = { yaxis: { rangemode: "tozero", title: { text: "share right" } } };
  $("rl-grid").hidden = !(reward.length || evals.length);  // no gap left where nothing is drawn
  showChart("chart-rl-reward", reward, { yaxis: { title: { text: "reward / pass rate" } } });
  showChart("chart-rl-eval", evals, Object.assign({}, rate, legend));
  showChart("chart-rl-length", length, { yaxis: { rangemode: "tozero", title: { text: "tokens" } } });
  showChart("chart-rl-tps", tps, { yaxis: { tickformat: ",.0f" } });
  showChart("chart-rl-kl", kl, { yaxis: { exponentformat: "e" } });
  showChart("chart-chat", chat, Object.assign({}, rate, legend));
}

// The lr and grad-norm charts also draw an RL run's (its policy's optimizer), beside any train run's.
function rlTrainTraces(run, d) {
  const rl = d.extra.rl;
  if (!rl.step.length) return { lr: [], grad: [] };
  return {
    lr: [line(run, rl.step, rl.lr, { hovertemplate: `${run.name}<br>step %{x}: %{y:.3e}<extra></extra>` })],
    grad: [line(run, rl.step, smooth(rl.grad_norm, S.smoothing))],
  };
}

// ---------- run list and cards ----------
const known = (v) => v !== null && v !== undefined;

function extraSub(run) {  // the run list's figure of an RL or SFT run
  if (known(run.held_out_pass_at_1)) {
    return [el("span", { title: "held-out pass@1 of the last evaluation" }, `pass@1 ${fmtNum(run.held_out_pass_at_1, 3)}`)];
  }
  if (known(run.reward)) return [el("span", { title: "mean reward of the last step" }, `reward ${fmtNum(run.reward, 3)}`)];
  if (known(run.chat_acc)) {
    return [el("span", { title: "held-out accuracy of the last evaluation" }, `acc ${fmtNum(run.chat_acc, 3)}`)];
  }
  return [];
}

// A card's figures for an RL run (null for any other run): its last step's reward and pass@1, the last held-out
// pass@1, answer length and sampling speed.
function rlStats(run, d, updated) {
  if (!run.rl && !hasRl(d)) return null;
  const rl = d.extra.rl, tps = last(rl.sampled_tokens_per_s);
  return [
    stat("reward", fmtNum(last(rl.reward) ?? run.reward, 3)),
    stat("pass@1", fmtNum(last(rl.pass_at_1) ?? run.pass_at_1, 3)),
    stat("held-out pass@1", fmtNum(last(d.extra.rlEval.overall) ?? run.held_out_pass_at_1, 3)),
    stat("answer tokens", fmtNum(last(rl.answer_tokens), 1)),
    stat("sampled tok/s", tps === null ? "–" : Math.round(tps).toLocaleString()),
    updated,
  ];
}

function chatStat(run, d) {  // SFT's held-out accuracy on a card, when the run measures it
  const acc = last(d.extra.chat.overall) ?? run.chat_acc;
  return known(acc) ? stat("held-out acc", fmtNum(acc, 3)) : null;
}
