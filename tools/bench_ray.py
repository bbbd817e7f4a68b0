"""Ray's overhead on one machine: Ray Data over N prompts with
1 actor x T threads and T actors x 1 thread against LLM.generate alone, then Ray Serve
with 1 and 2 replicas against `conveyor serve` without Ray under `conveyor bench serve`.
Every run gets the same greedy requests (ignore_eos, fixed length), so output tokens
are equal and the ratios are throughput ratios. Take figures on a quiet machine.

    PYTHONPATH=python python tools/bench_ray.py MODEL [--prompts 1000] [--max-tokens 64] [--threads 2]
        [--serve-prompts 200] [--no-serve]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from conveyor import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_runs(model: str, prompts: list, max_tokens: int, threads: int) -> list:
    import ray

    from conveyor.ray.data import build_processor

    sp = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    rows = []
    with LLM(model, num_threads=threads) as llm:
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)
        dt = time.perf_counter() - t
    rows.append(("LLM.generate alone", 1, threads, dt, sum(len(o.outputs[0].token_ids) for o in outs)))
    ray.init(num_cpus=threads, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)]).materialize()
        for actors, cpus in ((1, threads), (threads, 1)):
            proc = build_processor(model, sampling_params=sp, batch_size=32, concurrency=actors, num_cpus=cpus)
            t = time.perf_counter()
            got = proc(ds).take_all()
            dt = time.perf_counter() - t
            assert len(got) == len(prompts)
            rows.append((f"Ray Data {actors} x {cpus}", actors, cpus, dt,
                         sum(r["num_generated_tokens"] for r in got)))
    finally:
        ray.shutdown()
    return rows


def serve_run(label: str, cmd: list, n: int, out_json: str) -> dict:
    """Starts a server (cmd), waits for /health, runs `conveyor bench serve` at rate inf
    against it, stops it; returns the bench's JSON."""
    import httpx

    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"{label}: server exited:\n{open(log.name).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: not ready after 300 s")
            time.sleep(1)
        r = subprocess.run([sys.executable, "-m", "conveyor", "bench", "serve", "--url", url, "--num-prompts", str(n),
                            "--rates", "inf", "--json", out_json], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"{label}: bench failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return json.load(open(out_json))
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-prompts", type=int, default=200)
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--json", default="bench_ray.json")
    a = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}; model {a.model}; {a.threads} CPUs", flush=True)
    prompts = [f"Once upon a time {i}" for i in range(a.prompts)]
    result = {"data": [], "serve": []}
    rows = data_runs(a.model, prompts, a.max_tokens, a.threads)
    base = rows[0][4] / rows[0][3]
    print(f"\nRay Data, {a.prompts} prompts x {a.max_tokens} tokens")
    print(f"{'run':<22} {'time s':>8} {'out tok/s':>10} {'vs alone':>9}")
    for name, actors, cpus, dt, toks in rows:
        print(f"{name:<22} {dt:8.2f} {toks / dt:10.0f} {toks / dt / base:9.2f}")
        result["data"].append(dict(run=name, actors=actors, cpus=cpus, seconds=dt, output_tokens=toks))
    if not a.no_serve:
        py = [sys.executable, "-m", "conveyor", "serve", a.model]
        runs = [("conveyor serve (no Ray)", py + ["--num-threads", str(a.threads)]),
                ("Ray Serve 1 replica", py + ["--ray", "--replicas", "1", "--cpus-per-replica", str(a.threads)]),
                ("Ray Serve 2 replicas", py + ["--ray", "--replicas", "2",
                                               "--cpus-per-replica", str(max(a.threads // 2, 1))])]
        print(f"\nServe, {a.serve_prompts} requests at once (conveyor bench serve --rates inf)")
        print(f"{'server':<26} {'out tok/s':>10} {'TTFT p50/p99 ms':>17} {'E2E p50/p99 ms':>17}")
        for label, cmd in runs:
            r = serve_run(label, cmd + ["--port", str(free_port())], a.serve_prompts, "/tmp/bench_ray_serve.json")
            run = r["runs"][0] if "runs" in r else r
            tps = run.get("output_throughput") or run.get("output_tok_s")
            ttft, e2e = run["ttft_s"], run["e2e_s"]
            print(f"{label:<26} {tps:10.0f} {ttft['p50'] * 1e3:8.0f}/{ttft['p99'] * 1e3:<8.0f} "
                  f"{e2e['p50'] * 1e3:8.0f}/{e2e['p99'] * 1e3:<8.0f}", flush=True)
            result["serve"].append(dict(server=label, **{k: run[k] for k in ("ttft_s", "e2e_s")}, output_tok_s=tps))
    json.dump(result, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
