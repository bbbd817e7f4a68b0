"""`conveyor bench study`: Anyscale's continuous-batching study, reproduced against the
real baselines.

One workload per output-length cap: N requests of P random token ids each (the same
prompts for every cap), output lengths from an exponential of mean M with draws above
the cap rejected, EOS ignored, greedy, all submitted at once. Every system gets the
byte-identical requests (a SHA-256 of the token ids and lengths is checked by each
system and recorded) and runs in its own process:

- naive static batching: HF transformers ``generate()`` on the same checkpoint, static
  batches, left padding, each batch running until its longest member ends;
- Conveyor with ``scheduling="static"``, the same batch size;
- Conveyor continuous batching over the paged KV cache;
- vLLM, when it is importable (never a dependency).

All share one KV budget (``--kv-tokens``, the study's ~8k tokens): Conveyor's pool holds
that many tokens, and the static batch size, unless given, is the largest whose members
all fit at full length (P + cap), as a static system must reserve. The report: output
tokens/s, the ratio to naive static, p50/p99 end-to-end latency, peak KV memory, forward
steps, preemptions, tokens recomputed after them (and their share of the tokens computed),
the mean running batch and the KV pool's mean occupancy per system and cap, then each
Conveyor run's occupancy over time; JSON and a plot of throughput against cap.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import common
from .workloads import load_workload, make_study_workload, save_workload, workload_hash  # noqa: F401
from ..cli_args import count

DEFAULT_KV_TOKENS = 8192  # the study's budget: ~8k tokens of KV (16 x 544, 12 x 640, 8 x 1024, 4 x 2048)
SYSTEMS = ("hf_static", "conveyor_static", "conveyor_continuous", "vllm")
LABELS = {"hf_static": "HF static (naive)", "conveyor_static": "Conveyor static",
          "conveyor_continuous": "Conveyor continuous", "vllm": "vLLM"}
QUICK = dict(shape="tiny", dtype="float32", num_requests=12, prompt_len=16, mean_output=8,
             caps=(4, 8, 32), kv_tokens=160)


# ----------------------------------------------------------------------------- workload


def default_caps(mean_output: int) -> List[int]:
    return [max(1, mean_output // 4), mean_output, 4 * mean_output]


# ----------------------------------------------------------------------------- KV budget


def kv_bytes_per_token(cfg: Dict[str, Any], dtype: str) -> int:
    """Keys and values of one token over all layers, at the KV dtype (the model's)."""
    head_dim = cfg.get("head_dim") or cfg["dim"] // cfg["n_heads"]
    elem = 4 if dtype == "float32" else 2
    return 2 * cfg["n_layers"] * cfg["n_kv_heads"] * head_dim * elem


def plan_batch(*, kv_tokens: int, prompt_len: int, cap: int, block_size: int, num_requests: int,
               batch_size: Optional[int] = None) -> Dict[str, int]:
    """The static batch size and the shared KV pool (in blocks) for one cap: the largest
    batch whose members all fit the budget at full length (block-granular, so Conveyor's
    static batch never preempts), unless one is given; the pool grows to hold a given
    batch that the budget cannot."""
    if kv_tokens < 1:
        raise ValueError(f"kv_tokens must be >= 1, got {kv_tokens}")
    per_seq = -(-(prompt_len + cap) // block_size)
    pool = -(-kv_tokens // block_size)
    fits = max(1, pool // per_seq)
    bs = min(num_requests, fits if batch_size is None else batch_size)
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return {"batch_size": bs, "pool_blocks": max(pool, bs * per_seq), "blocks_per_seq": per_seq}


# ----------------------------------------------------------------------------- one system (worker side)


def _versions(*mods: str) -> Dict[str, str]:
    out = {}
    for m in mods:
        try:
            out[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is just not listed
            pass
    return out


def _summary(system: str, digest: str, wall: float, output_lens, got_lens, e2e, *, steps, kv_peak,
             preemptions=None, extra=None) -> Dict[str, Any]:
    bad = [i for i, (a, b) in enumerate(zip(output_lens, got_lens)) if int(a) != int(b)]
    if bad:
        i = bad[0]
        raise RuntimeError(f"{system}: request {i} got {got_lens[i]} tokens, asked for {output_lens[i]} "
                           f"({len(bad)} requests wrong)")
    n_out = int(sum(int(n) for n in output_lens))
    out = {"system": system, "workload_hash": digest, "wall_s": wall, "output_tokens": n_out,
           "output_tokens_per_s": n_out / max(wall, 1e-9),
           "e2e": common.percentiles(e2e) if e2e is not None else None,
           "steps": steps, "kv_bytes_peak": kv_peak, "preemptions": preemptions}
    out.update(extra or {})
    return out


def run_hf(spec: Dict[str, Any], prompts, output_lens, digest) -> Dict[str, Any]:
    import torch

    from . import hf_static

    torch.set_num_threads(spec["threads"])
    model = hf_static.load_model(spec["model"], dtype=spec["dtype"], device=spec["device"])
    hf_static.run_static(model, [p[:8] for p in prompts[:2]], [2, 2], batch_size=2, device=spec["device"])
    r = hf_static.run_static(model, prompts, output_lens, batch_size=spec["batch_size"],
                             device=spec["device"], return_tokens=spec.get("return_tokens", False))
    got = [len(t) for t in r["tokens"]] if r.get("tokens") is not None else r["own_tokens"]
    extra = {"batch_size": spec["batch_size"], "computed_output_tokens": r["computed_output_tokens"],
             "batches": len(r["batches"]), "versions": _versions("torch", "transformers"),
             "threads": torch.get_num_threads()}
    if "tokens" in r:
        extra["tokens"] = r["tokens"]
    return _summary("hf_static", digest, r["wall_s"], output_lens, got, r["e2e_s"],
                    steps=r["steps"], kv_peak=r["kv_bytes_peak"], extra=extra)


def run_conveyor(spec: Dict[str, Any], prompts, output_lens, digest) -> Dict[str, Any]:
    from .. import __version__

    sched = "static" if spec["system"] == "conveyor_static" else "continuous"
    # the KV dtype is the one the budget was counted in (HF keeps its cache in the model dtype)
    engine = dict(dtype=spec["dtype"], device=spec["device"], num_threads=spec["threads"],
                  block_size=spec["block_size"], kv_cache_dtype=spec["dtype"])
    common.warm_up(spec["model"], kv_cache_memory="fit", **engine)
    wl = common.Workload([np.asarray(p, dtype=np.int32) for p in prompts], list(output_lens))
    llm = common.make_llm(spec["model"], scheduling=sched, max_num_seqs=spec["batch_size"],
                          max_num_batched_tokens=spec.get("max_num_batched_tokens"),
                          kv_cache_memory=spec["kv_pool_bytes"], enable_prefix_caching=False,
                          adaptive_batch_limit=spec.get("adaptive_batch_limit", False), **engine)
    try:
        r = common.run_offline(llm, wl, temperature=0.0, trace=bool(spec.get("trace")))
        st = llm.stats()
    finally:
        llm.close()
    block_bytes = st["kv_cache_bytes"] // st["num_blocks"]
    lat = common.request_latencies(r["outputs"])
    extra = {"batch_size": spec["batch_size"], "versions": {"conveyor": __version__},
             "threads": spec["threads"], "kv_pool_bytes": st["blocks_total"] * block_bytes,
             "max_num_batched_tokens": st["max_num_batched_tokens"],
             "recomputed_tokens": st["num_recomputed_tokens"], "resumed_tokens": st["num_resumed_tokens"],
             "running_target": st["running_target"], "held_back_steps": st["num_held_back_steps"],
             "computed_tokens": st["prompt_tokens"] + st["generation_tokens"],
             "running_mean": r.get("running_mean"),
             "kv_occupancy": occupancy_over_time(r["kv"]["blocks_used_series"], st["blocks_total"])}
    if spec.get("return_tokens"):
        extra["tokens"] = [list(map(int, o.outputs[0].token_ids)) for o in r["outputs"]]
    if spec.get("trace"):  # the engine's step trace (tools/study_steps.py)
        extra["trace"] = [list(e) for e in r["trace"]]
    return _summary(spec["system"], digest, r["throughput"]["wall_s"], output_lens, lat["output_tokens"],
                    lat["e2e"], steps=r["steps"], preemptions=r["preemptions"],
                    kv_peak=r["kv"]["blocks_used_peak"] * block_bytes, extra=extra)


def occupancy_over_time(blocks_used: Sequence[int], blocks_total: int, parts: int = 10) -> List[float]:
    """The KV pool's occupancy (blocks in use / blocks in the pool) per step, averaged over
    each of `parts` equal spans of the run's steps: its shape over time in a few numbers."""
    u = np.asarray(blocks_used, dtype=float) / max(1, blocks_total)
    if u.size == 0:
        return []
    return [float(x.mean()) for x in np.array_split(u, min(parts, u.size))]


def run_vllm(spec: Dict[str, Any], prompts, output_lens, digest) -> Dict[str, Any]:
    from vllm import LLM, SamplingParams

    kw = dict(model=spec["model"], dtype=spec["dtype"], max_num_seqs=256, seed=0,
              enable_prefix_caching=False, skip_tokenizer_init=True)
    try:  # newer vLLM takes the KV pool in bytes; older ones size it from free memory
        llm = LLM(kv_cache_memory_bytes=spec["kv_pool_bytes"], **kw)
    except TypeError:
        llm = LLM(**kw)
    reqs = [{"prompt_token_ids": list(p)} for p in prompts]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, temperature=0.0, detokenize=False)
              for n in output_lens]
    llm.generate(reqs[:2], [SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)] * 2,
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    return _summary("vllm", digest, wall, output_lens, got, None, steps=None, kv_peak=None,
                    extra={"versions": _versions("vllm", "torch"), "threads": spec["threads"]})


RUNNERS: Dict[str, Callable] = {"hf_static": run_hf, "conveyor_static": run_conveyor,
                                "conveyor_continuous": run_conveyor, "vllm": run_vllm}


def run_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One system on one workload (spec: system, model, workload file, batch_size,
    kv_pool_bytes, dtype, device, threads, block_size); the worker process's body."""
    if spec["system"] not in RUNNERS:
        raise ValueError(f"unknown system {spec['system']!r}; choose from {', '.join(SYSTEMS)}")
    prompts, output_lens, digest = load_workload(spec["workload"])
    return RUNNERS[spec["system"]](spec, prompts, output_lens, digest)


def _worker_main(spec_path: str) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not corrupt the JSON on stdout
    with open(spec_path) as f:
        res = run_worker(json.load(f))
    real_stdout.write(json.dumps(res, default=common._json_default) + "\n")
    real_stdout.flush()
    return 0


# ----------------------------------------------------------------------------- the study (parent side)


@functools.lru_cache(maxsize=None)
def system_available(system: str) -> Optional[str]:
    """None when the system can run here, else why not. Modules that are installed are
    imported once in a child process: an install cut short (torch without its shared
    libraries) is found there, not as a failed run after the other systems' work."""
    need = {"hf_static": ("torch", "transformers"), "vllm": ("vllm",)}.get(system, ())
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not importable"
    if not need:
        return None
    proc = subprocess.run([sys.executable, "-c", "import " + ", ".join(need)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"{' and '.join(need)} installed but failing to import ({lines[-1] if lines else 'no message'})"
    return None


def run_in_subprocess(spec: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    """Runs one system in a fresh Python process; its stderr passes through."""
    path = os.path.join(workdir, f"spec-{spec['system']}-{spec['cap']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    from ..testing import subprocess_env

    env = subprocess_env()  # the conveyor this process imported (symlinked build folders too)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(spec["threads"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run([sys.executable, "-m", "conveyor.bench.study", "--worker", path],
                          stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"system {spec['system']} (cap {spec['cap']}) failed with exit code "
                           f"{proc.returncode}; its stderr is above")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def run_study(model: str, *, num_requests: int, prompt_len: int, mean_output: int,
              caps: Sequence[int], kv_tokens: int = DEFAULT_KV_TOKENS, batch_size: Optional[int] = None,
              systems: Sequence[str] = SYSTEMS, dtype: str = "auto", device: str = "cpu",
              threads: Optional[int] = None, block_size: int = 16, seed: int = 0,
              hf_dtype: Optional[str] = None, return_tokens: bool = False,
              adaptive_batch_limit: bool = False,
              progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Every system on every cap's workload; returns a JSON-ready dict."""
    say = progress or (lambda s: None)
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if not caps or any(int(c) < 1 for c in caps):
        raise ValueError(f"caps must be positive ints, got {list(caps)}")
    if num_requests < 1 or prompt_len < 1 or mean_output < 1:
        raise ValueError("num_requests, prompt_len and mean_output must be >= 1")
    machine = common.machine_info()
    threads = threads or machine["usable_cores"] or 1
    cfg = common.checkpoint_config(model)
    dtype = cfg.get("dtype", "float32") if dtype == "auto" else dtype
    per_token = kv_bytes_per_token(cfg, dtype)
    hf_dtype = hf_dtype or dtype
    skipped = {s: why for s in systems if (why := system_available(s))}
    for s, why in skipped.items():
        say(f"skipping {LABELS[s]}: {why}")
    run = [s for s in systems if s not in skipped]
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="conveyor-study-") as tmp:
        for cap in caps:
            wl = make_study_workload(vocab_size=cfg["vocab_size"], num_requests=num_requests,
                                     prompt_len=prompt_len, mean_output=mean_output, cap=int(cap), seed=seed)
            wl_path = os.path.join(tmp, f"workload-{cap}.json")
            digest = save_workload(wl, wl_path)
            plan = plan_batch(kv_tokens=kv_tokens, prompt_len=prompt_len, cap=int(cap),
                              block_size=block_size, num_requests=num_requests, batch_size=batch_size)
            pool_bytes = plan["pool_blocks"] * block_size * per_token
            d = wl.describe()
            say(f"cap {cap}: {len(wl)} requests, {wl.output_tokens} output tokens (mean "
                f"{d['output_len_mean']:.1f}, max {d['output_len_max']}), static batch {plan['batch_size']}, "
                f"KV pool {plan['pool_blocks'] * block_size} tokens, workload {digest[:12]}")
            row: Dict[str, Any] = {"cap": int(cap), "workload": d, "workload_hash": digest,
                                   "batch_size": plan["batch_size"],
                                   "kv_pool_tokens": plan["pool_blocks"] * block_size,
                                   "kv_pool_bytes": pool_bytes, "systems": {}}
            for s in run:
                spec = {"system": s, "cap": int(cap), "model": str(model), "workload": wl_path,
                        "batch_size": 256 if s in ("conveyor_continuous", "vllm") else plan["batch_size"],
                        "kv_pool_bytes": pool_bytes, "device": device,
                        "dtype": hf_dtype if s == "hf_static" else dtype,
                        "threads": threads, "block_size": block_size, "return_tokens": return_tokens,
                        "adaptive_batch_limit": adaptive_batch_limit and s == "conveyor_continuous"}
                t = time.perf_counter()
                res = run_in_subprocess(spec, tmp)
                if res["workload_hash"] != digest:
                    raise RuntimeError(f"{s} ran workload {res['workload_hash']}, not {digest}")
                row["systems"][s] = res
                e2e = res.get("e2e") or {}
                say(f"  {LABELS[s]:<20} {res['output_tokens_per_s']:9.1f} out tok/s  p50 e2e "
                    f"{e2e.get('p50', float('nan')):7.2f} s  steps {res.get('steps')}  "
                    f"({time.perf_counter() - t:.0f} s)")
            finalize_row(row)
            rows.append(row)
    versions = {}
    for row in rows:
        for res in row["systems"].values():
            versions.update(res.get("versions", {}))
    return {
        "benchmark": "study",
        "machine": machine,
        "threads": threads,
        "versions": {"python": machine["python"], "numpy": machine["numpy"], **versions},
        "model": {**{k: cfg.get(k) for k in ("arch", "dim", "hidden_dim", "n_layers", "n_heads",
                                              "n_kv_heads", "vocab_size")},
                  "dtype": dtype, "path": str(model), "name": Path(str(model)).name},
        "knobs": {"num_requests": num_requests, "prompt_len": prompt_len, "mean_output": mean_output,
                  "caps": [int(c) for c in caps], "kv_tokens": kv_tokens, "batch_size": batch_size,
                  "block_size": block_size, "seed": seed, "device": device, "greedy": True,
                  "hf_dtype": hf_dtype, "adaptive_batch_limit": adaptive_batch_limit,
                  "ignore_eos": True, "kv_bytes_per_token": per_token},
        "systems": list(systems),
        "skipped": skipped,
        "headline_metric": "output tokens/s",
        "rows": rows,
        "elapsed_s": time.perf_counter() - t_start,
    }


def finalize_row(row: Dict[str, Any]) -> Dict[str, Any]:
    """Each system's throughput ratio to naive static batching (when it ran)."""
    base = row["systems"].get("hf_static")
    for res in row["systems"].values():
        res["ratio_to_naive"] = (res["output_tokens_per_s"] / base["output_tokens_per_s"]
                                 if base else None)
    return row


# ----------------------------------------------------------------------------- report


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def table_rows(r: Dict[str, Any]) -> List[List[str]]:
    out = []
    for row in r["rows"]:
        for s, res in row["systems"].items():
            e2e = res.get("e2e") or {}
            kv = res.get("kv_bytes_peak")
            label = LABELS[s]
            if s == "hf_static" and r["knobs"].get("hf_dtype") not in (None, r["model"]["dtype"]):
                label += f", {r['knobs']['hf_dtype']}"
            out.append([str(row["cap"]), f"{row['workload']['output_len_mean']:.1f}", label,
                        _fmt(res.get("batch_size") if s in ("hf_static", "conveyor_static") else None, "d"),
                        f"{res['output_tokens_per_s']:.1f}", _fmt(res.get("ratio_to_naive"), ".2f"),
                        _fmt(e2e.get("p50"), ".2f"), _fmt(e2e.get("p99"), ".2f"),
                        _fmt(kv / 2**20 if kv is not None else None, ".2f"),
                        _fmt(res.get("steps"), "d"), _fmt(res.get("preemptions"), "d"),
                        _recomputed(res), _fmt(res.get("running_mean"), ".1f"),
                        _fmt(100 * np.mean(occ) if (occ := res.get("kv_occupancy")) else None, ".0f")])
    return out


def _recomputed(res: Dict[str, Any]) -> str:
    """Tokens computed again after preemptions, with their share of all tokens computed."""
    n, total = res.get("recomputed_tokens"), res.get("computed_tokens")
    if n is None:
        return "-"
    return f"{n} ({100 * n / total:.1f}%)" if total else str(n)


HEADER = ["cap", "mean out", "system", "batch", "out tok/s", "vs naive", "p50 E2E s", "p99 E2E s",
          "KV peak MiB", "steps", "preempt", "recomputed", "mean running", "KV use %"]


def format_table(r: Dict[str, Any], markdown: bool = False) -> str:
    rows = table_rows(r)
    if markdown:
        align = ["---:", "---:", "---", *["---:"] * (len(HEADER) - 3)]
        lines = ["| " + " | ".join(HEADER) + " |", "| " + " | ".join(align) + " |"]
        lines += ["| " + " | ".join(x) + " |" for x in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(HEADER)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(HEADER), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [fmt(x) for x in rows])


def plot(r: Dict[str, Any], fig=None):
    """Output throughput (as the study's figure) and p50 E2E latency against the cap."""
    fig = fig or common.new_figure(9.0, 3.6)
    ax1, ax2 = fig.subplots(1, 2)
    caps = [row["cap"] for row in r["rows"]]
    styles = {"hf_static": ("C3", "s"), "conveyor_static": ("C1", "^"),
              "conveyor_continuous": ("C0", "o"), "vllm": ("C2", "D")}
    for s in r["systems"]:
        pts = [(row["cap"], row["systems"][s]) for row in r["rows"] if s in row["systems"]]
        if not pts:
            continue
        color, marker = styles[s]
        ax1.plot([c for c, _ in pts], [x["output_tokens_per_s"] for _, x in pts], marker=marker,
                 color=color, label=LABELS[s])
        lat = [(c, (x.get("e2e") or {}).get("p50")) for c, x in pts]
        lat = [(c, v) for c, v in lat if v is not None]
        if lat:
            ax2.plot([c for c, _ in lat], [v for _, v in lat], marker=marker, color=color, label=LABELS[s])
    for row in r["rows"]:
        c = row["systems"].get("conveyor_continuous")
        if c and c.get("ratio_to_naive"):
            ax1.annotate(f"{c['ratio_to_naive']:.1f}x", (row["cap"], c["output_tokens_per_s"]),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8, color="C0")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([str(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("max output length (cap, tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput (labels: continuous / naive static)", fontsize=9)
    ax2.set_ylabel("p50 end-to-end latency (s)")
    ax2.set_title("p50 latency, all requests sent at once", fontsize=9)
    ax1.legend(fontsize=7)
    k = r["knobs"]
    fig.suptitle(f"study on {r['model']['name']} ({r['model']['dtype']}): N={k['num_requests']}, "
                 f"P={k['prompt_len']}, exponential mean {k['mean_output']}, {k['device']}, "
                 f"{r['threads']} threads", fontsize=10)
    return fig


def print_report(r: Dict[str, Any], markdown: bool = False) -> None:
    k, m = r["knobs"], r["machine"]
    print("conveyor bench study (continuous batching against naive static batching)")
    print(f"machine: {m['cpu']}, {m['usable_cores']} usable cores, SIMD {m['simd']}, device {k['device']}, "
          f"{r['threads']} threads, load at start {m['loadavg_at_start']}")
    print("versions: " + ", ".join(f"{a} {b}" for a, b in r["versions"].items()))
    print(f"model: {r['model']['name']} (dim {r['model']['dim']}, {r['model']['n_layers']} layers, "
          f"vocab {r['model']['vocab_size']}, {r['model']['dtype']})")
    print(f"workload: N={k['num_requests']}, P={k['prompt_len']}, outputs exponential mean "
          f"{k['mean_output']} capped at {k['caps']}, seed {k['seed']}, greedy, EOS ignored, all at once; "
          f"KV budget {k['kv_tokens']} tokens, block size {k['block_size']}"
          + ("; continuous with adaptive_batch_limit" if k.get("adaptive_batch_limit") else ""))
    for row in r["rows"]:
        print(f"  cap {row['cap']}: workload sha256 {row['workload_hash']}, static batch {row['batch_size']}, "
              f"KV pool {row['kv_pool_tokens']} tokens")
    for s, why in r.get("skipped", {}).items():
        print(f"not run: {LABELS[s]} ({why})")
    print("out tok/s counts each request's own tokens; vs naive = / HF static; steps = forward passes")
    print(format_table(r, markdown=markdown))
    print("recomputed = tokens computed again after preemptions (share of all tokens computed); "
          "mean running = sequences per step; KV use = mean share of the pool's blocks in use")
    occ = [(row["cap"], s, res["kv_occupancy"]) for row in r["rows"] for s, res in row["systems"].items()
           if res.get("kv_occupancy")]
    if occ:
        print("KV pool occupancy over time (% of blocks in use, mean over each tenth of the run's steps):")
        for cap, s, o in occ:
            print(f"  cap {cap:<5} {LABELS[s]:<20} " + " ".join(f"{100 * x:3.0f}" for x in o))
    print(f"elapsed {r['elapsed_s']:.0f} s", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m conveyor.bench.study --worker SPEC.json")
        return _worker_main(argv[1])
    from ..cli_args import DefaultsHelpFormatter, Parser

    ap = Parser(prog="conveyor bench study", description=__doc__.splitlines()[0],
                formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="HF checkpoint folder or .gguf file (HF transformers dequantizes a GGUF's weights; "
                         "Conveyor keeps them quantized); default: the SmolLM-135M-shaped random "
                         "checkpoint (bf16), written once with conveyor.testing")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model and workload (seconds): N=12, P=16, M=8, caps 4,8,32")
    ap.add_argument("--num-requests", type=count, default=128, help="N (default 128)")
    ap.add_argument("--prompt-len", type=count, default=128, help="P (default 128)")
    ap.add_argument("--mean-output", type=count, default=128, help="M (default 128)")
    ap.add_argument("--caps", default=None, help="comma-separated caps (default M/4,M,4M)")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help=f"the KV budget shared by all systems, in tokens (default {DEFAULT_KV_TOKENS})")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="static batch size for HF and Conveyor static (default: the largest that "
                         "fits the KV budget at P + cap)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, float16, bfloat16")
    ap.add_argument("--hf-dtype", default=None,
                    help="dtype of the HF baseline (default: --dtype). torch's bfloat16 GEMM is a slow "
                         "path on CPUs without AVX512-BF16; float32 is the fairer baseline there")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    ap.add_argument("--num-threads", type=int, default=None, help="threads per system (default: usable cores)")
    ap.add_argument("--block-size", type=count, default=16, help="tokens per KV cache block")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--adaptive-batch-limit", action="store_true",
                    help="run Conveyor continuous with adaptive_batch_limit=True (admissions stop at the "
                         "knee of the step-time model it fits as it runs; default: off, as LLM's)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (for docs)")
    ap.add_argument("--bound", action="store_true",
                    help="also print each cap's physical bound and the fraction of it each system reached")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file (default: none)")
    ap.add_argument("--plot", default=None,
                    help="draw the results into this PNG file (needs matplotlib; default: none)")
    ap.add_argument("--from-json", default=None, help="print and plot a saved result instead of running (default: run)")
    args = ap.parse_args(argv)
    if args.plot:
        from ..extras import require

        require("matplotlib", f"{ap.prog} --plot")  # before the run, not after it

    if args.from_json:
        with open(args.from_json) as f:
            r = json.load(f)
        print_report(r, markdown=args.markdown)
        common.write_outputs(r, plot_path=args.plot, plot=plot)
        return 0
    from ..models import random_checkpoint as default_model

    n, p, m, kv = args.num_requests, args.prompt_len, args.mean_output, args.kv_tokens
    caps = common.parse_int_list(args.caps) if args.caps else None
    if args.quick:
        q = QUICK
        model = args.model or str(default_model(shape=q["shape"], dtype=q["dtype"]))
        n, p, m = q["num_requests"], q["prompt_len"], q["mean_output"]
        caps, kv = caps or list(q["caps"]), kv or q["kv_tokens"]
    else:
        model = args.model or str(default_model(shape="smollm-135m", dtype="bfloat16"))
    if not ((Path(model) / "config.json").is_file() or (Path(model).is_file() and model.endswith(".gguf"))):
        raise SystemExit(f"conveyor bench study: {model} is not a HF checkpoint folder (no config.json) "
                         "or a .gguf file; every system loads the same checkpoint")

    def say(s):
        print(s, file=sys.stderr, flush=True)

    try:
        r = run_study(model, num_requests=n, prompt_len=p, mean_output=m, caps=caps or default_caps(m),
                      kv_tokens=kv or DEFAULT_KV_TOKENS, batch_size=args.batch_size,
                      systems=[s for s in args.systems.split(",") if s], dtype=args.dtype,
                      device=args.device, threads=args.num_threads, block_size=args.block_size,
                      seed=args.seed, hf_dtype=args.hf_dtype,
                      adaptive_batch_limit=args.adaptive_batch_limit, progress=say)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"conveyor bench study: {e}")
    print_report(r, markdown=args.markdown)
    if args.bound:
        from .bound import add_study_bounds

        add_study_bounds(r, args.num_threads)
    common.write_outputs(r, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
