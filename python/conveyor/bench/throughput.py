"""`conveyor bench throughput`: offline throughput (after vLLM's benchmark_throughput).

N requests are submitted at once to one engine and run to completion. Prompts are
token ids drawn uniformly from the vocabulary with a fixed seed; prompt and output
lengths are fixed (``--input-len``, ``--output-len``) or sampled uniformly within
``--range-ratio`` of them; EOS is ignored so every request makes exactly its
``max_tokens``. Prints requests/s, total tokens/s ((prompt + output) / wall time) and
output tokens/s, and the mean KV waste sampled after every step.

``--warm`` first runs a workload of the same shape (other prompt tokens, so the
prefix cache cannot serve the timed run) once, untimed, on the same engine: the
figure is then a long-lived engine's (a server's, a notebook's), whose KV pages and
buffers already exist, instead of a fresh process's first batch. The first touch of
new memory can cost far more than the work itself: in a VM that backs its memory
lazily it was measured at 0.17 GB/s, seconds for the KV blocks of one batch.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from . import common
from ..cli_args import count


def run(model: str, *, num_requests: int = 64, input_len: int = 128, output_len: int = 64,
        range_ratio: float = 0.0, seed: int = 0, scheduling: str = "continuous",
        max_num_seqs: int = 256, max_num_batched_tokens: Optional[int] = None, warm: bool = False,
        bound: bool = False, **engine) -> Dict[str, Any]:
    """One throughput run (warm: after an untimed run of the same shape, other
    prompts, on the same engine; bound: with the workload's physical bound, as
    `bench bound` computes it, measured after the run); returns a JSON-ready dict."""
    machine = common.machine_info()
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    vocab = common.checkpoint_config(model)["vocab_size"]
    rng = np.random.default_rng([seed, 3])

    def lengths(center):
        lo = max(1, int(round(center * (1 - range_ratio))))
        hi = max(lo, int(round(center * (1 + range_ratio))))
        return common.uniform_lengths(rng, num_requests, lo, hi)

    prompt_lens, output_lens = lengths(input_len), lengths(output_len)
    wl = common.make_workload(n=num_requests, vocab_size=vocab, prompt_lens=prompt_lens,
                              output_lens=output_lens, seed=seed)
    common.warm_up(model, **engine)
    llm = common.make_llm(model, scheduling=scheduling, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, workload=wl, **engine)
    try:
        if warm:  # the same lengths, other tokens
            common.run_offline(llm, common.make_workload(n=num_requests, vocab_size=vocab, prompt_lens=prompt_lens,
                                                         output_lens=output_lens, seed=seed + 1),
                               sample_stats=False)
        hits0 = llm.stats()["prefix_hits"]
        res = common.run_offline(llm, wl)
        stats = llm.stats()
        res["prefix_hits"] = stats["prefix_hits"] - hits0
        if bound:
            from .bound import engine_bound, measure_machine

            res["bound"] = engine_bound(llm, model, prompt_lens, output_lens,
                                        measure_machine(engine.get("num_threads") or 0), max_seqs=max_num_seqs)
        model_desc = common.model_info(llm, model)
    finally:
        llm.close()
    out = common.strip_outputs(res)
    out.update(benchmark="throughput", machine=machine, model=model_desc,
               workload=wl.describe(),
               knobs={"scheduling": scheduling, "max_num_seqs": max_num_seqs, "warm": warm,
                      "max_num_batched_tokens": stats["max_num_batched_tokens"],
                      "block_size": stats["block_size"], "kv_cache_bytes": stats["kv_cache_bytes"],
                      "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio,
                      **{k: v for k, v in engine.items() if k != "block_size"}})
    return out


def format_result(r: Dict[str, Any]) -> str:
    t = r["throughput"]
    kv = r.get("kv", {})
    lines = [
        f"requests:        {r['workload']['num_requests']} "
        f"(prompt tokens {r['prompt_tokens']}, output tokens {r['output_tokens']})",
        f"elapsed:         {t['wall_s']:.2f} s over {r['steps']} steps, "
        f"{r['preemptions']} preemptions, mean running {r.get('running_mean', float('nan')):.1f}",
        f"Throughput: {t['requests_per_s']:.2f} requests/s, {t['total_tokens_per_s']:.1f} total tokens/s, "
        f"{t['output_tokens_per_s']:.1f} output tokens/s",
    ]
    if r.get("speculative"):
        from ..speculative import format_spec

        lines.append(format_spec(r["speculative"]))
    if kv:
        lines.append(f"KV waste:        mean {100 * kv['waste_mean']:.2f}%, max {100 * kv['waste_max']:.2f}% "
                     f"(block size {kv['block_size']}, peak {kv['blocks_used_peak']} blocks)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench throughput", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    common.add_engine_args(ap)
    ap.add_argument("--num-requests", "--num-prompts", type=count, default=64, dest="num_requests",
                    help="requests, all sent at once")
    ap.add_argument("--input-len", type=count, default=128, help="prompt tokens per request")
    ap.add_argument("--output-len", type=count, default=64, help="output tokens per request")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="sample lengths uniformly in [len*(1-r), len*(1+r)] (default 0: fixed)")
    ap.add_argument("--scheduling", default="continuous", choices=["continuous", "fcfs", "static", "priority"],
                    help="batching policy")
    ap.add_argument("--max-num-seqs", type=count, default=256, help="sequences running at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens computed in one step (default: the engine's)")
    ap.add_argument("--warm", action="store_true",
                    help="time a second run of the workload on the same engine (a long-lived engine's figure)")
    ap.add_argument("--bound", action="store_true",
                    help="also print the workload's physical bound and the fraction of it reached (bench bound)")
    ap.add_argument("--json", default=None, help="write the result as JSON to this file (default: none)")
    args = ap.parse_args(argv)

    model = common.resolve_model(args.model)
    r = run(model, num_requests=args.num_requests, input_len=args.input_len,
            output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
            scheduling=args.scheduling, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, warm=args.warm, bound=args.bound,
            **common.engine_kwargs(args))
    print("conveyor bench throughput")
    print(common.describe(r["machine"], r["model"], args.device))
    k = r["knobs"]
    print(f"knobs: scheduling {k['scheduling']}, max_num_seqs {k['max_num_seqs']}, token budget "
          f"{k['max_num_batched_tokens']}, block size {k['block_size']}, input {args.input_len}, "
          f"output {args.output_len}, range ratio {args.range_ratio}, seed {args.seed}"
          f"{', warm engine' if args.warm else ''}; weights "
          f"{r['model'].get('matrix_dtype')}, KV {r['model'].get('kv_cache_dtype')}")
    print(format_result(r), flush=True)
    if r.get("bound"):
        from .bound import ratio_line

        print(ratio_line("this workload", r["bound"], r["throughput"]["wall_s"]), flush=True)
    common.write_outputs(r, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
