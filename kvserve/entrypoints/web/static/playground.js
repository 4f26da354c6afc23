// The chat playground: streams /v1/chat/completions, renders markdown through DOMPurify, keeps
// conversations in localStorage.
"use strict";

const STORE = "kvserve.conversations";
const SETTINGS = "kvserve.settings";
const $ = (id) => document.getElementById(id);
const state = {conversations: load(STORE, []), current: null, controller: null};

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) || fallback; } catch (e) { return fallback; }
}
function save() { localStorage.setItem(STORE, JSON.stringify(state.conversations)); }

function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""));
}

function conversation() {
  if (!state.current) {
    state.current = {id: String(Date.now()), title: "New chat", created: new Date().toISOString(), messages: []};
    state.conversations.unshift(state.current);
  }
  return state.current;
}

function drawList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const row = document.createElement("div");
    row.className = "conv" + (c === state.current ? " active" : "");
    const name = document.createElement("span");
    name.textContent = c.title;
    name.onclick = () => { if (!state.controller) { state.current = c; drawAll(); } };
    const del = document.createElement("button");
    del.textContent = "×";
    del.title = "Delete";
    del.onclick = () => {
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.current === c) state.current = null;
      save(); drawAll();
    };
    row.append(name, del);
    list.append(row);
  }
}

function messageElement(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  div.innerHTML = '<div class="role"></div><div class="reasoning" hidden></div><div class="content"></div>' +
                  '<div class="tools" hidden></div><div class="stats"></div>';
  div.querySelector(".role").textContent = m.role;
  fillMessage(div, m);
  return div;
}

function fillMessage(div, m) {
  const content = div.querySelector(".content");
  if (m.role === "assistant") content.innerHTML = renderMarkdown(m.content);
  else content.textContent = m.content;
  const reasoning = div.querySelector(".reasoning");
  reasoning.hidden = !m.reasoning;
  reasoning.textContent = m.reasoning || "";
  const tools = div.querySelector(".tools");
  tools.hidden = !(m.tool_calls && m.tool_calls.length);
  tools.textContent = m.tool_calls ? m.tool_calls.map((t) => `${t.function.name}(${t.function.arguments})`).join("\n") : "";
  const stats = div.querySelector(".stats");
  stats.replaceChildren();
  if (m.stats) {
    const s = m.stats;
    stats.textContent = `${s.tokens} tokens · TTFT ${s.ttft_ms.toFixed(0)} ms · ${s.tokens_per_s.toFixed(1)} tokens/s` +
                        (s.finish ? ` · ${s.finish}` : "");
  }
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    stats.append(e);
  }
}

function drawAll() {
  drawList();
  const box = $("messages");
  box.replaceChildren();
  if (state.current) for (const m of state.current.messages) box.append(messageElement(m));
  box.scrollTop = box.scrollHeight;
}

function settings() {
  const num = (id) => { const v = $(id).value; return v === "" ? null : Number(v); };
  return {model: $("model").value, system: $("system").value, temperature: num("temperature"),
          top_p: num("top_p"), max_tokens: num("max_tokens"), seed: num("seed")};
}

function saveSettings() { localStorage.setItem(SETTINGS, JSON.stringify(settings())); }

function restoreSettings() {
  const s = load(SETTINGS, {});
  for (const k of ["system", "temperature", "top_p", "max_tokens", "seed"]) if (s[k] != null) $(k).value = s[k];
  return s.model;
}

async function loadModels() {
  const wanted = restoreSettings();
  const resp = await apiFetch("/v1/models");
  if (!resp.ok) { $("server").textContent = "models: " + await apiError(resp); return; }
  const body = await resp.json();
  const select = $("model");
  select.replaceChildren();
  for (const m of body.data) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    select.append(o);
  }
  if (wanted && body.data.some((m) => m.id === wanted)) select.value = wanted;
  $("server").textContent = body.data.length ? `${body.data[0].id} · context ${body.data[0].max_model_len ?? "?"}` : "";
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  const conv = conversation();
  if (conv.messages.length === 0) conv.title = text.slice(0, 40);
  conv.messages.push({role: "user", content: text});
  const reply = {role: "assistant", content: "", reasoning: "", tool_calls: []};
  conv.messages.push(reply);
  save(); drawAll();
  const div = $("messages").lastElementChild;
  div.classList.add("streaming");

  const s = settings();
  const history = conv.messages.slice(0, -1).filter((m) => !m.error || m.content)
    .map((m) => ({role: m.role, content: m.content}));
  const body = {model: s.model, messages: (s.system ? [{role: "system", content: s.system}] : []).concat(history),
                stream: true, stream_options: {include_usage: true}, temperature: s.temperature, top_p: s.top_p,
                max_tokens: s.max_tokens};
  if (s.seed != null) body.seed = s.seed;

  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const start = performance.now();
  let first = null, last = null, chunks = 0, usage = null, finish = null, pending = false;
  const redraw = () => {
    pending = false;
    fillMessage(div, reply);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  };
  try {
    const resp = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
      signal: controller.signal});
    if (!resp.ok) throw new Error(await apiError(resp));
    await readSSE(resp, (_, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        const piece = (d.content || "") + (d.reasoning_content || "");
        if (piece) {
          if (first === null) first = performance.now();
          last = performance.now();
          chunks += 1;
        }
        if (d.content) reply.content += d.content;
        if (d.reasoning_content) reply.reasoning += d.reasoning_content;
        for (const t of d.tool_calls || []) {
          const slot = reply.tool_calls[t.index || 0] ||
                       (reply.tool_calls[t.index || 0] = {function: {name: "", arguments: ""}});
          if (t.function && t.function.name) slot.function.name += t.function.name;
          if (t.function && t.function.arguments) slot.function.arguments += t.function.arguments;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (!pending) { pending = true; requestAnimationFrame(redraw); }
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else reply.error = String(e.message || e);
  } finally {
    state.controller = null;
    setBusy(false);
    const tokens = usage ? usage.completion_tokens : chunks;
    if (first !== null) {
      const span = (last - first) / 1000;
      reply.stats = {tokens, ttft_ms: first - start, tokens_per_s: span > 0 ? (tokens - 1) / span : 0, finish};
    } else if (finish) {
      reply.stats = {tokens: 0, ttft_ms: 0, tokens_per_s: 0, finish};
    }
    div.classList.remove("streaming");
    div.classList.add("done");
    save(); redraw();
  }
}

function stop() { if (state.controller) state.controller.abort(); }

function exportJSON() {
  const blob = new Blob([JSON.stringify(state.conversations, null, 2)], {type: "application/json"});
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "kvserve-conversations.json";
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

$("send").onclick = send;
$("stop").onclick = stop;
$("export").onclick = exportJSON;
$("new-chat").onclick = () => { if (!state.controller) { state.current = null; drawAll(); } };
$("forget-key").onclick = () => localStorage.removeItem(KEY_STORE);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
for (const id of ["system", "temperature", "top_p", "max_tokens", "seed", "model"]) $(id).onchange = saveSettings;
marked.use({gfm: true, breaks: true});
state.current = state.conversations[0] || null;
drawAll();
loadModels();
