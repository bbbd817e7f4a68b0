"""`conveyor bench latency`: Workload L, latency under Poisson load, in process on AsyncLLM.

100 requests (default), prompt lengths uniform in [P/2, 3P/2], output lengths from an
exponential of mean M with draws above 12M rejected (min 1), EOS ignored, arriving as
a Poisson process at two rates: a light one and one near saturation. Saturation is
measured first by a short offline run of continuous batching on requests of the same
distribution (all at once); the rates are fractions of it (default 0.3 and 0.9), or
given with --rates. Each rate runs on static batching (--static-batch-size) and on
continuous batching (default knobs), each on a fresh AsyncLLM, with the same requests
and arrival times. TTFT, TPOT and E2E come from the engine's per-request metrics
(arrival = when the request was added). Prints p50/p90/p99/mean, writes JSON and a PNG
of the E2E latency CDFs.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import common
from ..cli_args import count, positive_numbers

DEFAULT_FRACTIONS = (0.3, 0.9)


def output_cap(cfg: dict, prompt_len: int, mean_output: int, cap_factor: int = 12) -> int:
    """The longest output: cap_factor x the mean, or what the context leaves after the
    longest prompt when that is less (a small model's context)."""
    room = int(cfg.get("max_pos") or 1 << 30) - (3 * prompt_len) // 2
    if room < 1:
        raise ValueError(f"--prompt-len {prompt_len}: prompts of up to {(3 * prompt_len) // 2} tokens leave no "
                         f"room in the model's context of {cfg.get('max_pos')} tokens")
    return min(cap_factor * mean_output, room)


def make_workload(model: str, *, num_requests: int, prompt_len: int, mean_output: int,
                  cap_factor: int = 12, seed: int = 0) -> common.Workload:
    cfg = common.checkpoint_config(model)
    rng = np.random.default_rng([seed, 4])
    lens = common.uniform_lengths(rng, num_requests, max(1, prompt_len // 2), (3 * prompt_len) // 2)
    return common.make_workload(n=num_requests, vocab_size=cfg["vocab_size"], prompt_lens=lens,
                                mean_output=mean_output, cap=output_cap(cfg, prompt_len, mean_output, cap_factor),
                                seed=seed)


def calibrate(model: str, *, num_requests: int, prompt_len: int, mean_output: int, seed: int,
              max_num_batched_tokens: Optional[int] = None, **engine) -> Dict[str, Any]:
    """Saturation throughput: continuous batching, requests of the same distribution
    (another seed) all at once."""
    wl = make_workload(model, num_requests=num_requests, prompt_len=prompt_len,
                       mean_output=mean_output, seed=seed + 1000)
    llm = common.make_llm(model, max_num_batched_tokens=max_num_batched_tokens, workload=wl, **engine)
    try:
        res = common.run_offline(llm, wl, sample_stats=False)
    finally:
        llm.close()
    return {"num_requests": num_requests, "seed": seed + 1000, **res["throughput"]}


async def run_policy(model: str, wl: common.Workload, arrivals: Sequence[float], *, scheduling: str,
                     max_num_seqs: int, max_num_batched_tokens: Optional[int] = None,
                     **engine) -> Dict[str, Any]:
    """Sends the workload's requests at the given offsets (seconds) to a fresh AsyncLLM."""
    eng = common.make_llm(model, scheduling=scheduling, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, workload=wl,
                          asynchronous=True, **engine)
    params = [p.clone(output_kind="final_only") for p in wl.params()]
    loop = asyncio.get_running_loop()
    lags: List[float] = []
    try:
        t0 = loop.time()

        async def one(i):
            delay = t0 + arrivals[i] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(loop.time() - (t0 + arrivals[i]))
            final = None
            async for out in eng.generate(wl.prompts[i], params[i], request_id=f"r{i}"):
                final = out
            return final

        w0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(len(wl))))
        wall = time.perf_counter() - w0
        st = eng.stats()
    finally:
        eng.close()
    lat = common.request_latencies(outs)
    n_out = sum(lat["output_tokens"])
    return {
        "scheduling": scheduling, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": st["max_num_batched_tokens"],
        "throughput": common.throughputs(len(outs), wl.prompt_tokens, n_out, wall),
        "ttft": common.percentiles(lat["ttft"]), "tpot": common.percentiles(lat["tpot"]),
        "e2e": common.percentiles(lat["e2e"]),
        "e2e_values": sorted(float(x) for x in lat["e2e"]),
        "ttft_values": sorted(float(x) for x in lat["ttft"]),
        "preemptions": st["num_preemptions"], "steps": st["steps"],
        "arrival_lag_max_s": max(lags) if lags else 0.0,
        "all_finished": all(o is not None and o.finished for o in outs),
        **({"speculative": spec_stats_of(st)} if engine.get("speculative_config") else {}),
    }


def spec_stats_of(st: Dict[str, Any]) -> Dict[str, Any]:
    """A fresh engine's speculative figures (proposed, accepted, rates by position)."""
    return {k: st[k] for k in ("spec_proposed", "spec_accepted", "spec_steps_disabled", "spec_proposed_at",
                               "spec_accepted_at", "spec_acceptance_rate_at", "spec_acceptance_rate")}


async def run_study_async(model: str, *, num_requests: int = 100, prompt_len: int = 128,
                          mean_output: int = 64, rates: Optional[Sequence[float]] = None,
                          fractions: Sequence[float] = DEFAULT_FRACTIONS, calib_requests: int = 32,
                          static_batch_size: int = 16, max_num_seqs: int = 256,
                          max_num_batched_tokens: Optional[int] = None, seed: int = 0,
                          progress: Optional[Callable[[str], None]] = None, **engine) -> Dict[str, Any]:
    """Workload L (await it in a notebook; run_study wraps it in asyncio.run)."""
    say = progress or (lambda s: None)
    machine = common.machine_info()
    cfg = common.checkpoint_config(model)
    t_start = time.perf_counter()
    common.warm_up(model, **engine)
    calib = None
    if not rates:
        calib = calibrate(model, num_requests=calib_requests, prompt_len=prompt_len,
                          mean_output=mean_output, seed=seed,
                          max_num_batched_tokens=max_num_batched_tokens, **engine)
        rates = [f * calib["requests_per_s"] for f in fractions]
        say(f"saturation (continuous, {calib_requests} requests at once): "
            f"{calib['requests_per_s']:.3f} requests/s -> rates " + ", ".join(f"{x:.3f}" for x in rates))
    wl = make_workload(model, num_requests=num_requests, prompt_len=prompt_len,
                       mean_output=mean_output, seed=seed)
    runs = []
    for k, rate in enumerate(rates):
        arrivals = common.poisson_arrivals(np.random.default_rng([seed, 5, k]), len(wl), rate)
        for sched, seqs in (("static", static_batch_size), ("continuous", max_num_seqs)):
            t = time.perf_counter()
            r = await run_policy(model, wl, arrivals, scheduling=sched, max_num_seqs=seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, **engine)
            r.update(rate=rate, rate_fraction=(fractions[k] if calib else None),
                     arrival_span_s=arrivals[-1])
            say(f"rate {rate:.3f}/s {sched:<10}: e2e p50 {r['e2e']['p50']:.2f} s, p99 {r['e2e']['p99']:.2f} s, "
                f"ttft p50 {r['ttft']['p50']:.2f} s, {r['throughput']['output_tokens_per_s']:.1f} out tok/s "
                f"({time.perf_counter() - t:.0f} s)")
            runs.append(r)
    return {
        "benchmark": "latency",
        "machine": machine,
        "model": {**{k: cfg.get(k) for k in ("arch", "dim", "n_layers", "vocab_size", "dtype")},
                  "path": str(model), "name": str(model).rstrip("/").split("/")[-1]},
        "knobs": {"num_requests": num_requests, "prompt_len": prompt_len,
                  "prompt_len_range": [max(1, prompt_len // 2), (3 * prompt_len) // 2],
                  "mean_output": mean_output, "cap": output_cap(cfg, prompt_len, mean_output), "seed": seed,
                  "static_batch_size": static_batch_size, "continuous_max_num_seqs": max_num_seqs,
                  "max_num_batched_tokens": runs[0]["max_num_batched_tokens"] if runs else None,
                  "rate_fractions": list(fractions) if calib else None, "ignore_eos": True, **engine},
        "calibration": calib,
        "rates": list(rates),
        "workload": wl.describe(),
        "runs": runs,
        "elapsed_s": time.perf_counter() - t_start,
    }


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_study(model: str, **kw) -> Dict[str, Any]:
    # asyncio.run's own Ctrl-C handler only cancels the task, which cannot happen while the
    # blocking warm-up and calibration run (minutes on a real model); an interrupt raised
    # where the main thread is stops them as it stops any blocking call
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return asyncio.run(run_study_async(model, **kw))
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return asyncio.run(run_study_async(model, **kw))
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ms_decimals(seconds: float) -> int:
    """Decimals that keep about three significant digits of a time shown in ms (at most 3)."""
    ms = abs(seconds) * 1000
    return 0 if ms >= 100 else 1 if ms >= 10 else 2 if ms >= 1 else 3


def format_table(r: Dict[str, Any]) -> str:
    hdr = (f"{'rate/s':>7} {'policy':<10} | {'TTFT p50':>8} {'p90':>7} {'p99':>7} {'mean':>7} | "
           f"{'TPOT p50':>8} {'p90':>7} {'p99':>7} {'mean':>7} | {'E2E p50':>8} {'p90':>7} {'p99':>7} "
           f"{'mean':>7} | {'out tok/s':>9}")
    lines = [hdr, "-" * len(hdr)]
    for run in r["runs"]:
        def cells(m):  # milliseconds: seconds with 3 decimals round a tiny model's TPOT to 0.000
            return " ".join(f"{1000 * run[m][q]:>{8 if q == 'p50' else 7}.{_ms_decimals(run[m][q])}f}"
                            for q in ("p50", "p90", "p99", "mean"))
        lines.append(f"{run['rate']:>7.3f} {run['scheduling']:<10} | {cells('ttft')} | {cells('tpot')} | "
                     f"{cells('e2e')} | {run['throughput']['output_tokens_per_s']:>9.1f}")
    lines.append("(milliseconds; TPOT per output token after the first)")
    from ..speculative import format_spec

    for run in r["runs"]:
        if run.get("speculative"):
            lines.append(f"{run['rate']:>7.3f} {run['scheduling']:<10} {format_spec(run['speculative'])}")
    return "\n".join(lines)


def plot(r: Dict[str, Any], fig=None):
    """E2E latency CDF (solid) and TTFT CDF (dashed) per policy, one panel per rate."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rates = r["rates"]
    fig = fig or common.new_figure(4.6 * len(rates), 3.4)
    axes = fig.subplots(1, len(rates), squeeze=False)[0]
    colors = {"static": "C3", "continuous": "C0"}
    for ax, rate in zip(axes, rates):
        for run in (x for x in r["runs"] if x["rate"] == rate):
            c = colors.get(run["scheduling"], "C2")
            for key, style, what in (("e2e_values", "-", "E2E"), ("ttft_values", "--", "TTFT")):
                v = np.asarray(run[key])
                y = np.arange(1, v.size + 1) / v.size
                label = f"{run['scheduling']}" + (f" (bs {run['max_num_seqs']})" if run["scheduling"] == "static" else "")
                ax.step(v, y, where="post", linestyle=style, color=c, label=f"{label} {what}")
        frac = next((x["rate_fraction"] for x in r["runs"] if x["rate"] == rate), None)
        ax.set_title(f"{rate:.3f} requests/s" + (f" ({frac:g} x saturation)" if frac else ""), fontsize=9)
        ax.set_xlabel("latency (s)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3, which="both")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=7, loc="upper left")
    k = r["knobs"]
    fig.suptitle(f"Workload L on {r['model']['name']}: {k['num_requests']} Poisson requests, prompts "
                 f"{k['prompt_len_range'][0]}-{k['prompt_len_range'][1]}, outputs mean {k['mean_output']} "
                 f"cap {k['cap']}", fontsize=9.5)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench latency", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    common.add_engine_args(ap)
    ap.add_argument("--num-requests", type=count, default=100, help="requests per arrival rate")
    ap.add_argument("--prompt-len", type=count, default=128, help="P: prompts uniform in [P/2, 3P/2]")
    ap.add_argument("--mean-output", type=count, default=64, help="M: outputs capped exponential, cap 12M")
    ap.add_argument("--rates", type=positive_numbers, default=None, help="arrival rates in requests/s (skips calibration; default: fractions of the measured "
                         "saturation, see --fractions)")
    ap.add_argument("--fractions", type=positive_numbers, default=",".join(map(str, DEFAULT_FRACTIONS)),
                    help="rates as fractions of the measured saturation (default 0.3,0.9)")
    ap.add_argument("--calib-requests", type=count, default=32,
                    help="requests of the burst that measures the saturation rate")
    ap.add_argument("--static-batch-size", type=count, default=16, help="batch size of the static runs")
    ap.add_argument("--max-num-seqs", type=count, default=256, help="continuous max_num_seqs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens computed in one step (default: the engine's)")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file (default: none)")
    ap.add_argument("--plot", default=None,
                    help="draw the latency curves into this PNG file (needs matplotlib; default: none)")
    args = ap.parse_args(argv)
    if args.plot:
        from ..extras import require

        require("matplotlib", f"{ap.prog} --plot")  # before the run, not after it

    model = common.resolve_model(args.model)

    def say(s):
        print(s, file=sys.stderr, flush=True)

    r = run_study(model, num_requests=args.num_requests, prompt_len=args.prompt_len,
                  mean_output=args.mean_output,
                  rates=args.rates, fractions=args.fractions, calib_requests=args.calib_requests,
                  static_batch_size=args.static_batch_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, progress=say,
                  **common.engine_kwargs(args))
    k = r["knobs"]
    print("conveyor bench latency (Workload L, in-process AsyncLLM)")
    print(f"machine: {r['machine']['cpu']}, {r['machine']['usable_cores']} usable cores, SIMD "
          f"{r['machine']['simd']}, device {args.device}, load at start {r['machine']['loadavg_at_start']}")
    print(f"model: {r['model']['name']}; {k['num_requests']} requests, prompts uniform in "
          f"{k['prompt_len_range']}, outputs exp(mean {k['mean_output']}) cap {k['cap']}, EOS ignored, "
          f"seed {k['seed']}; static batch {k['static_batch_size']}, continuous max_num_seqs "
          f"{k['continuous_max_num_seqs']}, token budget {k['max_num_batched_tokens']}")
    if r["calibration"]:
        c = r["calibration"]
        print(f"saturation: {c['requests_per_s']:.3f} requests/s ({c['num_requests']} requests at once, "
              f"continuous); rates {', '.join(f'{x:.3f}' for x in r['rates'])} requests/s "
              f"= {k['rate_fractions']} x saturation")
    print(format_table(r), flush=True)
    common.write_outputs(r, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
