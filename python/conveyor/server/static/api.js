// Talking to this server: the API key (typed once, kept in localStorage, sent as a
// bearer token), JSON requests, and server-sent events read from a fetch() stream
// (EventSource cannot send the Authorization header).

const KEY_ITEM = "conveyor.apiKey";

export function apiKey() {
  try { return localStorage.getItem(KEY_ITEM) || ""; } catch { return ""; }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_ITEM, key); else localStorage.removeItem(KEY_ITEM);
  } catch { /* storage refused (private mode): the key lasts for this page only */ }
  memoryKey = key;
}

let memoryKey = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = memoryKey !== null ? memoryKey : apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function failure(resp) {
  let msg = resp.status + " " + resp.statusText;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) msg = body.error.message;
  } catch { /* not JSON */ }
  return new ApiError(resp.status, msg);
}

export async function getJSON(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

export async function postJSON(path, body, signal) {
  const resp = await fetch(path, { method: "POST", headers: headers({ "Content-Type": "application/json" }),
                                   body: JSON.stringify(body), signal });
  if (!resp.ok) throw await failure(resp);
  return resp;
}

// Calls onData(text) for each "data: ..." event of a server-sent-events response.
export async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).trimStart()).join("\n");
      if (data) onData(data);
    }
  }
}

export async function streamEvents(path, onData, signal) {
  const resp = await fetch(path, { headers: headers(), signal, cache: "no-store" });
  if (!resp.ok) throw await failure(resp);
  await readEvents(resp, onData);
}

// The key dialog every page shares, added to the page when this module loads.
const KEY_DIALOG = `
  <form method="dialog">
    <p id="key-message">This server needs an API key.</p>
    <label for="key-input">API key</label>
    <input id="key-input" type="password" autocomplete="off">
    <p class="hint">Kept in this browser's local storage and sent as a bearer token.</p>
    <div class="actions">
      <button value="save" id="key-save">Save</button>
      <button value="cancel" formnovalidate>Cancel</button>
    </div>
  </form>`;

function keyDialog() {
  let dlg = document.getElementById("key-dialog");
  if (!dlg) {
    dlg = document.createElement("dialog");
    dlg.id = "key-dialog";
    dlg.innerHTML = KEY_DIALOG; // a constant: no text from outside
    document.body.append(dlg);
  }
  return dlg;
}
keyDialog();

// Asks for the key: resolves when the visitor saved a key (or cancelled it).
export function askForKey(message) {
  const dlg = keyDialog();
  const input = document.getElementById("key-input");
  return new Promise(resolve => {
    if (dlg.open) { // asked already (another request needs it too): wait for that answer
      dlg.addEventListener("close", () => resolve(dlg.returnValue === "save"), { once: true });
      return;
    }
    document.getElementById("key-message").textContent = message || "This server needs an API key.";
    input.value = apiKey();
    const done = () => {
      dlg.removeEventListener("close", done);
      if (dlg.returnValue === "save") setApiKey(input.value.trim());
      resolve(dlg.returnValue === "save");
    };
    dlg.addEventListener("close", done);
    dlg.returnValue = ""; // Escape closes without a value
    dlg.showModal();
    input.focus();
  });
}
