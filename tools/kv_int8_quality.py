"""What the int8 KV cache costs in quality against the bf16 cache, on real models.

For each model (default: SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M from
~/.cache/conveyor) it measures, with the weights as the file stores them:

  (a) one forward pass over ~700 tokens of real text (the prose, code and figures of
      tools/bf16_activation_quality.py), all logits, once per KV cache dtype (float32,
      bfloat16, int8). Attention reads every key and value from the paged cache, the
      position's own included, so each row sees the cache's rounding at every earlier
      position. Per position: KL(p_bf16 || p_int8) in nats (mean, max), how often the
      argmax agrees, top-1 accuracy on the text's next token and perplexity; for scale,
      KL(p_f32 || p_bf16): what the bf16 cache itself costs against exact values;
  (b) greedy chat replies of up to 64 tokens to 10 prompts through conveyor.LLM with a
      float32, a bf16 and an int8 cache: for int8 against bf16, how many are identical
      token for token, where the others first differ, and the share of tokens equal up to
      the shorter reply; for scale, the same for the bf16 cache against the float32 one.

    python tools/kv_int8_quality.py [--model GGUF ...] [--threads 2] [--json out.json]

A measurement, not a test: it prints what it finds and asserts nothing about the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_activation_quality import (CHAT_PROMPTS, TEXT, all_logits, compare_logits,  # noqa: E402
                                     first_difference)

from conveyor import LLM, SamplingParams, _core  # noqa: E402
from conveyor.tokenizer import load_tokenizer  # noqa: E402

CACHE = Path.home() / ".cache" / "conveyor"
DEFAULT_MODELS = [CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf", CACHE / "gemma-3-270m-q4_k_m.gguf"]


def text_tokens(path: Path) -> tuple[list[int], dict]:
    """The evaluation text as one sequence (with the BOS token where the model's
    tokenizer adds one)."""
    tok = load_tokenizer(path)
    tokens: list[int] = []
    segments = {}
    for name, text in TEXT.items():
        ids = tok.encode(text, add_special_tokens=not tokens)
        segments[name] = (len(tokens), len(tokens) + len(ids))
        tokens += ids
    return tokens, segments


def greedy_replies(path: Path, kv_cache_dtype: str, threads: int, max_tokens: int) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, num_threads=threads, kv_cache_memory="256MiB")
    try:
        convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """How many replies are identical, where the others first differ, and the share of
    tokens equal position by position up to the shorter reply of each pair."""
    diffs = [first_difference(a, b) for a, b in zip(ref, other)]
    equal = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(ref, other))
    compared = sum(min(len(a), len(b)) for a, b in zip(ref, other))
    return {"prompts": len(ref), "identical": sum(d is None for d in diffs), "first_differences": diffs,
            "positionwise_equal": equal / max(1, compared)}


def measure(path: Path, threads: int, max_tokens: int) -> dict:
    tokens, segments = text_tokens(path)
    logits = {kv: all_logits(path, tokens, "auto", threads, kv_cache_dtype=kv)
              for kv in ("float32", "bfloat16", "int8")}
    text = {"int8 vs bf16": compare_logits(logits["bfloat16"], logits["int8"], tokens),
            "bf16 vs f32 (scale)": compare_logits(logits["float32"], logits["bfloat16"], tokens),
            "int8 vs f32": compare_logits(logits["float32"], logits["int8"], tokens)}
    for name, (s, e) in segments.items():
        text[f"  int8 vs bf16, {name}"] = compare_logits(logits["bfloat16"][s:e], logits["int8"][s:e], tokens[s:e])
    replies = {kv: greedy_replies(path, kv, threads, max_tokens) for kv in ("float32", "bfloat16", "int8")}
    greedy = {"int8 vs bf16": agreement(replies["bfloat16"], replies["int8"]),
              "bf16 vs f32 (scale)": agreement(replies["float32"], replies["bfloat16"]),
              "max_tokens": max_tokens}
    return {"model": str(path), "tokens": len(tokens), "segments": {k: e - s for k, (s, e) in segments.items()},
            "text": text, "greedy": greedy}


def print_result(r: dict) -> None:
    print(f"\n{Path(r['model']).name}: {r['tokens']} tokens of text ("
          + ", ".join(f"{k} {n}" for k, n in r["segments"].items()) + ")")
    print(f"{'':<26} {'KL mean':>9} {'KL max':>9} {'argmax =':>9} {'top-1':>7} {'ppl':>8}  (reference ppl)")
    for name, c in r["text"].items():
        print(f"{name:<26} {c['kl_mean']:9.2e} {c['kl_max']:9.2e} {c['argmax_agree']:9.4f} "
              f"{c['other']['top1']:7.4f} {c['other']['ppl']:8.3f}  ({c['ref']['ppl']:.3f})")
    print(f"greedy chat replies, up to {r['greedy']['max_tokens']} tokens:")
    for name, g in r["greedy"].items():
        if name != "max_tokens":
            print(f"  {name:<20} identical {g['identical']} of {g['prompts']}; first differences at "
                  f"{[d for d in g['first_differences'] if d is not None]}; "
                  f"{100 * g['positionwise_equal']:.1f}% of tokens equal position by position")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=None, help="a GGUF file (repeatable; default: the two above)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    models = [Path(m).expanduser() for m in a.model] if a.model else DEFAULT_MODELS
    missing = [str(m) for m in models if not m.is_file()]
    if missing:
        print(f"missing model files: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(f"SIMD {_core.kernel_info()['simd']}, {a.threads} threads; KL(reference || row) per position in nats")
    results = []
    for m in models:
        results.append(measure(m, a.threads, a.max_tokens))
        print_result(results[-1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
