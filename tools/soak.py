#!/usr/bin/env python3
"""Soak test: many requests with random lengths, a share aborted at random
moments, part of them on a KV budget so small that preemption never stops.

    python tools/soak.py                       5,000 requests through AsyncLLM
    python tools/soak.py --http                the same through `conveyor serve`,
                                               with clients that disconnect
    python tools/soak.py -n 300 --json out.json

What must hold (the exit status is 1 otherwise):
  * every request ends: finished (stop/length), aborted, or cancelled by its
    consumer -- none hangs (a per-request watchdog) and none errors;
  * at the end every KV block is free (stats()['blocks_used'] == 0) and nothing
    is running or waiting;
  * the tight engine preempted (stats()['num_preemptions'] > 0);
  * resident memory (/proc/<pid>/statm) after the run is within 5% of its level
    after a warm-up round (the first round allocates arenas and caches).

Two engines share the work: a normal one and a tight one (kv_cache_memory of a
few blocks, max_model_len 128). Aborts are half by cancelling the consumer task
(or, over HTTP, closing the connection) and half by engine.abort(request_id).
tests/test_soak.py runs a short version of this in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from conveyor.bench.serve import OwnServer
from conveyor.bench.serve_load import rss_bytes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared/models/stories260K/stories260K.bin"
WORDS = ("once upon a time there was a little girl named Lily who loved to play in the park with her "
         "big red ball and one day she saw a dog").split()
RSS_GROWTH_LIMIT = 0.05   # resident memory may grow this much over the measured round
TIGHT_BLOCKS = 10          # KV blocks of the tight engine (160 tokens at block_size 16)
TIGHT_MAX_MODEL_LEN = 128  # so one request always fits in the tight pool


# ---------------------------------------------------------------------------- memory

def settle_memory():
    """Collects garbage and hands free heap pages back to the OS, so that RSS shows
    what is held rather than what malloc keeps for reuse."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    i: int
    tight: bool
    prompt: object            # str or list of token ids
    n_prompt_max: int         # an upper bound of its token count
    max_tokens: int
    temperature: float
    seed: Optional[int]
    n: int
    kind: str                 # output_kind
    stream: bool              # HTTP only
    abort: Optional[str]      # None, "cancel" or "abort"
    abort_after: float        # seconds after the first output (or the start)
    abort_at_output: int      # or after this many outputs


def make_plans(n: int, seed: int, abort_frac: float, tight_frac: float, vocab: int):
    """Yields the plans one by one (none is kept after its request)."""
    rnd = random.Random(seed)
    for i in range(n):
        tight = rnd.random() < tight_frac
        if rnd.random() < 0.5:
            k = rnd.randint(1, 12)
            prompt = " ".join(rnd.choice(WORDS) for _ in range(k))
            n_prompt = 2 * len(prompt) + 2  # tokens <= bytes + BOS, generously
            n_prompt = min(n_prompt, 60)
            prompt = prompt[: n_prompt // 2 - 1] or "a"
        else:
            k = rnd.randint(1, 48)
            prompt = [rnd.randrange(3, vocab) for _ in range(k)]
            n_prompt = k
        room = (TIGHT_MAX_MODEL_LEN if tight else 512) - n_prompt
        max_tokens = rnd.randint(1, max(1, min(64, room)))
        r = rnd.random()
        abort = None if r >= abort_frac else ("cancel" if r < abort_frac / 2 else "abort")
        yield Plan(
            i=i, tight=tight, prompt=prompt, n_prompt_max=n_prompt, max_tokens=max_tokens,
            temperature=rnd.choice([0.0, 0.0, 0.8, 1.0]), seed=rnd.choice([None, rnd.randrange(2**32)]),
            n=2 if rnd.random() < 0.1 else 1, kind=rnd.choice(["cumulative", "delta", "final_only"]),
            stream=rnd.random() < 0.6, abort=abort, abort_after=rnd.random() * 0.05,
            abort_at_output=rnd.randint(0, 8))


@dataclass
class Tally:
    finished: int = 0
    aborted: int = 0          # ended with finish_reason "abort" (engine.abort)
    cancelled: int = 0        # the consumer went away
    errors: list = field(default_factory=list)
    hung: int = 0
    tokens: int = 0

    def add(self, status: str, detail=None):
        if status == "finished":
            self.finished += 1
        elif status == "aborted":
            self.aborted += 1
        elif status == "cancelled":
            self.cancelled += 1
        elif status == "hung":
            self.hung += 1
        else:
            self.errors.append(detail or status)

    @property
    def total(self):
        return self.finished + self.aborted + self.cancelled + self.hung + len(self.errors)


# ---------------------------------------------------------------------------- AsyncLLM

async def _one_async(engine, p: Plan, tally: Tally, watchdog: float):
    from conveyor import SamplingParams

    params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, n=p.n,
                            output_kind=p.kind)
    rid = f"soak-{p.i}"
    outs = []

    async def consume():
        async for out in engine.generate(p.prompt, params, request_id=rid):
            outs.append(out)
        return outs

    task = asyncio.ensure_future(consume())
    try:
        if p.abort == "cancel":
            await asyncio.wait([task], timeout=p.abort_after)
            if not task.done():
                task.cancel()
        elif p.abort == "abort":
            await asyncio.wait([task], timeout=p.abort_after)
            if not task.done():
                await engine.abort(rid)
        try:
            await asyncio.wait_for(asyncio.shield(task), watchdog)
        except asyncio.TimeoutError:
            task.cancel()
            tally.add("hung")
            return
        except asyncio.CancelledError:
            if task.cancelled():
                tally.add("cancelled")
                return
            raise
    except Exception as e:  # noqa: BLE001 - reported
        tally.add("error", f"request {p.i}: {type(e).__name__}: {e}")
        return
    if not outs or not outs[-1].finished:
        tally.add("error", f"request {p.i}: stream ended without a finished output")
        return
    last = outs[-1]
    reasons = {c.finish_reason for c in last.outputs}
    if p.kind == "delta":
        ntok = [sum(len(o.outputs[j].token_ids) for o in outs) for j in range(p.n)]
    else:
        ntok = [len(c.token_ids) for c in last.outputs]
    if any(k > p.max_tokens for k in ntok):
        tally.add("error", f"request {p.i}: {ntok} tokens for max_tokens {p.max_tokens}")
        return
    tally.tokens += sum(ntok)
    if "abort" in reasons:
        tally.add("aborted")
    elif reasons <= {"stop", "length"}:
        tally.add("finished")
    else:
        tally.add("error", f"request {p.i}: finish reasons {reasons}")


async def _workers(plans, concurrency, one):
    """`concurrency` workers take the plans in order: what is alive at any time is
    bounded by the concurrency, not by N (so the harness's own memory does not
    grow with the run and blur the RSS figure)."""
    it = iter(plans)

    async def worker():
        for p in it:
            await one(p)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _round_async(engines, plans, concurrency, watchdog) -> Tally:
    tally = Tally()
    await _workers(plans, concurrency, lambda p: _one_async(engines[p.tight], p, tally, watchdog))
    return tally


def _wait_idle(engine, timeout=30.0) -> dict:
    """Aborts from cancelled consumers are processed at the engine's next step:
    wait (bounded) until it has nothing left."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if (engine.num_unfinished() == 0 and st["blocks_used"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def memory(pid: "int | str" = "self") -> dict:
    """Resident memory of a process, split as a leak check needs it.

    The CPU backend maps each buffer of 1 MiB or more (the KV pool, a step's scratch) on
    its own and advises huge pages for it (VmFlags `hg`). The kernel commits such a
    mapping as it is first touched, in 2 MiB pages where it can: the KV pool's resident
    size grows with every block first handed out, in steps that a count of blocks cannot
    predict. So those mappings count by their size, which must not grow (a leaked buffer
    adds a mapping), and the rest (malloc's heap, Python's objects) by its resident size."""
    other = mapped = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            size = rss = 0
            for line in f:
                head = line.split(None, 1)[0]
                if head == "Size:":
                    size = int(line.split()[1]) * 1024
                elif head == "Rss:":
                    rss = int(line.split()[1]) * 1024
                elif head == "VmFlags:":  # the last line of a mapping's entry
                    if "hg" in line.split()[1:]:
                        mapped += size
                    else:
                        other += rss
    except OSError:  # no smaps (or the process is gone): all of the RSS, as /proc/PID/statm says
        rss = rss_bytes(pid)
        if rss is None:
            raise RuntimeError(f"process {pid} is gone")
        return {"rss": rss, "huge_page_maps": 0}
    return {"rss": other, "huge_page_maps": mapped}


def soak_async(model: Path, n: int, *, seed=0, abort_frac=0.3, tight_frac=0.3, concurrency=48,
               warmup: Optional[int] = None, watchdog=120.0, num_threads=None, log=print,
               check_rss=True) -> dict:
    from conveyor import AsyncLLM

    t_start = time.monotonic()
    kw = dict(num_threads=num_threads) if num_threads else {}
    normal = AsyncLLM(str(model), **kw)
    block_bytes = normal.stats()["kv_cache_bytes"] // max(1, normal.stats()["num_blocks"])
    # no admission margin: every request starts when its prompt fits, so the pool runs out
    tight = AsyncLLM(str(model), kv_cache_memory=TIGHT_BLOCKS * block_bytes,
                     max_model_len=TIGHT_MAX_MODEL_LEN, admission_reserve=0, **kw)
    engines = {False: normal, True: tight}
    vocab = normal.model_config["vocab_size"]
    try:
        w = warmup if warmup is not None else max(50, n // 10)
        t0 = time.monotonic()
        wt = asyncio.run(_round_async(engines, make_plans(w, seed + 1, abort_frac, tight_frac, vocab),
                                      concurrency, watchdog))
        for e in engines.values():
            _wait_idle(e)
        settle_memory()
        mem0 = memory()
        log(f"warm-up: {w} requests in {time.monotonic() - t0:.1f} s, RSS {mem0['rss'] / 2**20:.1f} MiB")

        t0 = time.monotonic()
        tally = asyncio.run(_round_async(engines, make_plans(n, seed, abort_frac, tight_frac, vocab),
                                         concurrency, watchdog))
        elapsed = time.monotonic() - t0

        def idle_and_memory():
            idle = {name: _wait_idle(e) for name, e in (("normal", normal), ("tight", tight))}
            settle_memory()
            return idle, memory()

        st, mem1 = idle_and_memory()

        def another_round():
            t = asyncio.run(_round_async(engines, make_plans(n, seed + 2, abort_frac, tight_frac, vocab),
                                         concurrency, watchdog))
            return (t, *idle_and_memory())

        second = _second_round(check_rss, mem0, mem1, another_round, log)
        if second:
            mem0, mem1, st = second["mem0"], second["mem1"], second["idle"]
    finally:
        normal.close()
        tight.close()
    res = _verdict("async", n, w, tally, wt, st, mem0, mem1, elapsed, time.monotonic() - t_start, log, check_rss)
    return _with_second_round(res, second)


def _second_round(check_rss, mem0, mem1, another_round, log) -> Optional[dict]:
    """When the measured round's RSS grew past the limit, one more round of the same size,
    to be judged instead: a leak grows again, a one-time step does not. Steps happen under
    CPU contention and while malloc's per-thread arenas settle. None when no second round
    was needed."""
    growth = (mem1["rss"] - mem0["rss"]) / mem0["rss"]
    if not check_rss or growth <= RSS_GROWTH_LIMIT:
        return None
    log(f"RSS grew {100 * growth:.1f}% in the first round: judging a second one")
    tally, idle, mem2 = another_round()
    return {"growth": growth, "tally": tally, "idle": idle, "mem0": mem1, "mem1": mem2}


def _with_second_round(res: dict, second: Optional[dict]) -> dict:
    if second:
        res["rss_growth_first_round_pct"] = round(100 * second["growth"], 2)
        t = second["tally"]
        if t.hung or t.errors:
            res["problems"].append(f"second round: {t.hung} hung, {len(t.errors)} errors, e.g. {t.errors[:3]}")
            res["ok"] = False
    return res


def _verdict(mode, n, w, tally, wt, st, mem0, mem1, elapsed, total, log, check_rss=True) -> dict:
    rss0, rss1 = mem0["rss"], mem1["rss"]
    growth = (rss1 - rss0) / rss0
    res = {
        "mode": mode, "requests": n, "warmup_requests": w, "finished": tally.finished, "aborted": tally.aborted,
        "cancelled": tally.cancelled, "hung": tally.hung, "errors": tally.errors[:20], "n_errors": len(tally.errors),
        "warmup_errors": wt.errors[:5] + (["hung"] * wt.hung),
        "tokens": tally.tokens, "seconds": round(elapsed, 2), "total_seconds": round(total, 2),
        "requests_per_s": round(n / elapsed, 1),
        "blocks_used_end": {k: v["blocks_used"] for k, v in st.items()},
        "running_end": {k: v["num_running"] + v["num_waiting"] for k, v in st.items()},
        "preemptions": {k: v["num_preemptions"] for k, v in st.items()},
        "engine_aborted": {k: v["requests_aborted"] for k, v in st.items()},
        "rss_after_warmup_mib": round(rss0 / 2**20, 2), "rss_after_run_mib": round(rss1 / 2**20, 2),
        "rss_growth_pct": round(100 * growth, 2),
        "huge_page_maps_mib": [round(mem0["huge_page_maps"] / 2**20, 2), round(mem1["huge_page_maps"] / 2**20, 2)],
    }
    problems = []
    if tally.total != n:
        problems.append(f"{n - tally.total} requests unaccounted for")
    if tally.hung:
        problems.append(f"{tally.hung} requests hung")
    if tally.errors or res["warmup_errors"]:
        problems.append(f"{len(tally.errors)} errors, e.g. {(tally.errors or res['warmup_errors'])[:3]}")
    for k, v in res["blocks_used_end"].items():
        if v != 0:
            problems.append(f"{k} engine holds {v} KV blocks at the end")
    for k, v in res["running_end"].items():
        if v != 0:
            problems.append(f"{k} engine has {v} requests left")
    if res["preemptions"]["tight"] <= 0:
        problems.append("the tight engine never preempted")
    if check_rss and growth > RSS_GROWTH_LIMIT:
        problems.append(f"RSS grew {100 * growth:.1f}% (> {100 * RSS_GROWTH_LIMIT:.0f}%) after the warm-up")
    if check_rss and mem1["huge_page_maps"] > mem0["huge_page_maps"]:
        problems.append(f"the engines' buffers grew from {mem0['huge_page_maps'] / 2**20:.1f} to "
                        f"{mem1['huge_page_maps'] / 2**20:.1f} MiB of mappings after the warm-up")
    res["problems"] = problems
    res["ok"] = not problems
    log(json.dumps(res, indent=1))
    return res


# ---------------------------------------------------------------------------- HTTP

class ServerProc(OwnServer):
    """`python -m conveyor.serve MODEL` on 127.0.0.1 with a free port."""

    def __init__(self, model: Path, *extra: str, python=sys.executable):
        super().__init__(str(model), extra, timeout=90.0, python=python, log_prefix="conveyor-soak-")

    def metrics(self) -> dict:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10.0, trust_env=False).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"(conveyor_[a-z_]+)\{[^}]*\} (\S+)$", line)
            if m and m.group(1) not in out:
                out[m.group(1)] = float(m.group(2))
        return out


async def _one_http(client, p: Plan, tally: Tally, watchdog: float):
    import httpx

    body = {"prompt": p.prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "n": p.n,
            "stream": p.stream}
    if p.seed is not None:
        body["seed"] = p.seed

    async def call():
        if p.stream:
            chunks, finish = 0, set()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return ("error", f"request {p.i}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    ev = json.loads(line[6:])
                    for c in ev.get("choices", []):
                        if c.get("finish_reason"):
                            finish.add(c["finish_reason"])
                    chunks += 1
                    if p.abort and chunks > p.abort_at_output:
                        return ("cancelled", None)  # leaving the block closes the connection
            if not finish:
                return ("error", f"request {p.i}: stream without a finish_reason")
            return ("finished", finish)
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return ("error", f"request {p.i}: HTTP {r.status_code}: {r.text[:200]}")
        ch = r.json()["choices"]
        for c in ch:
            if len(c.get("text") or "") and c["finish_reason"] not in ("stop", "length", "abort"):
                return ("error", f"request {p.i}: finish_reason {c['finish_reason']}")
        tally.tokens += int((r.json().get("usage") or {}).get("completion_tokens") or 0)
        return ("finished", {c["finish_reason"] for c in ch})

    task = asyncio.ensure_future(call())
    try:
        if p.abort and not p.stream:
            # a client that gives up mid-request: the connection is dropped
            await asyncio.wait([task], timeout=p.abort_after)
            if not task.done():
                task.cancel()
        status, detail = await asyncio.wait_for(asyncio.shield(task), watchdog)
    except asyncio.TimeoutError:
        task.cancel()
        tally.add("hung")
        return
    except asyncio.CancelledError:
        if task.cancelled():
            tally.add("cancelled")
            return
        raise
    except httpx.HTTPError as e:
        tally.add("error", f"request {p.i}: {type(e).__name__}: {e}")
        return
    if status == "finished":
        tally.add("aborted" if "abort" in detail else "finished")
    else:
        tally.add(status, detail)


async def _round_http(urls, plans, concurrency, watchdog) -> Tally:
    import httpx

    tally = Tally()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    clients = {k: httpx.AsyncClient(base_url=u, timeout=watchdog, trust_env=False, limits=limits)
               for k, u in urls.items()}
    try:
        await _workers(plans, concurrency, lambda p: _one_http(clients[p.tight], p, tally, watchdog))
    finally:
        for c in clients.values():
            await c.aclose()
    return tally


def _http_wait_idle(server: ServerProc, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m.get("conveyor_server_requests_in_flight", 1) == 0 and m.get("conveyor_kv_cache_blocks_used", 1) == 0
                and m.get("conveyor_num_requests_running", 1) == 0 and m.get("conveyor_num_requests_waiting", 1) == 0)
        if idle or time.monotonic() > deadline:
            return {"blocks_used": int(m.get("conveyor_kv_cache_blocks_used", -1)),
                    "num_running": int(m.get("conveyor_num_requests_running", -1)
                                       + m.get("conveyor_server_requests_in_flight", 0)),
                    "num_waiting": int(m.get("conveyor_num_requests_waiting", -1)),
                    "num_preemptions": int(m.get("conveyor_num_preemptions_total", 0)),
                    "requests_aborted": int(m.get("conveyor_requests_aborted_total", 0))}
        time.sleep(0.05)


def _servers_memory(servers) -> dict:
    ms = [memory(s.proc.pid) for s in servers]
    return {k: sum(m[k] for m in ms) for k in ms[0]}


def soak_http(model: Path, n: int, *, seed=0, abort_frac=0.3, tight_frac=0.3, concurrency=48,
              warmup: Optional[int] = None, watchdog=120.0, num_threads=None, log=print,
              check_rss=True) -> dict:
    from conveyor import LLM

    t_start = time.monotonic()
    with LLM(str(model), num_threads=1) as probe:  # the block size in bytes, and the vocabulary
        st = probe.stats()
        block_bytes = st["kv_cache_bytes"] // max(1, st["num_blocks"])
        vocab = probe.model_config["vocab_size"]
    extra = ["--num-threads", str(num_threads)] if num_threads else []
    servers = {}
    try:
        servers[False] = ServerProc(model, *extra)
        # no admission margin, as the in-process tight engine: the pool runs out and preempts
        servers[True] = ServerProc(model, "--kv-cache-memory", str(TIGHT_BLOCKS * block_bytes),
                                   "--max-model-len", str(TIGHT_MAX_MODEL_LEN), "--admission-reserve", "0", *extra)
        urls = {k: s.url for k, s in servers.items()}
        w = warmup if warmup is not None else max(50, n // 10)
        t0 = time.monotonic()
        wt = asyncio.run(_round_http(urls, make_plans(w, seed + 1, abort_frac, tight_frac, vocab),
                                     concurrency, watchdog))
        for s in servers.values():
            _http_wait_idle(s)
        mem0 = _servers_memory(servers.values())
        log(f"warm-up: {w} requests in {time.monotonic() - t0:.1f} s, servers' RSS {mem0['rss'] / 2**20:.1f} MiB")
        t0 = time.monotonic()
        tally = asyncio.run(_round_http(urls, make_plans(n, seed, abort_frac, tight_frac, vocab),
                                        concurrency, watchdog))
        elapsed = time.monotonic() - t0

        def idle_and_memory():
            idle = {"normal": _http_wait_idle(servers[False]), "tight": _http_wait_idle(servers[True])}
            return idle, _servers_memory(servers.values())

        st, mem1 = idle_and_memory()

        def another_round():
            t = asyncio.run(_round_http(urls, make_plans(n, seed + 2, abort_frac, tight_frac, vocab),
                                        concurrency, watchdog))
            return (t, *idle_and_memory())

        second = _second_round(check_rss, mem0, mem1, another_round, log)
        if second:
            mem0, mem1, st = second["mem0"], second["mem1"], second["idle"]
        disconnects = {("tight" if k else "normal"): s.metrics().get("conveyor_client_disconnects_total", 0)
                       for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    res = _verdict("http", n, w, tally, wt, st, mem0, mem1, elapsed, time.monotonic() - t_start, log, check_rss)
    res["server_disconnects_seen"] = disconnects
    return _with_second_round(res, second)


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("-n", "--requests", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests (default n/10, at least 50)")
    ap.add_argument("--abort-frac", type=float, default=0.3)
    ap.add_argument("--tight-frac", type=float, default=0.3, help="share of requests on the tight-KV engine")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--watchdog", type=float, default=120.0, help="seconds before a request counts as hung")
    ap.add_argument("--http", action="store_true", help="through `conveyor serve` subprocesses")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--no-rss-check", action="store_true", help="report RSS but do not judge it (e.g. under ASan)")
    a = ap.parse_args(argv)
    if not a.model.exists():
        print(f"soak: model not found: {a.model}", file=sys.stderr)
        return 2
    fn = soak_http if a.http else soak_async
    res = fn(a.model, a.requests, seed=a.seed, abort_frac=a.abort_frac, tight_frac=a.tight_frac,
             concurrency=a.concurrency, warmup=a.warmup, watchdog=a.watchdog, num_threads=a.num_threads,
             check_rss=not a.no_rss_check)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    print("soak:", "OK" if res["ok"] else "FAILED: " + "; ".join(res["problems"]))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
