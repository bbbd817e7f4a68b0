"""Batch-1 decode of a GGUF (or any model): best ms/token of a few greedy runs, and the
bytes a step streams (conveyor.bench.roofline's count), for before/after pairs of builds:

    for b in old new old new; do PYTHONPATH=/tmp/cv_build_$b/lib python tools/bench_decode.py MODEL --label $b; done
"""
import argparse

import numpy as np

from conveyor import LLM, SamplingParams
from conveyor.bench.roofline import kv_bytes_per_token, streamed_bytes_per_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    n = a.tokens
    with LLM(a.model, num_threads=a.threads, max_num_seqs=8, enable_prefix_caching=False) as llm:
        cfg = llm.model_config
        rng = np.random.default_rng(0)
        llm.generate([list(rng.integers(3, 1000, 16))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(a.runs):
            out = llm.generate([list(rng.integers(3, 1000, 32))],
                               SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)[0]
            m = out.metrics
            best = min(best, (m.finished_time - m.first_token_time) / (n - 1) * 1e3)
        mb = (streamed_bytes_per_step(cfg) + (32 + n / 2) * kv_bytes_per_token(cfg)) / 1e6
    print(f"{a.label}: best {best:.2f} ms/token, {mb:.1f} MB a step")


if __name__ == "__main__":
    main()
