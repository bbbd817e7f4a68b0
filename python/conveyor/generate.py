"""`conveyor generate`: the main job. Generates for a few prompts and prints the
outputs, the time spent generating and the total time. With no --model it uses the
built-in default model, SmolLM2-135M-Instruct (Q4_1 GGUF, fetched once into the
cache: see conveyor.models); offline, a deterministic random-weight
checkpoint of SmolLM-135M's shape (random text). Prompts go through the model's
chat template when it has one (--no-chat sends them as plain text). The model (given
positionally or as --model) is an HF checkpoint directory, a .gguf file, a llama2.c .bin,
a built-in model name (`conveyor models` lists them) or a shape name of
conveyor.testing.SHAPES."""
from __future__ import annotations

import argparse
import sys
import time

from .cli_args import MODEL_HELP, DefaultsHelpFormatter, Parser, add_model_arguments
from .models import DEFAULT_SHAPE, default_model_path, random_checkpoint, remove_stale_partial_checkpoints, \
    resolve_model

# Questions the default model (SmolLM2-135M-Instruct, greedy) answers well; the first is
# the showcase ("The capital of Japan is Tokyo.").
DEFAULT_PROMPTS = [
    "What is the capital of Japan?",
    "What is the chemical symbol for water?",
    "What is 2 + 2?",
    "Give me three tips for staying healthy.",
]
# the random-weight checkpoint, by the name scripts and benchmarks import
default_model = random_checkpoint
__all__ = ["DEFAULT_SHAPE", "DEFAULT_PROMPTS", "build_parser", "default_model",
           "remove_stale_partial_checkpoints", "main"]


def build_parser() -> argparse.ArgumentParser:
    from .sampling_params import SamplingParams

    d = SamplingParams()
    ap = Parser(prog="conveyor generate", description=__doc__,
                                 formatter_class=DefaultsHelpFormatter)
    add_model_arguments(ap, MODEL_HELP.replace(" (default:", ", or a shape name of conveyor.testing.SHAPES "
                                                            "(random weights) (default:"))
    ap.add_argument("--prompt", action="append", default=None,
                    help="a prompt (repeat for several; default: four sample questions)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="repeat the prompts up to this many requests (default: each once)")
    g = ap.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling: keep this much mass")
    g.add_argument("--top-k", type=int, default=d.top_k, help="keep the k likeliest tokens (0: all)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeatable; not included in the output; default: none)")
    g.add_argument("--logprobs", type=int, default=None,
                   help="print each generated token's log-probability and this many alternatives "
                        "(default: none)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    e = ap.add_argument_group("engine")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype ('auto': the checkpoint's)")
    e.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                   help="quantize the weight matrices at load (default: the file's types)")
    e.add_argument("--activation-dtype", default="auto", choices=["auto", "float32"],
                   help="GEMM inputs over bf16 weights: 'auto' rounds them to bf16 where the CPU has "
                        "vdpbf16ps (AVX512_BF16); 'float32' keeps them exact")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    e.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's)")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences running at once (default: the number of completions asked for, "
                        "at most 256)")
    e.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size such as 512MiB or 2GiB (default: what --max-num-seqs "
                        "sequences of --max-model-len need, capped by a share of free memory)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} or '
                        '{"model": DRAFT_PATH, "num_speculative_tokens": 4} (default: none)')
    e.add_argument("--scheduling", default="continuous", choices=["continuous", "fcfs", "static", "priority"],
                   help="batching policy")
    o = ap.add_argument_group("output")
    o.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt as a user message through the chat template "
                        "(default: when the model has a template)")
    o.add_argument("--stream", action="store_true",
                   help="print tokens as they are generated (n=1), one prompt after the other")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is one only when stderr is a terminal)")
    return ap


def _print_logprobs(tokenizer, completion) -> None:
    _print_logprob_rows(tokenizer, completion.token_ids, completion.logprobs)


def _print_logprob_rows(tokenizer, token_ids, logprobs) -> None:
    for pos, entry in enumerate(logprobs or ()):
        chosen = token_ids[pos]
        cells = []
        for tid, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
            piece = tokenizer.decode([tid]) if tokenizer is not None else str(tid)
            mark = "*" if tid == chosen else " "
            cells.append(f"{mark}{piece!r} {lp.logprob:.3f}")
        print(f"  [{pos}] " + "  ".join(cells))


async def _stream(llm, shown: list, prompts: list, params) -> tuple[int, int]:
    """Prints the completion of each prompt as it is generated, one after the other (and,
    with logprobs, their table once it ends); returns (prompt, generated) tokens."""
    n_prompt = n_gen = 0
    for label, prompt in zip(shown, prompts):
        print(f"--- {label!r}")
        ids, lps = [], []
        async for out in llm.generate(prompt, params):
            o = out.outputs[0]
            n_gen += len(o.token_ids)
            ids += o.token_ids
            lps += o.logprobs or []
            sys.stdout.write(o.text)
            sys.stdout.flush()
            if out.finished:
                n_prompt += len(out.prompt_token_ids)
                print(f"\n[{o.finish_reason}]")
                if params.logprobs is not None:
                    _print_logprob_rows(llm.get_tokenizer(), ids, lps)
    return n_prompt, n_gen


def main(argv=None) -> int:
    t_start = time.perf_counter()
    ap = build_parser()
    args = ap.parse_args(argv)

    from . import AsyncLLM, LLM, SamplingParams

    prompts = args.prompt or DEFAULT_PROMPTS
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            ap.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
        prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    if args.stream and args.n != 1:
        ap.error("--stream prints one completion per prompt: give --n 1")
    # Everything the user typed is checked before the model is loaded.
    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, stop=args.stop, logprobs=args.logprobs, seed=args.seed,
            ignore_eos=args.ignore_eos, output_kind="delta" if args.stream else "cumulative")
        from .engine import parse_bytes

        if args.kv_cache_memory is not None:
            parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
    except (ValueError, TypeError) as exc:
        ap.error(str(exc).replace("SamplingParams.", "--").replace("_", "-"))
    try:
        from .speculative import parse_speculative_config

        parse_speculative_config(args.speculative_config)
    except (ValueError, TypeError) as exc:
        ap.error(f"--speculative-config: {exc}")
    for name in ("max_model_len", "max_num_seqs", "num_threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")

    model = default_model_path() if args.model is None else resolve_model(args.model)
    max_num_seqs = args.max_num_seqs or (1 if args.stream else min(256, len(prompts) * args.n))
    kwargs = dict(dtype=args.dtype, num_threads=args.num_threads, device=args.device,
                  scheduling=args.scheduling, max_model_len=args.max_model_len,
                  max_num_seqs=max_num_seqs, kv_cache_sequences=max_num_seqs,
                  kv_cache_memory=args.kv_cache_memory,
                  quantization=args.quantization, activation_dtype=args.activation_dtype,
                  speculative_config=args.speculative_config)
    t_load = time.perf_counter()
    if args.stream:
        import asyncio

        with AsyncLLM(model, **kwargs) as llm:
            load_s = time.perf_counter() - t_load
            cfg, st = llm.model_config, llm.stats()
            t0 = time.perf_counter()
            tok = llm.tokenizer
            inputs = list(prompts)
            if args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None)):
                texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                         for p in prompts]
                inputs = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
            n_prompt, n_gen = asyncio.run(_stream(llm, prompts, inputs, params))
            gen_s = time.perf_counter() - t0
            st_end = llm.stats()
        n_req = len(prompts)
    else:
        with LLM(model, **kwargs) as llm:
            load_s = time.perf_counter() - t_load
            cfg, st = llm.model_config, llm.stats()
            progress = not args.no_progress and sys.stderr.isatty()
            t0 = time.perf_counter()
            tok = llm.tokenizer
            if args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None)):
                outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=progress)
            else:
                outs = llm.generate(prompts, params, use_tqdm=progress)
            gen_s = time.perf_counter() - t0
            st_end = llm.stats()
            for shown, o in list(zip(prompts, outs))[:8]:
                print(f"--- {shown!r}")
                for c in o.outputs:
                    if len(o.outputs) > 1:
                        print(f"[{c.index}]", end=" ")
                    print(c.text)
                    if args.logprobs is not None:
                        _print_logprobs(llm.tokenizer, c)
            if len(outs) > 8:
                print(f"... ({len(outs) - 8} more)")
            n_gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
            n_prompt = sum(len(o.prompt_token_ids) for o in outs)
            n_req = len(outs)
    total_s = time.perf_counter() - t_start
    print(f"\nmodel: {model}\n  {cfg['arch']} dim={cfg['dim']} layers={cfg['n_layers']} "
          f"heads={cfg['n_heads']}/{cfg['n_kv_heads']} vocab={cfg['vocab_size']}")
    seqs = st["max_num_seqs"]
    print(f"  KV cache {st['kv_cache_bytes'] / 2**20:.0f} MiB: {seqs} sequence{'s' if seqs != 1 else ''} of up to "
          f"{st['max_model_len']} tokens")
    print(f"{n_req} request{'s' if n_req != 1 else ''}, {n_prompt} prompt + {n_gen} generated tokens")
    print(f"generation: {gen_s:.2f} s ({n_gen / max(gen_s, 1e-9):.1f} output tok/s, "
          f"{(n_prompt + n_gen) / max(gen_s, 1e-9):.1f} total tok/s)")
    if args.speculative_config is not None:
        from .speculative import format_spec

        print(format_spec(st_end))
    print(f"total:      {total_s:.2f} s (model load {load_s:.2f} s)")
    return 0


if __name__ == "__main__":
    from .cli import main as _cli_main

    sys.exit(_cli_main(["generate", *sys.argv[1:]]))
