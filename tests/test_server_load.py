"""The server under load: 500 concurrent streams, overload (queue limit, 503 with
Retry-After), deadlines and priorities, against real server processes on loopback.
Clients: the light raw-socket client of the serving benchmark (conveyor.bench.serve_load)."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import conveyor  # noqa: E402
from conveyor import SamplingParams  # noqa: E402
from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.bench.serve_load import http_one  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue", "One day, a bird", "The sun was"]


def metric(url, name, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=30.0, trust_env=False).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))


def wait_metric(url, name, pred, timeout=15.0) -> float:
    deadline = time.monotonic() + timeout
    v = metric(url, name)
    while not pred(v) and time.monotonic() < deadline:
        time.sleep(0.05)
        v = metric(url, name)
    return v


def send(url, bodies, delays=None):
    """Streams every body at once (or after its delay); returns the records in order."""
    from urllib.parse import urlsplit

    u = urlsplit(url)

    async def go():
        t0 = time.perf_counter()
        tasks = [http_one(u.hostname, u.port, "/v1/completions",
                          {"stream": True, "stream_options": {"include_usage": True}, **b},
                          None, {"prompt": [], "max_tokens": b.get("max_tokens", 16)},
                          (delays or [0.0] * len(bodies))[i], t0)
                 for i, b in enumerate(bodies)]
        return await asyncio.gather(*tasks)

    return asyncio.run(asyncio.wait_for(go(), 120))


def one_request(url, body, delay, t0):
    """One request (streamed unless the body says "stream": False) sent at t0 + delay: the
    coroutine of the load generator's record."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return http_one(u.hostname, u.port, "/v1/completions", {"stream": True, **body}, None,
                    {"prompt": [], "max_tokens": body["max_tokens"]}, delay, t0)


@pytest.fixture(scope="module")
def llm():
    engine = conveyor.LLM(str(MODEL), num_threads=1)
    yield engine
    engine.close()


def test_500_concurrent_streams_match_generate(llm):
    server = OwnServer(str(MODEL), ["--num-threads", "1"], timeout=60.0)
    try:
        cases = [(PROMPTS[i % len(PROMPTS)], 1 + (i * 7) % 32) for i in range(500)]
        refs = {}
        for p in PROMPTS:
            ks = sorted({k for q, k in cases if q == p})
            outs = llm.generate([p] * len(ks), [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
                                                for k in ks], use_tqdm=False)
            refs.update({(p, k): o.outputs[0].text for k, o in zip(ks, outs)})
        finished0 = metric(server.url, "conveyor_requests_finished_total")
        recs = send(server.url, [{"prompt": p, "max_tokens": k, "temperature": 0, "ignore_eos": True}
                                 for p, k in cases])
        for (p, k), r in zip(cases, recs):
            assert r["status"] == 200 and r["error"] is None, r["error"]
            assert r["done"] and r["finish_reason"] == "length"
            assert r["output_tokens"] == k
            assert r["text"] == refs[(p, k)]  # every chunk, in order
        assert metric(server.url, "conveyor_requests_finished_total") - finished0 == 500
        assert wait_metric(server.url, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0
        assert metric(server.url, "conveyor_requests_rejected_total") == 0
    finally:
        server.stop()


def test_overload_refuses_the_excess_at_once():
    # 2 seats and a queue of 8: of 64 simultaneous long requests at most 10 are admitted
    # before the first of them could finish (500 tokens each); the rest get 503 at once.
    server = OwnServer(str(MODEL), ["--num-threads", "1", "--max-num-seqs", "2", "--max-queued-requests", "8"],
                       timeout=60.0)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
        recs = send(server.url, [body] * 64)
        ok = [r for r in recs if r["status"] == 200]
        refused = [r for r in recs if r["status"] == 503]
        assert len(ok) + len(refused) == 64
        # the queue's 8 at least; the 2 seats too when the engine scheduled some before the
        # rest arrived (timing: not asserted)
        assert len(ok) >= 8 and len(refused) >= 40, (len(ok), len(refused))
        first_done = min(r["start"] + r["e2e"] for r in ok)
        for r in refused:
            assert r["start"] + r["answered"] < first_done  # answered before any admitted one finished
            assert r["retry_after"] is not None and int(r["retry_after"]) >= 1
            assert '"type":"service_unavailable_error"' in r["error"].replace(" ", "")
            assert "max_queued_requests" in r["error"] or "overloaded" in r["error"]
        for r in ok:
            assert r["done"] and r["finish_reason"] == "length" and r["output_tokens"] == 500
        assert metric(server.url, "conveyor_requests_rejected_total") == len(refused)
        assert metric(server.url, "conveyor_http_errors_total", 'status="503"') == len(refused)
        assert metric(server.url, "conveyor_requests_finished_total") == len(ok)
        assert wait_metric(server.url, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0
    finally:
        server.stop()


def test_deadlines_end_requests_with_timeout_and_free_blocks():
    # One seat. A blocker holds it; requests behind it pass their deadline: from the body, or
    # the server's --request-timeout. The blocker is sized in tokens, not in time: 128
    # completions of 500 tokens, one at a time, are 64,000 decode steps (seconds even for the
    # fastest CPU on this tiny model), and the test checks the order of events: both deadlines
    # expire while the blocker still runs. Then the blocker is cancelled (its blocks freed).
    # The blocker does not stream: on a fast CPU this model makes ~15,000 steps a second, one
    # event each, more than the event loop delivers, which would delay the other requests.
    server = OwnServer(str(MODEL), ["--num-threads", "1", "--max-num-seqs", "1", "--request-timeout", "0.5"],
                       timeout=60.0)
    try:
        blocker = {"prompt": "Once upon a time", "max_tokens": 500, "n": 128, "ignore_eos": True, "timeout": 120,
                   "stream": False}
        short = {"prompt": "The dog", "max_tokens": 50, "ignore_eos": True, "timeout": 0.2}
        default = {"prompt": "The cat", "max_tokens": 50, "ignore_eos": True}

        def one(body, delay, t0):
            return one_request(server.url, body, delay, t0)

        async def go():
            t0 = time.perf_counter()
            blocking = asyncio.ensure_future(one(blocker, 0.0, t0))
            s, d = await asyncio.gather(one(short, 0.3, t0), one(default, 0.3, t0))
            still_running = not blocking.done()
            blocking.cancel()
            await asyncio.gather(blocking, return_exceptions=True)
            return s, d, still_running

        s, d, blocker_still_running = asyncio.run(asyncio.wait_for(go(), 120))
        assert s["status"] == 200 and s["finish_reason"] == "timeout" and s["done"] and s["text"] == ""
        assert d["status"] == 200 and d["finish_reason"] == "timeout" and d["done"]
        assert blocker_still_running, "the blocker ended before the deadlines: the test needs a bigger one"
        assert metric(server.url, "conveyor_requests_timed_out_total") == 2
        assert metric(server.url, "conveyor_request_success_total", 'finished_reason="timeout"') == 2
        assert wait_metric(server.url, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0
        # bad values name the field
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "timeout": -1}, trust_env=False)
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    finally:
        server.stop()


def test_priority_request_overtakes_the_queue():
    server = OwnServer(str(MODEL), ["--num-threads", "1", "--max-num-seqs", "1", "--scheduling", "priority"],
                       timeout=60.0)
    try:
        base = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}
        # The blocker, sized in tokens and not in time: 128 completions of 500 tokens on the
        # only seat (64,000 decode steps, seconds even on a fast CPU; not streamed, so the event
        # loop is not busy delivering them). The low ones queue behind it, the high one comes
        # last; the test checks the order of events, then cancels the blocker.
        blocker = {"prompt": "Once upon a time", **base, "max_tokens": 500, "n": 128, "priority": 0,
                   "stream": False}
        low = [{"prompt": f"Story {i}", **base, "priority": 10} for i in range(6)]
        high = {"prompt": "The king", **base, "priority": -5}

        def one(body, delay, t0):
            return one_request(server.url, body, delay, t0)

        async def go():
            t0 = time.perf_counter()
            blocking = asyncio.ensure_future(one(blocker, 0.0, t0))
            lows = [asyncio.ensure_future(one(b, 0.2, t0)) for b in low]
            king = await one(high, 0.4, t0)
            lows_done_before_king = sum(t.done() for t in lows)
            blocker_running = not blocking.done()
            blocking.cancel()
            await asyncio.gather(blocking, return_exceptions=True)
            return king, await asyncio.gather(*lows), lows_done_before_king, blocker_running

        king, lows, lows_done_first, blocker_running = asyncio.run(asyncio.wait_for(go(), 120))
        assert blocker_running, "the blocker ended before the high-priority request: the test needs a bigger one"
        assert lows_done_first == 0
        for r in [king] + lows:
            assert r["status"] == 200 and r["done"] and r["finish_reason"] == "length", r["error"]
        assert all(king["start"] + king["e2e"] < r["start"] + r["e2e"] for r in lows)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "priority": "high"}, trust_env=False)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    finally:
        server.stop()


def test_bench_serve_compares_http_with_inprocess(tmp_path, capsys):
    import json

    from conveyor.bench.serve import main

    out = tmp_path / "bench.json"
    rc = main(["--model", str(MODEL), "--server-args", "--num-threads 1 --max-prefill-tokens-while-decoding 16",
               "--num-prompts", "24", "--prompt-len", "48", "--output-mean", "12", "--rates", "inf",
               "--client-procs", "2", "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    inproc = run["inprocess"]
    for r in (run, inproc):
        assert r["completed"] == 24 and r["failed"] == 0 and r["rejected"] == 0
        assert r["ttft_s"]["p50"] > 0 and r["e2e_s"]["p99"] >= r["ttft_s"]["p50"]
        assert set(r["cpu_us_per_token"]) == {"total", "engine", "frontend"}
    assert run["output_tokens"] == inproc["output_tokens"]  # the same requests, EOS ignored
    assert run["client_procs"] == 2
    assert isinstance(run["http_overhead_us_per_token"], float)
    steps = inproc["steps"]
    assert steps["decode_only"]["n"] + steps["with_prompts"]["n"] > 0
    assert steps["max_prompt_tokens_while_decoding"] <= 16
    mixed = steps["mixed"]  # against decode-only steps at the same batch size
    if mixed is not None:
        assert 0.0 <= mixed["prompt_share"] < 1.0 and mixed["tpot_p99_ratio"] > 0 and mixed["streams"] > 0
    assert run["server_rss"]["start_mib"] > 10 and run["server_rss"]["max_mib"] >= run["server_rss"]["end_mib"]
    text = capsys.readouterr().out
    assert "in-process" in text and "HTTP overhead" in text and "server memory (RSS)" in text


def test_bench_serve_overload_reports_refusals_and_takes_a_given_saturation(tmp_path, capsys):
    import json

    from conveyor.bench.serve import main

    out = tmp_path / "bench.json"
    rc = main(["--model", str(MODEL), "--server-args", "--num-threads 1 --max-queued-requests 2",
               "--num-prompts", "30", "--prompt-len", "48", "--output-mean", "12", "--rates", "inf,2x",
               "--saturation", "40", "--duration", "0.5", "--no-inprocess", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    burst, paced = doc["runs"]
    assert doc["config"]["saturation_req_s"] == 40 and paced["saturation_multiple"] == 2
    assert burst["completed"] + burst["rejected"] == 30  # --num-prompts for the burst
    assert paced["completed"] + paced["rejected"] == 40  # 80 req/s for 0.5 s
    assert burst["rejected"] > 0 and burst["failed"] == 0
    assert burst["refusal_s"]["n"] == burst["rejected"] and 0 < burst["refusal_s"]["p99"] < 5.0
    assert "503 answered after (http)" in capsys.readouterr().out
    for bad in (["--saturation", "0"], ["--duration", "nan"]):
        with pytest.raises(SystemExit):
            main(["--model", str(MODEL), *bad])
