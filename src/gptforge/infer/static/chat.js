// gptforge's chat page: talks to the server's OpenAI API (/v1/chat/completions, streamed), keeps conversations in
// localStorage. Model output is data, never markup: every text goes into the page through textContent, and the small
// markdown renderer below builds elements itself (links only for http(s) URLs).
"use strict";

const STORE = "gptforge.chat.v1";
const DEFAULTS = { temperature: 0.7, top_p: 1, max_tokens: 256, key: "" };
const $ = (id) => document.getElementById(id);
let state = loadState();
let model = null; // {id, chat, max_model_len} from /v1/models
let busy = null; // {controller} while an answer streams

function loadState() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.conversations)) {
      saved.settings = Object.assign({}, DEFAULTS, saved.settings);
      return saved;
    }
  } catch (e) { /* a damaged store starts over */ }
  return { conversations: [], current: null, settings: Object.assign({}, DEFAULTS) };
}

function saveState() { localStorage.setItem(STORE, JSON.stringify(state)); }
function currentConversation() { return state.conversations.find((c) => c.id === state.current) || null; }

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (className) node.className = className;
  return node;
}

// ---- markdown, rendered safely: elements built one by one, text only through textContent ----
function renderMarkdown(text, into) {
  into.replaceChildren();
  const lines = text.split("\n");
  const listItem = /^\s*([-*+]|\d+[.)])\s+/;
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (/^\s*```/.test(line)) {
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      i++;
      const pre = el("pre");
      pre.append(el("code", code.join("\n")));
      into.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = el("h" + Math.min(6, heading[1].length + 2));
      inline(heading[2], h);
      into.append(h);
      i++;
      continue;
    }
    if (listItem.test(line)) {
      const list = el(/^\s*\d/.test(line) ? "ol" : "ul");
      while (i < lines.length && listItem.test(lines[i])) {
        const li = el("li");
        inline(lines[i].replace(listItem, ""), li);
        list.append(li);
        i++;
      }
      into.append(list);
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^\s*```/.test(lines[i]) && !listItem.test(lines[i])) {
      para.push(lines[i++]);
    }
    const p = el("p");
    inline(para.join("\n"), p);
    into.append(p);
  }
}

function inline(text, into) {
  const pattern = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;
  let last = 0;
  let m;
  while ((m = pattern.exec(text))) {
    if (m.index > last) into.append(document.createTextNode(text.slice(last, m.index)));
    if (m[1]) into.append(el("code", m[1].slice(1, -1)));
    else if (m[2]) into.append(el("strong", m[2].slice(2, -2)));
    else if (m[3]) into.append(el("em", m[3].slice(1, -1)));
    else {
      const a = el("a", m[4]);
      a.href = m[5]; // the pattern admits http(s) URLs only
      a.rel = "noopener noreferrer";
      a.target = "_blank";
      into.append(a);
    }
    last = pattern.lastIndex;
  }
  if (last < text.length) into.append(document.createTextNode(text.slice(last)));
}

// ---- the page ----
function render() {
  const conversation = currentConversation();
  renderList();
  $("system").value = conversation ? conversation.system || "" : "";
  const box = $("messages");
  box.replaceChildren();
  if (conversation) conversation.messages.forEach((m, i) => box.append(messageView(conversation, m, i)));
  $("regenerate").disabled = !!busy || !conversation || !conversation.messages.some((m) => m.role === "user");
  $("send").hidden = !!busy;
  $("stop").hidden = !busy;
  box.scrollTop = box.scrollHeight;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = el("li", null, c.id === state.current ? "current" : "");
    const open = el("button", c.title || "New conversation", "open");
    open.type = "button";
    open.title = c.title || "";
    open.onclick = () => { if (!busy) { state.current = c.id; saveState(); render(); } };
    const remove = el("button", "\u00d7", "delete");
    remove.type = "button";
    remove.title = "Delete this conversation";
    remove.onclick = () => {
      if (busy) return;
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
      saveState();
      render();
    };
    li.append(open, remove);
    list.append(li);
  }
}

function messageView(conversation, message, index) {
  const view = el("div", null, "message " + message.role);
  const head = el("div", null, "role");
  head.append(el("span", message.role === "user" ? "You" : "Model"));
  if (message.role === "user") {
    const edit = el("button", "Edit", "edit");
    edit.type = "button";
    edit.onclick = () => startEdit(conversation, index, view);
    head.append(edit);
  }
  const body = el("div", null, "body");
  if (message.role === "user") body.append(el("p", message.content));
  else renderMarkdown(message.content, body);
  view.append(head, body);
  if (message.note) view.append(el("div", message.note, "note"));
  return view;
}

function startEdit(conversation, index, view) {
  if (busy) return;
  const area = el("textarea", null, "edit-box");
  area.value = conversation.messages[index].content;
  area.rows = 3;
  const ok = el("button", "Save & regenerate", "save-edit");
  ok.type = "button";
  const cancel = el("button", "Cancel", "cancel-edit");
  cancel.type = "button";
  view.querySelector(".body").replaceChildren(area, ok, cancel);
  area.focus();
  ok.onclick = () => {
    conversation.messages[index].content = area.value;
    conversation.messages.splice(index + 1); // everything after the edited message is answered again
    saveState();
    answer(conversation);
  };
  cancel.onclick = render;
}

function newConversation() {
  if (busy) return null;
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 7);
  const conversation = { id, title: "New conversation", system: "", messages: [] };
  state.conversations.unshift(conversation);
  state.current = id;
  saveState();
  render();
  return conversation;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.key) h.Authorization = "Bearer " + state.settings.key;
  return h;
}

function request(conversation) {
  const s = state.settings;
  const options = { model: model.id, stream: true, temperature: Number(s.temperature), top_p: Number(s.top_p),
                    max_tokens: Math.max(1, Math.min(Number(s.max_tokens) || 1, model.max_model_len || 1e9)) };
  const history = conversation.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
  if (!model.chat) { // a base model continues the conversation's text
    return ["/v1/completions", Object.assign(options, { prompt: history.map((m) => m.content).join("") })];
  }
  const system = conversation.system ? [{ role: "system", content: conversation.system }] : [];
  return ["/v1/chat/completions", Object.assign(options, { messages: system.concat(history) })];
}

async function answer(conversation) {
  if (!model) { showBanner("no model: is the server running? (reload to retry)"); render(); return; }
  const reply = { role: "assistant", content: "" };
  conversation.messages.push(reply);
  const [url, body] = request(conversation);
  busy = { controller: new AbortController() };
  saveState();
  render();
  const target = $("messages").lastElementChild.querySelector(".body");
  let drawn = 0;
  let stored = Date.now();
  const draw = () => { renderMarkdown(reply.content, target); $("messages").scrollTop = 1e9; };
  try {
    const response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                        signal: busy.controller.signal });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(error && error.error ? error.error.message : response.status + " " + response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        readEvent(buffer.slice(0, cut), reply);
        buffer = buffer.slice(cut + 2);
      }
      if (Date.now() - drawn > 30) { draw(); drawn = Date.now(); }
      if (Date.now() - stored > 500) { saveState(); stored = Date.now(); } // a reload keeps most of it
    }
  } catch (e) {
    reply.note = e.name === "AbortError" ? "stopped" : "error: " + e.message;
  } finally {
    busy = null;
    saveState();
    render();
  }
}

function readEvent(event, reply) {
  for (const line of event.split("\n")) {
    if (!line.startsWith("data: ")) continue;
    const data = line.slice(6);
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    reply.content += (choice.delta ? choice.delta.content : choice.text) || "";
    if (choice.finish_reason === "length") reply.note = "reached the token limit";
  }
}

function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) { showBanner("This server needs its API key: enter it under Settings."); return; }
    const card = (await response.json()).data[0];
    model = { id: card.id, chat: card.chat !== false, max_model_len: card.max_model_len };
    $("model").textContent = card.id + " \u00b7 context " + card.max_model_len + " tokens" +
      (model.chat ? "" : " \u00b7 base model");
    showBanner(model.chat ? "" : "A base model (not chat-tuned): it continues the conversation's text.");
  } catch (e) {
    showBanner("Cannot reach the server: " + e.message);
  }
}

function bindSettings() {
  const s = state.settings;
  const pairs = [["temperature", "temperature-value"], ["top_p", "top-p-value"]];
  for (const [id, out] of pairs) {
    $(id).value = s[id];
    $(out).textContent = s[id];
    $(id).oninput = () => { s[id] = Number($(id).value); $(out).textContent = s[id]; saveState(); };
  }
  $("max_tokens").value = s.max_tokens;
  $("max_tokens").onchange = () => { s.max_tokens = Number($("max_tokens").value) || DEFAULTS.max_tokens; saveState(); };
  $("api-key").value = s.key;
  $("api-key").onchange = () => { s.key = $("api-key").value.trim(); saveState(); loadModel(); };
  $("system").oninput = () => {
    const c = currentConversation() || newConversation();
    c.system = $("system").value;
    saveState();
  };
}

function send() {
  const text = $("input").value;
  if (busy || !text.trim()) return;
  const conversation = currentConversation() || newConversation();
  conversation.messages.push({ role: "user", content: text });
  if (conversation.title === "New conversation") conversation.title = text.slice(0, 48);
  $("input").value = "";
  answer(conversation);
}

function regenerate() {
  const conversation = currentConversation();
  if (busy || !conversation) return;
  while (conversation.messages.length && conversation.messages[conversation.messages.length - 1].role !== "user") {
    conversation.messages.pop();
  }
  if (conversation.messages.length) answer(conversation);
}

document.addEventListener("DOMContentLoaded", () => {
  bindSettings();
  $("composer").onsubmit = (e) => { e.preventDefault(); send(); };
  $("input").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
  $("stop").onclick = () => { if (busy) busy.controller.abort(); };
  $("regenerate").onclick = regenerate;
  $("new-chat").onclick = newConversation;
  render();
  loadModel();
});
