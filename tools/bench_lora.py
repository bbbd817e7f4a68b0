"""Throughput of one batch of requests spread over k LoRA adapters, against the base
model alone and against the same adapters merged into their own copies of the weights
run one copy at a time (the one-model-per-process alternative), all in one run.

Random PEFT adapters (rank --rank, all seven modules) are written to a temporary folder.
The merged copies need an HF base (a folder); other bases skip that comparison.

  python tools/bench_lora.py [--model PATH] [--adapters 1,4,16] [--requests 64] [--rank 16]
                             [--max-tokens 32] [--threads N] [--lora-dtype float32|bfloat16]

Ratios compare runs of this one process; on a shared machine repeat it before trusting a
figure.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from conveyor import LLM, LoRARequest, SamplingParams, _core
from conveyor import testing as T



def timed(llm, prompts, params, loras=None) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="base model (default: a tiny random HF model)")
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lora-dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.adapters.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    model = Path(args.model) if args.model else T.write_hf_checkpoint(tmp / "base", shape="tiny")
    ck = _core.Checkpoint(str(model))
    cfg = ck.config
    ck.close()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg["vocab_size"], 24).tolist()} for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    adapters = []
    for i in range(max(ks)):
        w = T.random_lora_weights(cfg, args.rank, seed=100 + i)
        path = T.write_peft_adapter(tmp / f"a{i}", w, rank=args.rank, alpha=2 * args.rank)
        adapters.append((LoRARequest(f"a{i}", i + 1, str(path)), w))
    kw = {"num_threads": args.threads} if args.threads else {}
    print(f"model {model}, {args.requests} requests x {args.max_tokens} tokens, rank {args.rank}, all seven modules, "
          f"adapters in {args.lora_dtype}")
    with LLM(str(model), enable_lora=True, max_loras=max(ks), max_lora_rank=args.rank, lora_dtype=args.lora_dtype,
             skip_tokenizer_init=True, max_num_seqs=args.requests, **kw) as llm:
        timed(llm, prompts[:4], params)  # warm-up
        base = timed(llm, prompts, params)
        print(f"base alone: {base:.1f} tokens/s")
        for k in ks:
            loras = [adapters[i % k][0] for i in range(args.requests)]
            timed(llm, prompts[:k], params, loras[:k])  # adapters read and resident
            tps = timed(llm, prompts, params, loras)
            print(f"{k:3d} adapters in one batch: {tps:.1f} tokens/s = {tps / base:.2f} of the base")
    if model.is_dir():
        for k in ks:
            t0, n_tok = time.perf_counter(), 0
            for i in range(k):  # each merged copy serves its share of the requests, one at a time
                req, w = adapters[i]
                merged = T.write_merged_lora(tmp / f"merged{k}_{i}", model, w, 2.0)
                with LLM(str(merged), skip_tokenizer_init=True, max_num_seqs=args.requests, **kw) as llm:
                    share = prompts[i::k]
                    outs = llm.generate(share, params, use_tqdm=False)
                    n_tok += sum(len(o.outputs[0].token_ids) for o in outs)
            tps = n_tok / (time.perf_counter() - t0)
            print(f"{k:3d} merged copies one at a time (load included): {tps:.1f} tokens/s = "
                  f"{tps / base:.2f} of the base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
