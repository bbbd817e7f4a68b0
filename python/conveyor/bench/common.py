"""Shared pieces of the end-to-end benchmarks (throughput, variance, latency, timeline).

- workload generation with fixed seeds: random token-id prompts, capped exponential
  output lengths (Workload V and L of docs/benchmarks.md);
- an offline runner that drives the engine step by step (as ``LLM.generate`` does) so
  it can sample ``stats()`` after every step (KV waste, batch occupancy) and record the
  engine's step trace;
- metrics: percentiles with NumPy's linear interpolation, TTFT / TPOT / E2E per request,
  throughputs;
- a description of the machine (cores, SIMD level, load) and of the model.
"""
from __future__ import annotations

import argparse
import json
import sys
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from .. import __version__, _core, models
from ..async_llm import AsyncLLM
from ..engine import EngineCore
from ..llm import LLM
from ..models import find_model, random_checkpoint
from ..sampling_params import SamplingParams
from ..speculative import parse_speculative_config, spec_delta
from ..cli_args import count

STORIES_ENV = "CONVEYOR_STORIES"
# The KV pool: by default ("fit") each engine gets room for every request of its
# workload in KV at once (so nothing is ever preempted for lack of blocks) rather than
# the engine's own default, which sizes the pool from free memory: gigabytes that take
# seconds to allocate per engine on this machine. Every run reports its preemptions.
DEFAULT_KV_CACHE = "fit"


# ----------------------------------------------------------------------------- models


def stories_path() -> Optional[Path]:
    """stories260K.bin: $CONVEYOR_STORIES (the .bin or its folder), else the copy shipped
    inside the package."""
    env = os.environ.get(STORIES_ENV)
    if env:
        p = Path(env)
        p = p / "stories260K.bin" if p.is_dir() else p
        if p.is_file():
            return p
    return find_model("stories260K")


def resolve_model(name: Optional[str]) -> str:
    """A model argument as conveyor.models.resolve_model takes it (a path, a built-in name,
    a shape name), except None: the SmolLM-135M-shaped random checkpoint, and
    "stories260K"/"stories": $CONVEYOR_STORIES when set."""
    if name is None:
        return str(random_checkpoint())
    if name.lower() in ("stories260k", "stories") and not os.path.exists(name):
        p = stories_path()
        if p is not None:
            return str(p)
    return models.resolve_model(name)


def checkpoint_config(path: str) -> Dict[str, Any]:
    return dict(_core.Checkpoint(str(path)).config)


def kv_bytes_for(path: str, prompt_lens: Iterable[int], output_lens: Iterable[int],
                 block_size: int = 16, dtype: str = "float32") -> int:
    """KV pool bytes that hold every request at full length at once (+ a spare block
    each and 64 more) in a cache of ``dtype`` (float32 covers every dtype)."""
    cfg = checkpoint_config(path)
    head_dim = cfg.get("head_dim") or cfg["dim"] // cfg["n_heads"]
    per_token = _core.kv_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], head_dim, dtype)
    blocks = 64 + sum(-(-(int(p) + int(o)) // block_size) + 1 for p, o in zip(prompt_lens, output_lens))
    return int(blocks * block_size * per_token)


def model_info(llm, path: str) -> Dict[str, Any]:
    cfg = dict(llm.model_config)
    keep = ("arch", "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "vocab_size", "max_pos", "n_params", "weight_bytes", "matrix_dtype", "kv_cache_dtype")
    info = {k: cfg[k] for k in keep if k in cfg}
    info["path"] = str(path)
    info["name"] = Path(path).name
    return info


def machine_info() -> Dict[str, Any]:
    """Cores, SIMD level, CPU model and load: enough to read the figures in context."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "usable_cores": usable, "simd": getattr(_core, "simd", "?"),
            "python": platform.python_version(), "numpy": np.__version__,
            "conveyor": __version__, "loadavg_at_start": load,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe(machine: Dict[str, Any], model: Dict[str, Any], device: str = "cpu") -> str:
    m = model
    shape = (f"{m.get('name')}: dim {m.get('dim')}, {m.get('n_layers')} layers, "
             f"{m.get('n_heads')}/{m.get('n_kv_heads')} heads, vocab {m.get('vocab_size')}, "
             f"{m.get('n_params', 0) / 1e6:.1f}M params")
    return (f"machine: {machine['cpu']}, {machine['usable_cores']} usable cores, SIMD "
            f"{machine['simd']}, device {device}, load {machine['loadavg_at_start']}\nmodel: {shape}")


def make_llm(model: str, *, scheduling: str = "continuous", max_num_seqs: int = 256,
             max_num_batched_tokens: Optional[int] = None, block_size: int = 16,
             kv_cache_memory: Any = DEFAULT_KV_CACHE, workload: Optional["Workload"] = None,
             dtype: str = "auto", num_threads: Optional[int] = None, device: str = "cpu",
             seed: int = 0, enable_prefix_caching: bool = True, asynchronous: bool = False,
             kv_cache_dtype: str = "auto", speculative_config=None, quantization: Optional[str] = None,
             adaptive_batch_limit: bool = False):
    """An LLM (or AsyncLLM) for token-id prompts. kv_cache_memory "fit" sizes the pool
    for ``workload`` (see kv_bytes_for); None leaves it to the engine."""
    if kv_cache_memory == "fit":
        if workload is None:
            raise ValueError('kv_cache_memory="fit" needs the workload')
        kv_cache_memory = kv_bytes_for(model, [len(p) for p in workload.prompts],
                                       workload.output_lens, block_size)
    cls = AsyncLLM if asynchronous else LLM
    return cls(model, scheduling=scheduling, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
               kv_cache_memory=kv_cache_memory, dtype=dtype, num_threads=num_threads,
               device=device, seed=seed, enable_prefix_caching=enable_prefix_caching,
               kv_cache_dtype=kv_cache_dtype, skip_tokenizer_init=True,
               speculative_config=speculative_config, quantization=quantization,
               adaptive_batch_limit=adaptive_batch_limit)


# ----------------------------------------------------------------------------- workloads


def capped_exponential(rng: np.random.Generator, n: int, mean: float, cap: int,
                       minimum: int = 1) -> np.ndarray:
    """n integer lengths from an exponential of the given mean, rounded, at least
    ``minimum``; draws above ``cap`` are rejected and drawn again (the Anyscale study's
    datasets)."""
    if cap < minimum:
        raise ValueError(f"cap ({cap}) must be >= {minimum}")
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        x = np.maximum(minimum, np.rint(rng.exponential(mean, size=2 * (n - out.size) + 16)))
        out = np.concatenate([out, x[x <= cap].astype(np.int64)])
    return out[:n]


def uniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """n integers uniform in [lo, hi] (both included)."""
    return rng.integers(lo, hi + 1, size=n).astype(np.int64)


def random_prompts(rng: np.random.Generator, lengths: Iterable[int], vocab_size: int) -> List[np.ndarray]:
    """Token-id prompts drawn uniformly from the vocabulary (no two share a prefix block,
    so the prefix cache finds nothing)."""
    return [rng.integers(0, vocab_size, size=int(n)).astype(np.int32) for n in lengths]


@dataclass
class Workload:
    prompts: List[np.ndarray]
    output_lens: List[int]
    meta: Dict[str, Any] = field(default_factory=dict)

    def __len__(self):
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return int(sum(len(p) for p in self.prompts))

    @property
    def output_tokens(self) -> int:
        return int(sum(self.output_lens))

    def params(self, temperature: float = 1.0):
        """One SamplingParams per request: EOS ignored, max_tokens forcing the length."""
        return [SamplingParams(max_tokens=int(n), ignore_eos=True, temperature=temperature,
                               top_p=1.0) for n in self.output_lens]

    def describe(self) -> Dict[str, Any]:
        pl = np.asarray([len(p) for p in self.prompts])
        ol = np.asarray(self.output_lens)
        d = dict(self.meta)
        d.update(num_requests=len(self), prompt_tokens=self.prompt_tokens,
                 output_tokens=self.output_tokens, prompt_len_mean=float(pl.mean()),
                 output_len_mean=float(ol.mean()), output_len_max=int(ol.max()),
                 output_len_min=int(ol.min()), output_len_std=float(ol.std()))
        return d


def make_workload(*, n: int, vocab_size: int, prompt_len: int = 128, prompt_lens=None,
                  output_lens=None, mean_output: Optional[float] = None, cap: Optional[int] = None,
                  seed: int = 0) -> Workload:
    """Prompts of ``prompt_len`` tokens (or the given lengths) and output lengths (given,
    or capped exponential of ``mean_output`` with ``cap``), all from ``seed``: the same
    arguments give the same requests for every system."""
    rng_p = np.random.default_rng([seed, 1])
    rng_o = np.random.default_rng([seed, 2])
    if prompt_lens is None:
        prompt_lens = [prompt_len] * n
    if output_lens is None:
        if mean_output is None or cap is None:
            raise ValueError("give output_lens or mean_output and cap")
        output_lens = capped_exponential(rng_o, n, mean_output, cap).tolist()
    prompts = random_prompts(rng_p, prompt_lens, vocab_size)
    meta = {"seed": seed}
    if cap is not None:
        meta.update(cap=int(cap), mean_output_param=float(mean_output))
    return Workload(prompts, [int(x) for x in output_lens], meta)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> List[float]:
    """Arrival offsets (seconds) of a Poisson process of ``rate`` requests/s; the first at 0."""
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ----------------------------------------------------------------------------- metrics


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> Dict[str, float]:
    """p50/p90/p99 (NumPy's linear interpolation) and the mean; empty -> NaNs."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {**{f"p{q}": float("nan") for q in qs}, "mean": float("nan"), "count": 0}
    out = {f"p{q}": float(np.percentile(a, q)) for q in qs}
    out["mean"] = float(a.mean())
    out["count"] = int(a.size)
    return out


def request_latencies(outputs) -> Dict[str, List[float]]:
    """Per request: TTFT (arrival to first token), E2E (arrival to last token), TPOT
    ((E2E - TTFT) / (output tokens - 1), outputs longer than 1), from RequestMetrics."""
    ttft, e2e, tpot, n_out = [], [], [], []
    for o in outputs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        n_out.append(n)
        t = m.first_token_time - m.arrival_time if m.first_token_time else None
        e = m.finished_time - m.arrival_time if m.finished_time else None
        ttft.append(t)
        e2e.append(e)
        if t is not None and e is not None and n > 1:
            tpot.append((e - t) / (n - 1))
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "output_tokens": n_out}


def throughputs(n_requests: int, prompt_tokens: int, output_tokens: int, wall: float) -> Dict[str, float]:
    wall = max(wall, 1e-9)
    return {"wall_s": wall, "requests_per_s": n_requests / wall,
            "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / wall}


# ----------------------------------------------------------------------------- offline runner


def run_offline(llm, workload: Workload, *, sample_stats: bool = True, trace: bool = False,
                temperature: float = 1.0) -> Dict[str, Any]:
    """Submits every request at once and steps the engine to completion, like
    ``LLM.generate`` (the same loop, ``EngineCore.run``), sampling
    ``llm.stats()`` after every step when ``sample_stats``. Returns the outputs,
    throughputs, latencies and the per-step samples (KV waste, running count)."""
    core = llm._core
    params = workload.params(temperature)
    encoded = [core.tokenize_prompt(p) for p in workload.prompts]
    for (_, ids), p in zip(encoded, params):
        core.check_request(ids, p)
    s0 = llm.stats()
    if trace:
        core.set_trace(True)
        core.take_trace()  # drop anything older
    waste, running, used, kv_tokens = [], [], [], []

    def sample(_changed):
        st = core.stats()
        waste.append(st["kv_waste"])
        running.append(st["num_running"])
        used.append(st["blocks_used"])
        kv_tokens.append(st["tokens_in_kv"])

    t0 = time.perf_counter()
    reqs = [core.add_request(None, text, ids, p) for (text, ids), p in zip(encoded, params)]
    core.run(reqs, sample if sample_stats else None)
    wall = time.perf_counter() - t0
    steps_trace = core.take_trace() if trace else None
    if trace:
        core.set_trace(False)
    s1 = llm.stats()
    outputs = [EngineCore.build_output(r) for r in reqs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    res: Dict[str, Any] = {
        "outputs": outputs,
        "throughput": throughputs(len(outputs), workload.prompt_tokens, n_out, wall),
        "output_tokens": n_out,
        "prompt_tokens": workload.prompt_tokens,
        "steps": s1["steps"] - s0["steps"],
        "preemptions": s1["num_preemptions"] - s0["num_preemptions"],
        "time_forward_s": s1["time_forward"] - s0["time_forward"],
        "latency": latency_summary(outputs),
    }
    spec = core.args.speculative_config
    if spec is not None:
        res["speculative"] = spec_delta(s0, s1, spec["num_speculative_tokens"])
    if sample_stats and waste:
        w = np.asarray(waste)
        u = np.asarray(used)
        busy = u > 0
        peak = int(np.argmax(u))
        res["kv"] = {"waste_mean": float(w[busy].mean()) if busy.any() else 0.0,
                     "waste_max": float(w.max()), "waste_at_peak_usage": float(w[peak]),
                     "blocks_used_peak": int(u.max()), "block_size": int(s1["block_size"]),
                     "blocks_total": int(s1["blocks_total"]), "blocks_used_series": u.tolist(),
                     "token_weighted_waste": float(1.0 - np.sum(kv_tokens) /
                                                   max(1, np.sum(u) * s1["block_size"]))}
        res["running_mean"] = float(np.mean(running))
        res["running_max"] = int(np.max(running))
    if steps_trace is not None:
        res["trace"] = steps_trace
    return res


def warm_up(model: str, **engine) -> None:
    """A throwaway run on a small engine: the first run in a process pays for cold
    pages, caches and thread start-up, which would bias whichever system ran first."""
    cfg = checkpoint_config(model)
    wl = make_workload(n=4, vocab_size=cfg["vocab_size"], prompt_lens=[16] * 4,
                       output_lens=[4] * 4, seed=12345)
    engine = {k: v for k, v in engine.items() if k not in ("scheduling", "max_num_seqs")}
    llm = make_llm(model, workload=wl, **engine)
    try:
        run_offline(llm, wl, sample_stats=False)
    finally:
        llm.close()


def latency_summary(outputs) -> Dict[str, Any]:
    lat = request_latencies(outputs)
    return {"ttft": percentiles(lat["ttft"]), "tpot": percentiles(lat["tpot"]),
            "e2e": percentiles(lat["e2e"])}


def strip_outputs(res: Dict[str, Any]) -> Dict[str, Any]:
    """A result without the RequestOutput objects and the raw trace (JSON-ready)."""
    return {k: v for k, v in res.items() if k not in ("outputs", "trace")}


# ----------------------------------------------------------------------------- output


def write_json(path, obj) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def new_figure(width: float, height: float):
    """A matplotlib Figure that needs no pyplot and no GUI backend (renders with Agg);
    a notebook shows it when it is the cell's value."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def save_figure(fig, path, dpi: int = 100) -> str:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return str(path)


def write_outputs(result, json_path=None, plot_path=None, plot=None) -> None:
    """The end of every benchmark: the result as JSON and its figure (plot(result))
    as PNG where asked for, each announced on stderr."""
    if json_path:
        write_json(json_path, result)
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path and plot is not None:
        save_figure(plot(result), plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)


def parse_int_list(text: str) -> List[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def parse_float_list(text: str) -> List[float]:
    return [float(x) for x in str(text).replace(" ", "").split(",") if x]


def add_engine_args(ap) -> None:
    """Arguments every end-to-end benchmark takes."""
    ap.add_argument("--model", default=None,
                    help="HF folder or llama2.c .bin, 'stories260K', or a random shape name "
                         "('tiny', 'smollm-135m', ...); default: the built-in SmolLM-135M-shaped "
                         "random checkpoint")
    ap.add_argument("--dtype", default="auto", help="weight dtype (auto: the checkpoint's)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="auto (the engine's choice), float32, bfloat16, float16 or int8 (CPU only)")
    ap.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                    help="quantize the float matrices at load (a GGUF file's quantized ones stay as they are; "
                         "default: none)")
    ap.add_argument("--device", default="cpu", help="where to run (cpu or cuda)")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--block-size", type=count, default=16, help="tokens per KV cache block")
    ap.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE,
                    help="KV pool size such as 1GiB; 'fit' (default): room for the whole workload "
                         "at once; 'auto': the engine's default")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's prefix cache (default on). Off, freed KV blocks are reused "
                         "most recent first, so a warm engine touches no new memory")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4}; '
                         "the output then reports proposals and acceptance (default: none)")


def engine_kwargs(args) -> Dict[str, Any]:
    kv = None if str(args.kv_cache_memory).lower() in ("auto", "none", "") else args.kv_cache_memory
    kw = dict(dtype=args.dtype, device=args.device, num_threads=args.num_threads,
              block_size=args.block_size, kv_cache_memory=kv)
    if not getattr(args, "enable_prefix_caching", True):
        kw["enable_prefix_caching"] = False
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    if getattr(args, "speculative_config", None) is not None:
        kw["speculative_config"] = parse_speculative_config(args.speculative_config)
    return kw
