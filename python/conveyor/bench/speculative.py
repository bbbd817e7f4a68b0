"""`conveyor bench speculative`: speculative decoding (n-gram, or a draft model) against
plain decoding.

Batch 1 (or ``--batch``), greedy, on input-grounded prompts: "repeat this passage"
(a built-in passage of about 300 tokens) and "rewrite this code with one change".
Two engines (plain, and with ``--speculative-config``) run the same prompts back to
back, ``--reps`` times, alternating, so that a shared machine's noise falls on both
alike. Reports output tokens/s (the decode part: the time of the same requests with
max_tokens=1, their prefill, is subtracted; prefix caching is off so that it repeats),
the ratio, the acceptance by position, and whether the text is identical.

A draft model: ``--speculative-config '{"model": PATH, "num_speculative_tokens": k}'``,
or ``--draft-layers N`` for a copy of the target cut to its first N layers (written to a
temporary folder; the mechanics on a model that has no smaller sibling). The report
then explains the speedup: tokens per verification step (1 + accepted proposals) over
the cost of a step (the target's pass over k + 1 rows, plus k draft passes, whose share
of the time is measured).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from . import common
from ..cli_args import count

PASSAGE = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He polished the great lens, "
    "trimmed the wick and wrote the weather in his log: wind from the west, a light rain, three fishing "
    "boats returning before dark. On clear nights he could see the lights of the harbour town across the "
    "bay, and he counted the ships that passed along the coast, noting their names when he could read them "
    "through his old brass telescope. In winter the storms came often, and the waves broke high against the "
    "rocks below the tower, throwing spray up to the gallery rail. Still the light turned, every night, its "
    "long white beam sweeping over the black water, and the sailors who saw it knew where the reef lay and "
    "steered wide of it. When the keeper grew old, his daughter took over the work. She had learned every "
    "task from him: how to wind the clockwork that turned the lens, how to read the barometer, how to signal "
    "the lifeboat station with the lamp. She kept the same log, in the same careful hand, and added her own "
    "notes about the birds that nested on the cliffs and the seals that rested on the rocks at low tide.")
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
PROMPTS = {
    "repeat": f"Repeat the following passage exactly, word for word.\n\nPassage:\n{PASSAGE}\n\nRepeated passage:\n",
    "edit": f"Rewrite this Python function with the variable `total` renamed to `running_sum`. "
            f"Change nothing else.\n\n{CODE}\nRewritten function:\n",
}
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _chat(llm, text: str) -> Dict[str, Any]:
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    return {"prompt": text, "prompt_token_ids": tok.encode(text)}


def _timed(llm, prompts: List[Dict[str, Any]], max_tokens: int):
    """(decode seconds, outputs, stats delta): generate minus the same requests' prefill."""
    from .. import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - t
    s0 = llm.stats()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    wall = time.perf_counter() - t
    return max(wall - prefill, 1e-9), wall, outs, s0, llm.stats()


def run(model: str, *, workload: str = "repeat", batch: int = 1, max_tokens: int = 256, reps: int = 3,
        speculative_config: Optional[dict] = None, num_threads: Optional[int] = None,
        max_model_len: Optional[int] = None) -> Dict[str, Any]:
    from .. import LLM
    from ..speculative import parse_speculative_config, spec_delta

    spec = parse_speculative_config(speculative_config or DEFAULT_SPEC)
    spec["disable_by_batch_size"] = 0  # this benchmark measures speculation itself
    kw = dict(max_model_len=max_model_len, max_num_seqs=max(batch, 1), kv_cache_sequences=max(batch, 1),
              enable_prefix_caching=False, num_threads=num_threads)
    if max_model_len is None:  # the model's own, at most 2048 (the prompts and outputs here fit)
        from .._core import Checkpoint

        with Checkpoint(model) as ck:
            kw["max_model_len"] = min(2048, int(ck.config["max_pos"]))
    plain = LLM(model, **kw)
    specd = LLM(model, speculative_config=spec, **kw)
    try:
        prompts = [_chat(plain, PROMPTS[workload])] * batch
        runs = []
        for _ in range(reps):
            row = {}
            for name, llm in (("plain", plain), ("spec", specd)):
                dec, wall, outs, s0, s1 = _timed(llm, prompts, max_tokens)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                row[name] = {"decode_tok_s": (n - batch) / dec, "e2e_tok_s": n / wall, "tokens": n,
                             "texts": [o.outputs[0].text for o in outs]}
                row[name]["steps"] = s1["steps"] - s0["steps"]
                if name == "spec":
                    row["speculative"] = spec_delta(s0, s1, spec["num_speculative_tokens"])
                    step_time = s1["time_step"] - s0["time_step"]
                    row["propose_share"] = (s1["time_propose"] - s0["time_propose"]) / max(step_time, 1e-9)
            row["ratio_decode"] = row["spec"]["decode_tok_s"] / row["plain"]["decode_tok_s"]
            row["ratio_e2e"] = row["spec"]["e2e_tok_s"] / row["plain"]["e2e_tok_s"]
            row["identical"] = row["spec"]["texts"] == row["plain"]["texts"]
            runs.append(row)
        cfg = plain.model_config
    finally:
        plain.close()
        specd.close()
    return {"benchmark": "speculative", "machine": common.machine_info(), "model": str(model),
            "arch": cfg.get("arch"), "workload": workload, "batch": batch, "max_tokens": max_tokens,
            "speculative_config": spec, "runs": runs,
            "ratio_decode_median": statistics.median(r["ratio_decode"] for r in runs),
            "ratio_e2e_median": statistics.median(r["ratio_e2e"] for r in runs),
            "identical": all(r["identical"] for r in runs)}


def format_result(r: Dict[str, Any]) -> str:
    from ..speculative import format_spec

    lines = []
    for i, run_ in enumerate(r["runs"]):
        p, s = run_["plain"], run_["spec"]
        lines.append(f"rep {i}: plain {p['decode_tok_s']:.1f} tok/s, {r['speculative_config']['method']} "
                     f"{s['decode_tok_s']:.1f} tok/s "
                     f"(decode) -> {run_['ratio_decode']:.2f}x; end to end {run_['ratio_e2e']:.2f}x; "
                     f"{s['tokens']} tokens, identical text: {run_['identical']}")
    last = r["runs"][-1]
    lines.append(format_spec(last["speculative"]))
    per_step = last["spec"]["tokens"] / max(last["spec"]["steps"], 1)
    lines.append(f"tokens per step: {per_step:.2f} with speculation, "
                 f"{last['plain']['tokens'] / max(last['plain']['steps'], 1):.2f} without; proposing took "
                 f"{last['propose_share']:.1%} of the step time")
    lines.append(f"median ratio: {r['ratio_decode_median']:.2f}x decode, {r['ratio_e2e_median']:.2f}x end to end; "
                 f"identical text in every run: {r['identical']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench speculative", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--workload", default="repeat", choices=sorted(PROMPTS), help="the kind of prompts")
    ap.add_argument("--batch", type=count, default=1, help="requests at once")
    ap.add_argument("--max-tokens", type=count, default=256, help="output tokens per request")
    ap.add_argument("--reps", type=count, default=3, help="repetitions; the fastest counts")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), metavar="JSON",
                    help="the speculative decoding compared with plain decoding")
    ap.add_argument("--draft-layers", type=int, default=None, metavar="N",
                    help="draft model: the target's first N layers (overrides the config's method; "
                         "num_speculative_tokens is kept; default: none)")
    ap.add_argument("--json", default=None, help="write the result as JSON to this file (default: none)")
    a = ap.parse_args(argv)
    if a.model is None:
        from ..models import default_model_path

        model = str(default_model_path())
    else:
        model = common.resolve_model(a.model)
    try:
        cfg = json.loads(a.speculative_config)
    except ValueError as e:
        ap.error(f"--speculative-config: {e}")
    if not isinstance(cfg, dict):
        ap.error("--speculative-config must be a JSON object")
    with tempfile.TemporaryDirectory(prefix="conveyor-draft-") as tmp:
        if a.draft_layers is not None:
            from ..testing import truncate_checkpoint

            try:
                draft = truncate_checkpoint(model, os.path.join(tmp, "draft" + os.path.splitext(model)[1]),
                                            a.draft_layers)
            except (ValueError, OSError) as e:
                ap.error(f"--draft-layers: {e}")
            cfg = {"model": str(draft), "num_speculative_tokens": cfg.get("num_speculative_tokens", 4)}
        r = run(model, workload=a.workload, batch=a.batch, max_tokens=a.max_tokens, reps=a.reps,
                speculative_config=cfg, num_threads=a.num_threads)
    print(f"conveyor bench speculative: {r['workload']}, batch {r['batch']}, greedy, up to {r['max_tokens']} "
          f"tokens, {r['speculative_config']}")
    print(format_result(r), flush=True)
    if a.json:
        common.write_outputs(r, a.json)
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
