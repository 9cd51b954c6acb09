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
