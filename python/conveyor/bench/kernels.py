"""`conveyor bench kernels`: GEMM and memory bandwidth of the CPU kernels.

For each linear layer shape of a SmolLM-135M-like model (dim 576, FFN 1536,
9 heads x 64, 3 KV heads, vocab 49152) and each token count, it measures the
GFLOP/s of numpy's sgemm (``x @ W.T`` in float32, the BLAS numpy links) and of
Conveyor's GEMM with float32 and bfloat16 weights, in the same run, and the
ratio. With one token (decode GEMV) it also reports the weight bytes streamed
per second, beside a STREAM-style triad and a plain read of a large array,
both measured with Conveyor's thread pool. Weights that fit the caches
(everything here but lm_head, on most machines) stream faster than memory.
Each GEMM rate is also given as a fraction of the measured peak of the
instruction it runs on (``compute_peaks``: register-only loops in C, per
core and for all threads): the fp32 FMA peak for float32 weights, the
vdpbf16ps peak for bfloat16 weights on AVX512_BF16 CPUs, else the fp32 FMA
peak (bf16 widened to fp32). No rate can exceed its own peak, so no such
fraction is above 1 except by measurement noise (flagged when it happens).

Figures on a shared machine are noisy: compare the ratios, not absolute times.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .peaks import PEAK_OF_DTYPE, compute_peaks, format_peaks, measure_read_bw, measure_triad, merge_peaks

# name -> (rows = output features, cols = input features)
SMOLLM_135M_SHAPES: Dict[str, tuple] = {
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "qkv 960x576": (960, 576),
    "gate_up 3072x576": (3072, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}
TOKEN_COUNTS = (1, 8, 32, 128, 512)
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "GOTO_NUM_THREADS", "CONVEYOR_FORCE_SCALAR", "CONVEYOR_SIMD", "CONVEYOR_SPIN_US")


def _core():
    from conveyor import _core
    return _core


def _testing():
    """The kernel timing hooks live in conveyor._testing."""
    from conveyor import _testing
    return _testing


def blas_info() -> Dict[str, Any]:
    """The BLAS numpy uses: threadpoolctl's view if it is installed, else numpy.show_config()."""
    info: Dict[str, Any] = {"numpy": np.__version__}
    try:
        import threadpoolctl  # type: ignore

        pools = threadpoolctl.threadpool_info()
        info["threadpoolctl"] = [
            {k: p.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                   "threading_layer", "filepath")}
            for p in pools if p.get("user_api") == "blas"
        ]
    except ImportError:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                np.show_config()
            except Exception as e:  # pragma: no cover - depends on the numpy build
                print(f"numpy.show_config failed: {e}")
        text = buf.getvalue()
        lines = [ln.strip() for ln in text.splitlines()
                 if any(w in ln.lower() for w in ("openblas", "mkl", "blis", "accelerate", "name:",
                                                   "version:"))]
        info["show_config"] = lines[:12]
    return info


def machine_info() -> Dict[str, Any]:
    core = _core()
    kinfo = core.kernel_info()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": kinfo["cores"],
        "simd": kinfo["simd"],
        "python": platform.python_version(),
        "env": {k: os.environ.get(k) for k in ENV_VARS if os.environ.get(k) is not None},
    }


def _repeats(flops: float, budget_flops: float = 3e9) -> int:
    return int(max(3, min(100, budget_flops / max(flops, 1.0))))


def _time_interleaved(fns, repeats: int) -> List[float]:
    """Best seconds of each function, calling them in turn so that all of them
    see the same load on a shared machine. A function that returns a float
    reports its own time (measured in C); otherwise the call is timed here."""
    for f in fns:
        f()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            own = f()
            dt = time.perf_counter() - t0
            best[i] = min(best[i], own if isinstance(own, float) else dt)
    return best


def run_gemm_and_bandwidth(threads: Optional[int] = None,
                           tokens: Sequence[int] = TOKEN_COUNTS,
                           shapes: Optional[Dict[str, tuple]] = None,
                           seed: int = 0, triad_bytes: int = 64 << 20,
                           peak_seconds: float = 0.3) -> Dict[str, Any]:
    """Measures numpy sgemm vs Conveyor GEMM (f32 and bf16 weights) on the model's
    shapes for each token count, plus the triad and read bandwidths. Returns a
    dict {"machine", "blas", "threads", "triad_gbs", "read_gbs", "rows": [...]}
    where each row has shape, rows, cols, tokens, numpy/f32/bf16 GFLOP/s, the
    ratios to numpy, the fractions of the peak of the instruction each runs on
    (f32_of_peak, bf16_of_peak), and for one token the weight bytes per second
    (GB/s). "peaks" holds the measured peaks (compute_peaks), taken before and
    after the GEMMs (the higher of the two)."""
    hooks = _testing()
    nthreads = int(threads or 0)
    shapes = shapes or SMOLLM_135M_SHAPES
    rng = np.random.default_rng(seed)
    triad = measure_triad(nthreads, triad_bytes)
    read = measure_read_bw(nthreads, 2 * triad_bytes)
    peaks = compute_peaks(nthreads, peak_seconds)
    rows_out: List[Dict[str, Any]] = []
    for name, (rows, cols) in shapes.items():
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float32)
        wt = w.T  # numpy multiplies by the transposed view (no copy), as a model would
        m32 = hooks.kernel_matrix(w, "float32", "simd", nthreads)
        m16 = hooks.kernel_matrix(w, "bfloat16", "simd", nthreads)
        for n in tokens:
            x = rng.standard_normal((n, cols), dtype=np.float32)
            flops = 2.0 * n * rows * cols
            t_np, t32, t16 = _time_interleaved(
                [lambda: (x @ wt, None)[1],
                 lambda: hooks.kernel_matmul_time(m32, x, 1, False),
                 lambda: hooks.kernel_matmul_time(m16, x, 1, False)],
                _repeats(flops))
            row = {
                "shape": name, "rows": rows, "cols": cols, "tokens": n,
                "numpy_gflops": flops / t_np * 1e-9,
                "f32_gflops": flops / t32 * 1e-9,
                "bf16_gflops": flops / t16 * 1e-9,
            }
            row["f32_vs_numpy"] = row["f32_gflops"] / row["numpy_gflops"]
            row["bf16_vs_numpy"] = row["bf16_gflops"] / row["numpy_gflops"]
            if n == 1:
                row["f32_gbs"] = rows * cols * 4 / t32 * 1e-9
                row["bf16_gbs"] = rows * cols * 2 / t16 * 1e-9
                row["numpy_gbs"] = rows * cols * 4 / t_np * 1e-9
            rows_out.append(row)
        del m32, m16
    peaks = merge_peaks(peaks, compute_peaks(nthreads, peak_seconds))
    for row in rows_out:
        row["f32_of_peak"] = row["f32_gflops"] / peaks[PEAK_OF_DTYPE["float32"]]["all_gops"]
        row["bf16_of_peak"] = row["bf16_gflops"] / peaks[PEAK_OF_DTYPE["bfloat16"]]["all_gops"]
    return {
        "machine": machine_info(),
        "blas": blas_info(),
        "threads": nthreads or _core().kernel_info()["cores"],
        "triad_gbs": triad,
        "read_gbs": read,
        "peaks": peaks,
        "rows": rows_out,
    }


def format_table(res: Dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, SIMD {m['simd']}; Conveyor threads: {res['threads']}",
        f"env: {m['env'] or '(no BLAS/Conveyor variables set)'}",
        f"numpy BLAS: {json.dumps(res['blas'])}",
        f"memory (Conveyor pool): triad {res['triad_gbs']:.1f} GB/s (STREAM count), "
        f"read {res['read_gbs']:.1f} GB/s (a GEMV's pattern)",
        *format_peaks(res["peaks"]),
        "timings: best of interleaved calls; the Conveyor time is measured in C around the call",
        "'of pk': the fraction of the all-thread peak of the instruction the GEMM runs on",
        "",
        f"{'shape':<20}{'tokens':>7}{'numpy GF/s':>12}{'f32 GF/s':>10}{'ratio':>7}{'of pk':>7}"
        f"{'bf16 GF/s':>11}{'ratio':>7}{'of pk':>7}   GEMV GB/s (f32 / bf16 / numpy)",
    ]
    for r in res["rows"]:
        extra = ""
        if "bf16_gbs" in r:
            extra = (f"   {r['f32_gbs']:.1f} / {r['bf16_gbs']:.1f} / {r['numpy_gbs']:.1f}"
                     f"  (bf16 = {r['bf16_gbs'] / res['read_gbs']:.2f} x read)")
        flag = " !" if max(r["f32_of_peak"], r["bf16_of_peak"]) > 1.0 else ""
        lines.append(f"{r['shape']:<20}{r['tokens']:>7}{r['numpy_gflops']:>12.1f}"
                     f"{r['f32_gflops']:>10.1f}{r['f32_vs_numpy']:>7.2f}{r['f32_of_peak']:>7.2f}"
                     f"{r['bf16_gflops']:>11.1f}{r['bf16_vs_numpy']:>7.2f}{r['bf16_of_peak']:>7.2f}{extra}{flag}")
    if any(max(r["f32_of_peak"], r["bf16_of_peak"]) > 1.0 for r in res["rows"]):
        lines.append("! above its peak: the peak was measured while the machine was busy; rerun when quiet")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import DefaultsHelpFormatter, Parser

    ap = Parser(prog="conveyor bench kernels", description=__doc__.splitlines()[0],
                formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="Conveyor threads (default: all cores)")
    ap.add_argument("--tokens", type=str, default=",".join(map(str, TOKEN_COUNTS)),
                    help="comma-separated token counts")
    ap.add_argument("--shapes", type=str, default=None,
                    help="comma-separated shape names (default: all): " + "; ".join(SMOLLM_135M_SHAPES))
    ap.add_argument("--json", type=str, default=None, help="write the results as JSON to this file (default: none)")
    ap.add_argument("--model", type=str, default=None,
                    help="checkpoint for the model-level part (default: the built-in SmolLM-135M shape)")
    ap.add_argument("--no-model", action="store_true",
                    help="skip the model-level part (decode vs bandwidth, large steps vs compute)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    shapes = None
    if args.shapes:
        wanted = [s.strip() for s in args.shapes.split(",")]
        shapes = {k: v for k, v in SMOLLM_135M_SHAPES.items() if any(k.startswith(w) for w in wanted)}
        if not shapes:
            ap.error(f"no shape matches {args.shapes!r}")
    res = run_gemm_and_bandwidth(args.threads, tokens=tokens, shapes=shapes)
    print(format_table(res))
    if args.threads and not os.environ.get("OPENBLAS_NUM_THREADS"):
        print(f"note: numpy's BLAS used its default thread count; set OPENBLAS_NUM_THREADS="
              f"{args.threads} for a like-for-like comparison")
    if not args.no_model:
        from . import roofline
        from ..models import random_checkpoint as default_model

        print()
        model = args.model or str(default_model())
        res["model"] = roofline.run(model, args.threads)
        print(roofline.format_table(res["model"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
