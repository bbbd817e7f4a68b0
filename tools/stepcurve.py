"""Decode step time against the number of running sequences, from the engine's step trace.

For each B: B prompts of --prompt-len random tokens, --steps greedy tokens each
(ignore_eos), all submitted at once; the step trace gives every step's wall time and
the sequences it ran, and the figures are over the steps where exactly B sequences each
decoded one token. The KV pool is sized for B whole sequences, so none waits for room
(LLM's default pool holds four max_model_len contexts: 8192 tokens for a 2048-token
model, fewer than 64 sequences of 161, and the rest would run afterwards in extra steps).
A B whose steps never ran all B at once is reported as such, not as a step time.

    python tools/stepcurve.py --batches 32,48,64 --threads 2 [--model PATH --dtype float32]

Prints the load average too: on a shared machine compare ratios within one run.
--forward times the model's forward over B decode rows alone (conveyor._testing.ModelRunner,
every row at context prompt_len + steps / 2) in wall and process CPU time: with --threads 1
the CPU time is the step's work even on a loaded machine (no engine, no sampler).
"""
import argparse
import os
import statistics
from collections import defaultdict

import numpy as np

from conveyor import LLM, SamplingParams
from conveyor.models import random_checkpoint


def decode_steps(core, B):
    """Wall seconds of each traced step in which B sequences decoded one token each."""
    steps = defaultdict(lambda: [0.0, 0, 0])  # step -> [seconds, sequences, prompt work]
    for step, t0, t1, _rid, _idx, _n_new, prompt_work in core.take_trace():
        s = steps[step]
        s[0], s[1], s[2] = t1 - t0, s[1] + 1, s[2] + prompt_work
    return [sec for sec, n, work in steps.values() if n == B and work == 0]


def forward_curve(model, batches, a):
    """Best wall and median process CPU time of the forward over B decode rows."""
    import time

    from conveyor._testing import ModelRunner

    bs, ctx = 16, a.prompt_len + a.steps // 2
    nb = (ctx + bs - 1) // bs
    top = max(batches)
    with ModelRunner(model, dtype=a.dtype, kv_cache_dtype=a.dtype, block_size=bs, num_blocks=top * nb + 1,
                     max_tokens=top, max_seqs=top, num_threads=a.threads) as r:
        print(f"load average {os.getloadavg()[0]:.2f} at start; {a.threads} threads; forward only, context {ctx}")
        cpu = {}
        for B in batches:
            tables = np.arange(1, B * nb + 1).reshape(B, nb)
            batch = dict(tokens=np.arange(B) + 10, positions=np.full(B, ctx - 1),
                         slot_mapping=tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs,
                         query_start=np.arange(B + 1), context_lens=np.full(B, ctx), block_tables=tables,
                         logits_rows=np.arange(B))
            r.forward(**batch)
            walls, cpus = [], []
            for _ in range(8):
                w, c = time.perf_counter(), time.process_time()
                r.forward(**batch)
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
            cpu[B] = statistics.median(cpus)
            print(f"B={B:3d}: wall min {min(walls) * 1e3:7.2f} ms, CPU median {cpu[B] * 1e3:7.2f} ms "
                  f"({cpu[B] / B * 1e3:.3f} ms a row)", flush=True)
        print_growth("CPU", cpu)


def print_growth(what: str, per_b: dict) -> None:
    """How each batch's time grows over the next smaller one's, against linear growth."""
    done = sorted(per_b)
    for lo, hi in zip(done, done[1:]):
        print(f"{what}({hi}) / {what}({lo}) = {per_b[hi] / per_b[lo]:.2f} (linear: {hi / lo:.2f})")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,16,32,48,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=33, help="tokens generated per sequence")
    ap.add_argument("--shape", default="smollm-135m", help="a random checkpoint of this shape (without --model)")
    ap.add_argument("--model", default=None, help="a checkpoint to time instead")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--forward", action="store_true", help="time the model's forward alone (see above)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    model = a.model or str(random_checkpoint(shape=a.shape, dtype=a.dtype))
    if a.forward:
        forward_curve(model, batches, a)
        return
    with LLM(model, dtype=a.dtype, kv_cache_dtype=a.dtype, num_threads=a.threads, max_num_seqs=max(batches),
             kv_cache_sequences=max(batches), enable_prefix_caching=False) as llm:
        core = llm._core
        ctx = a.prompt_len + a.steps
        if llm.stats()["blocks_total"] * llm.stats()["block_size"] < max(batches) * ctx:
            raise SystemExit(f"the KV pool does not hold {max(batches)} sequences of {ctx} tokens")
        rng = np.random.default_rng(0)
        sp = SamplingParams(max_tokens=a.steps, ignore_eos=True, temperature=0)
        llm.generate([{"prompt_token_ids": rng.integers(10, 1000, a.prompt_len).tolist()}], sp, use_tqdm=False)
        print(f"load average {os.getloadavg()[0]:.2f} at start; {a.threads} threads")
        per_b = {}
        for B in batches:
            prompts = [{"prompt_token_ids": rng.integers(10, 1000, a.prompt_len).tolist()} for _ in range(B)]
            core.set_trace(True)
            core.take_trace()
            llm.generate(prompts, sp, use_tqdm=False)
            times = decode_steps(core, B)
            core.set_trace(False)
            if not times:
                print(f"B={B:3d}: no step ran all {B} sequences at once")
                continue
            med, best = statistics.median(times), min(times)
            per_b[B] = med
            print(f"B={B:3d}: {len(times):3d} decode steps, median {med * 1e3:7.2f} ms, min {best * 1e3:7.2f} ms, "
                  f"{B / med:7.1f} tok/s", flush=True)
        print_growth("step", per_b)


if __name__ == "__main__":
    main()
