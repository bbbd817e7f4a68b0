"""`conveyor generate`: the main job. Generates for a few prompts and prints
the outputs and the throughput. With no --model it uses the built-in default model,
SmolLM2-135M-Instruct (Q4_1 GGUF, fetched once into the cache: see
conveyor.default_model); offline, a deterministic random-weight checkpoint of
SmolLM-135M's shape (random text). Prompts go through the model's chat template
when it has one (--no-chat sends them as plain text)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_SHAPE = "smollm-135m"
DEFAULT_PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "In a small village by the sea,",
    "The best way to learn is",
]


def cache_dir() -> Path:
    base = os.environ.get("CONVEYOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "conveyor")
    return Path(base)


def default_model(shape: str = DEFAULT_SHAPE, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The built-in default checkpoint, made once and cached."""
    from .testing import write_hf_checkpoint

    path = cache_dir() / "models" / f"{shape}-random-{dtype}-seed{seed}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        print(f"conveyor: writing the default random-weight {shape} checkpoint to {path} (first use)",
              file=sys.stderr)
        write_hf_checkpoint(tmp, shape=shape, dtype=dtype, seed=seed)
        try:
            os.replace(tmp, path)
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process made it first
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="conveyor generate", description=__doc__)
    ap.add_argument("--model", help="HF checkpoint directory, .gguf file or llama2.c .bin "
                    "(default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="repeat the prompts up to this many requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                    help="quantize the weight matrices at load")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scheduling", default="continuous", choices=["continuous", "static", "priority"])
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="send each prompt as a user message through the chat template "
                         "(default: when the model has a template)")
    args = ap.parse_args(argv)

    from . import LLM, SamplingParams

    if args.model:
        model = args.model
    else:
        from .default_model import default_model_path

        model = default_model_path()
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.num_prompts:
        prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    llm = LLM(model, dtype=args.dtype, num_threads=args.num_threads, device=args.device,
              scheduling=args.scheduling, quantization=args.quantization)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    tok = llm._core.tokenizer
    chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    for p, o in list(zip(prompts, outs))[:8]:
        print(f"--- {p!r}")
        print(o.outputs[0].text)
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    cfg = llm.model_config
    print(f"\nmodel: {model}\n  {cfg['arch']} dim={cfg['dim']} layers={cfg['n_layers']} "
          f"heads={cfg['n_heads']}/{cfg['n_kv_heads']} vocab={cfg['vocab_size']}")
    print(f"{len(outs)} requests, {n_prompt} prompt + {n_gen} generated tokens in {dt:.2f} s: "
          f"{n_gen / dt:.1f} output tok/s, {(n_prompt + n_gen) / dt:.1f} total tok/s")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
