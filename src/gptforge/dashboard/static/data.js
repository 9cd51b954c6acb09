// gptforge dashboard: the page's helpers and its data (app.js has the state, polling and the page itself).
// Text from run files is always set with textContent, never parsed as HTML.
"use strict";

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

