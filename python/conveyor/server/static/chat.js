// The chat page: a conversation through the server's /v1/chat/completions, streamed.
import { ApiError, askForKey, getJSON, postJSON, readEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = id => document.getElementById(id);
const log = $("log"), prompt = $("prompt"), statusLine = $("status");
const sendBtn = $("send"), stopBtn = $("stop"), regenBtn = $("regenerate");

let model = null;
let messages = []; // {role, content}, the conversation without the system prompt
let running = null; // the AbortController of the answer being streamed

function setStatus(text) { statusLine.textContent = text || ""; }

function setBusy(busy) {
  sendBtn.disabled = busy;
  stopBtn.disabled = !busy;
  regenBtn.disabled = busy || !messages.some(m => m.role === "assistant");
}

// Requests that need the key ask for it once, then retry.
async function withKey(fn) {
  for (;;) {
    try {
      return await fn();
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) {
        if (await askForKey(e.message)) continue;
      }
      throw e;
    }
  }
}

async function loadEngine() {
  const info = await withKey(() => getJSON("/v1/engine/settings"));
  model = info.model;
  $("model-name").textContent = info.model;
  const dl = $("engine-settings");
  dl.replaceChildren();
  // the values in effect first (settings left to the engine are null), then the other settings given
  const rows = { "max model len": info.max_model_len, "max num seqs": info.max_num_seqs,
                 "max num batched tokens": info.max_num_batched_tokens, "KV blocks": info.kv_cache.blocks_total,
                 "block size": info.kv_cache.block_size };
  const shown = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "skip_tokenizer_init"];
  for (const [k, v] of Object.entries(info.settings)) {
    if (v !== null && v !== undefined && !shown.includes(k)) {
      rows[k.replace(/_/g, " ")] = typeof v === "object" ? JSON.stringify(v) : v;
    }
  }
  for (const [k, v] of Object.entries(rows)) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k;
    dd.textContent = String(v);
    dl.append(dt, dd);
  }
}

function messageView(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "body";
  div.append(who, body);
  if (role === "assistant") {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(div.dataset.text || "", copy));
    div.append(copy);
  }
  log.append(div);
  return div;
}

function show(div, text, done) {
  div.dataset.text = text;
  div.querySelector(".body").innerHTML = renderMarkdown(text); // escaped first: see markdown.js
  div.classList.toggle("streaming", !done);
  log.scrollTop = log.scrollHeight;
}

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const ta = document.createElement("textarea");
    ta.value = text;
    document.body.append(ta);
    ta.select();
    document.execCommand("copy");
    ta.remove();
  }
  btn.textContent = "Copied";
  setTimeout(() => { btn.textContent = "Copy"; }, 1200);
}

function number(id, lo, hi) {
  const v = Number($(id).value);
  if (!Number.isFinite(v) || v < lo || v > hi) throw new Error(`${$(id).closest("label").textContent.trim()} must be in [${lo}, ${hi}]`);
  return v;
}

async function answer() {
  const body = {
    model: model || undefined,
    messages: ($("system").value.trim() ? [{ role: "system", content: $("system").value.trim() }] : []).concat(messages),
    stream: true,
    temperature: number("temperature", 0, 2),
    top_p: number("top-p", 0.01, 1),
    max_tokens: Math.round(number("max-tokens", 1, 1e9)),
  };
  const view = messageView("assistant");
  let text = "";
  let pending = false;
  const controller = new AbortController();
  running = controller;
  setBusy(true);
  setStatus("Generating…");
  let finish = null;
  try {
    const resp = await withKey(() => postJSON("/v1/chat/completions", body, controller.signal));
    await readEvents(resp, data => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const c of chunk.choices || []) {
        if (c.delta && c.delta.content) text += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (!pending) { // one redraw per frame however fast tokens come
        pending = true;
        requestAnimationFrame(() => { pending = false; if (running === controller) show(view, text, false); });
      }
    });
    setStatus(finish === "length" ? "Stopped at max tokens." : "");
  } catch (e) {
    if (e.name === "AbortError") setStatus("Stopped.");
    else setStatus("Error: " + e.message);
  } finally {
    running = null;
    show(view, text, true);
    view.dataset.finish = finish || (controller.signal.aborted ? "stopped" : "error");
    if (text) messages.push({ role: "assistant", content: text });
    else view.remove();
    setBusy(false);
    prompt.focus();
  }
}

async function send() {
  const text = prompt.value.trim();
  if (!text || running) return;
  prompt.value = "";
  messages.push({ role: "user", content: text });
  show(messageView("user"), text, true);
  await answer();
}

$("composer").addEventListener("submit", e => { e.preventDefault(); send(); });
prompt.addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
stopBtn.addEventListener("click", () => { if (running) running.abort(); });
document.addEventListener("keydown", e => { if (e.key === "Escape" && running) running.abort(); });
regenBtn.addEventListener("click", async () => {
  if (running || !messages.length) return;
  if (messages[messages.length - 1].role === "assistant") {
    messages.pop();
    const views = log.querySelectorAll(".msg.assistant");
    views[views.length - 1].remove();
  }
  await answer();
});
$("clear").addEventListener("click", () => {
  if (running) running.abort();
  messages = [];
  log.replaceChildren();
  setStatus("");
  setBusy(false);
  prompt.focus();
});
$("key-button").addEventListener("click", async () => {
  if (await askForKey("The API key this server was started with (--api-key).")) loadEngine().catch(e => setStatus("Error: " + e.message));
});

if (matchMedia("(max-width: 720px)").matches) $("settings-panel").open = false; // room for the chat on a phone
setBusy(false);
loadEngine().catch(e => setStatus("Error: " + e.message));
