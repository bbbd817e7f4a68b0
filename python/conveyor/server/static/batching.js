// The live view of continuous batching: reads /v1/engine/events (one summary of the
// engine's steps at most every 100 ms) and draws the slot timeline, the KV blocks,
// the queue and the throughput.
import { ApiError, askForKey, getJSON, postJSON, streamEvents } from "./api.js";

const $ = id => document.getElementById(id);
const MAX_STEPS = 400;      // steps on the slot timeline
const SERIES_SECONDS = 60;  // time on the other charts

const state = {
  events: 0, stepsSeen: 0, requests: new Set(), steps: [], series: [], maxSlot: 3, maxNumSeqs: 0,
  totals: { preemptions: 0, specProposed: 0, specAccepted: 0 }, last: null,
  peaks: { running: 0, waiting: 0, kvUsed: 0, batch: 0 },
};
window.conveyorBatching = state; // for the page's tests and the curious
let model = null;
let dirty = false;

function colour(request, light) {
  const hue = (request * 137.508) % 360;
  return `hsl(${hue.toFixed(1)}, 62%, ${light ? 72 : 52}%)`;
}

function onEvent(ev) {
  state.events++;
  state.last = ev;
  state.maxNumSeqs = ev.max_num_seqs || state.maxNumSeqs;
  // the slot runs back into one list of [slot, request, prefill] per step
  const at = new Map();
  const cols = ev.steps;
  cols.step.forEach((n, i) => {
    const cell = { seqs: [], waiting: ev.waiting };
    at.set(n, cell);
    state.steps.push(cell);
    state.peaks.batch = Math.max(state.peaks.batch, cols.seqs[i]);
  });
  for (const [slot, request, first, last, prefill] of ev.slots) {
    state.requests.add(request);
    if (slot > state.maxSlot) state.maxSlot = slot;
    for (let n = first; n <= last; n++) {
      const cell = at.get(n);
      if (cell) cell.seqs.push([slot, request, prefill]);
    }
  }
  state.stepsSeen += cols.step.length;
  if (state.steps.length > MAX_STEPS) state.steps.splice(0, state.steps.length - MAX_STEPS);
  state.totals.preemptions += ev.preemptions;
  state.totals.specProposed += ev.spec_proposed;
  state.totals.specAccepted += ev.spec_accepted;
  state.peaks.running = Math.max(state.peaks.running, ev.running);
  state.peaks.waiting = Math.max(state.peaks.waiting, ev.waiting);
  state.peaks.kvUsed = Math.max(state.peaks.kvUsed, ev.kv.used);
  state.series.push({ t: ev.time, kvUsed: ev.kv.used, kvCached: ev.kv.cached, kvTotal: ev.kv.total,
                      waiting: ev.waiting, running: ev.running, tps: ev.tokens_per_s });
  while (state.series.length && state.series[0].t < ev.time - SERIES_SECONDS) state.series.shift();
  $("f-running").textContent = ev.running;
  $("f-waiting").textContent = ev.waiting;
  $("f-kv").textContent = `${ev.kv.used} / ${ev.kv.total}`;
  $("f-tps").textContent = Math.round(ev.tokens_per_s);
  $("f-steps").textContent = ev.steps_total;
  $("f-preempt").textContent = state.totals.preemptions;
  $("f-spec").textContent = `${state.totals.specAccepted} / ${state.totals.specProposed}`;
  if (!dirty) { dirty = true; requestAnimationFrame(draw); }
}

function fit(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * dpr)), h = Math.max(1, Math.round(canvas.clientHeight * dpr));
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return [ctx, canvas.clientWidth, canvas.clientHeight];
}

function ink() { return getComputedStyle(document.body).color; }

function drawSlots() {
  const [ctx, w, h] = fit($("slots"));
  ctx.clearRect(0, 0, w, h);
  const rows = Math.max(4, state.maxSlot + 1);
  const left = 52, top = 4, bottom = 18;
  const rowH = (h - top - bottom) / rows;
  const colW = (w - left) / MAX_STEPS;
  ctx.fillStyle = ink();
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  const every = Math.ceil(12 / Math.max(rowH, 1));
  for (let r = 0; r < rows; r += every) ctx.fillText(`slot ${r}`, 2, top + (r + .5) * rowH);
  const x0 = left + (MAX_STEPS - state.steps.length) * colW;
  state.steps.forEach((st, i) => {
    // whole pixels, each column up to the next one's start: no seams between steps
    const x = Math.floor(x0 + i * colW), cw = Math.max(1, Math.floor(x0 + (i + 1) * colW) - x);
    const used = new Set();
    for (const [slot, request, prefill] of st.seqs) {
      used.add(slot);
      ctx.fillStyle = colour(request, false);
      ctx.fillRect(x, top + slot * rowH + 1, cw, Math.max(rowH - 2, 1));
      if (prefill > 0) {
        ctx.fillStyle = "rgba(0,0,0,.45)";
        ctx.fillRect(x, top + slot * rowH + 1, cw, Math.max((rowH - 2) / 4, 1));
      }
    }
    if (st.waiting > 0) { // idle slots while requests wait
      ctx.fillStyle = "rgba(128,128,128,.35)";
      const limit = state.maxNumSeqs ? Math.min(rows, state.maxNumSeqs) : rows;
      for (let r = 0; r < limit; r++) if (!used.has(r)) ctx.fillRect(x, top + r * rowH + 1, cw, Math.max(rowH - 2, 1));
    }
  });
  ctx.fillStyle = ink();
  ctx.textBaseline = "alphabetic";
  ctx.fillText(`last ${state.steps.length} steps →`, left, h - 4);
}

function drawSeries(id, lines, unit) {
  const [ctx, w, h] = fit($(id));
  ctx.clearRect(0, 0, w, h);
  const s = state.series;
  const left = 52, top = 6, bottom = 16;
  const now = s.length ? s[s.length - 1].t : 0;
  let max = 1;
  for (const p of s) for (const l of lines) max = Math.max(max, l.value(p));
  ctx.strokeStyle = "rgba(128,128,128,.4)";
  ctx.beginPath(); ctx.moveTo(left, h - bottom + .5); ctx.lineTo(w, h - bottom + .5); ctx.stroke();
  ctx.fillStyle = ink();
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(String(Math.round(max)), 2, top + 8);
  ctx.fillText("0", 2, h - bottom);
  ctx.fillText(`last ${SERIES_SECONDS} s  ${unit}`, left, h - 3);
  const x = t => left + (w - left) * (1 - (now - t) / SERIES_SECONDS);
  const y = v => top + (h - top - bottom) * (1 - v / max);
  let lx = w - 4;
  for (const l of lines.slice().reverse()) {
    ctx.strokeStyle = l.colour; ctx.lineWidth = 1.6;
    ctx.beginPath();
    s.forEach((p, i) => { const px = x(p.t), py = y(l.value(p)); if (i) ctx.lineTo(px, py); else ctx.moveTo(px, py); });
    ctx.stroke();
    ctx.fillStyle = l.colour;
    const tw = ctx.measureText(l.name).width;
    lx -= tw;
    ctx.fillText(l.name, lx, top + 8);
    lx -= 12;
  }
}

function draw() {
  dirty = false;
  drawSlots();
  drawSeries("kv", [{ name: "in use", colour: "#2f7fd0", value: p => p.kvUsed },
                    { name: "cached (free, reusable)", colour: "#8a6fd0", value: p => p.kvCached }], "blocks");
  drawSeries("queue", [{ name: "waiting", colour: "#d0602f", value: p => p.waiting },
                       { name: "running", colour: "#2fa05f", value: p => p.running }], "");
  drawSeries("tps", [{ name: "tokens/s", colour: "#2f7fd0", value: p => p.tps }], "");
}

async function connect() {
  for (;;) {
    try {
      const info = await getJSON("/v1/engine/settings");
      model = info.model;
      $("model-name").textContent = `${info.model} · ${info.max_num_seqs} slots · ${info.kv_cache.blocks_total} KV blocks · ${info.settings.scheduling || ""}`;
      $("status").textContent = "Live.";
      await streamEvents("/v1/engine/events", data => onEvent(JSON.parse(data)));
      $("status").textContent = "The server closed the stream; reconnecting…";
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) {
        $("status").textContent = "Needs the API key.";
        await askForKey(e.message);
        continue;
      }
      $("status").textContent = `Disconnected (${e.message}); reconnecting…`;
    }
    await new Promise(r => setTimeout(r, 1000));
  }
}

const PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a big bird",
                 "Tom had a red ball", "The sun was hot"];
const LENGTHS = [8, 64, 16, 128, 32, 4, 96, 24, 48, 12];

$("burst").addEventListener("click", async () => {
  const n = Math.max(1, Math.min(256, Math.round(Number($("burst-n").value) || 1)));
  const out = $("burst-status");
  let done = 0, failed = 0;
  out.textContent = `0 / ${n} done`;
  $("burst").disabled = true;
  await Promise.all(Array.from({ length: n }, async (_, i) => {
    try {
      const resp = await postJSON("/v1/completions", { model: model || undefined, prompt: PROMPTS[i % PROMPTS.length],
                                                       max_tokens: LENGTHS[i % LENGTHS.length], temperature: 0.8,
                                                       ignore_eos: true });
      await resp.json();
      done++;
    } catch (e) {
      failed++;
      if (e instanceof ApiError && e.status === 401) out.dataset.error = e.message;
    }
    out.textContent = `${done} / ${n} done` + (failed ? `, ${failed} failed` : "");
  }));
  $("burst").disabled = false;
});

$("key-button").addEventListener("click", () => askForKey("The API key this server was started with (--api-key)."));
window.addEventListener("resize", () => { if (!dirty) { dirty = true; requestAnimationFrame(draw); } });
draw();
connect();
