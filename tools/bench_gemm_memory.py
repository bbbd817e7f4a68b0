"""Development: a GEMM with its weights from memory against the same GEMM with them in cache.

A decode step reads every weight matrix once, so its GEMMs see their weights come from memory;
`kernel_matmul_time` repeats one matrix, whose weights then sit in cache. This script prepares
enough copies of each shape (random weights, bf16 by default) to exceed the caches, times one
pass over all of them ("memory") and the same number of calls on the first one ("cache"), and
prints both and their ratio: how much of the in-cache speed a matrix keeps when it streams.

  python tools/bench_gemm_memory.py [--tokens 64] [--dtype bfloat16] [--threads 2] [--mb 110]
                                    [--shapes 1024x512,512x1408,2816x512,512x512,8192x512]

Each figure is the best of --rounds passes. The shapes (rows x cols of W) are by default the
SmolLM-135M layer's: QKV (960 x 576), down (576 x 1536), gate and up (3072 x 576), and o
(576 x 576). The line after them gives this machine's peak for the dtype, measured in the run.
"""
import argparse
import time

import numpy as np

from conveyor import _testing

SHAPES = ((960, 576), (576, 1536), (3072, 576), (576, 576))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=110.0, help="weight bytes cycled per shape (well above L3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES), help="ROWSxCOLS,...")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rng = np.random.default_rng(0)
    esize = 4 if a.dtype == "float32" else 2
    for rows, cols in shapes:
        count = max(2, int(a.mb * 1e6 / (rows * cols * esize)))
        mats = [_testing.kernel_matrix(rng.standard_normal((rows, cols)).astype(np.float32), a.dtype, "simd", a.threads)
                for _ in range(count)]
        x = rng.standard_normal((a.tokens, cols)).astype(np.float32)
        for m in mats:  # first touch of the outputs and the weights' pages
            _testing.kernel_matmul(m, x)
        mem = hot = float("inf")
        for _ in range(a.rounds):
            t = time.perf_counter()
            for m in mats:
                _testing.kernel_matmul(m, x)
            mem = min(mem, (time.perf_counter() - t) / count)
            t = time.perf_counter()
            for _ in range(count):
                _testing.kernel_matmul(mats[0], x)
            hot = min(hot, (time.perf_counter() - t) / count)
        flops = 2.0 * a.tokens * rows * cols
        print(f"{rows} x {cols}, {a.tokens} tokens: memory {mem * 1e6:.1f} us ({flops / mem / 1e9:.0f} GFLOP/s), "
              f"cache {hot * 1e6:.1f} us ({flops / hot / 1e9:.0f}), memory / cache speed {hot / mem:.2f}", flush=True)


    from conveyor.bench.peaks import PEAK_OF_DTYPE, compute_peaks

    kind = PEAK_OF_DTYPE[a.dtype]
    peak = compute_peaks(a.threads)[kind]
    print(f"peak {kind}: {peak}")


if __name__ == "__main__":
    main()
