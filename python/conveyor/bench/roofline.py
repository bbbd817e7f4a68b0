"""Workload R on a whole model: batch-1 decode against the memory-bandwidth
bound, large steps against the compute bound, and the share of a step spent
outside the kernels at 64 running sequences. Bounds are measured in the same
run, by Conveyor's own C loops: the read bandwidth of one large array (a
GEMV's access pattern; the STREAM triad is printed beside it) and the peak of
the very instruction the model's GEMMs run on (``measure_peak``: vdpbf16ps
for bfloat16 weights on AVX512_BF16 CPUs, else fp32 FMAs, bf16 and f16
widened), measured before and after the model (the higher is kept), so no
fraction is above 1 but by measurement noise, which is then flagged. Each
model measurement is likewise the best of ``repeats`` runs (fresh prompts each):
on a shared machine other jobs only ever slow a run down, and the bounds it is
set against are best-of figures too."""
from __future__ import annotations

import json
import time
from typing import Any, Dict, Optional, Sequence

import numpy as np

from .. import LLM, SamplingParams, _core, _testing
from .bound import QUANTIZED, keys_seen, model_cost, peak_kind
from .peaks import compute_peaks, format_peaks, fraction_text, merge_peaks
from ..cli_args import count

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def sgemm_peak_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best numpy sgemm rate on an n x n x n product."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best * 1e-9


def streamed_bytes_per_step(cfg: Dict[str, Any]) -> int:
    """Weight bytes a decode step reads: every matrix once; of the embedding
    table only a few rows (not counted)."""
    embed = cfg.get("embed_bytes")
    if embed is None:
        embed = cfg["vocab_size"] * cfg["dim"] * _DTYPE_BYTES[cfg.get("compute_dtype", cfg["dtype"])]
    return int(cfg["weight_bytes"] - embed)


def kv_bytes_per_token(cfg: Dict[str, Any]) -> int:
    return _core.kv_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"], cfg["kv_cache_dtype"])


def generation_flops(cfg: Dict[str, Any], seqs: Sequence[tuple]) -> float:
    """The arithmetic an engine must do to generate from ``seqs`` ((prompt length, output
    tokens) each): every layer matrix for each token computed (the prompt and each output
    but the last), the LM head once for each token sampled, and attention over the keys
    each query sees (a sliding-window layer's window only). The embedding is a lookup, and
    a prompt's positions before its last sample nothing: counting every parameter for every
    token would put a large-vocabulary model's prefill above the machine's peak."""
    cost = model_cost(cfg, kv_bytes_per_token(cfg))
    window = int(cfg.get("sliding_window") or 0) or None
    tokens = samples = attended = attended_local = 0
    for prompt_len, n_out in seqs:
        n = prompt_len + n_out - 1
        tokens += n
        samples += n_out
        attended += keys_seen(0, n)[0]
        attended_local += keys_seen(0, n, window)[0]
    return cost.step_flops(tokens, samples, attended, attended_local)


def peak_kind_of(cfg: Dict[str, Any], activation_dtype: str = "auto") -> str:
    """The measured peak a model's GEMMs are bound by: int8 dot products for quantized
    matrices (every GGUF block type: the CPU computes them all on int8 activations), else
    the float instruction of its compute dtype."""
    mdt = cfg.get("matrix_dtype", cfg.get("compute_dtype", cfg["dtype"]))
    # float matrices run in their compute dtype; bf16 weights widened onto the fp32 FMAs
    # when the activations are float32
    return peak_kind(mdt if mdt in QUANTIZED else cfg.get("compute_dtype", cfg["dtype"]),
                     bf16_dot_native=activation_dtype != "float32")


def _random_prompts(rng, n, length, vocab):
    return [rng.integers(3, vocab, size=length, dtype=np.int32) for _ in range(n)]


def run(model: str, threads: Optional[int] = None, dtype: str = "bfloat16",
        decode_tokens: int = 64, prefill_len: int = 512, n_prefill: int = 4,
        n_running: int = 64, quantization: Optional[str] = None,
        activation_dtype: str = "auto", repeats: int = 3) -> Dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    threads = threads or 0
    triad = float(_testing.kernel_triad(64 << 20, 5, threads))
    read = float(_testing.kernel_read_bw(128 << 20, 5, threads))
    peaks = compute_peaks(threads)
    rng = np.random.default_rng(0)
    res: Dict[str, Any] = {"triad_gbs": triad, "read_gbs": read, "sgemm_gflops": sgemm_peak_gflops(),
                           "model": model, "threads": threads or _core.kernel_info()["cores"],
                           "simd": _core.kernel_info()["simd"], "repeats": repeats}
    n_seqs = max(n_running, 8)  # and a pool that holds them all: the runs must not preempt
    with LLM(model, dtype=dtype, num_threads=threads or None, max_num_seqs=n_seqs, kv_cache_sequences=n_seqs,
             enable_prefix_caching=False, quantization=quantization, activation_dtype=activation_dtype) as llm:
        cfg = llm.model_config
        res["config"] = cfg
        vocab = cfg["vocab_size"]
        # (1) batch-1 decode vs the bandwidth bound
        p = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0)
        llm.generate(_random_prompts(rng, 1, 16, vocab), SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        tpot = float("inf")
        for _ in range(repeats):
            out = llm.generate(_random_prompts(rng, 1, 32, vocab), p, use_tqdm=False)[0]
            m = out.metrics
            tpot = min(tpot, (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1))
        avg_ctx = 32 + decode_tokens / 2
        step_bytes = streamed_bytes_per_step(cfg) + avg_ctx * kv_bytes_per_token(cfg)
        bound = step_bytes / (read * 1e9)
        res["decode_b1"] = {"ms_per_token": tpot * 1e3, "bytes_per_step": step_bytes,
                            "bound_ms": bound * 1e3, "fraction_of_bound": bound / tpot}
        # (2) large prefill steps vs the compute bound
        dt = float("inf")
        for _ in range(repeats):
            prompts = _random_prompts(rng, n_prefill, prefill_len, vocab)
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            dt = min(dt, time.perf_counter() - t)
        toks = n_prefill * prefill_len
        flops = generation_flops(cfg, [(prefill_len, 1)] * n_prefill)
        res["prefill"] = {"tokens": toks, "tokens_per_s": toks / dt, "gflops": flops / dt * 1e-9}
        # (3) 64 running sequences: throughput vs the compute bound, time outside kernels
        best = None
        for _ in range(repeats):
            s0 = llm.stats()
            prompts = _random_prompts(rng, n_running, 16, vocab)
            t = time.perf_counter()
            o = llm.generate(prompts, SamplingParams(max_tokens=decode_tokens, ignore_eos=True),
                             use_tqdm=False)
            w = time.perf_counter() - t
            if best is None or w < best[0]:
                best = (w, o, s0, llm.stats())
        wall, outs, st0, st1 = best
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        kern = st1["time_forward"] - st0["time_forward"]
        step = st1["time_step"] - st0["time_step"]
        steps = st1["steps"] - st0["steps"]
        flops = generation_flops(cfg, [(16, len(o.outputs[0].token_ids)) for o in outs])
        res["decode_b64"] = {
            "output_tokens_per_s": gen / wall, "steps": steps, "ms_per_step": wall / steps * 1e3,
            "gflops": flops / wall * 1e-9,
            "outside_kernels_share": (wall - kern) / wall,
            "schedule_share": (st1["time_schedule"] - st0["time_schedule"]) / wall,
            "build_share": (st1["time_build"] - st0["time_build"]) / wall,
            "sample_share": (st1["time_sample"] - st0["time_sample"]) / wall,
            "python_share": (wall - step) / wall,
        }
    # the bound of the GEMMs: the peak of the instruction they run on
    peaks = merge_peaks(peaks, compute_peaks(threads))
    # quantized matrices (GGUF or quantization=) multiply on int8 dot products
    kind = peak_kind_of(cfg, activation_dtype)
    res["activation_dtype"] = activation_dtype
    res["peaks"] = peaks
    res["compute_bound"] = {"kind": kind, "instruction": peaks[kind]["instruction"],
                            "gflops": peaks[kind]["all_gops"]}
    for key in ("prefill", "decode_b64"):
        res[key]["fraction_of_compute_bound"] = res[key]["gflops"] / peaks[kind]["all_gops"]
    return res


def format_table(r: Dict[str, Any]) -> str:
    c = r["config"]
    d1, pf, d64 = r["decode_b1"], r["prefill"], r["decode_b64"]
    return "\n".join([
        f"model: {r['model']} ({c['arch']}, {c['n_params'] / 1e6:.1f}M params, "
        f"{c.get('matrix_dtype', c['dtype'])} matrices, "
        f"{c['kv_cache_dtype']} KV), threads {r['threads']}",
        f"kernels: {r['simd']}; read bandwidth {r['read_gbs']:.1f} GB/s (triad {r['triad_gbs']:.1f}); "
        f"numpy sgemm {r['sgemm_gflops']:.1f} GFLOP/s (for reference only)",
        *format_peaks(r["peaks"]),
        f"compute bound of the GEMMs: {r['compute_bound']['gflops']:.1f} GFLOP/s "
        f"({r['compute_bound']['instruction']}, {r['compute_bound']['kind']} peak on all threads)",
        f"batch-1 decode: {d1['ms_per_token']:.2f} ms/token; bound {d1['bound_ms']:.2f} ms "
        f"({d1['bytes_per_step'] / 1e6:.1f} MB/step at the read bandwidth) -> "
        f"{fraction_text(d1['bound_ms'], d1['ms_per_token'])} of the bandwidth bound",
        f"prefill ({pf['tokens']} tokens): {pf['tokens_per_s']:.0f} tok/s, {pf['gflops']:.1f} GFLOP/s -> "
        f"{fraction_text(pf['gflops'], r['compute_bound']['gflops'])} of the compute bound",
        f"64 running: {d64['output_tokens_per_s']:.0f} output tok/s, {d64['ms_per_step']:.1f} ms/step, "
        f"{d64['gflops']:.1f} GFLOP/s -> {fraction_text(d64['gflops'], r['compute_bound']['gflops'])} "
        f"of the compute bound",
        f"  outside kernels {d64['outside_kernels_share'] * 100:.1f}% of the wall time "
        f"(schedule {d64['schedule_share'] * 100:.2f}%, batch build {d64['build_share'] * 100:.2f}%, "
        f"sampling {d64['sample_share'] * 100:.2f}%, Python {d64['python_share'] * 100:.2f}%)",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import DefaultsHelpFormatter, Parser

    ap = Parser(prog="conveyor bench roofline", description=__doc__.splitlines()[0],
                formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in SmolLM-135M shape)")
    ap.add_argument("--dtype", default="bfloat16", help="weight dtype of the float matrices")
    ap.add_argument("--activation-dtype", default="auto", choices=["auto", "float32"],
                    help="GEMM inputs over bf16 weights (float32: not the vdpbf16ps path)")
    ap.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                    help="quantize the matrices at load (a GGUF file's quantized ones stay as they are; default: none)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--decode-tokens", type=count, default=64, help="sequences in the decode step measured")
    ap.add_argument("--prefill-len", type=count, default=512, help="tokens per prefill prompt")
    ap.add_argument("--repeats", type=count, default=3, help="runs of each model measurement; the best is kept")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file (default: none)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    if a.model is None:
        from ..models import random_checkpoint as default_model

        a.model = str(default_model())
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    r = run(a.model, a.threads, a.dtype, a.decode_tokens, prefill_len=a.prefill_len,
            quantization=a.quantization, activation_dtype=a.activation_dtype, repeats=a.repeats)
    print(format_table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
