"""A stop signal while requests run and wait: every client gets a proper end (a whole
answer, or 503 engine_closed: JSON for a plain request, an error event then [DONE] for a
stream), the process exits 0 soon, and the log holds no traceback. A real server over
stories260K, one sequence at a time, so that most requests wait."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
BODY = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
N = 120


def _server(*extra):
    return OwnServer(str(MODEL), ("--max-num-seqs", "1", "--num-threads", "1", *extra), timeout=60.0)


async def _plain(c):
    r = await c.post("/v1/completions", json=BODY)
    if r.status_code == 200:
        return "whole" if r.json()["choices"][0]["finish_reason"] == "length" else r.text
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["code"] == "engine_closed", r.text
    return "503"


async def _stream(c):
    events = []
    async with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["code"] == "engine_closed", last
        return "cut" if len(events) > 2 else "503"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "whole"


def _signal_under_load(server, stream: bool, signals, gap: float = 0.3):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=N + 8)) as c:
            tasks = [asyncio.ensure_future((_stream if stream else _plain)(c)) for _ in range(N)]
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            for i, sig in enumerate(signals):
                if i:
                    await asyncio.sleep(gap)
                server.proc.send_signal(sig)
            rc = await asyncio.to_thread(server.proc.wait, 30)
            took = time.monotonic() - t0
            ends = await asyncio.gather(*tasks)
            return rc, took, ends

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sigterm_ends_waiting_requests_with_503_and_exits(stream):
    server = _server()
    try:
        rc, took, ends = _signal_under_load(server, stream, [signal.SIGTERM])
        log = server.read_log()
    finally:
        server.stop()
    assert rc == 0 and took < 5.0, (rc, took)
    assert ends.count("503") > N // 2, ends  # the waiting ones were refused at once, not started
    assert set(ends) <= {"whole", "503", "cut"}, ends
    assert "Traceback" not in log, log[-3000:]


def test_a_second_signal_or_no_grace_cuts_running_streams_with_an_error_event():
    for extra, signals in ((("--shutdown-timeout", "0"), [signal.SIGTERM]),
                           ((), [signal.SIGTERM, signal.SIGINT])):
        server = _server(*extra)
        try:
            rc, took, ends = _signal_under_load(server, True, signals, gap=0.05)
            log = server.read_log()
        finally:
            server.stop()
        # a Ctrl-C that lands after the drain, while the process tears down, ends it as
        # interrupted (-SIGINT), as any Python program; every client has had its end by then
        statuses = (0, -signal.SIGINT) if len(signals) > 1 else (0,)
        assert rc in statuses and took < 5.0, (extra, rc, took)
        assert set(ends) <= {"whole", "503", "cut"} and ends.count("503") > N // 2, (extra, ends)
        assert "Traceback" not in log, log[-3000:]


def test_shutdown_timeout_is_checked():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "conveyor", "serve", str(MODEL), "--shutdown-timeout", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--shutdown-timeout" in r.stderr, r.stderr
