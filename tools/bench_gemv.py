"""One-token GEMV of each GGUF block type on a matrix larger than the caches (random blocks,
float16 scales 0.01): ms and GB/s of the file's bytes, against the read bandwidth.

    python tools/bench_gemv.py --rows 131072 --threads 2
"""
import argparse

import numpy as np

from conveyor import _testing
from conveyor.gguf import _TYPE_LAYOUT, GGMLType

SCALES = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q4_k": [0, 2], "q6_k": [208], "q3_k": [108], "q2_k": [80, 82]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="q8_0,q5_0,q6_k,q4_k,q3_k,q2_k")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for q in a.types.split(","):
        blk, size = _TYPE_LAYOUT[GGMLType[q.upper()]]
        cols = 640 if blk == 32 else 768
        raw = rng.integers(0, 256, (a.rows, cols // blk, size), dtype=np.uint8)
        for o in SCALES[q]:
            raw[:, :, o:o + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        wb = raw.reshape(a.rows, -1)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        t = _testing.kernel_qgemm_time(x, wb, q, threads=a.threads, repeats=20)
        print(f"{q}: {a.rows}x{cols}, {wb.nbytes / 1e6:.1f} MB, {t * 1e3:.2f} ms, {wb.nbytes / t / 1e9:.1f} GB/s")
    print(f"read bandwidth: {float(_testing.kernel_read_bw(128 << 20, 5, a.threads)):.1f} GB/s")


if __name__ == "__main__":
    main()
