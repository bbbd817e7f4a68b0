"""`conveyor bench variance`: Workload V, static against continuous batching as the
variance of output lengths rises (after Anyscale's continuous-batching study).

For each cap (default M/4, M, 4M, 12M) one workload of N requests: prompts of P random
token ids, output lengths from an exponential of mean M with draws above the cap
rejected (min 1), EOS ignored and max_tokens forcing each length, all sent at once. The
same requests (fixed seed) run on:

- static batching with the study's batch size for the cap (16/12/8/4),
- static batching at each size of a small sweep (the best one is reported too),
- continuous batching with default knobs (token budget 2048, max_num_seqs 256);

each on a fresh engine, KV waste and the running count sampled after every step. It
prints output throughput per system, the continuous/static ratios and p50 end-to-end
latency per cap, and writes JSON and a PNG of throughput against cap.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import common
from ..cli_args import count

STUDY_BATCH_SIZES = (16, 12, 8, 4)  # for caps M/4, M, 4M, 12M, as the study chose them
DEFAULT_SWEEP = (8, 16, 32, 64)


def default_caps(mean_output: int) -> List[int]:
    return [max(1, mean_output // 4), mean_output, 4 * mean_output, 12 * mean_output]


def _summary(res: Dict[str, Any], label: str, scheduling: str, max_num_seqs: int) -> Dict[str, Any]:
    out = common.strip_outputs(res)
    out.update(label=label, scheduling=scheduling, max_num_seqs=max_num_seqs)
    return out


def run_system(model: str, wl: common.Workload, *, scheduling: str, max_num_seqs: int,
               max_num_batched_tokens: Optional[int] = None, **engine) -> Dict[str, Any]:
    """One system on one workload, on a fresh engine (no prefix cache carried over)."""
    llm = common.make_llm(model, scheduling=scheduling, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, workload=wl, **engine)
    try:
        res = common.run_offline(llm, wl)
        res["max_num_batched_tokens"] = llm.stats()["max_num_batched_tokens"]
        res["kv_cache_bytes"] = llm.stats()["kv_cache_bytes"]
    finally:
        llm.close()
    return res


def finalize_row(row: Dict[str, Any], num_requests: int) -> Dict[str, Any]:
    """The derived figures of one cap: best static size, ratios, p50 latencies, steps.

    With every request sent at once and N <= max_num_seqs, a static batch of N holds the
    whole workload, so it runs the same schedule as continuous batching; the best static
    size is therefore taken among sizes below N, and the batch of N is reported apart
    ("static_whole")."""
    sweep = {int(k): v for k, v in row["static_sweep"].items()}
    below = [b for b in sweep if b < num_requests] or list(sweep)
    best_bs = max(below, key=lambda b: sweep[b]["throughput"]["output_tokens_per_s"])
    best = sweep[best_bs]
    cont, study = row["continuous"], row["static_study"]
    c_tp = cont["throughput"]["output_tokens_per_s"]
    row["static_best_batch_size"] = best_bs
    row["static_whole_batch_size"] = num_requests if num_requests in sweep else None
    row["ratio_vs_study"] = c_tp / study["throughput"]["output_tokens_per_s"]
    row["ratio_vs_best"] = c_tp / best["throughput"]["output_tokens_per_s"]
    if num_requests in sweep:
        row["ratio_vs_whole"] = c_tp / sweep[num_requests]["throughput"]["output_tokens_per_s"]
    # engine steps: what a step-bound (memory-bound, GPU-like) machine pays for
    row["step_ratio_vs_study"] = study["steps"] / max(1, cont["steps"])
    row["step_ratio_vs_best"] = best["steps"] / max(1, cont["steps"])
    row["p50_e2e"] = {"continuous": cont["latency"]["e2e"]["p50"],
                      "static_study": study["latency"]["e2e"]["p50"],
                      "static_best": best["latency"]["e2e"]["p50"]}
    return row


def run_study(model: str, *, num_requests: int = 48, prompt_len: int = 128, mean_output: int = 64,
              caps: Optional[Sequence[int]] = None, study_sizes: Optional[Sequence[int]] = None,
              sweep: Sequence[int] = DEFAULT_SWEEP, seed: int = 0,
              max_num_batched_tokens: Optional[int] = None, max_num_seqs: int = 256,
              repeat: int = 1, progress: Optional[Callable[[str], None]] = None,
              **engine) -> Dict[str, Any]:
    """Runs Workload V; returns a JSON-ready dict (see format_table and plot). With
    repeat > 1 every system runs that many times and keeps its fastest run."""
    caps = list(caps) if caps else default_caps(mean_output)
    study_sizes = list(study_sizes) if study_sizes else list(STUDY_BATCH_SIZES)
    if len(study_sizes) != len(caps):
        raise ValueError(f"{len(caps)} caps need {len(caps)} study batch sizes, got {len(study_sizes)}")
    say = progress or (lambda s: None)
    machine = common.machine_info()
    cfg = common.checkpoint_config(model)
    common.warm_up(model, **engine)
    t_start = time.perf_counter()
    rows = []
    for cap, study_bs in zip(caps, study_sizes):
        wl = common.make_workload(n=num_requests, vocab_size=cfg["vocab_size"], prompt_len=prompt_len,
                                  mean_output=mean_output, cap=cap, seed=seed)
        row: Dict[str, Any] = {"cap": cap, "workload": wl.describe()}
        say(f"cap {cap}: {len(wl)} requests, {wl.output_tokens} output tokens "
            f"(mean {wl.describe()['output_len_mean']:.1f}, max {wl.describe()['output_len_max']})")

        def one(label, scheduling, seqs):
            t = time.perf_counter()
            r = run_system(model, wl, scheduling=scheduling, max_num_seqs=seqs,
                           max_num_batched_tokens=max_num_batched_tokens, **engine)
            s = _summary(r, label, scheduling, seqs)
            say(f"  {label:<22} {s['throughput']['output_tokens_per_s']:8.1f} out tok/s  "
                f"p50 e2e {s['latency']['e2e']['p50']:7.2f} s  mean running "
                f"{s.get('running_mean', 0):5.1f}  ({time.perf_counter() - t:.0f} s)")
            return s

        systems = [("continuous", "continuous", max_num_seqs),
                   (f"static bs={study_bs} (study)", "static", study_bs)]
        for bs in sorted({min(b, num_requests) for b in sweep}):  # a batch above N is N
            if bs != study_bs:
                systems.append((f"static bs={bs}", "static", bs))
        # repeats run round-robin (so a burst of load hits every system alike); each
        # system keeps its fastest run, with every run's throughput listed
        best: Dict[str, Dict[str, Any]] = {}
        for rep in range(max(1, repeat)):
            for label, sched, seqs in systems:
                s = one(label if repeat <= 1 else f"{label} #{rep + 1}", sched, seqs)
                s["label"] = label
                prev = best.get(label)
                tps = (prev["repeats_output_tokens_per_s"] if prev else []) + \
                    [s["throughput"]["output_tokens_per_s"]]
                if prev is None or s["throughput"]["output_tokens_per_s"] > prev["throughput"]["output_tokens_per_s"]:
                    best[label] = s
                best[label]["repeats_output_tokens_per_s"] = tps
        row["continuous"] = best["continuous"]
        row["static_study"] = best[systems[1][0]]
        sweep_runs = {seqs: best[label] for label, sched, seqs in systems[1:]}
        row["static_sweep"] = {str(bs): sweep_runs[bs] for bs in sorted(sweep_runs)}
        finalize_row(row, num_requests)
        rows.append(row)
    llm_stats = rows[0]["continuous"] if rows else {}
    out = {
        "benchmark": "variance",
        "machine": machine,
        "model": {**{k: cfg.get(k) for k in ("arch", "dim", "hidden_dim", "n_layers", "n_heads",
                                              "n_kv_heads", "vocab_size", "dtype")},
                  "path": str(model), "name": str(model).rstrip("/").split("/")[-1]},
        "knobs": {"num_requests": num_requests, "prompt_len": prompt_len, "mean_output": mean_output,
                  "caps": caps, "study_batch_sizes": study_sizes, "sweep": list(sweep), "seed": seed,
                  "continuous_max_num_seqs": max_num_seqs, "repeat": repeat,
                  "max_num_batched_tokens": llm_stats.get("max_num_batched_tokens"),
                  "ignore_eos": True, "temperature": 1.0,
                  **{k: v for k, v in engine.items()}},
        "headline_metric": "output tokens/s",
        "rows": rows,
        "elapsed_s": time.perf_counter() - t_start,
    }
    out["cost_model"] = cost_model(out)
    return out


def format_table(r: Dict[str, Any]) -> str:
    hdr = (f"{'cap':>5} {'out mean':>8} | {'cont tok/s':>10} | {'static(study)':>15} {'ratio':>6} | "
           f"{'static(best<N)':>15} {'ratio':>6} | {'one batch':>9} | "
           f"{'p50 e2e s: cont':>15} {'study':>6} {'best':>6} | {'KV waste mean/max':>17} | "
           f"{'steps cont':>10} {'study/cont':>10} {'best/cont':>9}")
    lines = [hdr, "-" * len(hdr)]
    for row in r["rows"]:
        c = row["continuous"]
        st = row["static_study"]
        best = row["static_sweep"][str(row["static_best_batch_size"])]
        kv = c.get("kv", {})
        whole = row.get("ratio_vs_whole")
        lines.append(
            f"{row['cap']:>5} {row['workload']['output_len_mean']:>8.1f} | "
            f"{c['throughput']['output_tokens_per_s']:>10.1f} | "
            f"{st['throughput']['output_tokens_per_s']:>8.1f} (bs {st['max_num_seqs']:>2}) "
            f"{row['ratio_vs_study']:>6.2f} | "
            f"{best['throughput']['output_tokens_per_s']:>8.1f} (bs {best['max_num_seqs']:>2}) "
            f"{row['ratio_vs_best']:>6.2f} | "
            f"{(f'{whole:.2f}' if whole is not None else '-'):>9} | "
            f"{row['p50_e2e']['continuous']:>15.2f} {row['p50_e2e']['static_study']:>6.2f} "
            f"{row['p50_e2e']['static_best']:>6.2f} | "
            f"{100 * kv.get('waste_mean', float('nan')):>7.2f}% / {100 * kv.get('waste_max', float('nan')):>5.2f}% | "
            f"{c['steps']:>10} {row['step_ratio_vs_study']:>10.2f} {row['step_ratio_vs_best']:>9.2f}")
    return "\n".join(lines)


def plot(r: Dict[str, Any], fig=None):
    """Output throughput and p50 E2E latency against the cap, per system."""
    fig = fig or common.new_figure(9.0, 3.6)
    ax1, ax2 = fig.subplots(1, 2)
    caps = [row["cap"] for row in r["rows"]]
    n = r["knobs"]["num_requests"]
    systems = [
        ("continuous", lambda row: row["continuous"], "C0", "o", "-"),
        ("static, study batch sizes", lambda row: row["static_study"], "C3", "s", "-"),
        (f"static, best of sweep (bs < {n})",
         lambda row: row["static_sweep"][str(row["static_best_batch_size"])], "C1", "^", "-"),
    ]
    if all(row.get("static_whole_batch_size") for row in r["rows"]):
        systems.append((f"static, one batch of all {n}", lambda row: row["static_sweep"][str(n)],
                        "C7", "x", ":"))
    for label, pick, color, marker, ls in systems:
        ax1.plot(caps, [pick(row)["throughput"]["output_tokens_per_s"] for row in r["rows"]],
                 marker=marker, color=color, linestyle=ls, label=label)
        ax2.plot(caps, [pick(row)["latency"]["e2e"]["p50"] for row in r["rows"]],
                 marker=marker, color=color, linestyle=ls, label=label)
    for row in r["rows"]:
        ax1.annotate(f"{row['ratio_vs_study']:.1f}x", (row["cap"], row["continuous"]["throughput"]["output_tokens_per_s"]),
                     textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8, color="C0")
        ax1.annotate(f"bs {row['static_study']['max_num_seqs']}", (row["cap"], row["static_study"]["throughput"]["output_tokens_per_s"]),
                     textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7, color="C3")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([str(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("output length cap (tokens)")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("output tokens/s")
    ax1.set_ylim(bottom=0)
    ax1.set_title("throughput (labels: continuous / static study)", fontsize=9)
    ax2.set_ylabel("p50 end-to-end latency (s)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("p50 latency, all requests sent at once", fontsize=9)
    ax1.legend(fontsize=7)
    k = r["knobs"]
    fig.suptitle(f"Workload V on {r['model']['name']}: N={k['num_requests']}, P={k['prompt_len']}, "
                 f"M={k['mean_output']} ({r['machine']['usable_cores']} cores, {r['machine']['simd']})",
                 fontsize=10)
    return fig


def cost_model(r: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Least-squares fit over every run of the study: wall time = a * steps + b * tokens
    (a: the fixed cost of a step, mostly reading the weights; b: the cost of each token
    computed). It says how much the step savings of continuous batching can be worth on
    this machine: the ratio the fit predicts per cap, beside the plain step ratio (what a
    step-bound machine, b ~ 0, would see)."""
    import numpy as np

    xs, ys = [], []
    for row in r["rows"]:
        toks = row["workload"]["prompt_tokens"] + row["workload"]["output_tokens"]
        for run in [row["continuous"], *row["static_sweep"].values()]:
            xs.append([run["steps"], toks])
            ys.append(run["throughput"]["wall_s"])
    if len(xs) < 3:
        return None
    x, y = np.asarray(xs, dtype=float), np.asarray(ys)
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = (y - x @ np.array([a, b])) / np.maximum(x @ np.array([a, b]), 1e-9)
    caps = []
    for row in r["rows"]:
        toks = row["workload"]["prompt_tokens"] + row["workload"]["output_tokens"]
        c, st = row["continuous"]["steps"], row["static_study"]["steps"]
        caps.append({"cap": row["cap"], "predicted_ratio_vs_study": (a * st + b * toks) / (a * c + b * toks),
                     "step_ratio_vs_study": st / max(1, c)})
    return {"step_ms": 1e3 * a, "token_ms": 1e3 * b, "runs": len(ys),
            "residual_rms": float(np.sqrt(np.mean(resid ** 2))), "caps": caps}


def print_report(r: Dict[str, Any]) -> None:
    k = r["knobs"]
    m = r["machine"]
    print("conveyor bench variance (Workload V)")
    print(f"machine: {m['cpu']}, {m['usable_cores']} usable cores, SIMD {m['simd']}, device "
          f"{k.get('device', 'cpu')}, load at start {m['loadavg_at_start']}")
    print(f"model: {r['model']['name']} (dim {r['model']['dim']}, {r['model']['n_layers']} layers, "
          f"vocab {r['model']['vocab_size']}, {r['model']['dtype']})")
    print(f"workload: N={k['num_requests']}, P={k['prompt_len']}, M={k['mean_output']}, caps {k['caps']}, "
          f"seed {k['seed']}, EOS ignored, all requests at once; continuous max_num_seqs "
          f"{k['continuous_max_num_seqs']}, token budget {k['max_num_batched_tokens']}, block size "
          f"{k.get('block_size', 16)}; static sizes {k['study_batch_sizes']} (study), sweep {k['sweep']}")
    print("throughput = output tokens/s; ratio = continuous / static; one batch = continuous / static "
          "with all N in one batch; KV waste of the continuous runs; steps = engine steps "
          "(continuous, and static / continuous)")
    print(format_table(r))
    cm = r.get("cost_model") or cost_model(r)
    if cm:
        print(f"cost fit over {cm['runs']} runs: wall = {cm['step_ms']:.1f} ms x steps + {cm['token_ms']:.2f} ms "
              f"x tokens (rms residual {100 * cm['residual_rms']:.0f}%); continuous/static(study) predicted "
              "by the fit: " + ", ".join(f"cap {c['cap']} {c['predicted_ratio_vs_study']:.2f}" for c in cm["caps"]))
    print(f"elapsed {r['elapsed_s']:.0f} s", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench variance", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    common.add_engine_args(ap)
    ap.add_argument("--num-requests", type=count, default=48, help="N (default 48 on this CPU)")
    ap.add_argument("--prompt-len", type=count, default=128, help="P (default 128)")
    ap.add_argument("--mean-output", type=count, default=64, help="M (default 64)")
    ap.add_argument("--caps", default=None, help="comma-separated caps (default M/4,M,4M,12M)")
    ap.add_argument("--static-sizes", default=None,
                    help="the study's static batch size per cap (default 16,12,8,4)")
    ap.add_argument("--sweep", default=",".join(map(str, DEFAULT_SWEEP)),
                    help="static batch sizes to sweep (default 8,16,32,64; '' for none)")
    ap.add_argument("--max-num-seqs", type=count, default=256, help="continuous max_num_seqs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens computed in one step (default: the engine's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per system, round-robin, keeping the fastest (default 1)")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file (default: none)")
    ap.add_argument("--plot", default=None,
                    help="draw the results into this PNG file (needs matplotlib; default: none)")
    ap.add_argument("--from-json", default=None, help="print and plot a saved result instead of running (default: run)")
    args = ap.parse_args(argv)
    if args.plot:
        from ..extras import require

        require("matplotlib", f"{ap.prog} --plot")  # before the run, not after it

    if args.from_json:  # re-render a saved run (table, plot) with the current code
        with open(args.from_json) as f:
            r = json.load(f)
        for row in r["rows"]:
            finalize_row(row, r["knobs"]["num_requests"])
        print_report(r)
        common.write_outputs(r, plot_path=args.plot, plot=plot)
        return 0
    model = common.resolve_model(args.model)
    caps = common.parse_int_list(args.caps) if args.caps else None
    sizes = common.parse_int_list(args.static_sizes) if args.static_sizes else None
    if caps and not sizes:
        sizes = [STUDY_BATCH_SIZES[min(i, 3)] for i in range(len(caps))]

    def say(s):
        print(s, file=sys.stderr, flush=True)

    r = run_study(model, num_requests=args.num_requests, prompt_len=args.prompt_len,
                  mean_output=args.mean_output, caps=caps, study_sizes=sizes,
                  sweep=common.parse_int_list(args.sweep), seed=args.seed,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  repeat=args.repeat, progress=say, **common.engine_kwargs(args))
    print_report(r)
    common.write_outputs(r, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
