"""The browser pages of `conveyor serve` (the chat at /, the live view of batching at
/batching) and the events endpoint that feeds the live view.

The pages are driven in a real headless Chromium (Debian's `chromium`) through the
Chrome DevTools Protocol over --remote-debugging-pipe: NUL-separated JSON messages
on file descriptors 3 and 4, so no websocket client is needed. Answers are checked
against the same server's non-streamed answers; every network request the pages make
is recorded, and none may leave the server.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR, unsanitized_env  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; "
                                                             ".ci/run installs it)")
SCREENSHOTS = os.environ.get("CONVEYOR_UI_SCREENSHOTS")  # a folder to save the pages' screenshots in
KEY = "sekrit-key"


class Server(OwnServer):
    def __init__(self, *extra: str):
        super().__init__(str(MODEL), ("--no-enable-prefix-caching", *extra), timeout=60.0)


# ---------------------------------------------------------------------------- the browser


class Browser:
    """Headless Chromium driven through the DevTools protocol on a pipe."""

    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="conveyor-ui-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()

        def fds():  # the protocol's ends at 3 (commands in) and 4 (answers out)
            os.dup2(cmd_r, 3)
            os.dup2(resp_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", "--mute-audio",
             f"--user-data-dir={self.profile}", "about:blank"],
            preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False,
            env=unsanitized_env())
        os.close(cmd_r)
        os.close(resp_w)
        self._next = 0
        self._answers: dict[int, dict] = {}
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._handlers = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self._resp_r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._answers[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    with self._cond:
                        self.events.append(msg)
                    for h in list(self._handlers):
                        h(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0,
             wait: bool = True):
        with self._cond:
            self._next += 1
            mid = self._next
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        if not wait:
            return None
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no answer to {method}")
                self._cond.wait(left)
            ans = self._answers.pop(mid)
        if "error" in ans:
            raise RuntimeError(f"{method}: {ans['error']}")
        return ans.get("result", {})

    def page(self, width: int = 1200, height: int = 800, mobile: bool = False) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, session, width, height, mobile)

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except (OSError, TimeoutError, RuntimeError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        os.close(self._cmd_w)
        self._reader.join(5)
        os.close(self._resp_r)
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab: its console errors, exceptions and network requests are recorded."""

    def __init__(self, browser: Browser, session: str, width: int, height: int, mobile: bool):
        self.b, self.session = browser, session
        self.errors: list[str] = []
        self.requests: list[dict] = []
        self._fulfil = None
        browser._handlers.append(self._on_event)
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": mobile})

    def send(self, method, params=None, **kw):
        return self.b.send(method, params, self.session, **kw)

    def _on_event(self, msg):
        if msg.get("sessionId") != self.session:
            return
        m, p = msg["method"], msg.get("params", {})
        if m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append("exception: " + d.get("exception", {}).get("description", d.get("text", "")))
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append("log: " + p["entry"]["text"])
        elif m == "Network.requestWillBeSent":
            r = p["request"]
            self.requests.append({"url": r["url"], "method": r["method"], "body": r.get("postData")})
        elif m == "Fetch.requestPaused" and self._fulfil is not None:
            status, headers, body = self._fulfil(p["request"])
            self.send("Fetch.fulfillRequest", {
                "requestId": p["requestId"], "responseCode": status,
                "responseHeaders": [{"name": k, "value": v} for k, v in headers.items()],
                "body": base64.b64encode(body).decode()}, wait=False)

    def intercept(self, url_pattern: str, fulfil):
        """Answers requests matching url_pattern with fulfil(request) -> (status, headers, body)."""
        self._fulfil = fulfil
        self.send("Fetch.enable", {"patterns": [{"urlPattern": url_pattern}]})

    def goto(self, url: str, timeout: float = 30.0):
        n = len(self.b.events)
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", since=n, timeout=timeout)

    def wait_event(self, method: str, since: int = 0, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.b.events[since:]:
                if ev.get("method") == method and ev.get("sessionId") == self.session:
                    return ev
            time.sleep(0.02)
        raise TimeoutError(f"no {method}")

    def js(self, expression: str, timeout: float = 30.0):
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(expression)
            if v:
                return v
            time.sleep(0.05)
        raise TimeoutError(f"{what or expression} did not become true in {timeout} s")

    def type(self, selector: str, text: str):
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", {"text": text})

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13})

    def click(self, selector: str):
        self.js(f"document.querySelector({json.dumps(selector)}).click()")

    def screenshot(self, name: str) -> bytes:
        png = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        if SCREENSHOTS:
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            (Path(SCREENSHOTS) / name).write_bytes(png)
        return png

    def outside(self, base: str) -> list[str]:
        """The requests that went anywhere but the server (data: URLs are the page's own)."""
        return [r["url"] for r in self.requests if not (r["url"].startswith(base + "/") or r["url"] == base
                                                        or r["url"].startswith("data:"))]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed():
    s = Server("--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    b = Browser()
    yield b
    b.close()


def sse_data(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def chat_reference(url: str, messages: list, max_tokens: int, headers=None) -> str:
    """The server's own non-streamed greedy answer."""
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                       "temperature": 0, "top_p": 0.95},
                   headers=headers, timeout=60, trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------------- the chat page


@needs_chromium
def test_chat_page_streams_an_answer_with_a_system_prompt(server, browser):
    page = browser.page()
    page.goto(server.url + "/")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'", what="the model's name")
    shown = page.js("""[...document.querySelectorAll('#engine-settings dt')].map(
        dt => [dt.textContent, dt.nextElementSibling.textContent])""")
    info = httpx.get(server.url + "/v1/engine/settings", trust_env=False).json()
    assert len({k for k, _ in shown}) == len(shown)
    shown = dict(shown)
    assert shown["KV blocks"] == str(info["kv_cache"]["blocks_total"]) and shown["scheduling"] == "continuous"
    assert shown["max num seqs"] == str(info["max_num_seqs"]) == "256"
    assert shown["enable prefix caching"] == "false"  # as the server was started
    page.js("document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value = '60';"
            "document.getElementById('system').value = 'You tell short stories.'")
    # every state the streamed answer is drawn in
    page.js("""window.__seen = [];
      new MutationObserver(() => { const m = document.querySelector('.msg.assistant');
        if (m && m.querySelector('.body').textContent) window.__seen.push(m.dataset.text); })
        .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});""")
    # a slow link (20 kB/s): the answer's chunks arrive over about a second, not within one frame
    page.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 20000,
                                                   "uploadThroughput": -1})
    page.type("#prompt", "Tell me about a cat")
    page.press_enter()  # the keyboard sends
    page.wait_for("document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').dataset.finish",
                  what="the answer's end")
    text = page.js("document.querySelector('.msg.assistant').dataset.text")
    ref = chat_reference(server.url, [{"role": "system", "content": "You tell short stories."},
                                      {"role": "user", "content": "Tell me about a cat"}], 60)
    assert text == ref and text
    partial = {s for s in page.js("window.__seen") if s and s != ref}
    assert len(partial) >= 3, "the answer appeared at once, not as it streamed"
    assert all(ref.startswith(p) for p in partial)
    page.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                   "uploadThroughput": -1})
    sent = [r for r in page.requests if r["url"].endswith("/v1/chat/completions")]
    body = json.loads(sent[0]["body"])
    assert body["stream"] is True and body["messages"][0] == {"role": "system", "content": "You tell short stories."}
    assert body["temperature"] == 0 and body["max_tokens"] == 60
    assert page.js("document.querySelector('.msg.user .body').textContent") == "Tell me about a cat"
    # regenerate: the same greedy answer again, in place of the first
    page.click("#regenerate")
    page.wait_for("document.querySelectorAll('.msg.assistant').length === 1 && "
                  "document.querySelector('.msg.assistant').dataset.finish && !document.getElementById('send').disabled",
                  what="the regenerated answer")
    assert page.js("document.querySelector('.msg.assistant').dataset.text") == ref
    assert len([r for r in page.requests if r["url"].endswith("/v1/chat/completions")]) == 2
    # copy: the answer's text (its Markdown source) on the clipboard
    browser.send("Browser.grantPermissions", {"origin": server.url,
                                              "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    page.click(".msg.assistant .copy")
    page.wait_for("document.querySelector('.msg.assistant .copy').textContent === 'Copied'")
    assert page.js("navigator.clipboard.readText()") == ref
    page.screenshot("chat.png")
    page.click("#clear")
    assert page.js("document.getElementById('log').children.length") == 0
    assert page.errors == []
    assert page.outside(server.url) == []


@needs_chromium
def test_chat_page_stops_mid_answer(server, browser):
    page = browser.page()
    page.goto(server.url + "/")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'")
    page.js("document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value = '400'")
    # Stop as soon as the first words are drawn
    page.js("""new MutationObserver((_, obs) => { const b = document.querySelector('.msg.assistant .body');
        if (b && b.textContent) { obs.disconnect(); document.getElementById('stop').click(); } })
        .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});""")
    # a slow link: the answer takes seconds to arrive, so that Stop comes while it streams
    page.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 20000,
                                                   "uploadThroughput": -1})
    page.type("#prompt", "Once upon a time")
    page.click("#send")
    page.wait_for("document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').dataset.finish")
    assert page.js("document.querySelector('.msg.assistant').dataset.finish") == "stopped"
    assert page.js("document.getElementById('status').textContent") == "Stopped."
    stopped = page.js("document.querySelector('.msg.assistant').dataset.text")
    ref = chat_reference(server.url, [{"role": "user", "content": "Once upon a time"}], 400)
    assert stopped and ref.startswith(stopped) and len(stopped) < len(ref)
    # the server let the request go: nothing left running
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ev = json.loads(sse_data(_first_event(server.url))[0])
        if ev["running"] == 0 and ev["waiting"] == 0:
            break
        time.sleep(0.1)
    assert ev["running"] == 0 and ev["waiting"] == 0
    assert page.js("document.getElementById('send').disabled") is False
    assert page.errors == []


HOSTILE = ('Look: <img src=x onerror="window.__xss=1"> and <script>window.__xss=2</script> '
           '<a href="javascript:window.__xss=3">link</a>\n\n```html\n<script>window.__xss=4</script>\n```\n'
           '**bold** and `<b>code</b>`')


@needs_chromium
def test_chat_page_shows_html_from_the_model_as_text(server, browser):
    page = browser.page()

    def fulfil(request):
        words = [HOSTILE[i:i + 7] for i in range(0, len(HOSTILE), 7)]
        chunks = [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stories260K",
                   "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in words]
        chunks.append({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stories260K",
                       "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return 200, {"Content-Type": "text/event-stream"}, body.encode()

    page.intercept("*/v1/chat/completions", fulfil)
    page.goto(server.url + "/")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'")
    page.type("#prompt", "hello")
    page.press_enter()
    page.wait_for("document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').dataset.finish")
    time.sleep(0.3)
    body = ".msg.assistant .body"
    assert page.js(f"document.querySelector('{body}').querySelectorAll('img, script, a, b').length") == 0
    assert page.js("window.__xss === undefined")
    shown = page.js(f"document.querySelector('{body}').textContent")
    assert '<img src=x onerror="window.__xss=1">' in shown and "<script>window.__xss=2</script>" in shown
    assert page.js(f"document.querySelector('{body} pre code').textContent") == "<script>window.__xss=4</script>"
    assert page.js(f"document.querySelector('{body} strong').textContent") == "bold"
    assert page.js(f"document.querySelector('{body} p code').textContent") == "<b>code</b>"
    assert page.errors == []


@needs_chromium
def test_chat_page_on_a_phone_by_keyboard(server, browser):
    page = browser.page(width=390, height=800, mobile=True)
    page.goto(server.url + "/")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'")
    # nothing wider than the screen; the composer is on screen
    assert page.js("document.documentElement.scrollWidth") <= 390
    assert page.js("document.getElementById('prompt').getBoundingClientRect().bottom") <= 800
    assert page.js("document.getElementById('settings-panel').open") is False
    # keyboard: Tab reaches the message box and the buttons
    focusable = page.js("""(() => { const names = []; document.body.focus();
        for (const el of document.querySelectorAll('a, button, input, textarea, summary'))
          if (el.tabIndex >= 0 && !el.disabled && el.offsetParent !== null) names.push(el.id || el.tagName);
        return names; })()""")
    assert {"prompt", "send", "clear"} <= set(focusable)
    page.screenshot("chat-phone.png")
    assert page.errors == []


@needs_chromium
def test_chat_page_asks_for_the_api_key(keyed, browser):
    html = httpx.get(keyed.url + "/", trust_env=False)
    assert html.status_code == 200 and KEY not in html.text  # the page is public and holds no secret
    assert httpx.get(keyed.url + "/v1/engine/settings", trust_env=False).status_code == 401
    page = browser.page()
    page.goto(keyed.url + "/")
    page.wait_for("document.getElementById('key-dialog').open", what="the key dialog")
    page.type("#key-input", KEY)
    page.click("#key-save")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'", what="the model's name")
    assert page.js("localStorage.getItem('conveyor.apiKey')") == KEY
    page.js("document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value = '20'")
    page.type("#prompt", "Hi")
    page.press_enter()
    page.wait_for("document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').dataset.finish")
    ref = chat_reference(keyed.url, [{"role": "user", "content": "Hi"}], 20,
                         headers={"Authorization": f"Bearer {KEY}"})
    assert page.js("document.querySelector('.msg.assistant').dataset.text") == ref
    # a reload keeps the key: no dialog
    page.goto(keyed.url + "/")
    page.wait_for("document.getElementById('model-name').textContent === 'stories260K'")
    assert page.js("document.getElementById('key-dialog').open") is False
    # the key went as a bearer token, never in a URL
    assert not any(KEY in r["url"] for r in page.requests)
    assert page.outside(keyed.url) == []
    # the 401s the dialog answered are the only errors the browser logged
    assert all("401" in e for e in page.errors), page.errors


# ---------------------------------------------------------------------------- the live view


@needs_chromium
def test_batching_page_draws_a_burst(server, browser):
    page = browser.page(width=1200, height=1300)
    page.goto(server.url + "/batching")
    page.wait_for("window.conveyorBatching && window.conveyorBatching.events > 0", what="the first event")
    assert page.js("document.querySelector('a[href=\"/\"]') !== null")
    blank = page.js(_INK)
    page.js("document.getElementById('burst-n').value = '12'")
    page.click("#burst")
    page.wait_for("document.getElementById('burst-status').textContent === '12 / 12 done'", timeout=60,
                  what="the burst's end")
    # the events trail the answers by up to 100 ms: wait for the last steps, then idle
    page.wait_for("window.conveyorBatching.requests.size === 12 && window.conveyorBatching.last.running === 0 && "
                  "window.conveyorBatching.last.waiting === 0 && window.conveyorBatching.last.kv.used === 0",
                  what="every request seen, then the engine idle again")
    st = page.js("""(() => { const s = window.conveyorBatching;
        return {requests: s.requests.size, peaks: s.peaks, steps: s.stepsSeen, maxSlot: s.maxSlot,
                kvLast: s.last.kv.used}; })()""")
    assert st["requests"] == 12
    # several sequences shared steps, in several slots (the figures are snapshots every 100 ms,
    # and stories260K may run a whole burst between two of them)
    assert st["peaks"]["batch"] > 1 and st["maxSlot"] >= 1 and st["steps"] > 0 and st["kvLast"] == 0
    # the slots are drawn: the page draws on the next animation frame after an event, which
    # on a busy machine can come after the state above is read
    page.wait_for(f"{_INK} > {blank + 1000}", timeout=10, what="the slots drawn after the burst")
    page.screenshot("batching.png")
    assert page.errors == []
    assert page.outside(server.url) == []


@needs_chromium
def test_batching_page_shows_the_queue_and_kv_cache_fill_and_drain(smollm2_gguf, browser):
    """On the default model (slow enough for the 100 ms snapshots to catch it) with 4
    slots: a burst of 12 makes requests wait, fills KV blocks, and all returns to idle."""
    s = OwnServer(str(smollm2_gguf), ("--max-num-seqs", "4", "--no-enable-prefix-caching"), timeout=120.0)
    try:
        page = browser.page(width=1200, height=1300)
        page.goto(s.url + "/batching")
        page.wait_for("window.conveyorBatching && window.conveyorBatching.events > 0", what="the first event")
        page.js("document.getElementById('burst-n').value = '12'")
        page.click("#burst")
        page.wait_for("document.getElementById('burst-status').textContent === '12 / 12 done'", timeout=240,
                      what="the burst's end")
        page.wait_for("window.conveyorBatching.requests.size === 12 && window.conveyorBatching.last.running === 0 && "
                      "window.conveyorBatching.last.kv.used === 0", what="the engine idle again")
        st = page.js("""(() => { const s = window.conveyorBatching;
            return {peaks: s.peaks, maxSlot: s.maxSlot, last: s.last}; })()""")
        assert st["peaks"]["running"] == 4 and st["peaks"]["batch"] == 4 and st["maxSlot"] == 3
        assert st["peaks"]["waiting"] > 0 and st["peaks"]["kvUsed"] > 0
        assert st["last"]["waiting"] == 0
        page.screenshot("batching-smollm2.png")
        assert page.errors == []
    finally:
        s.stop()


_INK = """(() => { const c = document.getElementById('slots'); const d = c.getContext('2d')
    .getImageData(0, 0, c.width, c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
    return n; })()"""


@needs_chromium
def test_pages_load_without_errors_or_other_origins(server, browser):
    for path in ("/", "/batching"):
        page = browser.page()
        page.goto(server.url + path)
        time.sleep(0.5)
        assert page.errors == [], path
        assert page.outside(server.url) == [], path
        names = {r["url"].rsplit("/", 1)[-1] for r in page.requests}
        assert "style.css" in names and "api.js" in names


# ---------------------------------------------------------------------------- without a browser


def test_pages_are_served_with_a_strict_policy(server):
    for path, kind in (("/", "text/html"), ("/batching", "text/html"), ("/static/chat.js", "text/javascript"),
                       ("/static/style.css", "text/css")):
        r = httpx.get(server.url + path, trust_env=False)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert "script-src 'self'" in r.headers["content-security-policy"]
    for path in ("/static/nope.js", "/static/..%2Fapp.py", "/static/../ui.py"):
        assert httpx.get(server.url + path, trust_env=False).status_code == 404
    html = httpx.get(server.url + "/", trust_env=False).text
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere


def test_no_ui_turns_the_pages_off():
    s = Server("--no-ui")
    try:
        for path in ("/", "/batching", "/static/chat.js"):
            r = httpx.get(s.url + path, trust_env=False)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(s.url + "/v1/models", trust_env=False).status_code == 200
    finally:
        s.stop()


def _first_event(url: str, headers=None) -> str:
    with httpx.stream("GET", url + "/v1/engine/events", headers=headers, timeout=10, trust_env=False) as r:
        if r.status_code != 200:
            return r.read().decode()
        text = ""
        for chunk in r.iter_text():
            text += chunk
            if "\n\n" in text:
                return text


def test_events_need_the_key(keyed):
    r = httpx.get(keyed.url + "/v1/engine/events", timeout=10, trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(keyed.url + "/v1/engine/events?api_key=" + KEY, timeout=10, trust_env=False)
    assert r.status_code == 401  # the key goes in the header only, never in a URL that logs keep
    ev = json.loads(sse_data(_first_event(keyed.url, {"Authorization": f"Bearer {KEY}"}))[0])
    assert ev["type"] == "steps" and ev["kv"]["total"] > 0


EVENT_KEYS = {"type", "time", "interval_s", "steps", "slots", "steps_total", "steps_omitted", "prefill_tokens",
              "decode_tokens", "preemptions", "spec_proposed", "spec_accepted", "kv", "running", "waiting",
              "tokens_per_s", "max_num_seqs"}


def test_events_describe_the_steps_of_the_requests_sent(server):
    """Every step of four requests, each sequence's tokens adding up to its prompt and
    its answer (each computed once; the last sampled token needs no step), at most
    one event per 100 ms."""
    events, ready, stop = [], threading.Event(), threading.Event()

    def listen():
        with httpx.stream("GET", server.url + "/v1/engine/events", timeout=30, trust_env=False) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            buf = ""
            for chunk in r.iter_text():
                buf += chunk
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    events.append((time.monotonic(), json.loads(block[len("data: "):])))
                    ready.set()
                if stop.is_set():
                    return

    th = threading.Thread(target=listen)
    th.start()
    assert ready.wait(10)
    usages = {}

    def one(i):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time " * (i + 1),
                                                              "max_tokens": 8 + 6 * i, "ignore_eos": True},
                       timeout=30, trust_env=False)
        usages[i] = r.json()["usage"]

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    time.sleep(0.5)
    stop.set()
    th.join(10)
    assert len(events) >= 2
    for _, ev in events:
        assert set(ev) == EVENT_KEYS
        assert set(ev["kv"]) == {"used", "cached", "free", "total"}
        assert ev["kv"]["used"] + ev["kv"]["free"] <= ev["kv"]["total"]
    # at most one event per 100 ms, by the server's clock (a loaded client may read two at once)
    gaps = [b[1]["time"] - a[1]["time"] for a, b in zip(events, events[1:])]
    assert min(gaps) > 0.09, gaps
    assert sum(ev["steps_omitted"] for _, ev in events) == 0
    numbers = [n for _, ev in events for n in ev["steps"]["step"]]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert events[-1][1]["steps_total"] >= len(numbers)
    per_request: dict[int, list] = {}
    for _, ev in events:
        cols = ev["steps"]
        assert set(cols) == {"step", "ms", "seqs", "prefill_tokens", "decode_tokens", "proposals"}
        assert all(len(v) == len(cols["step"]) for v in cols.values())
        assert sum(cols["prefill_tokens"]) == ev["prefill_tokens"] and sum(cols["decode_tokens"]) == ev["decode_tokens"]
        assert set(cols["proposals"]) <= {0}  # no speculative decoding here
        # the runs cover each step's sequences exactly, one sequence per slot
        cover: dict[int, list] = {n: [] for n in cols["step"]}
        for slot, rid, first, last, prefill, tokens in ev["slots"]:
            assert first <= last and prefill in (0, 1) and tokens >= last - first + 1
            for n in range(first, last + 1):
                if n in cover:
                    cover[n].append(slot)
            per_request.setdefault(rid, [0, 0])[0 if prefill else 1] += tokens
        for n, seqs in zip(cols["step"], cols["seqs"]):
            assert len(cover[n]) == seqs and len(set(cover[n])) == seqs
    assert len(per_request) == 4
    expected = sorted((u["prompt_tokens"], u["completion_tokens"] - 1) for u in usages.values())
    assert sorted(tuple(v) for v in per_request.values()) == expected
    assert sum(ev["prefill_tokens"] for _, ev in events) == sum(e[0] for e in expected)
    assert sum(ev["decode_tokens"] for _, ev in events) == sum(e[1] for e in expected)
    assert events[-1][1]["running"] == 0 and events[-1][1]["kv"]["used"] == 0


# ---------------------------------------------------------------------------- the broadcaster, in process


def test_events_cost_nothing_without_a_listener():
    """With no listener the step trace is off (the engine records nothing) and no
    event is built; a listener that goes away turns it off again."""
    from conveyor import AsyncLLM, SamplingParams
    from conveyor.server.events import EngineEvents

    async def main():
        engine = AsyncLLM(str(MODEL))
        try:
            events = EngineEvents(engine, interval=0.02)

            async def run(n):
                async for _ in engine.generate("Once upon a time", SamplingParams(max_tokens=n, ignore_eos=True)):
                    pass

            await run(10)
            await asyncio.sleep(0.1)
            assert engine.take_step_trace() == [] and events.events_built == 0
            listeners = [events.subscribe() for _ in range(100)]
            assert events.tracing
            await run(10)
            await asyncio.sleep(0.1)
            built = events.events_built
            assert built >= 1
            for q in listeners:  # every listener got the same events
                assert q.qsize() == listeners[0].qsize() >= 1
            for q in listeners:
                events.unsubscribe(q)
            assert not events.tracing
            await run(10)
            await asyncio.sleep(0.1)
            assert engine.take_step_trace() == [] and events.events_built == built
        finally:
            engine.close()

    asyncio.run(main())


def test_events_listeners_that_go_away_are_dropped():
    """The app served in this process: clients that disconnect mid-stream are
    unsubscribed at once, and with the last one the step trace goes off."""
    import socket

    import uvicorn

    from conveyor import AsyncLLM
    from conveyor.server.app import build_app

    engine = AsyncLLM(str(MODEL))
    app = build_app(engine, model_name="m")
    events = app.state.events
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = sock.getsockname()[1]

        def listen():
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"GET /v1/engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"data: " not in got:
                got += conn.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            return conn

        conns = [listen() for _ in range(5)]
        assert len(events.listeners) == 5 and events.tracing
        with httpx.Client(base_url=url, timeout=10, trust_env=False) as c:
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
            for conn in conns[:4]:
                conn.close()
            _wait(lambda: len(events.listeners) == 1)
            assert events.tracing
            conns[4].close()
            _wait(lambda: not events.listeners)
            assert not events.tracing
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
            assert engine.take_step_trace() == []  # nothing recorded with no listener
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


def _wait(cond, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_events_summary_of_a_made_up_trace():
    """Slots, runs and columns of a trace written by hand: request 1 prefills in two
    chunks then decodes; request 2 decodes with speculative proposals and leaves;
    request 3 takes the lowest free slot (2's)."""
    from conveyor.server import events as ev_mod

    class Idle:
        closed = False

    ev = ev_mod.EngineEvents(Idle())
    t = [(0, 0.0, 0.001, 1, 0, 4, 4), (0, 0.0, 0.001, 2, 0, 3, 3),
         (1, 0.001, 0.003, 1, 0, 4, 4), (1, 0.001, 0.003, 2, 0, 4, 0),  # 2 verifies 3 proposals
         (2, 0.003, 0.004, 1, 0, 1, 0), (2, 0.003, 0.004, 2, 0, 1, 0),
         (3, 0.004, 0.005, 1, 0, 1, 0), (3, 0.004, 0.005, 3, 0, 2, 2),
         (4, 0.005, 0.006, 1, 0, 1, 0), (4, 0.005, 0.006, 3, 0, 1, 0)]
    out = ev._summary(t, {"num_preemptions": 1, "generation_tokens": 0, "steps": 0},
                      {"num_preemptions": 3, "generation_tokens": 8, "steps": 5, "blocks_used": 2,
                       "blocks_free": 6, "blocks_total": 8, "num_running": 2}, 10.0, 10.5)
    assert out["steps"] == {"step": [0, 1, 2, 3, 4], "ms": [1.0, 2.0, 1.0, 1.0, 1.0], "seqs": [2, 2, 2, 2, 2],
                            "prefill_tokens": [7, 4, 0, 2, 0], "decode_tokens": [0, 4, 2, 1, 2],
                            "proposals": [0, 3, 0, 0, 0]}
    assert sorted(out["slots"]) == sorted([
        [0, 1, 0, 1, 1, 8], [0, 1, 2, 4, 0, 3],  # request 1: prefill steps 0-1, decode 2-4, slot 0
        [1, 2, 0, 0, 1, 3], [1, 2, 1, 2, 0, 5],  # request 2: slot 1 until it leaves after step 2
        [1, 3, 3, 3, 1, 2], [1, 3, 4, 4, 0, 1]])  # request 3 takes slot 1, now free
    assert (out["prefill_tokens"], out["decode_tokens"], out["preemptions"]) == (13, 9, 2)
    assert out["tokens_per_s"] == 16.0 and out["kv"] == {"used": 2, "cached": 0, "free": 6, "total": 8}
    # past the cap, the latest steps are kept and the runs cut to them
    cap = ev_mod.MAX_STEPS_PER_EVENT
    ev2 = ev_mod.EngineEvents(Idle())
    long = [(s, 0.0, 0.0, 7, 0, 1, 0) for s in range(cap + 10)]
    out = ev2._summary(long, {}, {}, 0.0, 0.1)
    assert out["steps_omitted"] == 10 and out["steps"]["step"][0] == 10 and len(out["steps"]["step"]) == cap
    assert out["slots"] == [[0, 7, 10, cap + 9, 0, cap + 10]]
    assert out["decode_tokens"] == cap + 10  # the totals count every step


def test_shutdown_ends_the_event_streams():
    """A listener does not hold up the server's shutdown: its stream ends cleanly."""
    import socket

    s = Server()
    try:
        conn = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=10)
        conn.sendall(b"GET /v1/engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"data: " not in got:
            got += conn.recv(65536)
        t0 = time.monotonic()
        s.proc.terminate()
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0 < 3.0  # not the 5 s the graceful shutdown would wait for it
        while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = conn.recv(65536)
            assert chunk, got[-200:]
            got += chunk
        conn.close()
        assert "Traceback" not in s.read_log()
    finally:
        s.stop()
