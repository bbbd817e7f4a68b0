"""`conveyor bench scheduler`: the cost of one scheduling step.

A decode workload: `--running` sequences (default 1,024, the max_num_seqs cap)
decode one token each per step while `--waiting` more (default 100,000) wait
behind them, with plenty of KV blocks. After a warm-up that fills the running
set, it times schedule + commit per step two ways:

- in C (`Scheduler.bench_steps`): only cv_scheduler_schedule + cv_scheduler_commit,
  the fake runner's token appends outside the timed span;
- in Python (time.perf_counter around `schedule()` + `commit()`), which adds the
  binding's cost of building the plan as Python lists.

The same is measured with `--compare-waiting` (default 1,000) waiting sequences:
a step's cost should depend on the running sequences, not on the waiting queue,
so the two C figures should match. Figures on a shared machine are noisy:
compare the ratio, not absolute times.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..cli_args import count


def _core():
    from conveyor import _core
    return _core


def _testing():
    """The scheduler harness (Scheduler.bench_steps) lives in conveyor._testing."""
    from conveyor import _testing
    return _testing


def _pcts(seconds: List[float]) -> Dict[str, float]:
    a = np.asarray(seconds, dtype=np.float64) * 1e6
    return {"median_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean()), "max_us": float(a.max()), "steps": int(a.size)}


def measure(n_waiting: int, n_running: int, steps: int, py_steps: int, block_size: int,
            prompt_len: int, budget: int, policy: str) -> Dict[str, Any]:
    hooks = _testing()
    max_tokens = steps + py_steps + 64  # nobody finishes while measured
    per_seq = -(-(prompt_len + max_tokens) // block_size)
    cfg = dict(num_blocks=1 + n_running * per_seq, block_size=block_size, max_num_seqs=n_running,
               max_num_batched_tokens=budget, max_model_len=prompt_len + max_tokens,
               enable_prefix_caching=True, enable_chunked_prefill=True, policy=policy)
    s = hooks.Scheduler(**cfg)
    t0 = time.perf_counter()
    for i in range(n_running + n_waiting):
        # distinct prompts, so the prefix cache finds nothing to share
        s.add(i, [(i * 7 + j) % 50000 for j in range(prompt_len)], max_tokens)
    add_s = time.perf_counter() - t0

    # warm up: admit and prefill the running set, then one pure decode step
    for _ in range(10 * n_running):
        s.bench_steps(1)
        if s.stats()["n_running"] == n_running:
            break
    s.bench_steps(2)  # the last admitted finish their prefill
    st = s.stats()
    if st["n_running"] != n_running or st["n_waiting"] != n_waiting:
        raise RuntimeError(f"warm-up left {st['n_running']} running, {st['n_waiting']} waiting")

    c_times = s.bench_steps(steps)

    # Python-timed: the binding call with plan lists; appends outside the timing
    n_tokens = {}
    py_times = []
    for _ in range(py_steps):
        t0 = time.perf_counter()
        plan = s.schedule()
        s.commit()
        py_times.append(time.perf_counter() - t0)
        for sid, start, n in zip(plan["seq_ids"], plan["start_pos"], plan["num_new_tokens"]):
            if sid not in n_tokens:
                n_tokens[sid] = s.seq_info(sid)["n_tokens"]
            if start + n == n_tokens[sid]:
                s.append_token(sid, 1)
                n_tokens[sid] += 1
    s.check()
    st = s.stats()
    return {"waiting": n_waiting, "running": n_running, "config": cfg, "add_seconds": add_s,
            "c_schedule_commit": _pcts(c_times), "py_schedule_commit": _pcts(py_times),
            "tokens_per_step": n_running, "kv_waste": st["kv_waste"],
            "blocks_used": st["blocks_used"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench scheduler", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    ap.add_argument("--waiting", type=count, default=100_000, help="waiting sequences (default 100000)")
    ap.add_argument("--compare-waiting", type=count, default=1_000,
                    help="waiting sequences of the comparison run (default 1000)")
    ap.add_argument("--running", type=count, default=1024, help="running sequences = max_num_seqs")
    ap.add_argument("--steps", type=count, default=500, help="C-timed steps per run")
    ap.add_argument("--py-steps", type=count, default=50, help="Python-timed steps per run")
    ap.add_argument("--block-size", type=count, default=16, help="tokens per KV cache block")
    ap.add_argument("--prompt-len", type=count, default=16, help="tokens per prompt")
    ap.add_argument("--budget", type=count, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--policy", choices=["continuous", "priority", "static"], default="continuous",
                    help="the scheduling policy measured")
    ap.add_argument("--json", type=str, default=None, help="write the results as JSON to this file (default: none)")
    args = ap.parse_args(argv)

    core = _core()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "simd": getattr(core, "simd", "?"), "python": platform.python_version()}
    print(f"conveyor bench scheduler: {machine['platform']}, {machine['cpus']} CPUs, "
          f"simd {machine['simd']}")
    print(f"decode workload: {args.running} running (max_num_seqs), block_size {args.block_size}, "
          f"prompt {args.prompt_len}, budget {args.budget}, policy {args.policy}, prefix caching on")
    # a throwaway run first: the first measurement in a process pays for a cold
    # allocator and caches, which would bias whichever run came first
    measure(args.compare_waiting, args.running, min(args.steps, 200), 1, args.block_size,
            args.prompt_len, args.budget, args.policy)
    runs = []
    for waiting in (args.waiting, args.compare_waiting):
        runs.append(measure(waiting, args.running, args.steps, args.py_steps, args.block_size,
                            args.prompt_len, args.budget, args.policy))
    hdr = f"{'waiting':>9} {'running':>8} | {'C median':>9} {'C p99':>9} | {'Py median':>10} {'Py p99':>9}  (us per schedule+commit)"
    print(hdr)
    print("-" * len(hdr))
    for r in runs:
        c, p = r["c_schedule_commit"], r["py_schedule_commit"]
        print(f"{r['waiting']:>9} {r['running']:>8} | {c['median_us']:>9.1f} {c['p99_us']:>9.1f} | "
              f"{p['median_us']:>10.1f} {p['p99_us']:>9.1f}")
    ratio = runs[0]["c_schedule_commit"]["median_us"] / runs[1]["c_schedule_commit"]["median_us"]
    print(f"C median ratio {args.waiting} / {args.compare_waiting} waiting: {ratio:.2f} "
          f"(1.0 = independent of the waiting queue)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "runs": runs,
                       "c_median_ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
