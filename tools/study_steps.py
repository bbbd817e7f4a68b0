"""Where the study's time goes, step by step: one cap's workload (as `conveyor bench study`
draws it) through Conveyor with one scheduling and the engine's step trace, then the steps
split into prompt-only, mixed and decode-only, the decode-only steps by batch size (time a
decode and context a decode), and the least-squares step model
t = A + B_d * decodes + B_p * prompt tokens + B_c * kilo-tokens of the decodes' contexts.

    python tools/study_steps.py --cap 128 --scheduling static continuous
"""
import argparse

import numpy as np

from conveyor.bench import common
from conveyor.bench.study import kv_bytes_per_token, plan_batch, run_conveyor
from conveyor.bench.workloads import make_study_workload, workload_hash
from conveyor.models import random_checkpoint

BUCKETS = ((1, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 64), (64, 257))


def run(model: str, cap: int, scheduling: str, args) -> dict:
    """bench study's run of one Conveyor system, with the step trace taken apart per step."""
    cfg = common.checkpoint_config(model)
    dtype = cfg.get("dtype", "float32")
    wl = make_study_workload(vocab_size=cfg["vocab_size"], num_requests=args.num_requests,
                             prompt_len=args.prompt_len, mean_output=args.mean_output, cap=cap, seed=0)
    plan = plan_batch(kv_tokens=args.kv_tokens, prompt_len=args.prompt_len, cap=cap, block_size=16,
                      num_requests=args.num_requests, batch_size=None)
    spec = {"system": f"conveyor_{scheduling}", "model": model, "dtype": dtype, "device": "cpu",
            "threads": args.threads, "block_size": 16, "trace": True,
            "batch_size": 256 if scheduling == "continuous" else plan["batch_size"],
            "kv_pool_bytes": plan["pool_blocks"] * 16 * kv_bytes_per_token(cfg, dtype)}
    res = run_conveyor(spec, wl.prompts, wl.output_lens, workload_hash(wl.prompts, wl.output_lens))
    steps, pos = {}, {}
    for step, t0, t1, rid, _idx, n_new, n_prompt_work in res["trace"]:
        s = steps.setdefault(step, dict(t=t1 - t0, dec=0, prompt=0, ctx=0))
        pos[rid] = pos.get(rid, 0) + n_new
        if n_prompt_work:
            s["prompt"] += n_prompt_work
        else:
            s["dec"] += n_new
            s["ctx"] += pos[rid]
    return dict(wall=res["wall_s"], tps=res["output_tokens_per_s"], p50=res["e2e"]["p50"],
                steps=[steps[k] for k in sorted(steps)])


def report(name: str, res: dict) -> None:
    st = res["steps"]
    t, dec, pr, ctx = (np.array([s[k] for s in st], dtype=float) for k in ("t", "dec", "prompt", "ctx"))
    print(f"{name}: {res['tps']:.1f} out tok/s, p50 {res['p50']:.2f} s, wall {res['wall']:.2f} s, "
          f"steps {len(st)} ({t.sum():.2f} s)")
    for label, m in (("prompt-only", dec == 0), ("mixed", (pr > 0) & (dec > 0)), ("decode-only", pr == 0)):
        print(f"  {label:<12} {int(m.sum()):5d} steps {t[m].sum():7.2f} s  decodes {int(dec[m].sum()):6d}  "
              f"prompt tokens {int(pr[m].sum()):6d}")
    only = pr == 0
    for lo, hi in BUCKETS:
        m = only & (dec >= lo) & (dec < hi)
        if m.any():
            print(f"    {lo:3d}-{hi - 1:<3d} decodes: {int(m.sum()):4d} steps, {np.mean(t[m]) * 1e3:6.1f} ms a step, "
                  f"{np.mean(t[m] / dec[m]) * 1e3:5.2f} ms and {np.mean(ctx[m] / dec[m]):4.0f} context tokens a decode")
    fit = np.linalg.lstsq(np.c_[np.ones(len(t)), dec, pr, ctx / 1024], t, rcond=None)[0] * 1e3
    print("  fit: A %.2f ms, B_d %.3f ms a decode, B_p %.3f ms a prompt token, B_c %.3f ms a kilo-token of context"
          % tuple(fit))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the study's SmolLM-135M-shaped bf16 checkpoint")
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--scheduling", nargs="+", default=["static", "continuous"], choices=["static", "continuous"])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--mean-output", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = a.model or str(random_checkpoint(shape="smollm-135m", dtype="bfloat16"))
    for s in a.scheduling:
        report(s, run(model, a.cap, s, a))


if __name__ == "__main__":
    main()
