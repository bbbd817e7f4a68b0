"""Hostile requests against a real `conveyor serve` (stories260K, --api-key, a chat
template with traps) on loopback: every one gets a clear 4xx
or a bounded answer, and /health, polled every 50 ms by a separate process, stays
under 100 ms at the 99th percentile while they arrive."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
KEY = "hostile-test-key"

# A template that is fine for ordinary messages and springs a trap on a keyword: CPU
# without output, output without end, jinja's own OverflowError (range past its cap),
# and a gigabyte built in one C call by each builder (join, format, str.format, +, ~).
TEMPLATE = textwrap.dedent("""\
    {%- set first = messages[0]['content'] -%}
    {%- set s = 'a' * 16000000 if first in ('format', 'plus', 'tilde') else '' -%}
    {%- if first == 'join' -%}{{ range(100000) | map('string') | join('x' * 10000) }}
    {%- elif first == 'format' -%}{{ ('%s' * 64) | format(*([s] * 64)) }}
    {%- elif first == 'strformat' -%}{{ '{:>1000000000}'.format('a') }}
    {%- elif first == 'plus' -%}{%- set a = s + s -%}{%- set b = a + a -%}{%- set c = b + b -%}{%- set d = c + c -%}{%- set e = d + d -%}{{ (e + e) | length }}
    {%- elif first == 'tilde' -%}{%- set a = s ~ s -%}{%- set b = a ~ a -%}{%- set c = b ~ b -%}{%- set d = c ~ c -%}{%- set e = d ~ d -%}{{ (e ~ e) | length }}
    {%- elif first == 'spin' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}
    {%- elif first == 'flood' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}xxxxxxxxxx{%- endfor -%}{%- endfor -%}
    {%- elif first == 'overflow' -%}{%- for i in range(10 ** 9) -%}{%- endfor -%}
    {%- endif -%}
    {%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}
    {% endfor -%}assistant:""")

HEALTH_POLLER = """
import http.client, json, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
lat = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/health")
    r = c.getresponse(); r.read(); c.close()
    lat.append(time.perf_counter() - t0)
    time.sleep(0.05)
print(json.dumps(lat))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmpl = tmp_path_factory.mktemp("tmpl") / "trap.jinja"
    tmpl.write_text(TEMPLATE)
    s = OwnServer(str(MODEL), ["--api-key", KEY, "--chat-template", str(tmpl)], timeout=120.0)
    c = httpx.Client(base_url=s.url, trust_env=False, timeout=120.0, headers={"Authorization": f"Bearer {KEY}"})
    c.url_ = s.url
    c.own_server = s
    yield c
    c.close()
    s.stop()


@contextlib.contextmanager
def server_log_on_failure(c):
    """A failure inside says what the server said: its log's tail (an exception, a
    sanitizer report) and whether it is still running."""
    try:
        yield
    except Exception as e:
        s = c.own_server
        state = "running" if s.proc.poll() is None else f"exited with status {s.proc.returncode}"
        raise AssertionError(f"{type(e).__name__}: {e}\n--- the server ({state}), its log's last 6000 "
                             f"characters ---\n{s.read_log()[-6000:]}") from e


def completion(c, **body):
    return c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, **body})


def chat(c, content, **body):
    return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                "max_tokens": 8, **body})


def expect_400(r, param, match=""):
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["param"] == param, err
    assert match in err["message"], err


# Each hostile request and what it must get.
HOSTILE = {
    # a regex past llguidance's limits, n=16: 400 naming the field, not 200 "abort"
    "regex-past-limits": (lambda c: completion(c, guided_regex="((a{100}){100}){100}", n=16, max_tokens=4),
                          lambda r: expect_400(r, "guided_regex", "grammar engine gave up")),
    # 20,000 choices
    "choice-20k": (lambda c: completion(c, guided_choice=[f"w{i}" for i in range(20000)]),
                   lambda r: expect_400(r, "guided_choice", "at most 1024")),
    # 8k bad words: over the cap, refused before tokenizing
    "bad-words-8k": (lambda c: completion(c, bad_words=[f"word{i}" for i in range(8000)]),
                     lambda r: expect_400(r, "bad_words", "at most 1024")),
    # 1,000 bad words (under the cap) are served
    "bad-words-1k": (lambda c: completion(c, bad_words=[f"w{i}" for i in range(1000)]),
                     lambda r: r.status_code == 200 or pytest.fail(r.text[:300])),
    # 7.8 MB of tiny stop strings: more JSON values than the budget takes, refused
    # before json.loads (which would hold the GIL a quarter of a second)
    "body-values-8mb": (lambda c: completion(c, stop=["ab"] * 1_300_000),
                        lambda r: expect_400(r, "body", "JSON values")),
    # a 4 MB prompt: 400 before tokenizing
    "prompt-4mb": (lambda c: completion(c, prompt="ab " * 1_400_000),
                   lambda r: expect_400(r, "prompt", "more than can fit in max_model_len")),
    # a template that spins, one that floods, one that overflows jinja's range cap
    "template-spin": (lambda c: chat(c, "spin"), lambda r: expect_400(r, "messages", "TimeoutError")),
    "template-flood": (lambda c: chat(c, "flood"), lambda r: expect_400(r, "messages", "output is over")),
    "template-overflow": (lambda c: chat(c, "overflow"), lambda r: expect_400(r, "messages", "OverflowError")),
    # a gigabyte from one C call of each builder: the template worker's memory cap
    **{f"template-{b}": ((lambda b: lambda c: chat(c, b))(b), lambda r: expect_400(r, "messages", "memory"))
       for b in ("join", "format", "strformat", "plus", "tilde")},
    # 1024 bad words of 15,000 characters (15 MB): a 413 before reading
    # it; of 3,000 or 2,000: over the request budget, before tokenizing; of 100:
    # tokenized once, off the event loop, and served
    "bad-words-15k-chars": (lambda c: completion(c, bad_words=[f"w{i} " + "ab " * 5000 for i in range(1024)]),
                            lambda r: r.status_code == 413 or pytest.fail(r.text[:300])),
    "bad-words-3k-chars": (lambda c: completion(c, bad_words=[f"w{i} " + "ab " * 1000 for i in range(1024)]),
                           lambda r: expect_400(r, "bad_words", "budget")),
    "bad-words-2k-chars": (lambda c: completion(c, bad_words=[f"w{i} " + "ab " * 660 for i in range(1024)]),
                           lambda r: expect_400(r, "bad_words", "budget")),
    "bad-words-100-chars": (lambda c: completion(c, bad_words=[f"w{i} " + "ab " * 33 for i in range(1024)]),
                            lambda r: r.status_code == 200 or pytest.fail(r.text[:300])),
    # a token id past 64 bits, a list as the tool name, a lone surrogate in a regex
    "prompt-id-huge": (lambda c: completion(c, prompt=[99999999999999999999]),
                       lambda r: expect_400(r, "prompt", "outside the vocabulary")),
    "tool-name-list": (lambda c: c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": ["f"]}}}),
        lambda r: expect_400(r, "tool_choice", "not among")),
    "regex-surrogate": (lambda c: c.post("/v1/completions", content=b'{"prompt": "hi", "guided_regex": "a\\ud800"}',
                                         headers={"Content-Type": "application/json"}),
                        lambda r: expect_400(r, "guided_regex", "invalid Unicode")),
    # GBNF; guided + best_of > n
    "gbnf": (lambda c: completion(c, guided_grammar='root ::= "yes" | "no"', max_tokens=5),
             lambda r: r.json()["choices"][0]["text"] in ("yes", "no") or pytest.fail(r.text)),
    "guided-best-of": (lambda c: completion(c, guided_choice=["red", "blue"], n=1, best_of=3, max_tokens=5,
                                            temperature=1.0),
                       lambda r: (r.json()["choices"][0]["text"] in ("red", "blue")
                                  and r.json()["choices"][0]["finish_reason"] == "stop") or pytest.fail(r.text)),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_request_answered(server, name):
    send, check = HOSTILE[name]
    with server_log_on_failure(server):
        t0 = time.monotonic()
        r = send(server)
        took = time.monotonic() - t0
        check(r)
        assert took < 10.0, f"{name} took {took:.1f} s"
        assert server.get("/health").status_code == 200


def _metric(text, name, status=None):
    for line in text.splitlines():
        if line.startswith(name) and (status is None or f'status="{status}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("ctype", ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_browsers_form_body_is_refused(server, ctype):
    """What a page on another site can POST without a CORS preflight: refused from a browser
    (which sends Origin), served from curl (no Origin); JSON from a browser is served."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()
    r = server.post("/v1/completions", content=body, headers={"Content-Type": ctype, "Origin": "http://evil.example"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "body", r.text
    assert server.post("/v1/completions", content=body, headers={"Content-Type": ctype}).status_code == 200
    assert server.post("/v1/completions", content=body, headers={"Content-Type": "application/json",
                                                                 "Origin": "http://evil.example"}).status_code == 200


def test_a_client_gone_while_sending_its_body_is_a_disconnect(server):
    import socket

    before = server.get("/metrics").text
    host, port = server.url_.split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while _metric(server.get("/metrics").text, "conveyor_client_disconnects_total") == \
            _metric(before, "conveyor_client_disconnects_total"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = server.get("/metrics").text
    assert _metric(after, "conveyor_http_errors_total", 500) == _metric(before, "conveyor_http_errors_total", 500)
    assert "internal error" not in server.own_server.read_log()


def test_unread_stream_options_are_named(server):
    r = completion(server, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert r.status_code == 200
    assert r.headers["x-conveyor-ignored-fields"] == "stream_options.continuous_usage_stats"


def test_errors_are_counted(server):
    """4xx answers are counted in conveyor_http_errors_total (500s go the same way)."""
    before = server.get("/metrics").text
    expect_400(completion(server, prompt=[99999999999999999999]), "prompt")
    after = server.get("/metrics").text

    def count(text):
        for line in text.splitlines():
            if line.startswith("conveyor_http_errors_total") and 'status="400"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert count(after) == count(before) + 1


def test_health_p99_under_hostile_mix(server):
    """Every hostile request above, three times over from six client threads, while a
    separate process polls /health every 50 ms: its p99 stays under 100 ms."""
    host, port = server.url_.split("//")[1].split(":")
    poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, host, port, "20"], stdout=subprocess.PIPE,
                              text=True)
    time.sleep(0.5)
    with ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(HOSTILE[name][0], server) for _ in range(3) for name in HOSTILE]
        for f in futs:
            assert f.result().status_code in (200, 400, 413)
    out, _ = poller.communicate(timeout=120)
    lat = sorted(json.loads(out))
    assert len(lat) > 100
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"/health under the hostile mix: {len(lat)} polls, median {lat[len(lat) // 2] * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    if os.environ.get("CONVEYOR_SANITIZED") == "1":
        return  # under ASan (tools/sanitize.sh) every answer is checked, not the timing
    assert p99 < 0.100, f"/health p99 {p99 * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms over {len(lat)} polls"


def test_one_request_takes_at_most_a_quarter_of_the_queue():
    """With --max-queued-requests 8, one request may queue 2 prompts: 3 is a 400 naming
    'prompt', so that one client cannot fill the queue for everyone."""
    s = OwnServer(str(MODEL), ["--max-queued-requests", "8"], timeout=120.0)
    try:
        with httpx.Client(base_url=s.url, trust_env=False, timeout=120.0) as c:
            expect_400(completion(c, prompt=["a", "b", "c"]), "prompt", "at most 2 (a quarter of max_queued_requests=8)")
            r = completion(c, prompt=["Once", "The dog"], max_tokens=2)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        s.stop()


def test_streamed_grammar_given_up_midway_ends_with_the_error(server):
    """Streaming: a grammar the grammar engine gives up on after tokens were sent ends
    the stream with an error event naming the field (or, given up at once, a 400)."""
    r = server.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4, "stream": True,
                                             "guided_regex": "((a{100}){100}){100}"})
    if r.status_code == 400:
        expect_400(r, "guided_regex", "gave up")
        return
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and "error" in events[-1], r.text[-500:]
    assert events[-1]["error"]["param"] == "guided_regex" and "gave up" in events[-1]["error"]["message"]


BURNER = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass\n"
# A control: the smallest HTTP server answering /health, in its own process, polled
# beside the real one; when the machine is so busy that it is slow too (p99 over
# half the server's bound, or a stall over half its max), the timing says nothing
# about the server.
CONTROL_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def _percentiles(lat):
    lat = sorted(lat)
    return lat[len(lat) // 2], lat[int(0.99 * (len(lat) - 1))], lat[-1]


def test_health_under_hostile_mix_with_cpu_burners(server):
    """The machine loaded by two CPU burners beside the server while every
    hostile request above arrives (three times over, six clients): /health, polled by
    another process, stays at p99 <= 150 ms and max <= 400 ms beyond twice what a trivial
    server beside it takes (the machine's own share: on 2 shared cores the scheduler alone
    puts tens of ms on a poll), and greedy answers are the same after the storm as before
    it. A loop blocked by one hostile request (a huge prompt tokenized or a grammar compiled
    on it) stalls a poll for seconds."""
    greedy = [("Once upon a time", 12), ("The little dog", 10)]

    def answers():
        return [completion(server, prompt=p, max_tokens=m, temperature=0).json()["choices"][0]["text"]
                for p, m in greedy]

    before = answers()
    host, port = server.url_.split("//")[1].split(":")
    seconds = 25
    control = subprocess.Popen([sys.executable, "-c", CONTROL_SERVER], stdout=subprocess.PIPE, text=True)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(seconds + 5)]) for _ in range(2)]
    try:
        control_port = control.stdout.readline().strip()
        pollers = [subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, h, p, str(seconds)],
                                    stdout=subprocess.PIPE, text=True)
                   for h, p in ((host, port), ("127.0.0.1", control_port))]
        time.sleep(0.5)
        with ThreadPoolExecutor(6) as ex, server_log_on_failure(server):
            futs = [ex.submit(HOSTILE[name][0], server) for _ in range(3) for name in HOSTILE]
            for f in futs:
                assert f.result().status_code in (200, 400, 413)
        lat, control_lat = (json.loads(p.communicate(timeout=180)[0]) for p in pollers)
    finally:
        for proc in (*burners, control):
            proc.kill()
            proc.wait()
    assert len(lat) > 100 and answers() == before
    (median, p99, worst), (c_median, c_p99, c_worst) = _percentiles(lat), _percentiles(control_lat)
    summary = (f"/health under the hostile mix with 2 CPU burners: {len(lat)} polls, median {median * 1000:.1f} ms, "
               f"p99 {p99 * 1000:.1f} ms, max {worst * 1000:.1f} ms; a control server beside it: median "
               f"{c_median * 1000:.1f} ms, p99 {c_p99 * 1000:.1f} ms, max {c_worst * 1000:.1f} ms")
    print(summary)
    if os.environ.get("CONVEYOR_SANITIZED") == "1":
        return  # under ASan (tools/sanitize.sh) every answer is checked, not the timing
    if c_p99 > 0.050 or c_worst > 0.125:
        pytest.skip(f"the machine is too busy to time the server (a trivial server beside it took over "
                    f"50 ms at p99, or 125 ms at most): {summary}")
    assert p99 <= 0.150 + 2 * c_p99 and worst <= 0.400 + 2 * c_worst, summary
