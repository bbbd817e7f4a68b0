"""The child processes of `conveyor bench serve`: the HTTP load generator and the
in-process AsyncLLM runner. Each reads one JSON job on stdin and writes one JSON
result on stdout, so that neither shares a process (or a GIL) with what it measures.

    python -m conveyor.bench.serve_load http       # job: url, model, requests, delays, t0, ...
    python -m conveyor.bench.serve_load inprocess  # job: model, engine, requests, delays, ...

The HTTP client is a few lines of asyncio over raw sockets (HTTP/1.1, chunked
server-sent events, TCP_NODELAY), far lighter per token than a general client, so
that one process can drive hundreds of streams without becoming the bottleneck.

Per request (both paths, same definitions): TTFT = first output with text - send,
E2E = last output with text - send, TPOT = (E2E - TTFT) / (output tokens - 1),
ITL = gaps between outputs with text. Times are time.perf_counter() (CLOCK_MONOTONIC,
one clock for every process on the machine).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from typing import Optional, Union
from urllib.parse import urlsplit

ENGINE_THREADS = ("cv-engine", "cv-worker")  # thread names the C core gives its threads


# ---------------------------------------------------------------------------- CPU time


def cpu_seconds(pid: int) -> dict:
    """CPU seconds (user + system) of process pid: "total" (every thread, living or
    exited), "engine" (the C core's living threads, by name) and "frontend" (the rest:
    the event loop, the HTTP stack, the output dispatcher)."""
    tick = os.sysconf("SC_CLK_TCK")

    def ticks(stat: str) -> int:
        rest = stat[stat.rindex(")") + 2:].split()  # fields from 3 on; comm may hold spaces
        return int(rest[11]) + int(rest[12])         # utime, stime (fields 14, 15)

    with open(f"/proc/{pid}/stat") as f:
        total = ticks(f.read())  # the whole thread group
    engine = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith(ENGINE_THREADS):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    engine += ticks(f.read())
        except OSError:
            continue  # the thread exited meanwhile
    return {"total": total / tick, "engine": engine / tick, "frontend": (total - engine) / tick}


def cpu_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def rss_bytes(pid: Union[int, str] = "self") -> Optional[int]:
    """Resident memory of process pid (this one by default), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


# ---------------------------------------------------------------------------- records


def new_record(req: dict) -> dict:
    return {"prompt_tokens": len(req["prompt"]), "max_tokens": req["max_tokens"], "ok": False,
            "ttft": None, "e2e": None, "tpot": None, "itl": [], "output_tokens": 0, "error": None,
            "start": None, "status": None, "answered": None, "retry_after": None, "text": "",
            "finish_reason": None, "done": False}


def close_record(rec: dict, start: float, first: Optional[float], last: Optional[float]) -> dict:
    if first is None:
        rec["error"] = rec["error"] or "no tokens streamed"
        return rec
    rec["ttft"] = first - start
    rec["e2e"] = last - start
    if rec["output_tokens"] > 1:
        rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (rec["output_tokens"] - 1)
    rec["ok"] = rec["error"] is None
    return rec


# ---------------------------------------------------------------------------- HTTP


async def _read_chunks(reader: asyncio.StreamReader, chunked: bool):
    """Yields the body of an HTTP/1.1 response piece by piece."""
    if not chunked:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data
    while True:
        line = await reader.readline()
        if not line:
            return
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def http_one(host: str, port: int, path: str, body: dict, api_key: Optional[str], req: dict,
                   delay: float, t0: float) -> dict:
    """One streamed request. The record also keeps what a test checks: the status, when
    the status line came (answered), Retry-After, the streamed text in order, the finish
    reason and whether [DONE] arrived."""
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    rec = new_record(req)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    start = time.perf_counter()
    rec["start"] = start - t0
    first = last = None
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(head.encode() + b"\r\n" + payload)
        status = await reader.readline()
        rec["answered"] = time.perf_counter() - start
        rec["status"] = int(status.split()[1])
        chunked = False
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
            elif k == "retry-after":
                rec["retry_after"] = v.strip()
        if rec["status"] != 200:
            body_bytes = b"".join([c async for c in _read_chunks(reader, chunked)])
            rec["error"] = f"HTTP {rec['status']}: {body_bytes[:300].decode('utf-8', 'replace')}"
            return rec
        buf = b""
        done = False
        async for data in _read_chunks(reader, chunked):
            buf += data
            while b"\n\n" in buf and not done:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    done = rec["done"] = True
                    break
                now = time.perf_counter()
                ev = json.loads(event[6:])
                if "error" in ev:
                    rec["error"] = str(ev["error"].get("message"))
                    continue
                ch = ev.get("choices")
                if ch and ch[0].get("finish_reason"):
                    rec["finish_reason"] = ch[0]["finish_reason"]
                if ch and ch[0].get("text"):
                    rec["text"] += ch[0]["text"]
                    if first is None:
                        first = now
                    else:
                        rec["itl"].append(now - last)
                    last = now
                if ev.get("usage"):
                    rec["output_tokens"] = ev["usage"]["completion_tokens"]
            if done:
                break
    except Exception as e:  # noqa: BLE001 - a failed request is data
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    finally:
        if writer is not None:
            writer.close()
    return close_record(rec, start, first, last)


async def http_run(job: dict) -> list:
    u = urlsplit(job["url"])
    host, port = u.hostname, u.port or 80
    t0 = job["t0"]
    tasks = []
    for req, delay in zip(job["requests"], job["delays"]):
        body = {"model": job["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **req.get("extra", {})}
        tasks.append(http_one(host, port, "/v1/completions", body, job.get("api_key"), req, delay, t0))
    return await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------- in process


async def inprocess_one(engine, req: dict, delay: float, t0: float) -> dict:
    from ..sampling_params import SamplingParams

    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    rec = new_record(req)
    params = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, temperature=0.0,
                            output_kind="delta")
    start = time.perf_counter()
    rec["start"] = start - t0
    first = last = None
    try:
        async for out in engine.generate({"prompt_token_ids": req["prompt"]}, params):
            o = out.outputs[0]
            rec["output_tokens"] += len(o.token_ids)
            if o.text:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    rec["itl"].append(now - last)
                last = now
    except Exception as e:  # noqa: BLE001
        from .. import EngineOverloadedError

        if isinstance(e, EngineOverloadedError):
            rec["status"] = 503  # refused, as the server would answer
            rec["answered"] = time.perf_counter() - start
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    return close_record(rec, start, first, last)


async def inprocess_run(job: dict) -> dict:
    from ..async_llm import AsyncLLM

    engine = AsyncLLM(job["model"], **job["engine"])
    try:
        warm = [{"prompt": r["prompt"], "max_tokens": min(r["max_tokens"], 8)} for r in job["requests"][:4]]
        await asyncio.gather(*[inprocess_one(engine, r, 0.0, time.perf_counter()) for r in warm])
        pid = os.getpid()
        engine._core.set_trace(True)
        before = cpu_seconds(pid)
        t0 = time.perf_counter() + 0.05
        recs = await asyncio.gather(*[inprocess_one(engine, r, d, t0)
                                      for r, d in zip(job["requests"], job["delays"])])
        wall = time.perf_counter() - t0
        cpu = cpu_delta(before, cpu_seconds(pid))
        trace = engine._core.take_trace()
    finally:
        engine.close()
    return {"records": recs, "wall": wall, "cpu": cpu, "steps": step_times(trace)}


def step_times(trace) -> dict:
    """From the engine's step trace (step, t0, t1, request, seq, new tokens, of them prompt
    tokens): the times of decode-only steps and of steps with prompt work, the most prompt
    tokens in a step that also decoded, and what prompts cost the running streams
    (mixed_step_cost)."""
    import numpy as np

    steps: dict = {}
    for step, t0, t1, _rid, _idx, n_new, n_prompt_work in trace:
        s = steps.setdefault(step, [t1 - t0, 0, 0])  # time, prompt tokens, decodes
        s[1] += n_prompt_work
        if n_prompt_work == 0:
            s[2] += 1
    out = {}
    for name, keep in (("decode_only", lambda s: s[1] == 0), ("with_prompts", lambda s: s[1] > 0)):
        d = np.asarray([s[0] for s in steps.values() if keep(s)], dtype=np.float64)
        out[name] = {"n": int(d.size), **({"p50": float(np.percentile(d, 50)), "p99": float(np.percentile(d, 99))}
                                          if d.size else {"p50": None, "p99": None})}
    out["max_prompt_tokens_while_decoding"] = max((s[1] for s in steps.values() if s[2] > 0), default=0)
    out["mixed"] = mixed_step_cost(trace, steps)
    return out


def mixed_step_cost(trace, steps: dict) -> Optional[dict]:
    """What prompt work costs the streams that decode alongside it, measured against
    decode-only steps *at the same batch size*: a straight line t(B) = a + b*B fitted
    to the decode-only steps (B = sequences decoding) says what each decoding step would
    have taken without its prompt tokens. Per stream, the engine-side TPOT is the mean
    time of the steps it decoded in, and its decode-only counterpart the mean of t(B)
    over the same steps; their p99s and ratio are what the stall-free target compares.
    prompt_share is the part of the decoding steps' time spent on prompt tokens: spread
    evenly, the streams' mean TPOT ratio is 1 / (1 - prompt_share), whatever the cap."""
    import numpy as np

    dec = [(s[2], s[0]) for s in steps.values() if s[1] == 0 and s[2] > 0]
    if len({b for b, _ in dec}) < 2:
        return None  # cannot fit a line
    b_arr = np.asarray([b for b, _ in dec], dtype=np.float64)
    t_arr = np.asarray([t for _, t in dec], dtype=np.float64)
    slope, intercept = np.polyfit(b_arr, t_arr, 1)

    def alone(b: int) -> float:
        return max(intercept + slope * b, 1e-9)

    per_stream: dict = {}
    for step, _t0, _t1, rid, idx, _n_new, n_prompt_work in trace:
        if n_prompt_work == 0:
            per_stream.setdefault((rid, idx), []).append(step)
    actual, counter = [], []
    for st in per_stream.values():
        if len(st) < 2:
            continue
        actual.append(float(np.mean([steps[s][0] for s in st])))
        counter.append(float(np.mean([alone(steps[s][2]) for s in st])))
    decoding = [s for s in steps.values() if s[2] > 0]
    busy = sum(s[0] for s in decoding)
    prompt_time = sum(max(0.0, s[0] - alone(s[2])) for s in decoding if s[1] > 0)
    if not actual or busy <= 0:
        return None
    a99, c99 = float(np.percentile(actual, 99)), float(np.percentile(counter, 99))
    share = prompt_time / busy
    return {"fit_ms": [float(intercept) * 1e3, float(slope) * 1e3], "streams": len(actual),
            "tpot_steps_p99": a99, "tpot_decode_only_same_batch_p99": c99, "tpot_p99_ratio": a99 / c99,
            "tpot_mean_ratio": float(np.mean(actual)) / float(np.mean(counter)),
            "prompt_share": share, "mean_ratio_if_spread": 1.0 / max(1e-9, 1.0 - share)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("http", "inprocess"):
        print("usage: python -m conveyor.bench.serve_load {http|inprocess} < job.json", file=sys.stderr)
        return 2
    job = json.load(sys.stdin)
    if argv[0] == "http":
        result = {"records": asyncio.run(http_run(job))}
    else:
        result = asyncio.run(inprocess_run(job))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
