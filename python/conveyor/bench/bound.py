"""`conveyor bench bound`: the physical bound of a workload on this machine, and with
``--measure`` the engine's time beside it as a ratio.

An ideal engine runs the workload's requests (all submitted at once) in steps: every
running sequence that has its prompt decodes one token, and the rest of the step's token
budget (``max_num_batched_tokens``) goes to prompt chunks, admitting waiting requests while
fewer than ``max_num_seqs`` run; a request leaves the step its last token is sampled; the KV
pool never runs short (nothing is preempted). A step
costs at least max(FLOPs / peak, bytes / bandwidth):

- FLOPs: 2 per weight of the layers' matrices for every token computed, 2 per weight of the
  LM head for every sequence that samples a token, and 4 per (query head, head dimension,
  key) in attention (q.k and p.v), over every layer;
- bytes: the matrices once (the layers' and the LM head, as the engine stores them; the
  embedding table's few rows not counted) plus the keys and values of every sequence in the
  step, its whole context, at the KV cache's bytes per token;
- a sliding-window layer (Gemma 3's local ones) attends to and reads only its window;
- peak: the measured peak of the instruction the model's GEMMs run on (int8 dot products
  for quantized matrices, vdpbf16ps for bf16 where the CPU has it, else fp32 FMAs); the
  bandwidth: the measured read bandwidth of one large array. Both are measured in the
  same run, since they move between runs on a shared VM.

The bound of the workload is the sum over its steps. Workloads: ``study`` (N requests of P
random tokens, outputs from the study's capped exponential with a seed, as ``bench study``
draws them), ``decode`` (batch 1), ``running`` (64 sequences decoding together) and
``prefill`` (long prompts, one output token each).
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .workloads import make_study_workload
from ..cli_args import count

# Bytes per weight of each matrix dtype as the CPU engine stores it: the float dtypes as
# they are; Q8_0 and Q4_1 at GGUF's bytes a block of 32, and Q4_0 at Q4_1's where the
# quantized GEMMs pack 16-row panels (AVX512-VNNI: a min slot for every 4-bit format; its
# own 18 bytes elsewhere, bytes_per_weight); the formats the kernels compute in a
# repacking (cv_quant_compute_type): Q4_K as Q4_F (two float32 and 16 bytes a block of 32),
# Q5_0 as Q8_0, Q5_1, Q3_K, Q5_K and Q6_K as Q8_F (three float32 and 32 bytes); Q2_K as the
# file's 84 bytes a super-block of 256.
STORED_BYTES_PER_WEIGHT: Dict[str, float] = {
    "float32": 4.0, "bfloat16": 2.0, "float16": 2.0,
    "q8_0": 34 / 32, "q4_0": 20 / 32, "q4_1": 20 / 32, "q5_0": 34 / 32,
    "q4_k": 24 / 32, "q5_1": 44 / 32, "q3_k": 44 / 32, "q5_k": 44 / 32, "q6_k": 44 / 32,
    "q2_k": 84 / 256,
}
QUANTIZED = {k for k in STORED_BYTES_PER_WEIGHT if k.startswith("q")}
WORKLOADS = ("study", "decode", "running", "prefill")


# ----------------------------------------------------------------------------- the model's costs


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model costs per token, per sample and per key."""
    layer_weights: int         # weights of all layers' matrices (q, k, v, o, gate, up, down)
    lm_head_weights: int       # vocab x dim
    weight_bytes: float        # bytes a step reads of the weights (matrices, LM head, norms)
    kv_bytes_per_token: int    # keys and values of one token over all layers
    attn_flops_per_key: int    # 4 x layers x query heads x head dim
    n_layers: int = 1
    local_layers: int = 0      # sliding-window layers: they attend to the window only

    def _split(self, full: int, local: int) -> float:
        """A per-layer count summed over the layers: the full ones see ``full``, the local ones ``local``."""
        return ((self.n_layers - self.local_layers) * full + self.local_layers * local) / self.n_layers

    def step_flops(self, tokens: int, samples: int, attended: int, attended_local: Optional[int] = None) -> float:
        keys = self._split(attended, attended if attended_local is None else attended_local)
        return 2.0 * self.layer_weights * tokens + 2.0 * self.lm_head_weights * samples \
            + float(self.attn_flops_per_key) * keys

    def step_bytes(self, kv_tokens: int, kv_local: Optional[int] = None) -> float:
        kv = self._split(kv_tokens, kv_tokens if kv_local is None else kv_local)
        return self.weight_bytes + float(self.kv_bytes_per_token) * kv


def matrix_shapes(cfg: Dict[str, Any]) -> List[tuple]:
    """(rows, cols) of one layer's matrices as the engine stacks them: qkv, o, gate_up, down."""
    dim, hidden, hd = int(cfg["dim"]), int(cfg["hidden_dim"]), int(cfg["head_dim"])
    q, kv = int(cfg["n_heads"]) * hd, int(cfg["n_kv_heads"]) * hd
    return [(q + 2 * kv, dim), (dim, q), (2 * hidden, dim), (dim, hidden)]


def bytes_per_weight(dtype: str) -> float:
    if dtype not in STORED_BYTES_PER_WEIGHT:
        raise ValueError(f"unknown weight dtype {dtype!r}; known: {', '.join(STORED_BYTES_PER_WEIGHT)}")
    if dtype == "q4_0" and not _panels():
        return 18 / 32  # the row layout keeps GGUF's blocks
    return STORED_BYTES_PER_WEIGHT[dtype]


def _panels() -> bool:
    """True when this process's quantized GEMMs pack 16-row panels (the CPU backend's level)."""
    from .. import _core

    return _core.kernel_info().get("quant_level") == "avx512vnni"


# bytes per weight of an embedding table (which keeps a file's or quantization='s blocks as
# they are) -> its dtype
_TABLE_DTYPES = {4.0: "float32", 2.0: "bfloat16", 34 / 32: "q8_0", 18 / 32: "q4_0", 20 / 32: "q4_1"}


def lm_head_bytes_per_weight(cfg: Dict[str, Any]) -> float:
    """The LM head is the embedding's dtype (tied, or quantized alike) stored as a matrix:
    the engine's ``lm_head_dtype`` where it reports one, else told by ``embed_bytes``."""
    if cfg.get("lm_head_dtype") in STORED_BYTES_PER_WEIGHT:
        return bytes_per_weight(cfg["lm_head_dtype"])
    if not cfg.get("embed_bytes"):
        return bytes_per_weight(cfg["matrix_dtype"])
    per = cfg["embed_bytes"] / (int(cfg["vocab_size"]) * int(cfg["dim"]))
    dtype = next((d for b, d in _TABLE_DTYPES.items() if abs(b - per) < 1e-9), None)
    return bytes_per_weight(dtype) if dtype else per


def model_cost(cfg: Dict[str, Any], kv_bytes_per_token: int) -> ModelCost:
    """The costs of a model from its config (an engine's ``model_config``). Each layer
    matrix is held at ``matrix_dtype``, except one whose rows do not split into blocks of
    32 (its input size not a multiple of 32), which a quantized model keeps at its float
    ``compute_dtype``; the LM head at the embedding's dtype (from ``embed_bytes``); the
    norm vectors in float32. A file that mixes matrix dtypes (a GGUF "mixed ..."
    dtype), or whose matrix dtype has no entry in STORED_BYTES_PER_WEIGHT, is counted from
    the engine's own byte count (``weight_bytes`` less the embedding), which follows each
    tensor's dtype."""
    n_layers, dim = int(cfg["n_layers"]), int(cfg["dim"])
    shapes = matrix_shapes(cfg)
    layers = n_layers * sum(r * c for r, c in shapes)
    head = int(cfg["vocab_size"]) * dim
    mixed = str(cfg.get("dtype", "")).startswith("mixed") or cfg["matrix_dtype"] not in STORED_BYTES_PER_WEIGHT
    if mixed and "weight_bytes" in cfg and "embed_bytes" in cfg:
        weight_bytes = float(cfg["weight_bytes"] - cfg["embed_bytes"])
    else:
        quant, plain = cfg["matrix_dtype"], cfg.get("compute_dtype", cfg["matrix_dtype"])
        per_layer = sum(r * c * bytes_per_weight(quant if c % 32 == 0 or quant not in QUANTIZED else plain)
                        for r, c in shapes)
        head_bytes = head * lm_head_bytes_per_weight(cfg)
        weight_bytes = n_layers * per_layer + head_bytes + 4.0 * dim * (2 * n_layers + 1)
    attn = 4 * n_layers * int(cfg["n_heads"]) * int(cfg["head_dim"])
    window, period = int(cfg.get("sliding_window") or 0), int(cfg.get("sliding_window_period") or 0)
    local = sum((l + 1) % period != 0 for l in range(n_layers)) if window > 0 and period > 0 else 0
    return ModelCost(layers, head, weight_bytes, int(kv_bytes_per_token), attn, n_layers, local)


def peak_kind(matrix_dtype: str, bf16_dot_native: bool = True) -> str:
    """The measured peak (bench kernels' compute_peaks) the model's GEMMs are bound by."""
    if matrix_dtype in QUANTIZED:
        return "int8_dot"
    if matrix_dtype == "bfloat16" and bf16_dot_native:
        return "bf16_dot"
    return "fp32_fma"


# ----------------------------------------------------------------------------- the ideal engine's steps


@dataclass(frozen=True)
class Step:
    tokens: int          # tokens computed (decodes and prompt chunks)
    samples: int         # sequences that sample a token (decodes and prompts completed)
    attended: int        # keys attended, summed over the tokens computed
    kv_tokens: int       # tokens of KV read: every sequence in the step, its whole context
    running: int         # sequences in the step
    attended_local: int  # the same two in a sliding-window layer (equal without a window)
    kv_local: int


def keys_seen(start: int, n: int, window: Optional[int] = None) -> tuple:
    """Positions start .. start+n-1 of one sequence computed in one step: (keys attended,
    summed over the n queries; distinct keys read), where a query at position p sees keys
    0..p, or only the last ``window`` of them."""
    lo, hi = start + 1, start + n  # keys seen by the first and the last query
    if window is None or hi <= window:
        return (lo + hi) * n // 2, hi
    attended = n * window if lo > window else (lo + window) * (window - lo + 1) // 2 + (hi - window) * window
    return attended, min(hi, n + window - 1)


def ideal_steps(prompt_lens: Sequence[int], output_lens: Sequence[int], *, budget: int,
                max_seqs: int, window: Optional[int] = None) -> List[Step]:
    """The steps an ideal engine runs for requests all submitted at once (module doc);
    ``window``: the sliding window of a model's local layers."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths against {len(output_lens)} output lengths")
    if budget < 1 or max_seqs < 1:
        raise ValueError(f"budget and max_seqs must be >= 1, got {budget} and {max_seqs}")
    if any(int(p) < 1 for p in prompt_lens) or any(int(o) < 1 for o in output_lens):
        raise ValueError("every prompt and output length must be >= 1")
    prompt = [int(p) for p in prompt_lens]
    out = [int(o) for o in output_lens]
    done = [0] * len(prompt)      # prompt tokens computed
    made = [0] * len(prompt)      # output tokens sampled
    waiting, running = deque(range(len(prompt))), []
    steps: List[Step] = []
    while waiting or running:
        left = budget
        tokens = samples = attended = kv = attended_local = kv_local = 0
        in_step = set()

        def compute(start: int, n: int) -> None:
            nonlocal attended, kv, attended_local, kv_local
            a, k = keys_seen(start, n)
            al, kl = keys_seen(start, n, window)
            attended, kv, attended_local, kv_local = attended + a, kv + k, attended_local + al, kv_local + kl

        for i in running:  # decodes first
            if done[i] == prompt[i] and left > 0:
                compute(prompt[i] + made[i] - 1, 1)  # the last sampled token joins the cache
                tokens, samples, left = tokens + 1, samples + 1, left - 1
                made[i] += 1
                in_step.add(i)
        while left > 0:  # then prompt chunks: the running ones, then admitted requests
            i = next((j for j in running if done[j] < prompt[j]), None)
            if i is None:
                if not waiting or len(running) >= max_seqs:
                    break
                i = waiting.popleft()
                running.append(i)
            c = min(left, prompt[i] - done[i])
            compute(done[i], c)
            tokens, left = tokens + c, left - c
            done[i] += c
            if done[i] == prompt[i]:
                samples += 1
                made[i] = 1
            in_step.add(i)
        steps.append(Step(tokens, samples, attended, kv, len(in_step), attended_local, kv_local))
        running = [i for i in running if made[i] < out[i]]
    return steps


def bound_seconds(steps: Sequence[Step], cost: ModelCost, peak_gops: float, read_gbs: float) -> Dict[str, float]:
    """The bound of a step sequence: seconds in all, and the shares of steps and seconds
    where the bytes (not the FLOPs) decide."""
    if peak_gops <= 0 or read_gbs <= 0:
        raise ValueError(f"peak and bandwidth must be positive, got {peak_gops} GOP/s and {read_gbs} GB/s")
    total = mem_s = flops = nbytes = 0.0
    mem_steps = 0
    for s in steps:
        f = cost.step_flops(s.tokens, s.samples, s.attended, s.attended_local)
        b = cost.step_bytes(s.kv_tokens, s.kv_local)
        tc, tm = f / (peak_gops * 1e9), b / (read_gbs * 1e9)
        total += max(tc, tm)
        flops += f
        nbytes += b
        if tm >= tc:
            mem_steps += 1
            mem_s += tm
    return {"seconds": total, "steps": len(steps), "flops": flops, "bytes": nbytes,
            "memory_bound_steps": mem_steps, "memory_bound_share": mem_s / total if total else 0.0}


# ----------------------------------------------------------------------------- workloads


@dataclass
class WorkloadSpec:
    name: str
    prompt_lens: List[int]
    output_lens: List[int]
    describe: str


def workload_specs(names: Sequence[str], vocab_size: int, *, num_requests: int = 128, prompt_len: int = 128,
                   mean_output: int = 128, cap: int = 512, seed: int = 0, decode_tokens: int = 128,
                   n_running: int = 64, running_tokens: int = 64, prefill_len: int = 512,
                   n_prefill: int = 4) -> List[WorkloadSpec]:
    out = []
    for name in names:
        if name == "study":
            wl = make_study_workload(vocab_size=vocab_size, num_requests=num_requests, prompt_len=prompt_len,
                                   mean_output=mean_output, cap=cap, seed=seed)
            out.append(WorkloadSpec(name, [prompt_len] * num_requests, list(wl.output_lens),
                                    f"{num_requests} x prompt {prompt_len}, outputs exponential mean "
                                    f"{mean_output} cap {cap}, seed {seed}"))
        elif name == "decode":
            out.append(WorkloadSpec(name, [32], [decode_tokens], f"batch 1, prompt 32, {decode_tokens} out"))
        elif name == "running":
            out.append(WorkloadSpec(name, [16] * n_running, [running_tokens] * n_running,
                                    f"{n_running} running, prompt 16, {running_tokens} out"))
        elif name == "prefill":
            out.append(WorkloadSpec(name, [prefill_len] * n_prefill, [1] * n_prefill,
                                    f"{n_prefill} x prompt {prefill_len}, 1 out"))
        else:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return out


# ----------------------------------------------------------------------------- the machine


def measure_machine(threads: int = 0) -> Dict[str, Any]:
    """The peaks (bench kernels' compute_peaks) and the read bandwidth, now."""
    from .peaks import compute_peaks

    return {"read_gbs": measure_read_bw(threads), "peaks": compute_peaks(threads)}


def measure_read_bw(threads: int = 0) -> float:
    """The read bandwidth now, GB/s (bench kernels' measure_read_bw)."""
    from .peaks import measure_read_bw as read_bw

    return read_bw(threads)


def merge_machine(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """The better of two measurements of each figure (load only ever lowers them)."""
    from .peaks import merge_peaks

    return {"read_gbs": max(a["read_gbs"], b["read_gbs"]), "peaks": merge_peaks(a["peaks"], b["peaks"])}


def workload_bound(cfg: Dict[str, Any], kv_bytes_per_token: int, prompt_lens, output_lens, *, budget: int,
                   max_seqs: int, machine: Dict[str, Any], activation_dtype: str = "auto") -> Dict[str, Any]:
    """The bound of one workload on a model (its engine's model_config) and a machine."""
    bf16_native = "widened" not in machine["peaks"]["bf16_dot"]["instruction"] and activation_dtype != "float32"
    kind = peak_kind(cfg["matrix_dtype"], bf16_native)
    cost = model_cost(cfg, kv_bytes_per_token)
    steps = ideal_steps(prompt_lens, output_lens, budget=budget, max_seqs=max_seqs,
                        window=int(cfg["sliding_window"]) if cost.local_layers else None)
    peak = machine["peaks"][kind]["all_gops"]
    b = bound_seconds(steps, cost, peak, machine["read_gbs"])
    b.update(peak_kind=kind, peak_gops=peak, read_gbs=machine["read_gbs"], weight_bytes=cost.weight_bytes,
             output_tokens=int(sum(output_lens)), prompt_tokens=int(sum(prompt_lens)))
    return b


def engine_bound(llm, model: str, prompt_lens, output_lens, machine: Dict[str, Any], *, max_seqs: int,
                 activation_dtype: str = "auto") -> Dict[str, Any]:
    """workload_bound with a live engine of ``model``: its model config (and the
    checkpoint's sliding window), KV cache dtype and token budget."""
    from .. import _core

    cfg = dict(llm.model_config)
    if "sliding_window" not in cfg:
        ck = common.checkpoint_config(model)
        cfg.update({k: ck.get(k, 0) for k in ("sliding_window", "sliding_window_period")})
    st = llm.stats()
    kv = _core.kv_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"], cfg["kv_cache_dtype"])
    return workload_bound(cfg, kv, prompt_lens, output_lens, budget=int(st["max_num_batched_tokens"]),
                          max_seqs=max_seqs, machine=machine, activation_dtype=activation_dtype)


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.2f} ms"


def ratio_line(label: str, bound: Dict[str, Any], wall_s: Optional[float], prompt_rate: bool = False) -> str:
    """One line: the bound (and the measured time, and bound / measured: the fraction of
    the bound reached). prompt_rate: rates in prompt tokens/s (a prefill workload)."""
    n, unit = (bound["prompt_tokens"], "prompt tok/s") if prompt_rate else (bound["output_tokens"], "out tok/s")
    text = (f"{label}: bound {_seconds(bound['seconds'])} ({n / bound['seconds']:.1f} {unit}; "
            f"{bound['steps']} steps, {100 * bound['memory_bound_share']:.0f}% of the time bandwidth-bound; "
            f"{bound['peak_kind']} peak {bound['peak_gops']:.0f} GOP/s, read {bound['read_gbs']:.1f} GB/s)")
    if wall_s is not None:
        text += (f"; measured {_seconds(wall_s)} ({n / wall_s:.1f} {unit}) -> "
                 f"{bound['seconds'] / wall_s:.2f} of the bound")
    return text


def add_study_bounds(r: Dict[str, Any], threads: Optional[int] = None) -> None:
    """`bench study --bound`: the bound of each cap's workload (drawn again from the same
    seed), measured on this machine now, printed beside every system's wall time as the
    fraction reached, and stored in each row of ``r`` under "bound"."""
    from .. import LLM

    k, m = r["knobs"], r["model"]
    machine = measure_machine(threads or r.get("threads") or 0)
    kv = m["dtype"] if m["dtype"] in ("float32", "bfloat16", "float16") else "auto"  # as the study's engines
    engine = dict(dtype=m["dtype"], kv_cache_dtype=kv, block_size=k["block_size"],
                  num_threads=threads or r.get("threads"), kv_cache_memory="16MiB", enable_prefix_caching=False)
    with LLM(m["path"], max_num_seqs=256, skip_tokenizer_init=True, **engine) as llm:
        for row in r["rows"]:
            wl = make_study_workload(vocab_size=m["vocab_size"], num_requests=k["num_requests"],
                                   prompt_len=k["prompt_len"], mean_output=k["mean_output"], cap=row["cap"],
                                   seed=k["seed"])
            b = engine_bound(llm, m["path"], [len(p) for p in wl.prompts], wl.output_lens, machine, max_seqs=256)
            row["bound"] = b
            print(ratio_line(f"cap {row['cap']}", b, None))
            for s, res in row["systems"].items():
                frac = res["fraction_of_bound"] = b["seconds"] / res["wall_s"]
                print(f"  {s:<20} measured {_seconds(res['wall_s'])} -> {frac:.2f} of the bound")


# ----------------------------------------------------------------------------- the command


def run(model: str, workloads: Sequence[WorkloadSpec], *, measure: bool = False, threads: Optional[int] = None,
        max_num_seqs: int = 256, max_num_batched_tokens: Optional[int] = None, repeats: int = 1,
        **engine) -> Dict[str, Any]:
    """Every workload's bound (and with ``measure`` its wall time on the engine, in this
    process, after an untimed warm-up of the same engine: the best of ``repeats`` runs, as
    the bandwidth and peaks are the best of theirs, since load only ever slows a run).
    With ``repeats`` > 1 each run is also set against the bound at the read bandwidth
    measured just before and after it (``run_fractions``, their median
    ``paired_fraction_of_bound``). JSON-ready."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    machine = measure_machine(threads or 0)
    kv_mem = max(common.kv_bytes_for(model, w.prompt_lens, w.output_lens) for w in workloads)  # one at a time
    llm = common.make_llm(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          kv_cache_memory=kv_mem, num_threads=threads, enable_prefix_caching=False, **engine)
    rows = []
    try:
        cfg = dict(llm.model_config)
        if measure:  # first touch of pages and thread start-up, untimed
            common.run_offline(llm, common.make_workload(n=4, vocab_size=cfg["vocab_size"], prompt_lens=[16] * 4,
                                                         output_lens=[4] * 4, seed=12345), sample_stats=False)
        for i, w in enumerate(workloads):
            row: Dict[str, Any] = {"workload": w.name, "describe": w.describe}
            wall = None
            if measure:
                wl = common.make_workload(n=len(w.prompt_lens), vocab_size=cfg["vocab_size"],
                                          prompt_lens=w.prompt_lens, output_lens=w.output_lens, seed=100 + i)
                walls, run_gbs = [], []
                for _ in range(repeats):
                    before = measure_read_bw(threads or 0) if repeats > 1 else None
                    t = time.perf_counter()
                    res = common.run_offline(llm, wl, sample_stats=False, temperature=0.0)
                    walls.append(time.perf_counter() - t)
                    if before is not None:
                        run_gbs.append((before + measure_read_bw(threads or 0)) / 2)
                wall = min(walls)
                row.update(wall_s=wall, walls_s=walls, engine_steps=res["steps"], preemptions=res["preemptions"])
                if run_gbs:
                    row["run_read_gbs"] = run_gbs
            rows.append((w, row))
        if measure:
            machine = merge_machine(machine, measure_machine(threads or 0))
        for w, row in rows:
            row["bound"] = engine_bound(llm, model, w.prompt_lens, w.output_lens, machine, max_seqs=max_num_seqs)
            if row.get("wall_s"):
                row["fraction_of_bound"] = row["bound"]["seconds"] / row["wall_s"]
            if row.get("run_read_gbs"):  # each run against the bandwidth measured around it
                row["run_fractions"] = [
                    engine_bound(llm, model, w.prompt_lens, w.output_lens, {**machine, "read_gbs": gbs},
                                 max_seqs=max_num_seqs)["seconds"] / wall
                    for gbs, wall in zip(row["run_read_gbs"], row["walls_s"])]
                row["paired_fraction_of_bound"] = statistics.median(row["run_fractions"])
        model_desc = common.model_info(llm, model)
        model_desc["embed_bytes"] = cfg.get("embed_bytes")
    finally:
        llm.close()
    return {"benchmark": "bound", "model": model_desc, "machine": common.machine_info(), "measured": machine,
            "rows": [row for _, row in rows]}


def format_result(r: Dict[str, Any]) -> str:
    m, meas = r["model"], r["measured"]
    lines = [f"model: {m['name']} ({m.get('n_layers')} layers, dim {m.get('dim')}, vocab {m.get('vocab_size')}; "
             f"{m.get('matrix_dtype')} matrices, {m.get('kv_cache_dtype')} KV)",
             f"measured: read bandwidth {meas['read_gbs']:.1f} GB/s; peaks " +
             ", ".join(f"{k} {p['all_gops']:.0f}" for k, p in meas["peaks"].items()) + " GOP/s"]
    for row in r["rows"]:
        lines.append(ratio_line(f"{row['workload']} ({row['describe']})", row["bound"], row.get("wall_s"),
                                prompt_rate=row["workload"] == "prefill"))
        if len(row.get("walls_s") or ()) > 1:
            lines.append(f"  best of {len(row['walls_s'])} runs: " + ", ".join(_seconds(w) for w in row["walls_s"]))
        if row.get("run_fractions"):
            lines.append("  each run against the read bandwidth measured around it: " + ", ".join(
                f"{f:.2f} ({g:.1f} GB/s)" for f, g in zip(row["run_fractions"], row["run_read_gbs"])) +
                f" -> median {row['paired_fraction_of_bound']:.2f} of the bound")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import DefaultsHelpFormatter, Parser

    ap = Parser(prog="conveyor bench bound", description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in SmolLM-135M-shaped random one)")
    ap.add_argument("--workload", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--measure", action="store_true", help="also run each workload on the engine and print the ratio")
    ap.add_argument("--dtype", default="auto", help="weight dtype of the float matrices (auto: the checkpoint's)")
    ap.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1"],
                    help="quantize the float matrices at load (default: none)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, float32, bfloat16, float16 or int8")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--max-num-seqs", type=count, default=256, help="sequences running at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens computed in one step (default: the engine's)")
    ap.add_argument("--num-requests", type=count, default=128, help="study: requests")
    ap.add_argument("--prompt-len", type=count, default=128, help="study: prompt tokens")
    ap.add_argument("--mean-output", type=count, default=128, help="study: mean output length")
    ap.add_argument("--cap", type=count, default=512, help="study: longest output")
    ap.add_argument("--seed", type=int, default=0, help="study: workload seed")
    ap.add_argument("--decode-tokens", type=count, default=128, help="decode: output tokens at batch 1")
    ap.add_argument("--running", type=count, default=64, help="running: sequences decoding together")
    ap.add_argument("--running-tokens", type=count, default=64, help="running: output tokens each")
    ap.add_argument("--prefill-len", type=count, default=512, help="prefill: tokens per prompt")
    ap.add_argument("--num-prefill", type=count, default=4, help="prefill: prompts")
    ap.add_argument("--repeats", type=count, default=1,
                    help="with --measure: runs of each workload, the best one compared with the bound (the "
                         "bandwidth and peaks are the best of their runs too); with 2 or more, each run is "
                         "also compared with the bound at the read bandwidth measured just before and after "
                         "it (this VM's bandwidth moves with its neighbours' load), and the median printed")
    ap.add_argument("--json", default=None, help="write the result as JSON to this file (default: none)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    names = [s for s in a.workload.split(",") if s]
    if not names:
        ap.error(f"--workload names no workload; choose from {','.join(WORKLOADS)}")
    model = common.resolve_model(a.model)
    try:
        specs = workload_specs(names, common.checkpoint_config(model)["vocab_size"], num_requests=a.num_requests,
                               prompt_len=a.prompt_len, mean_output=a.mean_output, cap=a.cap, seed=a.seed,
                               decode_tokens=a.decode_tokens, n_running=a.running, running_tokens=a.running_tokens,
                               prefill_len=a.prefill_len, n_prefill=a.num_prefill)
    except ValueError as e:
        ap.error(str(e))
    engine = dict(dtype=a.dtype, quantization=a.quantization)
    if a.kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = a.kv_cache_dtype
    r = run(model, specs, measure=a.measure, threads=a.num_threads, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, repeats=a.repeats, **engine)
    print("conveyor bench bound")
    print(format_result(r), flush=True)
    if a.json:
        common.write_json(a.json, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
