"""Development: two builds (or two settings) of one engine job, timed in lockstep.

On a shared 2-core VM one run can move 10-20% against the next, and the drift is
slow, so two builds timed minutes apart compare the hours more than the builds.
This script keeps one engine loaded per side (a child process each, so each can
import its own build) and runs the job on A and B in turn, alternating which goes
first, for ROUNDS pairs. It prints every pair's ratio B / A and their median.

  python tools/ab_lockstep.py JOB ROUNDS A B
    A, B: PYTHONPATH[:quantization][,VAR=VALUE...], e.g. /tmp/cv_build_old/lib and
          /tmp/cv_build_new/lib, or one build twice: DIR and DIR:q8_0, or DIR and
          DIR,CONVEYOR_WEIGHT_ARENA=0 (environment variables of that side only;
          AB_KV_CACHE_DTYPE=int8 sets that side's kv_cache_dtype)
    JOB:  b64      64 sequences, 16-token prompts, 64 tokens out (roofline's 64 running)
          b2, b4, b8, b16  2 to 16 sequences, 128-token prompts, 64 tokens out (small decode batches)
          prefill  4 prompts x 512 tokens, one token out (roofline's prefill)
          dec      one sequence, 64 tokens out, greedy (tokens/s between first and last)
          study    128 requests, prompts and outputs uniform in 64..192 (bench throughput's
                   --num-requests 128 --input-len 128 --output-len 128 --range-ratio 0.5)
  --model PATH   (default: the built-in default model; random-weight bf16 SmolLM shape)
  --threads N    (default 2)

Each figure is output tokens/s (prefill: prompt tokens/s). Build with
tools/dev_build.sh NAME, which prints the PYTHONPATH to pass.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def child(job: str, model: str, quant: str, threads: int) -> None:
    import numpy as np

    from conveyor import LLM, SamplingParams
    from conveyor.engine import EngineArgs
    from conveyor.generate import default_model

    rng = np.random.default_rng(0)
    # a pool for all 128 sequences on both sides (a build without the field sizes it so)
    pool = {"kv_cache_sequences": 128} if "kv_cache_sequences" in EngineArgs.__dataclass_fields__ else {}
    if os.environ.get("AB_KV_CACHE_DTYPE"):  # one side's KV cache dtype (a setting, not a build)
        pool["kv_cache_dtype"] = os.environ["AB_KV_CACHE_DTYPE"]
    llm = LLM(model or str(default_model()), num_threads=threads, max_num_seqs=128,
              enable_prefix_caching=False, quantization=quant or None, **pool)
    vocab = llm.model_config["vocab_size"]

    def prompts(n, lens):
        return [{"prompt_token_ids": rng.integers(0, vocab, int(L)).tolist()} for L in lens[:n]]

    def run() -> float:
        if job == "b64":
            ps, sp = prompts(64, [16] * 64), SamplingParams(max_tokens=64, ignore_eos=True)
        elif job in ("b2", "b4", "b8", "b16"):
            n = int(job[1:])
            ps, sp = prompts(n, [128] * n), SamplingParams(max_tokens=64, ignore_eos=True)
        elif job == "prefill":
            ps, sp = prompts(4, [512] * 4), SamplingParams(max_tokens=1)
        elif job == "dec":
            out = llm.generate(prompts(1, [32]), SamplingParams(max_tokens=65, ignore_eos=True, temperature=0.0),
                               use_tqdm=False)[0]
            return 64 / (out.metrics.finished_time - out.metrics.first_token_time)
        else:  # study
            ps = prompts(128, rng.integers(64, 193, 128))
            sp = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(64, 193, 128)]
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        if job == "prefill":
            return sum(len(p["prompt_token_ids"]) for p in ps) / dt
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    run()  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        print(f"{run():.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", choices=["b64", "b2", "b4", "b8", "b16", "prefill", "dec", "study"])
    ap.add_argument("rounds", type=int)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quant", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.job, a.model, a.quant, a.threads)
        return

    def spawn(spec: str) -> subprocess.Popen:
        build, *settings = spec.split(",")
        path, _, quant = build.partition(":")
        env = dict(os.environ, PYTHONPATH=path)
        for kv in settings:
            var, eq, value = kv.partition("=")
            if not eq:
                sys.exit(f"{spec}: {kv!r} is not VAR=VALUE")
            env[var] = value
        cmd = [sys.executable, __file__, a.job, "0", "-", "-", "--child", "--threads", str(a.threads),
               "--model", a.model, "--quant", quant]
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "ready":
            sys.exit(f"{spec}: the engine did not start")
        return p

    procs = [spawn(a.a), spawn(a.b)]

    def once(i: int) -> float:
        procs[i].stdin.write("go\n")
        procs[i].stdin.flush()
        return float(procs[i].stdout.readline())

    fa, fb, ratios = [], [], []
    for r in range(a.rounds):
        if r % 2:
            y, x = once(1), once(0)
        else:
            x, y = once(0), once(1)
        fa.append(x)
        fb.append(y)
        ratios.append(y / x)
        print(f"pair {r + 1}: A {x:9.1f}  B {y:9.1f}  B/A {y / x:.3f}", flush=True)
    print(f"median: A {statistics.median(fa):.1f}  B {statistics.median(fb):.1f}  "
          f"B/A {statistics.median(ratios):.3f} (pairs {min(ratios):.3f} .. {max(ratios):.3f}); "
          f"load average {os.getloadavg()[0]:.2f}")
    for p in procs:
        p.stdin.close()
        p.wait()


if __name__ == "__main__":
    main()
