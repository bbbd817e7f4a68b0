#!/usr/bin/env python
"""Quantized GEMM microbench: GOP/s of the quantized kernels against bf16 weights on the
SmolLM-135M shapes, for several token counts, timed interleaved in one process (so the ratio
to bf16 holds up on a loaded machine better than either figure).

The quantized figure is `_testing.kernel_qgemm_time`: the matrix is prepared (copied, or
repacked for the Q5/K formats) once, then the best of the GEMMs (activation quantization
included) is kept. bf16 is `kernel_matrix` once, then `kernel_matmul_time`.

K-quants need rows of whole 256-element super-blocks: ``--shapes gemma`` takes Gemma 3
270M's matrices whose columns are (attn_output 640x1024, ffn_down 640x2048), e.g.
    python tools/bench_qgemm.py --shapes gemma --types q4_1,q4_k,q5_0,q6_k

On an AVX512-VNNI CPU the prepared matrix is in the VNNI level's panel layout (kernels/cpu/
quant.h: P16); another --level then reads it through an unpacking step per 16 rows, so to time
the AVX2 or AVX-VNNI kernels as such a CPU without AVX-512 runs them, set CONVEYOR_SIMD=avx2:
    CONVEYOR_SIMD=avx2 python tools/bench_qgemm.py --level avx2

To compare two builds, run it once with each on PYTHONPATH, back to back, e.g.
    PYTHONPATH=/tmp/cv_old python tools/bench_qgemm.py --types q4_1
    PYTHONPATH=python      python tools/bench_qgemm.py --types q4_1
"""
from __future__ import annotations

import argparse
import numpy as np

SHAPE_SETS = {
    "smollm": {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)},
    "gemma": {"attn_out 640x1024": (640, 1024), "down 640x2048": (640, 2048)},
}


def main() -> int:
    from conveyor import _testing
    from conveyor.gguf import quantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q8_0,q4_0,q4_1")
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--level", default="best", help="quantized level (scalar, avx2, avx512vnni, avxvnni, best)")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best of each is kept")
    ap.add_argument("--shapes", default="smollm", choices=sorted(SHAPE_SETS), help="which model's matrices")
    args = ap.parse_args()
    qtypes = [t for t in args.types.split(",") if t]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    kquants = [q for q in qtypes if q.endswith("_k")]
    narrow = [n for n, (_, cols) in SHAPE_SETS[args.shapes].items() if cols % 256]
    if kquants and narrow:
        ap.error(f"{', '.join(kquants)} need columns in whole 256-element super-blocks, which "
                 f"{', '.join(narrow)} of --shapes {args.shapes} lack: use --shapes gemma")
    rng = np.random.default_rng(0)
    print(f"level {args.level} (best here: {_testing.kernel_qlevels()['best']}), threads {args.threads or 'all'}")
    print(f"{'shape':18} {'n':>4} {'bf16 GF/s':>10} " + " ".join(f"{q + ' GOP/s':>11} {'/bf16':>6}" for q in qtypes))
    for name, (rows, cols) in SHAPE_SETS[args.shapes].items():
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        m16 = _testing.kernel_matrix(w, "bfloat16", "simd", args.threads)
        wq = {q: quantize(w, q).reshape(rows, -1) for q in qtypes}
        for n in tokens:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            ops = 2.0 * n * rows * cols
            reps = max(1, int(2e8 / ops))
            fns = [lambda: _testing.kernel_matmul_time(m16, x, reps)]
            fns += [lambda q=q: _testing.kernel_qgemm_time(x, wq[q], q, level=args.level, threads=args.threads,
                                                        repeats=reps) for q in qtypes]
            best = [float("inf")] * len(fns)
            for _ in range(args.rounds):
                for i, f in enumerate(fns):
                    best[i] = min(best[i], f())
            rates = [ops / t * 1e-9 for t in best]
            cells = " ".join(f"{r:11.1f} {r / rates[0]:6.2f}" for r in rates[1:])
            print(f"{name:18} {n:4d} {rates[0]:10.1f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
