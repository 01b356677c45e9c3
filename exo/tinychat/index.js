// tinychat: a chat page for exo's ChatGPT-compatible API. Plain browser JavaScript, no build step, no CDN.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  histories: loadHistories(), // [{id, title, model, time, messages: [{role, content}]}], newest first
  currentId: null,
  models: {}, // id -> {name, downloaded, download_percentage, total_size, total_downloaded, loading}
  selectedModel: localStorage.getItem("selectedModel"),
  abort: null, // AbortController of the answer being streamed
  downloading: new Set(), // "<node id> <model id>" of the downloads under way at the last poll
  failed: new Set(), // models whose latest download on this node failed
};

// --- small helpers ---

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatBytes(bytes) {
  if (!Number.isFinite(bytes) || bytes <= 0) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(bytes) / Math.log(1024)));
  return `${(bytes / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function formatDuration(seconds) {
  if (!Number.isFinite(seconds) || seconds <= 0) return "–";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

async function errorText(response) {
  // exo answers errors in OpenAI's shape, {"error": {"message": ...}}; older nodes sent {"detail": ...} or {"error": "..."}.
  try {
    const body = await response.json();
    return (body.error && body.error.message) || body.detail || body.error || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// --- the node's API, with its key when it needs one ---

// A node started with --api-key answers 401 without it: ask the user once, keep it in localStorage["apiKey"], retry.
let askingForKey = null;

async function api(path, options = {}) {
  const call = (key) => fetch(`${window.location.origin}${path}`, { ...options, headers: { ...(options.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) } });
  const used = localStorage.getItem("apiKey");
  const response = await call(used);
  if (response.status !== 401) return response;
  // Calls sent before the user answered come back 401 too: they retry with the new key instead of asking again.
  if (localStorage.getItem("apiKey") === used) {
    askingForKey = askingForKey || Promise.resolve().then(() => {
      const key = window.prompt("This exo node needs its API key (the node's --api-key):");
      if (key) localStorage.setItem("apiKey", key.trim());
    }).finally(() => { askingForKey = null; });
    await askingForKey;
  }
  const key = localStorage.getItem("apiKey");
  return key && key !== used ? call(key) : response;
}

// The `data:` payloads of a server-sent-events response, as they arrive.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

// --- conversations (localStorage["histories"]) ---

function loadHistories() {
  try {
    const stored = JSON.parse(localStorage.getItem("histories") || "[]");
    return Array.isArray(stored) ? stored.filter((h) => h && Array.isArray(h.messages)) : [];
  } catch {
    return [];
  }
}

function saveHistories() {
  try {
    localStorage.setItem("histories", JSON.stringify(state.histories));
  } catch (e) {
    console.warn("could not save conversations", e);
  }
}

function currentConversation() {
  return state.histories.find((h) => h.id === state.currentId) || null;
}

function newConversation() {
  if (state.abort) return;
  state.currentId = null;
  renderHistoryList();
  renderMessages();
  $("prompt").focus();
}

function openConversation(id) {
  if (state.abort) return;
  state.currentId = id;
  const conversation = currentConversation();
  if (conversation && conversation.model && state.models[conversation.model]) selectModel(conversation.model);
  renderHistoryList();
  renderMessages();
}

function deleteConversation(id) {
  if (state.abort && id === state.currentId) return;
  state.histories = state.histories.filter((h) => h.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveHistories();
  renderHistoryList();
  renderMessages();
}

function renderHistoryList() {
  const list = $("history-list");
  list.replaceChildren();
  for (const h of state.histories) {
    const item = el("li", { class: h.id === state.currentId ? "active" : "", title: new Date(h.time).toLocaleString(), onclick: () => openConversation(h.id) },
      el("span", { class: "title" }, h.title || "New chat"),
      el("button", { class: "delete", type: "button", "aria-label": "Delete conversation", onclick: (e) => { e.stopPropagation(); deleteConversation(h.id); } }, "×"));
    list.append(item);
  }
}

// --- messages ---

// Renders text with ``` fenced code blocks and `inline code`; everything goes in as text, never as HTML.
function renderText(node, text) {
  node.replaceChildren();
  const fence = /```[^\n`]*\n?([\s\S]*?)(?:```|$)/g;
  let last = 0;
  for (const match of text.matchAll(fence)) {
    appendInline(node, text.slice(last, match.index));
    node.append(el("pre", {}, el("code", {}, match[1])));
    last = match.index + match[0].length;
  }
  appendInline(node, text.slice(last));
}

function appendInline(node, text) {
  text.split(/(`[^`\n]+`)/).forEach((part, i) => {
    if (i % 2) node.append(el("code", {}, part.slice(1, -1)));
    else if (part) node.append(document.createTextNode(part));
  });
}

function messageNode(message) {
  const node = el("div", { class: `message ${message.role}` });
  renderText(node, message.content);
  if (message.meta) node.append(el("span", { class: "meta" }, message.meta));
  return node;
}

function renderMessages() {
  const box = $("messages");
  const conversation = currentConversation();
  box.replaceChildren();
  if (!conversation || conversation.messages.length === 0) {
    box.append(el("div", { id: "empty-state" },
      el("img", { src: "/favicon.svg", alt: "", width: "56", height: "56" }),
      el("h1", {}, "Chat with a model running across your machines"),
      el("p", { class: "muted" }, "Answers stream in as the ring generates them. Conversations stay in this browser.")));
    return;
  }
  for (const message of conversation.messages) box.append(messageNode(message));
  box.scrollTop = box.scrollHeight;
}

function showError(text) {
  const box = $("messages");
  box.querySelector("#empty-state")?.remove();
  box.append(el("div", { class: "message error", role: "alert" }, text));
  box.scrollTop = box.scrollHeight;
}

// --- streaming a reply ---

// Reads exo's SSE stream (`data: {json}\n\n` events) and calls onDelta with each piece of text. The last event
// carries the answer's last text, if any (never an end-of-turn marker), with the finish reason; an event with an
// `error` (finish "error") ends the answer with that error. A `[DONE]` line (other servers send one) also ends it.
async function readStream(response, onDelta) {
  let finishReason = null;
  for await (const data of sseData(response)) {
    if (data === "[DONE]") return finishReason;
    const payload = JSON.parse(data);
    if (payload.error) throw new Error(payload.error.message || String(payload.error));
    const choice = payload.choices && payload.choices[0];
    if (!choice) continue;
    const content = (choice.delta && choice.delta.content) || "";
    if (content) onDelta(content);
    if (choice.finish_reason === "stop") return "stop";
    if (choice.finish_reason) finishReason = choice.finish_reason;
  }
  return finishReason;
}

async function send(text) {
  if (state.abort || !text.trim()) return;
  if (!state.selectedModel) {
    showError("No model to chat with: the node reports no models for its engine.");
    return;
  }
  let conversation = currentConversation();
  if (!conversation) {
    conversation = { id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now()), title: text.trim().slice(0, 60), model: state.selectedModel, time: Date.now(), messages: [] };
    state.histories.unshift(conversation);
    state.currentId = conversation.id;
  }
  conversation.model = state.selectedModel;
  conversation.time = Date.now();
  conversation.messages.push({ role: "user", content: text });
  saveHistories();
  renderHistoryList();
  renderMessages();

  const reply = { role: "assistant", content: "" };
  const node = messageNode(reply);
  node.classList.add("streaming");
  $("messages").append(node);
  setGenerating(true);
  const started = performance.now();
  let firstTokenAt = null;
  let pieces = 0;
  try {
    const history = conversation.messages.map(({ role, content }) => ({ role, content }));
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: state.selectedModel, messages: history, stream: true }),
      signal: state.abort.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const finish = await readStream(response, (delta) => {
      firstTokenAt = firstTokenAt || performance.now();
      pieces += 1;
      reply.content += delta;
      renderText(node, reply.content);
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
      const seconds = (performance.now() - firstTokenAt) / 1000;
      $("stats").textContent = `first token ${((firstTokenAt - started) / 1000).toFixed(2)} s · ${seconds > 0 && pieces > 1 ? ((pieces - 1) / seconds).toFixed(1) : "–"} tokens/s`;
    });
    if (finish === "length") reply.meta = "stopped at the length limit";
  } catch (e) {
    if (e.name === "AbortError") reply.meta = "stopped";
    else {
      if (!reply.content) node.remove();
      showError(`Error: ${e.message}`);
    }
  } finally {
    node.classList.remove("streaming");
    if (reply.content || reply.meta) {
      conversation.messages.push(reply);
      saveHistories();
      if (reply.meta) node.append(el("span", { class: "meta" }, reply.meta));
    }
    setGenerating(false);
  }
}

function setGenerating(on) {
  state.abort = on ? new AbortController() : null;
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
  if (!on) $("prompt").focus();
}

// --- models and downloads ---

function selectModel(id) {
  state.selectedModel = id;
  localStorage.setItem("selectedModel", id);
  $("model-select").value = id;
  renderModelStatus();
}

function renderModelPicker() {
  const select = $("model-select");
  const ids = Object.keys(state.models);
  select.replaceChildren(...ids.map((id) => {
    const m = state.models[id];
    const suffix = m.downloaded === true ? " ✓" : m.total_downloaded > 0 ? ` (${m.download_percentage.toFixed(0)}%)` : "";
    return el("option", { value: id }, `${m.name || id}${suffix}`);
  }));
  if (!ids.includes(state.selectedModel)) state.selectedModel = ids.includes("smollm2-135m") ? "smollm2-135m" : ids[0] || null;
  if (state.selectedModel) select.value = state.selectedModel;
  renderModelStatus();
}

function renderModelStatus() {
  const m = state.models[state.selectedModel];
  const status = $("model-status");
  $("download-model").hidden = !m || m.downloaded !== false;
  $("delete-model").hidden = !m || !(m.total_downloaded > 0);
  if (!m || m.downloaded === null || m.downloaded === undefined) status.textContent = "";
  else if (m.downloaded) status.textContent = `on disk · ${formatBytes(m.total_size)}`;
  else if (state.failed.has(state.selectedModel)) status.textContent = "download failed (see Downloads)";
  else if ([...state.downloading].some((key) => key.endsWith(` ${state.selectedModel}`))) status.textContent = "downloading (see Downloads)";
  else if (!m.total_size) status.textContent = "not downloaded";
  else status.textContent = `${(m.download_percentage || 0).toFixed(1)}% of ${formatBytes(m.total_size)} on disk`;
}

async function loadModels() {
  try {
    const response = await api("/initial_models");
    if (!response.ok) throw new Error(await errorText(response));
    state.models = await response.json();
    renderModelPicker();
  } catch (e) {
    $("model-status").textContent = `could not list models: ${e.message}`;
  }
  pollModelPool();
  setInterval(pollModelPool, 15000);
}

// Read with fetch rather than EventSource, which cannot send the API key.
async function pollModelPool() {
  try {
    const response = await api("/modelpool");
    if (!response.ok) return;
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      try {
        for (const [id, status] of Object.entries(JSON.parse(data))) {
          if (state.models[id]) Object.assign(state.models[id], status, { loading: false });
        }
      } catch (e) {
        console.warn("bad modelpool event", e);
      }
    }
    renderModelPicker();
    renderModelPool();
  } catch {
    // the node may be restarting; the next poll tries again
  }
}

function renderModelPool() {
  const list = $("model-pool");
  list.replaceChildren();
  for (const [id, m] of Object.entries(state.models)) {
    if (!m.downloaded && !(m.total_downloaded > 0)) continue; // nothing of it on disk
    list.append(el("li", {}, `${m.name || id}: ${m.downloaded ? "on disk" : `${m.download_percentage.toFixed(1)}%`} · ${formatBytes(m.total_size)}`,
      el("div", { class: "bar" }, el("div", { style: `width: ${Math.min(100, m.download_percentage)}%` }))));
  }
}

async function downloadModel(model = state.selectedModel) {
  const response = await api("/download", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model }) });
  if (!response.ok) showError(`Download failed: ${await errorText(response)}`);
  else {
    $("model-status").textContent = "download started";
    pollDownloads();
  }
}

async function deleteModel() {
  const model = state.selectedModel;
  if (!window.confirm(`Delete the downloaded files of ${model}?`)) return;
  const response = await api(`/models/${encodeURIComponent(model)}`, { method: "DELETE" });
  if (!response.ok) showError(`Delete failed: ${await errorText(response)}`);
  pollModelPool();
}

// The ring's downloads under way (every node's, from /v1/download/progress), each with its files arriving now, and
// this node's downloads that failed (from /v1/downloads), each with what went wrong and a button to try again.
async function pollDownloads() {
  try {
    const [progressResponse, downloadsResponse] = await Promise.all([api("/v1/download/progress"), api("/v1/downloads")]);
    if (!progressResponse.ok) return;
    const running = Object.entries(await progressResponse.json());
    const failed = downloadsResponse.ok ? Object.entries(await downloadsResponse.json()).filter(([, d]) => d.status === "failed") : [];
    const box = $("downloads");
    if (running.length === 0 && failed.length === 0) box.replaceChildren(el("p", { class: "muted" }, "No downloads in progress."));
    else box.replaceChildren(...running.map(([nodeId, p]) => downloadNode(nodeId, p)), ...failed.map(([model, d]) => failedDownloadNode(model, d)));
    const now = new Set(running.map(([nodeId, p]) => `${nodeId} ${p.shard && p.shard.model_id}`));
    if ([...state.downloading].some((key) => !now.has(key))) pollModelPool(); // one ended: what is on disk has changed
    state.downloading = now;
    state.failed = new Set(failed.map(([model]) => model));
    renderModelStatus();
  } catch {
    // the node may be restarting; the next poll tries again
  }
}

function downloadNode(nodeId, p) {
  const percent = p.total_bytes ? (100 * p.downloaded_bytes) / p.total_bytes : 0;
  const arriving = Object.values(p.file_progress || {}).filter((f) => f.status === "in_progress");
  const sources = p.file_sources || {}; // where each file comes from: "hub" or "peer <node id>"
  return el("div", { class: "download" },
    el("div", {}, `${p.repo_id || (p.shard && p.shard.model_id) || "model"} on ${nodeId}`),
    el("div", { class: "bar" }, el("div", { style: `width: ${percent.toFixed(1)}%` })),
    el("div", { class: "muted" }, `${formatBytes(p.downloaded_bytes)} / ${formatBytes(p.total_bytes)} · ${formatBytes(p.overall_speed)}/s · ETA ${formatDuration(p.overall_eta)} · ${p.completed_files} of ${p.total_files} files`),
    el("ul", { class: "files" }, ...arriving.map((f) => el("li", { class: "muted" },
      `${f.file_path}${sources[f.file_path] ? ` from ${sources[f.file_path]}` : ""} · ${f.total ? ((100 * f.downloaded) / f.total).toFixed(0) : 0}% · ${formatBytes(f.speed)}/s`))));
}

function failedDownloadNode(model, d) {
  return el("div", { class: "download failed", role: "alert" },
    el("div", {}, `${(state.models[model] && state.models[model].name) || model}: download failed`),
    el("div", { class: "reason" }, d.error ? d.error.message : "unknown error"),
    el("button", { type: "button", onclick: () => downloadModel(model) }, "Try again"));
}

// --- topology ---

async function pollTopology() {
  try {
    const response = await api("/v1/topology");
    if (response.ok) renderTopology(await response.json());
  } catch {
    // try again at the next poll
  }
}

function renderTopology(topology) {
  const drawing = $("topology");
  const ids = Object.keys(topology.nodes || {});
  const cx = 140, cy = 105, radius = ids.length > 1 ? 70 : 0;
  const position = {};
  ids.forEach((id, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / ids.length;
    position[id] = [cx + radius * Math.cos(angle), cy + radius * Math.sin(angle)];
  });
  drawing.replaceChildren();
  for (const [from, edges] of Object.entries(topology.peer_graph || {})) {
    for (const edge of edges) {
      const a = position[from], b = position[edge.to_id];
      if (a && b) drawing.append(svg("line", { class: "edge", x1: a[0], y1: a[1], x2: b[0], y2: b[1] }));
    }
  }
  for (const id of ids) {
    const caps = topology.nodes[id];
    const [x, y] = position[id];
    const group = svg("g", { class: `node${id === topology.active_node_id ? " active" : ""}` });
    group.append(svg("circle", { cx: x, cy: y, r: 22 }));
    group.append(svg("text", { class: "inside", x, y: y + 4 }, `${(caps.memory / 1024).toFixed(0)} GB`));
    group.append(svg("text", { x, y: y + 36 }, id.length > 14 ? `${id.slice(0, 12)}…` : id));
    drawing.append(group);
  }
  if (!ids.length) drawing.append(svg("text", { x: cx, y: cy }, "no nodes yet"));
  const layers = placedLayers(topology.placement);
  $("node-list").replaceChildren(...ids.map((id) => {
    const caps = topology.nodes[id];
    return el("li", {},
      el("div", { class: "id" }, `${id}${id === topology.active_node_id ? " · working" : ""}`),
      el("div", { class: "muted" }, `${caps.model} · ${caps.chip}`),
      el("div", { class: "muted" }, `${formatBytes(caps.memory * 1024 * 1024)} memory · ${Number(caps.flops && caps.flops.fp32 || 0).toFixed(2)} TFLOPS fp32`),
      ...(layers[id] || []).map((line) => el("div", { class: "muted layers" }, line)));
  }));
}

// Each node's lines under its entry: for every model placed, its group and its layers ("group 1 of 2: layers 0–18 of 30").
function placedLayers(placement) {
  const lines = {};
  if (!placement || !placement.active) return lines;
  for (const [model, view] of Object.entries(placement.models || {})) {
    view.groups.forEach((group, i) => {
      for (const stage of group.stages) {
        const where = view.groups.length > 1 ? `group ${i + 1} of ${view.groups.length}` : "one group";
        const state = view.ready[i] ? "" : " · loading";
        (lines[stage.node_id] = lines[stage.node_id] || []).push(
          `${model}: ${where}, layers ${stage.start_layer}–${stage.end_layer} of ${view.n_layers}${state}`);
      }
    });
  }
  return lines;
}

// --- wiring ---

function init() {
  const prompt = $("prompt");
  $("send-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value;
    prompt.value = "";
    prompt.style.height = "";
    send(text);
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("send-form").requestSubmit();
    }
  });
  prompt.addEventListener("input", () => {
    prompt.style.height = "";
    prompt.style.height = `${Math.min(prompt.scrollHeight, 200)}px`;
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("new-chat").addEventListener("click", newConversation);
  $("model-select").addEventListener("change", (e) => selectModel(e.target.value));
  $("download-model").addEventListener("click", () => downloadModel());
  $("delete-model").addEventListener("click", deleteModel);
  $("toggle-cluster").addEventListener("click", (e) => {
    const hidden = document.body.classList.toggle("cluster-hidden");
    e.target.setAttribute("aria-pressed", String(!hidden));
  });

  state.currentId = state.histories.length ? state.histories[0].id : null;
  renderHistoryList();
  renderMessages();
  loadModels();
  pollTopology();
  setInterval(pollTopology, 5000);
  pollDownloads();
  setInterval(pollDownloads, 1000);
  prompt.focus();
}

init();
