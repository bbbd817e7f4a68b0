"""Development: times the CPU paged-attention kernel (conveyor._testing.kernel_paged_attention).

Cases (SmolLM-135M shape: head_dim 64, 9 query heads over 3 KV heads, block size 16):
  decode   64 sequences x 1 new token, contexts uniform in 128..600
  prefill  one 512-token chunk of a prompt after 512 cached tokens (chunked prefill)
  study    a decode step of the study workload: 80 sequences, contexts 150..250, over 30
           layers of caches of their own (bf16: 370 MB, so K/V come from DRAM as in the engine)
GFLOP/s counts 2 multiply-adds (q.k and p.v) per (vector, key, dim), i.e. 4 flops,
and is set against the fp32 FMA peak (measure_peak) of the same threads.

  python tools/bench_attention.py [--threads 2] [--impl simd] [--cache bfloat16|float16|float32|int8] [--repeats 20]
Run it back to back against another build (PYTHONPATH) and compare ratios: the
machine may be shared.
"""
import argparse
import os
import time

import numpy as np

from conveyor import _core
from conveyor import _testing as core


def case(rng, news, prefixes, *, nkv=3, G=3, hd=64, bs=16, cdt="bfloat16"):
    ctx = np.asarray(prefixes) + np.asarray(news)
    per = (ctx + bs - 1) // bs
    nb = int(per.sum())
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.zeros((len(ctx), int(per.max())), np.int32)
    used = 0
    for s, n in enumerate(per):
        tables[s, :n] = perm[used:used + n]
        used += n
    kc = rng.standard_normal((nb, nkv, bs, hd), dtype=np.float32)
    vc = rng.standard_normal((nb, nkv, bs, hd), dtype=np.float32)
    if cdt == "bfloat16":  # the top 16 bits (truncation is fine for timing)
        kc, vc = (np.ascontiguousarray((a.view(np.uint32) >> 16).astype(np.uint16)) for a in (kc, vc))
    elif cdt == "float16":
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    elif cdt == "int8":  # random integers and per-row scales (values do not matter for timing)
        ks, vs = (rng.uniform(0.01, 0.05, a.shape[:3]).astype(np.float32) for a in (kc, vc))
        kc, vc = (np.clip(np.rint(a * 40), -127, 127).astype(np.int8) for a in (kc, vc))
        scales = dict(k_scale=ks, v_scale=vs)
    qs = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]), nkv * G, hd), dtype=np.float32)
    flops = 4.0 * nkv * G * hd * sum(n * (c - 0.5 * (n - 1)) for n, c in zip(news, ctx))
    return dict(args=(q, kc, vc, tables, ctx.astype(np.int32), qs), cdt=cdt, flops=flops,
                scales=scales if cdt == "int8" else {})


def best_time(c, impl, threads, repeats):
    """Best time of one call; a list of cases (layers): of one call on each in turn."""
    cs = c if isinstance(c, list) else [c]
    kws = [dict(cache_dtype="bfloat16" if x["cdt"] == "bfloat16" else None, impl=impl, threads=threads,
                **x["scales"]) for x in cs]
    for x, kw in zip(cs, kws):
        core.kernel_paged_attention(*x["args"], **kw)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for x, kw in zip(cs, kws):
            core.kernel_paged_attention(*x["args"], **kw)
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impl", default="simd")
    ap.add_argument("--cache", default="bfloat16", choices=["bfloat16", "float16", "float32", "int8"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30, help="layers of the study case (0: skip it)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    peak = core.measure_peak("fp32_fma", a.threads, 0.2)["gops"]
    level = _core.kernel_info()["simd"] if a.impl == "simd" else a.impl
    print(f"impl {a.impl} ({level}), cache {a.cache}, block {a.block_size}, threads {a.threads}, fp32 FMA peak {peak:.1f} GFLOP/s, "
          f"load average {os.getloadavg()[0]:.2f}")
    cases = {
        "decode 64 x ctx 128..600": case(rng, [1] * 64, rng.integers(127, 600, 64), cdt=a.cache, bs=a.block_size),
        "prefill 512 after 512": case(rng, [512], [512], cdt=a.cache, bs=a.block_size),
    }
    if a.layers > 0:
        ctx = rng.integers(149, 250, 80)
        cases[f"study 80 x ctx 150..250 x {a.layers}L"] = [case(rng, [1] * 80, ctx, cdt=a.cache, bs=a.block_size) for _ in range(a.layers)]
    for name, c in cases.items():
        t = best_time(c, a.impl, a.threads, a.repeats)
        flops = sum(x["flops"] for x in c) if isinstance(c, list) else c["flops"]
        gf = flops / t / 1e9
        print(f"{name:26s} {t * 1e3:8.3f} ms  {gf:7.1f} GFLOP/s  {gf / peak:5.2f} of fp32 peak")


if __name__ == "__main__":
    main()
