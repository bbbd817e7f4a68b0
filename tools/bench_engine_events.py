"""What listening to /v1/engine/events costs the engine.

Serves a model in this process (the app of `conveyor serve`, uvicorn on a thread) and
runs the same load from a client process with 0 listeners on the events endpoint and
with many (default 100), alternating, several rounds. Reads the engine's own step
timing before and after each run and prints, per listener count, the mean step time
(what the C engine spends per step: the step trace is recorded there), the load's
wall time, the CPU time of this process (the server and its engine; the client runs
elsewhere), the time the events' poller took, and the ratios to the run without
listeners.

    PYTHONPATH=... python tools/bench_engine_events.py [--model PATH] [--listeners 100]
        [--requests 32] [--max-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

STORIES = Path(__file__).resolve().parents[2] / "shared/models/stories260K/stories260K.bin"

# The client: k listeners read events until the load is done; the load is n completions at once.
# (Each listener's count includes the response's header block.)
CLIENT = r"""
import asyncio, json, sys, time
import httpx

async def main(url, k, n, max_tokens):
    limits = httpx.Limits(max_connections=k + n + 8, max_keepalive_connections=k + n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as c:
        got = [0] * k
        started = [asyncio.Event() for _ in range(k)]
        done = asyncio.Event()

        host, port = url.split("//")[1].split(":")

        async def listen(i):  # plain sockets: a listener costs this process little
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                while not done.is_set():
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        return
                    got[i] += chunk.count(b"\n\n")
                    started[i].set()
            finally:
                writer.close()

        listeners = [asyncio.create_task(listen(i)) for i in range(k)]
        for e in started:
            await e.wait()

        async def one(i):
            r = await c.post("/v1/completions", json={"prompt": "Once upon a time " * (1 + i % 4),
                                                      "max_tokens": max_tokens, "ignore_eos": True})
            r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
        done.set()
        for t in listeners:
            t.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        print(json.dumps({"wall_s": wall, "events": sum(got)}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def serve(model: str):
    import uvicorn

    from conveyor import AsyncLLM
    from conveyor.server.app import build_app

    engine = AsyncLLM(model, enable_prefix_caching=False)
    app = build_app(engine, model_name="bench")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return engine, app.state.events, server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # this process: the server and its engine, not the client
    return ru.ru_utime + ru.ru_stime


def run_once(engine, events, url: str, listeners: int, requests: int, max_tokens: int) -> dict:
    before, cpu0, busy0 = engine.stats(), cpu_seconds(), events.busy_s
    out = subprocess.run([sys.executable, "-c", CLIENT, url, str(listeners), str(requests), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    after, cpu1, busy1 = engine.stats(), cpu_seconds(), events.busy_s
    res = json.loads(out.stdout)
    res["cpu_s"] = cpu1 - cpu0
    res["poller_ms"] = 1e3 * (busy1 - busy0)
    steps = after["steps"] - before["steps"]
    res["steps"] = steps
    res["step_ms"] = 1e3 * (after["time_step"] - before["time_step"]) / max(steps, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(STORIES))
    ap.add_argument("--listeners", type=int, default=100)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    engine, events, server, thread, url = serve(args.model)
    counts = (0, 1, args.listeners)
    runs: dict[int, list] = {k: [] for k in counts}
    try:
        run_once(engine, events, url, 0, args.requests, args.max_tokens)  # warm up
        for _ in range(args.rounds):
            for k in counts:
                runs[k].append(run_once(engine, events, url, k, args.requests, args.max_tokens))
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()
    base_step = statistics.median(r["step_ms"] for r in runs[0])
    base_wall = statistics.median(r["wall_s"] for r in runs[0])
    base_cpu = statistics.median(r["cpu_s"] for r in runs[0])
    print(f"model {Path(args.model).name}, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds (medians)")
    print(f"{'listeners':>9} {'steps':>6} {'step ms':>9} {'ratio':>6} {'wall s':>8} {'ratio':>6} "
          f"{'server cpu s':>12} {'ratio':>6} {'poller ms':>9} {'events':>7}")
    for k in counts:
        def med(key):
            return statistics.median(r[key] for r in runs[k])

        print(f"{k:>9} {med('steps'):>6.0f} {med('step_ms'):>9.4f} {med('step_ms') / base_step:>6.3f} "
              f"{med('wall_s'):>8.3f} {med('wall_s') / base_wall:>6.3f} {med('cpu_s'):>12.3f} "
              f"{med('cpu_s') / base_cpu:>6.3f} {med('poller_ms'):>9.2f} {med('events'):>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
