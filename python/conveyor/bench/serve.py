"""`conveyor bench serve`: the HTTP server under Poisson load (Workload L), against AsyncLLM
in process on the same requests.

    conveyor bench serve --model MODEL [--num-prompts 100] [--prompt-len 128] [--output-mean 64]
                         [--rates auto | 2,8,inf] [--client-procs 1] [--no-inprocess]
                         [--json FILE] [--plot FILE.png]
    conveyor bench serve --url http://127.0.0.1:8000 ...

N requests with prompt lengths uniform in [P/2, 3P/2] (random token ids) and output lengths
from an exponential of mean M, redrawn above the cap 12M (EOS ignored, max_tokens forcing the
length), sent with Poisson arrivals to /v1/completions as streams. With --model the benchmark
starts its own server on a free loopback port (engine knobs after --server-args) and stops it
at the end; with --url it uses a running one.

The load generator runs in its own process(es) (--client-procs, a light raw-socket client:
conveyor.bench.serve_load). With --model each rate also runs the same requests, at the same
arrival times, through AsyncLLM in a separate process with the same engine knobs, and both
paths report throughput and TTFT / TPOT / ITL / E2E percentiles. CPU time: the server's and
the in-process runner's, split by thread into the engine (the C core's named threads) and the
frontend (everything else); the HTTP overhead is the server's frontend CPU per streamed output
token minus AsyncLLM's.

Rates: "auto" (default) first sends every request at once (rate inf), takes the request
throughput X it reached as the capacity, then runs a light rate 0.25 X and a near-saturation
rate 0.9 X; "0.9x,4x" names multiples of X, "2,inf" absolute rates. Each run uses the same
requests (same seed) and the same server. Requests refused with 503 (overload control,
`--server-args "--max-queued-requests 16"`) are counted apart from failures.

Mixed steps: the in-process runner also takes the engine's step trace and reports step
times (p50 / p99) of decode-only steps and of steps that carry prompt tokens, and the most
prompt tokens in a step that also decoded (bounded by max_prefill_tokens_while_decoding).

Per request: TTFT (send to first streamed token), E2E (send to last token), TPOT
((E2E - TTFT) / (output tokens - 1), for outputs longer than one token) and ITL (gaps
between successive streamed chunks, pooled; the server may coalesce tokens that arrive
together into one chunk, so ITL here is per chunk). Percentiles use numpy's linear
interpolation. Prints a table, writes JSON, and draws the E2E CDF per rate with --plot.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..cli_args import count

PCTS = (50, 90, 99)


# ---------------------------------------------------------------------------- the workload


def make_workload(n: int, prompt_len: int, output_mean: float, vocab_lo: int, vocab_hi: int,
                  max_model_len: int, seed: int, run: int = 0) -> list[dict]:
    """Requests as {"prompt": [ids], "max_tokens": k}, identical for a given seed and run.
    Lengths depend on the seed only; the token ids also on `run`, so that a later run
    does not find the earlier run's prompts in the prefix cache."""
    rng = np.random.default_rng(seed)
    id_rng = np.random.default_rng([seed, run])
    cap = 12 * output_mean
    lo = max(1, prompt_len // 2)
    hi = max(lo, (3 * prompt_len) // 2)
    reqs = []
    for _ in range(n):
        plen = int(rng.integers(lo, hi + 1))
        plen = min(plen, max_model_len - 2)
        while True:
            out = rng.exponential(output_mean)
            if out <= cap:
                break
        out = max(1, int(round(out)))
        out = min(out, max_model_len - plen)
        ids = id_rng.integers(vocab_lo, vocab_hi, size=plen).tolist()
        reqs.append({"prompt": ids, "max_tokens": out})
    return reqs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) from the start: Poisson arrivals at `rate` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def summarize(values) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PCTS}}
    return {"n": int(a.size), "mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}}


# ---------------------------------------------------------------------------- the clients


def _child(mode: str, job: dict):
    """Starts `python -m conveyor.bench.serve_load MODE` with the job on stdin."""
    from ..testing import subprocess_env

    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.bench.serve_load", mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    return proc


def _collect(proc, what: str) -> dict:
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"conveyor bench serve: the {what} process failed (status {proc.returncode})")
    return json.loads(out)


def summarize_records(recs: list, wall: float, rate: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r["prompt_tokens"] for r in ok)
    return {
        "rate": rate,
        "duration_s": wall,
        "completed": len(ok),
        "rejected": sum(1 for r in recs if r.get("status") == 503),  # overload control, not failures
        "failed": sum(1 for r in recs if not r["ok"] and r.get("status") != 503),
        "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
        "request_throughput": len(ok) / wall,
        "output_throughput": out_tok / wall,
        "total_throughput": (out_tok + in_tok) / wall,
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "ttft_s": summarize(r["ttft"] for r in ok),
        "tpot_s": summarize(r["tpot"] for r in ok),
        "itl_s": summarize(x for r in ok for x in r["itl"]),
        "e2e_s": summarize(r["e2e"] for r in ok),
        "e2e_samples": sorted(r["e2e"] for r in ok),
        # how long a refused request waited for its 503
        "refusal_s": summarize(r["answered"] for r in recs if r.get("status") == 503 and r.get("answered") is not None),
    }


class RssSampler:
    """Samples a process's resident memory every `every` seconds on a thread while a run
    lasts, to show whether memory stays flat under load."""

    def __init__(self, pid: int, every: float = 0.25):
        import threading

        from .serve_load import rss_bytes

        self._read = lambda: rss_bytes(pid)
        self.samples: list = []
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            v = self._read()
            if v is not None:
                self.samples.append(v)
            if self._stop.wait(self._every):
                return

    def stop(self) -> Optional[dict]:
        """Stops sampling; start, max and end in MiB, and the growth from the first to
        the last quarter of the run (mean of each)."""
        self._stop.set()
        self._thread.join()
        s = self.samples
        if len(s) < 4:
            return None
        q = max(1, len(s) // 4)
        mib = 1 << 20
        return {"start_mib": s[0] / mib, "max_mib": max(s) / mib, "end_mib": s[-1] / mib,
                "first_quarter_mib": sum(s[:q]) / q / mib, "last_quarter_mib": sum(s[-q:]) / q / mib,
                "samples": len(s)}


def cpu_per_token(cpu: Optional[dict], tokens: int) -> Optional[dict]:
    """CPU microseconds per output token, by part."""
    if cpu is None or tokens <= 0:
        return None
    return {k: v * 1e6 / tokens for k, v in cpu.items()}


def run_load(base_url: str, model: str, reqs: list[dict], rate: float, seed: int, api_key: Optional[str],
             client_procs: int = 1, server_pid: Optional[int] = None) -> dict:
    """Sends reqs to the server from client_procs processes; the server's CPU time is
    sampled around the run when its pid is known (a server of our own)."""
    from .serve_load import cpu_delta, cpu_seconds

    delays = arrival_times(len(reqs), rate, seed)
    k = max(1, min(client_procs, len(reqs)))
    # the children start in well under a second; they all aim at the same t0
    t0 = time.perf_counter() + 1.0 + 0.25 * k
    before = cpu_seconds(server_pid) if server_pid else None
    rss = RssSampler(server_pid) if server_pid else None
    procs = [_child("http", {"url": base_url, "model": model, "api_key": api_key, "t0": t0,
                             "requests": reqs[i::k], "delays": delays[i::k]}) for i in range(k)]
    recs = []
    for p in procs:
        recs += _collect(p, "load generator")["records"]
    wall = max((r["start"] + (r["e2e"] or 0.0)) for r in recs) if recs else 0.0
    wall = max(wall, 1e-9)
    cpu = cpu_delta(before, cpu_seconds(server_pid)) if server_pid else None
    res = summarize_records(recs, wall, rate)
    res["server_rss"] = rss.stop() if rss else None
    res["cpu_s"] = cpu
    res["cpu_us_per_token"] = cpu_per_token(cpu, res["output_tokens"])
    res["client_procs"] = k
    return res


def run_inprocess(model: str, engine: dict, reqs: list[dict], rate: float, seed: int) -> dict:
    """The same requests at the same arrival times through AsyncLLM, in a process of its own."""
    delays = arrival_times(len(reqs), rate, seed)
    got = _collect(_child("inprocess", {"model": model, "engine": engine, "requests": reqs, "delays": delays}),
                   "in-process runner")
    res = summarize_records(got["records"], got["wall"], rate)
    res["steps"] = got["steps"]
    res["cpu_s"] = got["cpu"]
    res["cpu_us_per_token"] = cpu_per_token(got["cpu"], res["output_tokens"])
    return res


def engine_knobs(model: str, server_args: Sequence[str]) -> dict:
    """The AsyncLLM keyword arguments a `conveyor serve MODEL *server_args` would use."""
    from .. import serve

    return serve.engine_kwargs(serve.make_parser().parse_args([model, *server_args]))


# ---------------------------------------------------------------------------- a server of our own


class OwnServer:
    """`python -m conveyor.serve MODEL --port 0` on loopback, running the same conveyor
    package this process imported (proxies off); stopped by stop(). Used by this
    benchmark, the server tests and the soak."""

    def __init__(self, model: str, extra: Sequence[str] = (), timeout: float = 300.0,
                 python: str = sys.executable, log_prefix: str = "conveyor-serve-"):
        from ..testing import subprocess_env

        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
        env = subprocess_env()
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            env.pop(k, None)
        cmd = [python, "-m", "conveyor.serve", str(model), "--host", "127.0.0.1", "--port", "0",
               "--log-level", "warning", "--no-access-log", *extra]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self.url = self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def read_log(self) -> str:
        return self._text()

    def _text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def _wait(self, timeout: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self._text()}")
            if url is None:
                m = re.search(r"at (http://\S+?)/v1", self._text())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{self._text()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


# ---------------------------------------------------------------------------- output


def machine() -> dict:
    info = {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            info["cpu"] = m.group(1).strip()
    except OSError:
        pass
    try:
        from .. import _core

        info["simd"] = getattr(_core, "simd", None)
    except ImportError:
        pass
    return info


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:9.1f}"


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(runs: list[dict]) -> str:
    lines = []
    head = f"{'path':>10} {'metric':>6} " + " ".join(f"{h:>9}" for h in ("p50 ms", "p90 ms", "p99 ms", "mean ms"))
    for run in runs:
        rate = "inf" if math.isinf(run["rate"]) else f"{run['rate']:.2f}"
        paths = [("http", run)] + ([("in-process", run["inprocess"])] if run.get("inprocess") else [])
        lines.append(f"rate {rate} req/s")
        for name, r in paths:
            lines.append(f"  {name}: {r['completed']} done, {r['rejected']} refused (503), {r['failed']} failed "
                         f"in {r['duration_s']:.2f} s; "
                         f"{r['request_throughput']:.2f} req/s, output {r['output_throughput']:.1f} tok/s, "
                         f"total {r['total_throughput']:.1f} tok/s")
        lines.append(head)
        for name, r in paths:
            for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
                st = r[key]
                lines.append(f"{name:>10} {label:>6} " + " ".join(_ms(st[k]) for k in ("p50", "p90", "p99", "mean")))
        for name, r in paths:
            c = r.get("cpu_us_per_token")
            if c:
                lines.append(f"  CPU per output token, {name}: frontend {_us(c['frontend'])} us, engine "
                             f"{_us(c['engine'])} us, total {_us(c['total'])} us")
        st = run.get("inprocess", {}).get("steps")
        if st:
            lines.append(f"  in-process step times: decode-only p50 {_ms(st['decode_only']['p50']).strip()} "
                         f"p99 {_ms(st['decode_only']['p99']).strip()} ms ({st['decode_only']['n']} steps); "
                         f"with prompt tokens p50 {_ms(st['with_prompts']['p50']).strip()} "
                         f"p99 {_ms(st['with_prompts']['p99']).strip()} ms ({st['with_prompts']['n']}); "
                         f"most prompt tokens in a decoding step {st['max_prompt_tokens_while_decoding']}")
        mx = st.get("mixed") if st else None
        if mx:
            lines.append(f"  prompts vs decode-only steps at the same batch size (t(B) = {mx['fit_ms'][0]:.2f} + "
                         f"{mx['fit_ms'][1]:.3f}*B ms): stream TPOT p99 {_ms(mx['tpot_steps_p99']).strip()} vs "
                         f"{_ms(mx['tpot_decode_only_same_batch_p99']).strip()} ms = {mx['tpot_p99_ratio']:.2f}x "
                         f"(mean {mx['tpot_mean_ratio']:.2f}x); prompt share of decoding steps "
                         f"{mx['prompt_share']:.2f} -> {mx['mean_ratio_if_spread']:.2f}x if spread evenly")
        for name, r in paths:
            if r["rejected"] and r["refusal_s"]["n"]:
                f = r["refusal_s"]
                lines.append(f"  503 answered after ({name}): p50 {_ms(f['p50']).strip()} p99 {_ms(f['p99']).strip()} ms")
        m = run.get("server_rss")
        if m:
            lines.append(f"  server memory (RSS): start {m['start_mib']:.0f} MiB, max {m['max_mib']:.0f}, end "
                         f"{m['end_mib']:.0f}; first quarter {m['first_quarter_mib']:.0f}, last quarter "
                         f"{m['last_quarter_mib']:.0f}")
        if run.get("http_overhead_us_per_token") is not None:
            lines.append(f"  HTTP overhead: {_us(run['http_overhead_us_per_token'])} us of CPU per streamed "
                         f"output token (server frontend - AsyncLLM frontend)")
        for name, r in paths:
            if r["errors"]:
                lines.append(f"  errors ({name}): {r['errors']}")
        lines.append("")
    return "\n".join(lines)


def model_card(base: str, api_key) -> dict:
    """The first /v1/models entry of the server at `base`; a server that cannot be reached
    or does not answer as an OpenAI server is a one-line RuntimeError naming the URL."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=30.0, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {base} ({type(e).__name__}: {e or 'no answer'}); "
                           "is the server running?") from None
    if r.status_code != 200:
        raise RuntimeError(f"{base}/v1/models answered HTTP {r.status_code}"
                           + (" (wrong or missing --api-key?)" if r.status_code == 401 else ""))
    try:
        return r.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"{base}/v1/models did not answer with an OpenAI model list; is it an "
                           "OpenAI-compatible server?") from None


def plot_cdf(runs: list[dict], path: str, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        xs = np.asarray(run["e2e_samples"])
        if xs.size == 0:
            continue
        ys = np.arange(1, xs.size + 1) / xs.size
        label = "burst (inf)" if math.isinf(run["rate"]) else f"{run['rate']:.2f} req/s"
        ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- main


def _parse_rates(text: str):
    """'auto' (= 0.25x,0.9x after the burst), or requests/s, 'inf', and multiples of the
    saturation a burst measures first ('0.9x', '4x')."""
    if text.strip().lower() == "auto":
        return "auto"
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            if part.endswith("x"):
                v = float(part[:-1])
                rates.append(("x", v))
            else:
                v = math.inf if part in ("inf", "infinity") else float(part)
                rates.append(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read the rate {part!r} (examples: 2.5, inf, 0.9x)") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0, got {part}")
    return rates


def main(argv=None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench serve", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--model", help="start a server for this model on a free loopback port")
    ap.add_argument("--server-args", default="", help="extra `conveyor serve` arguments (one string)")
    ap.add_argument("--served-model-name", default=None, help="model name to send (default: ask /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                    help="the server's API key (default: $CONVEYOR_API_KEY, else none)")
    ap.add_argument("--num-prompts", type=count, default=100, help="requests per run")
    ap.add_argument("--prompt-len", type=count, default=128, help="P: prompt lengths uniform in [P/2, 3P/2]")
    ap.add_argument("--output-mean", type=float, default=64, help="M: mean output length (cap 12M)")
    ap.add_argument("--rates", type=_parse_rates, default="auto",
                    help="'auto', or comma-separated requests/s ('inf' = all at once) and multiples of the "
                         "measured saturation ('0.9x', '4x')")
    ap.add_argument("--saturation", type=float, default=None,
                    help="requests/s the multiples ('4x') refer to (default: measured with a burst first)")
    ap.add_argument("--duration", type=float, default=None,
                    help="for runs at a finite rate: send rate x this many seconds of requests "
                         "(default: --num-prompts requests)")
    ap.add_argument("--client-procs", type=count, default=1, help="load-generator processes")
    ap.add_argument("--no-inprocess", action="store_true",
                    help="skip the AsyncLLM in-process comparison (with --model)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file (default: none)")
    ap.add_argument("--plot", default=None, help="draw the E2E latency CDF into this PNG file (needs matplotlib; default: none)")
    args = ap.parse_args(argv)
    if args.plot:
        from ..extras import require

        require("matplotlib", f"{ap.prog} --plot")  # before the run, not after it
    if args.num_prompts < 1 or args.prompt_len < 1 or args.output_mean <= 0 or args.client_procs < 1:
        ap.error("--num-prompts, --prompt-len, --output-mean and --client-procs must be positive")
    for name in ("saturation", "duration"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and math.isfinite(v)):
            ap.error(f"--{name} must be a positive number of {'requests/s' if name == 'saturation' else 'seconds'}")
    from ..extras import require

    require("httpx", "conveyor bench serve")

    import shlex

    server_args = shlex.split(args.server_args)
    own = None
    runs: list[dict] = []
    try:
        if args.model:
            own = OwnServer(args.model, server_args)
            base = own.url
        else:
            base = args.url.rstrip("/")
            if base.endswith("/v1"):
                base = base[:-3]
        card = model_card(base, args.api_key)
        model = args.served_model_name or card["id"]
        max_model_len = int(card.get("max_model_len") or 2048)
        vocab = int(card.get("vocab_size") or 259)
        # Skip the first ids (specials in llama2.c and most HF vocabularies).
        vocab_lo = min(3, vocab - 1)
        inprocess = own is not None and not args.no_inprocess
        knobs = engine_knobs(args.model, server_args) if inprocess else None

        def one_run(rate):
            n = args.num_prompts
            if args.duration is not None and math.isfinite(rate):
                n = max(1, math.ceil(rate * args.duration))
            reqs = make_workload(n, args.prompt_len, args.output_mean, vocab_lo, vocab,
                                 max_model_len, args.seed, run=len(runs))
            label = "inf" if math.isinf(rate) else f"{rate:.2f}"
            print(f"conveyor bench serve: {len(reqs)} requests at rate {label} req/s ...", file=sys.stderr,
                  flush=True)
            res = run_load(base, model, reqs, rate, args.seed, args.api_key, args.client_procs,
                           own.proc.pid if own else None)
            if inprocess:
                print("conveyor bench serve: ... and through AsyncLLM in process", file=sys.stderr, flush=True)
                res["inprocess"] = run_inprocess(args.model, knobs, reqs, rate, args.seed)
                a, b = res["cpu_us_per_token"], res["inprocess"]["cpu_us_per_token"]
                if a and b:
                    res["http_overhead_us_per_token"] = a["frontend"] - b["frontend"]
            return res

        rates = [("x", 0.25), ("x", 0.9)] if args.rates == "auto" else args.rates
        saturation = args.saturation
        if saturation is None and any(isinstance(r, tuple) for r in rates):
            burst = one_run(math.inf)  # the saturation the multiples refer to
            runs.append(burst)
            saturation = burst["request_throughput"]
        for r in rates:
            if isinstance(r, tuple):
                if not saturation:
                    continue
                res = one_run(r[1] * saturation)
                res["saturation_multiple"] = r[1]
                runs.append(res)
            else:
                runs.append(one_run(r))
    finally:
        if own is not None:
            own.stop()

    config = {
        "workload": "L", "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "prompt_len_range": [max(1, args.prompt_len // 2), (3 * args.prompt_len) // 2],
        "output_mean": args.output_mean, "output_cap": 12 * args.output_mean, "seed": args.seed,
        "duration_s": args.duration, "saturation_given": args.saturation is not None,
        "rates": "auto" if args.rates == "auto" else [f"{r[1]:g}x" if isinstance(r, tuple) else r
                                                        for r in args.rates],
        "saturation_req_s": saturation, "client_procs": args.client_procs,
        "model": args.model or model, "served_model_name": model, "server": "own" if own else base,
        "server_args": args.server_args if own else None, "engine": knobs, "max_model_len": max_model_len,
        "temperature": 0, "ignore_eos": True,
    }
    m = machine()
    print(f"model {model}; {args.num_prompts} requests, prompts {config['prompt_len_range']} tokens, output "
          f"mean {args.output_mean:g} cap {12 * args.output_mean:g}; machine: {m.get('cpu', m['machine'])}, "
          f"{m['cores']} cores, SIMD {m.get('simd')}; server args: {args.server_args or '(defaults)'}")
    print(format_table(runs))

    def clean(r):
        return {k: (None if isinstance(v, float) and math.isinf(v) and k == "rate" else v)
                for k, v in r.items()} | {"rate_label": "inf" if math.isinf(r["rate"]) else r["rate"]}

    out = {"config": config, "machine": m,
           "runs": [clean(r) | ({"inprocess": clean(r["inprocess"])} if r.get("inprocess") else {})
                    for r in runs]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        title = f"E2E latency CDF, {Path(str(model)).name}, {args.num_prompts} req, P={args.prompt_len}, " \
                f"M={args.output_mean:g}"
        if plot_cdf(runs, args.plot, title):
            print(f"wrote {args.plot}")
    failed = any(r["failed"] for r in runs) or any(r["inprocess"]["failed"] for r in runs if r.get("inprocess"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
