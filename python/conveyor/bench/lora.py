"""`conveyor bench lora`: many LoRA adapters in one continuous batch against the base model
alone, and against each adapter merged into its own copy of the weights.

One batch of ``--requests`` requests (random prompts of ``--prompt-len`` tokens, greedy,
exactly ``--max-tokens`` output tokens each) spread round-robin over k distinct adapters,
for each k of ``--adapters``. The adapters are random, written in PEFT format at run time
(rank ``--rank``, all seven modules q/k/v/o/gate/up/down, alpha = 2 * rank). Each k runs
back to back with the base alone (the same requests, no adapter, on the same engine),
``--reps`` pairs, so that a shared machine's noise falls on both alike; the ratio of each
pair is reported, and their median.

The one-model-per-process alternative (``--merged``, the HF folder bases only): the same
requests, each adapter's share served by its own copy of the base with W + scale * B A
merged in, one copy at a time (written, loaded, run, closed), for k in ``--merged-adapters``;
its throughput with and without the loads, and the mixed batch's ratio to it.
"""
from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import common
from ..cli_args import count

def _tokens_per_s(llm, prompts, params, loras=None) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _adapter_weights(cfg: dict, rank: int, i: int) -> dict:
    from ..testing import random_lora_weights

    return random_lora_weights(cfg, rank, seed=1000 + i)


def run(model: str, *, adapters: Sequence[int] = (1, 4, 16, 64), requests: int = 64, rank: int = 16,
        prompt_len: int = 24, max_tokens: int = 32, reps: int = 2, lora_dtype: str = "auto",
        merged_adapters: Sequence[int] = (16,), engine: Optional[Dict[str, Any]] = None,
        seed: int = 0, workdir: Optional[str] = None) -> Dict[str, Any]:
    from .. import LLM, LoRARequest, SamplingParams
    from ..testing import write_merged_lora, write_peft_adapter

    ks = sorted(set(int(k) for k in adapters))
    if not ks or ks[0] < 1 or ks[-1] > requests:
        raise ValueError(f"adapters must be in [1, requests={requests}], got {list(adapters)}")
    engine = dict(engine or {})
    cfg = common.checkpoint_config(model)
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg["vocab_size"], prompt_len).tolist()}
               for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    alpha = 2.0 * rank
    merged_ks = [k for k in sorted(set(int(k) for k in merged_adapters)) if k >= 1] if Path(model).is_dir() else []
    tmp = tempfile.TemporaryDirectory(prefix="conveyor-bench-lora-", dir=workdir)
    try:
        root = Path(tmp.name)
        reqs = []
        for i in range(ks[-1]):
            path = write_peft_adapter(root / f"a{i}", _adapter_weights(cfg, rank, i), rank=rank, alpha=alpha)
            reqs.append(LoRARequest(f"a{i}", i + 1, str(path)))
        mixed: List[Dict[str, Any]] = []
        with LLM(model, enable_lora=True, max_loras=ks[-1], max_lora_rank=rank, lora_dtype=lora_dtype,
                 skip_tokenizer_init=True, max_num_seqs=requests, enable_prefix_caching=False, **engine) as llm:
            # warm-up with the whole batch: the first run at full size faults in the KV cache's
            # pages, which would otherwise slow the first pair's base run alone
            _tokens_per_s(llm, prompts, params)
            for k in ks:
                loras = [reqs[i % k] for i in range(requests)]
                _tokens_per_s(llm, prompts[:k], params, loras[:k])  # the k adapters read and resident
                pairs = []
                for _ in range(reps):
                    base = _tokens_per_s(llm, prompts, params)
                    with_lora = _tokens_per_s(llm, prompts, params, loras)
                    pairs.append({"base_tok_s": base, "lora_tok_s": with_lora, "ratio": with_lora / base})
                mixed.append({"adapters": k, "pairs": pairs,
                              "ratio_median": statistics.median(p["ratio"] for p in pairs),
                              "lora_tok_s_median": statistics.median(p["lora_tok_s"] for p in pairs),
                              "base_tok_s_median": statistics.median(p["base_tok_s"] for p in pairs)})
            stats = llm.stats()
            lora_dtype = llm.model_config["lora_dtype"]  # "auto" resolved
        merged = []
        for k in merged_ks:
            if k > requests:
                continue
            n_tok, load_s, gen_s = 0, 0.0, 0.0
            for i in range(k):  # each merged copy serves its share of the requests, one at a time
                copy = write_merged_lora(root / f"merged{k}_{i}", model, _adapter_weights(cfg, rank, i), alpha / rank)
                t = time.perf_counter()
                with LLM(str(copy), skip_tokenizer_init=True, max_num_seqs=requests, enable_prefix_caching=False,
                         **_merged_engine(engine, cfg)) as llm:
                    t1 = time.perf_counter()
                    outs = llm.generate(prompts[i::k], params, use_tqdm=False)
                    t2 = time.perf_counter()
                load_s += t1 - t
                gen_s += t2 - t1
                n_tok += sum(len(o.outputs[0].token_ids) for o in outs)
                shutil.rmtree(copy)
                gc.collect()
            row = {"adapters": k, "tok_s": n_tok / (load_s + gen_s), "tok_s_generate_only": n_tok / gen_s,
                   "load_s": load_s}
            same = [m for m in mixed if m["adapters"] == k]
            if same:
                row["mixed_over_merged"] = same[0]["lora_tok_s_median"] / row["tok_s"]
                row["mixed_over_merged_generate_only"] = same[0]["lora_tok_s_median"] / row["tok_s_generate_only"]
            merged.append(row)
    finally:
        tmp.cleanup()
    adapter_mb = _adapter_bytes(cfg, rank, lora_dtype) / 1e6
    return {"benchmark": "lora", "machine": common.machine_info(), "model": str(model), "arch": cfg.get("arch"),
            "requests": requests, "prompt_len": prompt_len, "max_tokens": max_tokens, "rank": rank,
            "modules": "q,k,v,o,gate,up,down", "lora_dtype": lora_dtype, "adapter_mb": adapter_mb,
            "engine": {k: v for k, v in engine.items() if v is not None}, "mixed": mixed, "merged": merged,
            "merged_skipped": None if Path(model).is_dir() else "the base is not an HF folder",
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "lora_stats": {k: v for k, v in stats.items() if k.startswith("lora_")}}


def _adapter_bytes(cfg: dict, rank: int, lora_dtype: str) -> int:
    """One adapter on all seven modules, as the engine holds it."""
    dim, hid = cfg["dim"], cfg["hidden_dim"]
    q = cfg["n_heads"] * cfg["head_dim"]
    kv = cfg["n_kv_heads"] * cfg["head_dim"]
    per_layer = (dim + q) * 2 + (dim + kv) * 2 + (dim + hid) * 3
    return rank * per_layer * cfg["n_layers"] * (2 if lora_dtype == "bfloat16" else 4)


def _merged_engine(engine: Dict[str, Any], cfg: dict) -> Dict[str, Any]:
    """The base's engine settings for a merged copy, which is stored in float32: without a
    --dtype it runs in the base's own dtype, so that only the adapters differ."""
    kw = dict(engine)
    if kw.get("dtype") in (None, "auto") and cfg.get("dtype"):
        kw["dtype"] = cfg["dtype"]
    return kw


def format_result(r: Dict[str, Any]) -> str:
    lines = [f"{r['model']}: {r['requests']} requests x {r['max_tokens']} tokens (prompts of {r['prompt_len']}), "
             f"rank {r['rank']} on {r['modules']}, adapters in {r['lora_dtype']} "
             f"({r['adapter_mb']:.1f} MB each)"]
    for m in r["mixed"]:
        pairs = ", ".join(f"{p['lora_tok_s']:.1f}/{p['base_tok_s']:.1f} = {p['ratio']:.2f}" for p in m["pairs"])
        lines.append(f"{m['adapters']:3d} adapters in one batch: {m['lora_tok_s_median']:.1f} tok/s, "
                     f"{m['ratio_median']:.2f} of the base (pairs adapters/base: {pairs})")
    for m in r["merged"]:
        line = (f"{m['adapters']:3d} merged copies one at a time: {m['tok_s']:.1f} tok/s with their loads "
                f"({m['load_s']:.1f} s), {m['tok_s_generate_only']:.1f} tok/s generating only")
        if "mixed_over_merged" in m:
            line += (f"; the mixed batch is {m['mixed_over_merged']:.2f}x that "
                     f"({m['mixed_over_merged_generate_only']:.2f}x generating only)")
        lines.append(line)
    if r["merged_skipped"]:
        lines.append(f"merged copies not measured: {r['merged_skipped']}")
    if r["load_average"]:
        lines.append("load average at the end: " + ", ".join(f"{x:.2f}" for x in r["load_average"]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench lora", description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    common.add_engine_args(ap)
    ap.add_argument("--adapters", default="1,4,16,64", help="numbers of distinct adapters in the batch")
    ap.add_argument("--requests", type=count, default=64, help="requests in the batch")
    ap.add_argument("--rank", type=count, default=16, help="adapter rank")
    ap.add_argument("--prompt-len", type=count, default=24, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=count, default=32, help="output tokens per request")
    ap.add_argument("--reps", type=count, default=2, help="base/adapters pairs per number of adapters")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="how the engine holds the adapter weights")
    ap.add_argument("--merged-adapters", default="16",
                    help="numbers of adapters served as merged copies one at a time (HF folder bases; "
                         "'' for none)")
    ap.add_argument("--json", default=None, help="write the result as JSON to this file (default: none)")
    a = ap.parse_args(argv)
    model = common.resolve_model(a.model)
    engine = common.engine_kwargs(a)
    engine.pop("kv_cache_memory", None)  # the engine's own default fits one batch
    engine.pop("enable_prefix_caching", None)  # always off: the same prompts run again
    if engine.get("speculative_config") is not None:
        ap.error("--speculative-config: this benchmark measures adapters, not speculation")
    for name in ("requests", "rank", "prompt_len", "max_tokens", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        ks = common.parse_int_list(a.adapters)
        merged_ks = common.parse_int_list(a.merged_adapters)
    except ValueError as e:
        ap.error(f"--adapters / --merged-adapters: {e}")
    try:
        r = run(model, adapters=ks, requests=a.requests, rank=a.rank, prompt_len=a.prompt_len,
                max_tokens=a.max_tokens, reps=a.reps, lora_dtype=a.lora_dtype, merged_adapters=merged_ks,
                engine=engine, seed=a.seed)
    except ValueError as e:
        ap.error(str(e))
    print("conveyor bench lora: " + format_result(r), flush=True)
    if a.json:
        common.write_outputs(r, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
