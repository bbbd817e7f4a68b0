"""Chooses the scheduler's admission reserve by measurement.

Runs the study's workload (N requests, fixed prompt, outputs exponential with
a mean, capped) through the C scheduler alone, with a fake runner that
appends one token per computed sequence, for each admission reserve (percent of the expected remaining output), on
the same KV pool. Prints per setting: steps to drain (fewer = larger batches;
each step reads the weights once), tokens computed (recomputation included),
preemptions, recomputed tokens, mean running batch and median finishing step
(a latency proxy). Counts only, no timing: the numbers are exact and
repeatable on any machine.

    python tools/admission_sweep.py [--n 128] [--prompt 128] [--mean 128] [--kv 8192]
"""
import argparse

import numpy as np

from conveyor._testing import Scheduler


def run(reserve, prompt, outs, max_tokens, kv_tokens, block_size, max_seqs, budget, policy="continuous"):
    s = Scheduler(num_blocks=kv_tokens // block_size + 1, block_size=block_size, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, max_model_len=prompt + max(max_tokens),
                  enable_prefix_caching=False, admission_reserve=reserve, policy=policy)
    for i, m in enumerate(max_tokens):
        s.add(i, [1 + (i + j) % 97 for j in range(prompt)], int(m))
    steps = computed = batch = 0
    done = {}
    while s.num_unfinished():
        plan = s.schedule()
        s.commit()
        steps += 1
        computed += plan["total_tokens"]
        batch += s.stats()["n_running"]
        for sid in plan["seq_ids"]:
            info = s.seq_info(sid)
            if info["status"] != "running" or info["n_computed"] != info["n_tokens"]:
                continue
            s.append_token(sid, 7)
            if info["n_tokens"] + 1 - prompt >= outs[sid]:
                s.finish(sid, "stopped" if outs[sid] < max_tokens[sid] else "length")
                done[sid] = steps
    st = s.stats()
    return dict(steps=steps, computed=computed, preempt=st["n_preempted_total"],
                recomputed=st["n_recomputed_tokens"], resumed=st["n_resumed_tokens"],
                batch=batch / steps, p50_done=float(np.median(list(done.values()))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--mean", type=float, default=128)
    ap.add_argument("--caps", default="32,128,512")
    ap.add_argument("--kv", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reserves", default="-1,25,50,100,150,200,400")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    raw = np.maximum(1, rng.exponential(a.mean, a.n).round().astype(int))
    for cap in map(int, a.caps.split(",")):
        outs = np.minimum(raw, cap)
        # max_tokens known exactly (the study's ignore_eos requests), or only the cap (EOS ends them)
        for known, max_tokens in (("exact", outs), ("cap", np.full(a.n, cap))):
            print(f"cap {cap}, max_tokens {known}")
            print(f"  {'res%':>4} {'steps':>6} {'computed':>9} {'preempt':>7} {'recomp':>7} {'resumed':>7} "
                  f"{'batch':>6} {'p50 done':>8}")
            for pct in map(int, a.reserves.split(",")):
                r = run(pct, a.prompt, outs, max_tokens, a.kv, a.block_size, a.max_num_seqs, a.budget)
                print(f"  {pct:>4} {r['steps']:>6} {r['computed']:>9} {r['preempt']:>7} {r['recomputed']:>7} "
                      f"{r['resumed']:>7} {r['batch']:>6.1f} {r['p50_done']:>8.0f}")
            # the study's static batch: as many as fit at full length (cap), run to completion
            batch = max(1, (a.kv // a.block_size) // -(-(a.prompt + cap) // a.block_size))
            r = run(0, a.prompt, outs, max_tokens, a.kv, a.block_size, batch, a.budget, policy="static")
            print(f"  {'static':>6} {r['steps']:>4} {r['computed']:>9} {r['preempt']:>7} {r['recomputed']:>7} "
                  f"{r['resumed']:>7} {r['batch']:>6.1f} {r['p50_done']:>8.0f}")


if __name__ == "__main__":
    main()
