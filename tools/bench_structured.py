"""Guided decoding overhead: a batch of 32 requests, half constrained by a JSON
schema, against the same batch unconstrained (same prompts, seeds and token
counts: ignore_eos is not usable with a grammar, so both runs use max_tokens
and the grammar is one that cannot finish early). Prints both times and the
ratio (target: within 1.3x). Take figures on a quiet machine.

    PYTHONPATH=python python tools/bench_structured.py [MODEL] [--n 32] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from conveyor import LLM, SamplingParams
from conveyor.guided import GuidedDecodingParams

DEFAULT = Path(__file__).resolve().parents[2] / "shared/models/stories260K/stories260K.bin"
# An array of short strings with no upper bound: it never completes before max_tokens.
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 5}}


def run(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    llm = LLM(a.model)
    prompts = [f"Once upon a time {i}" for i in range(a.n)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=a.max_tokens) for i in range(a.n)]
    guided = [p.clone(guided_decoding=GuidedDecodingParams(json=SCHEMA)) if i % 2 == 0 else p
              for i, p in enumerate(plain)]
    run(llm, prompts, plain)  # warm-up (the guided run builds the grammar tokenizer once)
    run(llm, prompts, guided)
    best_plain = best_guided = float("inf")
    for _ in range(a.repeats):
        t, n_plain = run(llm, prompts, plain)
        best_plain = min(best_plain, t)
        t, n_guided = run(llm, prompts, guided)
        best_guided = min(best_guided, t)
    print(f"unconstrained: {best_plain * 1e3:.1f} ms for {n_plain} tokens")
    print(f"half guided:   {best_guided * 1e3:.1f} ms for {n_guided} tokens")
    print(f"ratio (per token) guided/unconstrained: "
          f"{(best_guided / max(n_guided, 1)) / (best_plain / max(n_plain, 1)):.2f}x (target <= 1.30x)")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
