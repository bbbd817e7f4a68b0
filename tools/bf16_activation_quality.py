"""What rounding GEMM inputs to bf16 costs in quality, on the real model.

On a CPU with AVX512_BF16 the GEMMs over bf16 weights round their float32 input rows to
bf16 and run vdpbf16ps (activation_dtype="auto"); activation_dtype="float32" keeps them
exact. The default model, SmolLM2-135M-Instruct, is Q4_1, which never takes that path, so
this first writes a bf16 copy of it: every quantized matrix dequantized and stored as BF16,
the norm vectors F32 as in the original, the metadata (tokenizer, chat template, arch keys)
copied with its types. On that copy it measures:

  (a) one forward pass with all logits over ~740 tokens of real text (prose, code, numbers),
      once per setting: KL(p_fp32 || p_bf16) per position (mean, max), how often the argmax
      agrees, top-1 accuracy against the text's next token and perplexity of each setting;
      for scale, the same against an F32 copy (the exact dequantized weights: what the bf16
      copy's own weight rounding costs) and against the Q4_1 original on its own path (which
      quantizes GEMM inputs to 8 bits per block of 32);
  (b) greedy chat replies of up to 64 tokens to 10 prompts through conveyor.LLM, per
      setting: how many are identical token for token, where the others first differ, and
      how close the two candidate tokens were there (float32's log-probability gap); the
      Q4_1 original's replies against the same float32 ones, for scale.

    python tools/bf16_activation_quality.py [--model Q4_1.gguf] [--out bf16.gguf] [--json out.json]

A measurement, not a test: it prints what it finds (and which path "auto" ran) and asserts
nothing about the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from conveyor import LLM, SamplingParams, _core, _testing
from conveyor.gguf import GGMLType, GGUFReader, GGUFWriter, quantize
from conveyor.tokenizer import load_tokenizer


# The evaluation text, in segments scored together but reported apart. The prose is the
# opening of Jane Austen's Pride and Prejudice (1813, public domain); the code and the
# figures are written for this script.
TEXT = {
    "prose": """It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from the north of England; that he came down on Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his servants are to be in the house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine thing for our girls!"
""",
    "code": '''
def word_counts(path):
    """Counts how often each word occurs in a text file, most frequent first."""
    counts = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?\\"'()")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


if __name__ == "__main__":
    import sys
    for word, n in word_counts(sys.argv[1])[:10]:
        print(f"{n:6d}  {word}")
''',
    "numbers": """
The Earth is on average about 149.6 million kilometres from the Sun, and light covers that distance in roughly 8 minutes and 20 seconds. One year lasts about 365.25 days, which is why a leap day is added every 4 years, except in years divisible by 100 but not by 400: 1900 was not a leap year, 2000 was. The Moon orbits the Earth every 27.3 days at a mean distance of 384,400 km. Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level and freezes at 0 degrees Celsius (32 degrees Fahrenheit). The first ten prime numbers are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29, and their sum is 129.
""",
}

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for sleeping better.",
    "How do you say 'good morning' in French and in Spanish?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short, polite email declining a meeting invitation.",
]


# ---------------------------------------------------------------------------- the bf16 copy


FILE_TYPE = {GGMLType.BF16: 32, GGMLType.F32: 0}  # general.file_type (llama.cpp's numbering)


def write_dequantized_copy(src: Path, dst: Path, ggml_type=GGMLType.BF16) -> Path:
    """The model of ``src`` with every non-F32 tensor dequantized and stored as ``ggml_type``
    (BF16 or F32); F32 tensors (the norms) and all metadata copied as they are, except
    general.file_type."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, alignment=r.alignment, version=r.version)
    for key, value in r.metadata.items():
        vt, et = r.metadata_types[key]
        if key == "general.file_type":
            value = FILE_TYPE[ggml_type]
        w.add(key, value, vt, et)
    for name, info in r.tensors.items():
        if info.ggml_type == GGMLType.F32:
            w.add_tensor_producer(name, info.shape, GGMLType.F32, lambda n=name: [r.raw(n).tobytes()])
        else:  # one tensor in memory at a time (token_embd is 113 MB as float32)
            w.add_tensor_producer(name, info.shape, ggml_type,
                                  lambda n=name: [quantize(r.tensor(n), ggml_type).tobytes()])
    return w.write()


def copy_path(src: Path, ggml_type) -> Path:
    stem = src.name.split(".")[0]  # SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct
    return src.parent / "derived" / f"{stem}.{ggml_type.name}.gguf"


def ensure_copy(src: Path, dst: Path, ggml_type, rebuild: bool) -> Path:
    if rebuild or not dst.is_file() or dst.stat().st_mtime < src.stat().st_mtime:
        print(f"writing the {ggml_type.name} copy of {src} to {dst} ...", flush=True)
        write_dequantized_copy(src, dst, ggml_type)
    return dst


# ---------------------------------------------------------------------------- (a) logits


def all_logits(path: Path, tokens: list[int], activation_dtype: str, threads: int, last_only=False,
               kv_cache_dtype="float32") -> np.ndarray:
    """Logits of every position (or the last) of one sequence, fed in one pass (a float32
    KV cache by default, so the only difference between the two settings is the GEMM inputs)."""
    bs, n = 16, len(tokens)
    rows = np.array([n - 1], np.int32) if last_only else np.arange(n, dtype=np.int32)
    nblk = (n + bs - 1) // bs
    with _testing.ModelRunner(str(path), block_size=bs, num_blocks=nblk + 2, max_tokens=n, max_seqs=n,  # max_seqs bounds the logits rows
                           num_threads=threads, activation_dtype=activation_dtype,
                           kv_cache_dtype=kv_cache_dtype) as r:
        return r.forward(tokens=np.array(tokens, np.int32), positions=np.arange(n, dtype=np.int64),
                         slot_mapping=np.arange(bs, bs + n, dtype=np.int64),
                         query_start=np.array([0, n], np.int32), context_lens=np.array([n], np.int32),
                         block_tables=np.arange(1, nblk + 1, dtype=np.int32)[None, :],
                         logits_rows=rows)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def compare_logits(ref: np.ndarray, other: np.ndarray, tokens: list[int]) -> dict:
    """KL(ref || other) per position in nats, argmax agreement, and each side's top-1
    accuracy and perplexity on the text's next tokens (the last position has none)."""
    lp, lq = log_softmax(ref), log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    nxt = np.array(tokens[1:])
    rows = np.arange(len(nxt))

    def side(l, raw):
        return {"top1": float((raw[:-1].argmax(axis=1) == nxt).mean()),
                "ppl": float(np.exp(-l[rows, nxt].mean()))}

    a, b = ref.argmax(1), other.argmax(1)
    moved = np.flatnonzero(a != b)  # how close ref's top two were where the argmax moved
    gaps = lp[moved, a[moved]] - lp[moved, b[moved]]
    return {"positions": len(tokens), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "kl_max_at": int(kl.argmax()), "argmax_agree": float((a == b).mean()),
            "argmax_moved_gap_max": float(gaps.max()) if len(gaps) else None,
            "ref": side(lp, ref), "other": side(lq, other)}


# ---------------------------------------------------------------------------- (b) greedy


def greedy_replies(path: Path, activation_dtype: str, threads: int, max_tokens: int) -> tuple:
    """[(prompt ids, reply ids, reply text) per chat prompt], the engine's KV cache dtype."""
    llm = LLM(str(path), activation_dtype=activation_dtype, num_threads=threads, kv_cache_memory="256MiB")
    try:
        convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        return ([(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs],
                llm.model_config["kv_cache_dtype"])
    finally:
        llm.close()


def first_difference(a: list[int], b: list[int]):
    """Index of the first token that differs (or where one reply ends first); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the Q4_1 GGUF (default: python -m conveyor.default_model)")
    ap.add_argument("--out", default=None, help="where the bf16 copy goes (default: <cache>/derived/)")
    ap.add_argument("--rebuild", action="store_true", help="write the bf16 copy even if it exists")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)

    if a.model is None:
        from conveyor.default_model import resolve_default_model

        a.model = resolve_default_model()
        if a.model is None:
            print("no default model (offline?); pass --model", file=sys.stderr)
            return 2
    src = Path(os.fspath(a.model)).expanduser()
    dst = ensure_copy(src, Path(a.out).expanduser() if a.out else copy_path(src, GGMLType.BF16),
                      GGMLType.BF16, a.rebuild)
    # the exact dequantized values, to tell the copy's weight rounding from the activations'
    f32 = ensure_copy(src, dst.with_name(dst.name.replace(".BF16.", ".F32.")) if ".BF16." in dst.name
                      else dst.with_suffix(".F32.gguf"), GGMLType.F32, a.rebuild)
    info = _core.kernel_info()
    print(f"bf16 copy: {dst} ({dst.stat().st_size / 1e6:.0f} MB)")
    print(f"SIMD {info['simd']}; gemm_bf16 path (what 'auto' runs on bf16 weights): "
          f"{info['paths']['gemm_bf16']}; gemm_f32 path: {info['paths']['gemm_f32']}")
    if info["paths"]["gemm_bf16"] != "avx512_bf16":
        print("note: no vdpbf16ps here, so 'auto' and 'float32' are the same path")
    results = {"model": str(src), "bf16_copy": str(dst), "f32_copy": str(f32), "kernel_paths": info["paths"], "simd": info["simd"]}

    # (a) one pass over the text, all logits
    tok = load_tokenizer(dst)
    segments, tokens = {}, []
    for name, text in TEXT.items():
        ids = tok.encode(text, add_special_tokens=False)
        segments[name] = (len(tokens), len(tokens) + len(ids))
        tokens += ids
    print(f"\n(a) {len(tokens)} tokens of text (" + ", ".join(f"{k} {e - s}" for k, (s, e) in segments.items())
          + f"), one forward pass each, {a.threads} threads", flush=True)
    exact = all_logits(dst, tokens, "float32", a.threads)
    auto = all_logits(dst, tokens, "auto", a.threads)
    q4 = all_logits(src, tokens, "auto", a.threads)
    f32_exact = all_logits(f32, tokens, "float32", a.threads)
    rows = {"bf16 activations (auto)": compare_logits(exact, auto, tokens),
            "F32 copy, fp32 activations": compare_logits(exact, f32_exact, tokens),
            "Q4_1 original (its path)": compare_logits(exact, q4, tokens)}
    for name, (s, e) in segments.items():
        rows[f"  auto, {name} only"] = compare_logits(exact[s:e], auto[s:e], tokens[s:e])
    ref = rows["bf16 activations (auto)"]["ref"]
    print(f"reference: bf16 weights, float32 activations: top-1 {ref['top1']:.4f}, perplexity {ref['ppl']:.3f}")
    print("KL(reference || row) per position in nats; argmax =: share of positions with the same argmax;\n"
          "gap: the largest log p gap (reference) between the two argmaxes where they differ")
    print(f"{'against the reference':<28} {'KL mean':>9} {'KL max':>9} {'argmax =':>9} {'gap':>6} {'top-1':>7} {'ppl':>8}")
    for name, r in rows.items():
        g = r["argmax_moved_gap_max"]
        print(f"{name:<28} {r['kl_mean']:9.2e} {r['kl_max']:9.2e} {r['argmax_agree']:9.4f} "
              f"{'-' if g is None else f'{g:.3f}':>6} {r['other']['top1']:7.4f} {r['other']['ppl']:8.3f}")
    results["text"] = {"tokens": len(tokens), "segments": {k: e - s for k, (s, e) in segments.items()},
                       "compare": rows}

    # the copy is the same model as the Q4_1 original (greedy replies to the first prompt)
    sanity = {}
    for label, path in (("Q4_1 original", src), ("bf16 copy", dst)):
        llm = LLM(str(path), num_threads=a.threads, kv_cache_memory="256MiB")
        try:
            out = llm.chat([{"role": "user", "content": CHAT_PROMPTS[1]}],
                           SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
        finally:
            llm.close()
        sanity[label] = out.text
    print(f"\nsanity, greedy reply to {CHAT_PROMPTS[1]!r}:")
    for label, text in sanity.items():
        print(f"  {label:<14} {text!r}")
    results["sanity"] = sanity

    # (b) greedy chat replies per setting
    print(f"\n(b) greedy chat replies, up to {a.max_tokens} tokens, {len(CHAT_PROMPTS)} prompts", flush=True)
    exact_r, kv_dtype = greedy_replies(dst, "float32", a.threads, a.max_tokens)
    auto_r, _ = greedy_replies(dst, "auto", a.threads, a.max_tokens)
    q4_r, _ = greedy_replies(src, "auto", a.threads, a.max_tokens)
    replies = []
    print("tokens: float32/auto replies; first diff: the first token where auto (or the Q4_1 original)\n"
          "differs from float32; gap: log p(float32's token) - log p(auto's token) there, under float32\n"
          f"activations and a {kv_dtype} KV cache as the engine ran (a small gap is a near tie)")
    print(f"{'prompt':<46} {'tokens':>7} {'first diff':>10} {'gap, nats':>10} {'Q4_1 diff':>10}")
    for p, (pids, x, tx), (_, y, ty), (_, z, tz) in zip(CHAT_PROMPTS, exact_r, auto_r, q4_r):
        d, dq = first_difference(x, y), first_difference(x, z)
        gap = None
        if d is not None and d < min(len(x), len(y)):
            lp = log_softmax(all_logits(dst, pids + x[:d], "float32", a.threads, last_only=True,
                                        kv_cache_dtype=kv_dtype))[0]
            gap = float(lp[x[d]] - lp[y[d]])
        replies.append({"prompt": p, "tokens_fp32": len(x), "tokens_auto": len(y), "first_difference": d,
                        "gap_nats": gap, "q4_1_first_difference": dq, "text_fp32": tx, "text_auto": ty,
                        "text_q4_1": tz})
        print(f"{p[:45]:<46} {len(x):>3}/{len(y):<3} {'same' if d is None else d:>10} "
              f"{'' if gap is None else f'{gap:.3f}':>10} {'same' if dq is None else dq:>10}")
    same = sum(r["first_difference"] is None for r in replies)
    same_q4 = sum(r["q4_1_first_difference"] is None for r in replies)
    print(f"identical token for token to float32: auto {same} of {len(replies)}, "
          f"Q4_1 original {same_q4} of {len(replies)}")
    for r in replies:
        if r["first_difference"] is not None:
            print(f"\n  {r['prompt']!r} (first difference at token {r['first_difference']})\n"
                  f"    float32: {r['text_fp32']!r}\n    auto:    {r['text_auto']!r}")
    results["greedy"] = {"identical": same, "identical_q4_1": same_q4, "prompts": len(replies), "replies": replies}

    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
