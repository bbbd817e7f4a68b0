"""Chooses the scheduler's admission policy by measurement.

Runs the study's workload (N requests, fixed prompt, outputs exponential with
a mean, capped) through the C scheduler alone, with a fake runner that
appends one token per computed sequence, on the same KV pool, and charges
each step a modeled time, A + B_d * decode tokens + B_p * prompt tokens
(+ B_c * kilo-tokens of the decodes' contexts): the engine's own step-time
model, step_cost.h. The defaults are this project's 2-core Zen 4 machine on the
study's SmolLM-135M-shaped bf16 checkpoint (docs/dev/admission.md says how they
were measured).
Prints per setting: steps, tokens computed (recomputation included),
preemptions, recomputed tokens, mean running batch, and the modeled output
tokens/s (as a ratio to static batching's) and p50/p99 completion times of
requests that all arrive at once. Counts are exact; modeled times are as good
as the linear step model (it predicted the measured study within 2-4%).

    python tools/admission_sweep.py [--n 128] [--prompt 128] [--mean 128] [--kv 8192]
        [--reserves -1,0,50] [--policies continuous,fcfs] [--targets 0,24,32]
"""
import argparse

import numpy as np

from conveyor.engine import OFFLINE_PREFILL_CAP
from conveyor._testing import Scheduler, step_cost_knee
from conveyor.bench.common import capped_exponential

PROBE_EVERY, PROBE_MIN_DECODES = 8, 8  # the engine's (csrc/core/step_cost.h)


def run(outs, max_tokens, *, prompt, kv_tokens, block_size, max_seqs, budget, cost, policy="continuous",
        reserve=0, target=0, adaptive=False, cohort=False, drain=0, prefill_cap=0, noise=0.0, seed=0):
    """One workload, all arriving at once; target: a fixed running target (0: none);
    cohort: shortest-remaining-first in cohorts, emulated through the running target: the
    next request (the shortest max_tokens not yet started) is admitted only while its work
    (prompt and max_tokens, at the modeled costs) is at most the largest remaining work among
    the running ones, so a batch drains before longer requests start;
    drain: once that many requests have started, admit nothing until all of them ended
    (one drain, emulated through the running target);
    adaptive: the engine's rule (the knee of the step-time model fitted on the steps run,
    the last knee kept while the model cannot pin it down, and then half of every
    CV_STEP_COST_PROBE_EVERY-th step's decodes held back); noise: each step's time is
    multiplied by 1 + noise * N(0, 1)."""
    s = Scheduler(num_blocks=kv_tokens // block_size + 1, block_size=block_size, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, max_model_len=prompt + max(max_tokens),
                  enable_prefix_caching=False, admission_reserve=reserve, policy=policy,
                  max_prefill_tokens_while_decoding=prefill_cap)
    s.set_running_target(target)
    for i, m in enumerate(max_tokens):
        s.add(i, [1 + (i + j) % 97 for j in range(prompt)], int(m))
    steps = computed = batch = 0
    clock, done, seen = 0.0, {}, []
    rng = np.random.default_rng(seed)
    since_probe = 0
    started, made = set(), {}
    by_length = sorted(range(len(max_tokens)), key=lambda i: (max_tokens[i], i))
    while s.num_unfinished():
        if cohort:
            running = [i for i in started if i not in done]
            nxt = next((i for i in by_length if i not in started), None)
            left = max(((cost[2] * prompt if i not in made else 0.0) + cost[1] * (max_tokens[i] - made.get(i, 0))
                        for i in running), default=0.0)
            s.set_running_target(len(running) if nxt is not None and running and
                                 cost[2] * prompt + cost[1] * max_tokens[nxt] > left else 0)
        if drain:
            live = sum(1 for i in started if i not in done)
            s.set_running_target(live if len(started) >= drain and live and len(done) < drain else 0)
        plan = s.schedule()
        started.update(plan["seq_ids"])
        s.commit()
        steps += 1
        computed += plan["total_tokens"]
        batch += s.stats()["n_running"]
        decodes = [(n, p) for n, p in zip(plan["num_new_tokens"], plan["start_pos"]) if p >= prompt]
        decode, context = sum(n for n, _ in decodes), sum(p for _, p in decodes)
        t = cost[0] + cost[1] * decode + cost[2] * (plan["total_tokens"] - decode) + cost[3] * context / 1024
        if noise:
            t *= max(0.1, 1.0 + noise * rng.standard_normal())
        clock += t
        if adaptive:
            seen.append((decode, plan["total_tokens"] - decode, t, context))
            knee = step_cost_knee(seen[-400:], max_seqs)[0]
            since_probe += 1
            if knee is not None:
                s.set_running_target(knee)
                since_probe = 0
            elif (since_probe >= PROBE_EVERY and decode >= PROBE_MIN_DECODES
                  and s.num_unfinished() > s.stats()["n_running"]):
                s.limit_next_decodes(decode // 2)
                since_probe = 0
        for sid in plan["seq_ids"]:
            info = s.seq_info(sid)
            if info["status"] != "running" or info["n_computed"] != info["n_tokens"]:
                continue
            s.append_token(sid, 7)
            made[sid] = made.get(sid, 0) + 1
            if info["n_tokens"] + 1 - prompt >= outs[sid]:
                s.finish(sid, "stopped" if outs[sid] < max_tokens[sid] else "length")
                done[sid] = clock
    st = s.stats()
    e2e = np.array(list(done.values()))
    return dict(steps=steps, computed=computed, preempt=st["n_preempted_total"],
                recomputed=st["n_recomputed_tokens"], resumed=st["n_resumed_tokens"],
                batch=batch / steps, tps=float(np.sum(outs)) / clock, p50=float(np.median(e2e)),
                p99=float(np.percentile(e2e, 99)), mean=float(np.mean(e2e)))


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
    ap.add_argument("--prefill-cap", type=int, default=OFFLINE_PREFILL_CAP,
                    help="prompt tokens a step may carry while a sequence decodes (0: no cap; "
                         "default: LLM's, as the study runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.0,
                    help="relative timing noise of each step (the adaptive rule sees it)")
    ap.add_argument("--reserves", default="0", help="admission reserves (percent; 0: the default, -1: none)")
    ap.add_argument("--policies", default="fcfs,continuous")
    ap.add_argument("--targets", default="0,adaptive",
                    help="running targets: numbers (0: none), 'adaptive' (the engine's knee rule), 'cohort' "
                         "(shortest-remaining-first cohorts) or 'drainK' (one drain after K started; see run())")
    ap.add_argument("--cost", default="9e-3,1.38e-3,1.05e-3",
                    help="A,B_d,B_p[,B_c] seconds: a step's fixed time, per decode token, per prompt token "
                         "(measured: decode steps at 1..48 running and prompt-only steps, quiet machine), and "
                         "per kilo-token of the contexts the decodes attend to (default 0)")
    ap.add_argument("--max-tokens", default="exact", choices=["exact", "cap"],
                    help="each request's max_tokens: its output length (ignore_eos, the study) or the cap")
    a = ap.parse_args()
    cost = tuple(float(x) for x in a.cost.split(","))
    cost = cost + (0.0,) * (4 - len(cost))
    common = dict(prompt=a.prompt, kv_tokens=a.kv, block_size=a.block_size, budget=a.budget, cost=cost,
                  prefill_cap=a.prefill_cap, noise=a.noise, seed=a.seed)
    for cap in map(int, a.caps.split(",")):
        outs = capped_exponential(np.random.default_rng([a.seed, 2]), a.n, a.mean, cap)
        max_tokens = outs if a.max_tokens == "exact" else np.full(a.n, cap)
        batch = max(1, (a.kv // a.block_size) // -(-(a.prompt + cap) // a.block_size))
        st = run(outs, max_tokens, policy="static", max_seqs=batch, **common)
        print(f"cap {cap}, max_tokens {a.max_tokens}: static batch {batch}: {st['tps']:.1f} out tok/s, "
              f"p50 {st['p50']:.2f} s, p99 {st['p99']:.2f} s, mean {st['mean']:.2f} s, {st['steps']} steps")
        print(f"  {'policy':>10} {'res%':>4} {'target':>8} {'steps':>6} {'computed':>9} {'preempt':>7} "
              f"{'recomp':>7} {'batch':>6} {'tok/s':>7} {'p50 s':>6} {'p99 s':>6} {'mean s':>6}")
        for policy in a.policies.split(","):
            for pct in map(int, a.reserves.split(",")):
                for target in a.targets.split(","):
                    adaptive, cohort = target == "adaptive", target == "cohort"
                    drain = int(target[5:]) if target.startswith("drain") else 0
                    r = run(outs, max_tokens, policy=policy, reserve=pct, max_seqs=a.max_num_seqs,
                            target=0 if adaptive or cohort or drain else int(target), adaptive=adaptive,
                            cohort=cohort, drain=drain, **common)
                    print(f"  {policy:>10} {pct:>4} {target:>8} {r['steps']:>6} {r['computed']:>9} "
                          f"{r['preempt']:>7} {r['recomputed']:>7} {r['batch']:>6.1f} "
                          f"{r['tps'] / st['tps']:>6.3f}x {r['p50']:>6.2f} {r['p99']:>6.2f} {r['mean']:>6.2f}")


if __name__ == "__main__":
    main()
