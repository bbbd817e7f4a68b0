"""Naive static batching as HF transformers does it: the study's baseline.

Requests are cut, in submission order, into batches of ``batch_size``; each batch is
left-padded to its longest prompt and run with one ``model.generate()`` call, greedy,
until its longest member has all its tokens (``max_new_tokens`` = the batch's longest
output, EOS ignored so every row runs that long). A request's result is ready when its
batch ends; only its own first ``output_len`` tokens count as output, never the tokens
its row went on computing for the batch's longest member, nor the padding.

Needs torch and transformers (the ``peers`` extra); imported only by the code that runs
the baseline, so the rest of the package never needs them.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_TORCH_DTYPES = ("float32", "float16", "bfloat16")


def _torch_dtype(torch, name: str):
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_model(model_dir: str, *, dtype: str, device: str = "cpu"):
    """The HF model in ``dtype`` on ``device``, in eval mode: a HF folder, or a .gguf file
    (transformers dequantizes its weights at load; needs the gguf package)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    td = _torch_dtype(torch, dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": td}  # renamed in 4.56
    path = Path(model_dir)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    return model.to(device=device, dtype=td).eval()


def _cache_bytes(cache) -> Optional[int]:
    """Bytes held by the keys and values of a returned HF cache (None if unknown)."""
    tensors = []
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.54: one object per layer
        for layer in layers:
            tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    elif hasattr(cache, "key_cache"):
        tensors = list(cache.key_cache) + list(cache.value_cache)
    elif isinstance(cache, (tuple, list)):  # legacy tuple of (k, v) per layer
        tensors = [t for kv in cache for t in kv]
    tensors = [t for t in tensors if t is not None and hasattr(t, "numel")]
    if not tensors:
        return None
    return int(sum(t.numel() * t.element_size() for t in tensors))


def run_static(model, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], *,
               batch_size: int, device: str = "cpu", pad_token_id: int = 0,
               return_tokens: bool = False) -> Dict[str, Any]:
    """Runs every request (all submitted at time 0) in static batches; returns output
    token counts, per-request E2E latency (the end of its batch), forward passes per
    batch (counted by a hook on the model), each batch's generated width and the peak
    KV cache bytes, and with ``return_tokens`` every request's own token ids."""
    import torch
    from transformers import GenerationConfig

    if len(prompts) != len(output_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(output_lens)} output lengths")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        if len(p) == 0:
            raise ValueError(f"request {i} has an empty prompt")
        if int(n) < 1:
            raise ValueError(f"request {i} has output length {n}; it must be >= 1")

    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    # generate() fills what the passed config leaves unset from the model's own
    # generation config; clear its EOS so no row can stop (or be forced) early.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    tokens: List[Optional[List[int]]] = [None] * len(prompts)
    own = [0] * len(prompts)  # each request's own tokens, as generated
    e2e = [0.0] * len(prompts)
    batches = []
    kv_peak = None
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                idx = list(range(start, min(start + batch_size, len(prompts))))
                width = max(len(prompts[i]) for i in idx)
                ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):  # left padding: the prompt ends at the last column
                    p = torch.as_tensor(list(prompts[i]), dtype=torch.long)
                    ids[row, width - len(p):] = p
                    mask[row, width - len(p):] = 1
                longest = max(int(output_lens[i]) for i in idx)
                # eos_token_id None: no row stops early (EOS ignored, not suppressed, as
                # the other systems' ignore_eos); every row runs to the longest member.
                cfg = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest,
                                       do_sample=False, num_beams=1, eos_token_id=None,
                                       pad_token_id=pad_token_id, bos_token_id=None,
                                       return_dict_in_generate=True, use_cache=True)
                before = forwards[0]
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     generation_config=cfg)
                sync()
                t = time.perf_counter() - t0
                gen = out.sequences[:, width:].cpu()
                kv = _cache_bytes(getattr(out, "cache", None) or getattr(out, "past_key_values", None))
                if kv is not None:
                    kv_peak = max(kv_peak or 0, kv)
                del out
                batches.append({"requests": len(idx), "prompt_width": width, "longest_output": longest,
                                "generated_width": int(gen.shape[1]), "forwards": forwards[0] - before,
                                "kv_cache_bytes": kv})
                for row, i in enumerate(idx):
                    e2e[i] = t
                    own[i] = min(int(output_lens[i]), int(gen.shape[1]))
                    if return_tokens:
                        tokens[i] = gen[row, :int(output_lens[i])].tolist()
    finally:
        hook.remove()
        model.generation_config.eos_token_id = saved_eos
    wall = time.perf_counter() - t0
    res: Dict[str, Any] = {
        "wall_s": wall,
        "output_tokens": int(sum(own)),  # each request's own tokens only
        "own_tokens": own,
        "computed_output_tokens": int(sum(b["requests"] * b["generated_width"] for b in batches)),
        "e2e_s": e2e,
        "steps": int(sum(b["forwards"] for b in batches)),
        "batches": batches,
        "kv_bytes_peak": kv_peak,
    }
    if return_tokens:
        res["tokens"] = tokens
    return res
