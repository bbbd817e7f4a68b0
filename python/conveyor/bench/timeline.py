"""`conveyor bench timeline`: which sequence sits in which batch slot at every step.

A small run (default: 4 slots, 10 requests with varied output lengths, stories260K) on
static and on continuous batching, recorded with the engine's own step trace: every
step lists the sequences it computed. A sequence holds one slot from the first step it
is scheduled to its last; a newly scheduled sequence takes the lowest free slot. The
plot shows both side by side (x = step, y = slot, one colour per request, hatched =
prompt prefill, grey = an idle slot while requests wait): in the static batch the
short sequences' slots idle until the longest one ends; in continuous batching a freed
slot is taken by a waiting request at the next step.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from . import common
from ..cli_args import count

DEFAULT_OUTPUT_LENS = (10, 2, 4, 7, 3, 12, 2, 5, 8, 3)


def slots_from_trace(trace, n_slots: int, order: Optional[Dict[int, int]] = None) -> Dict[str, Any]:
    """Assigns batch slots from a step trace [(step, t0, t1, internal_id, seq_index,
    n_new_tokens), ...]. order maps internal ids to request numbers (default: ids).
    Returns bars (one per sequence), the slot x step grid (request number or -1) and
    idle counts; "waiting" means not yet scheduled (every request arrives at once)."""
    order = order or {}
    seqs: Dict[tuple, Dict[str, Any]] = {}
    steps = sorted({int(e[0]) for e in trace})
    if not steps:
        return {"n_steps": 0, "n_slots": n_slots, "bars": [], "grid": [[] for _ in range(n_slots)],
                "idle_slot_steps": 0, "idle_while_waiting": 0, "utilization": 0.0}
    s0 = steps[0]
    for step, _t0, _t1, iid, idx, n_new, *_ in trace:
        key = (int(iid), int(idx))
        d = seqs.setdefault(key, {"request": order.get(int(iid), int(iid)), "seq": int(idx),
                                  "start": int(step) - s0, "end": int(step) - s0,
                                  "prefill_steps": 0, "tokens": 0, "steps": 0})
        d["end"] = max(d["end"], int(step) - s0)
        d["start"] = min(d["start"], int(step) - s0)
        d["steps"] += 1
        d["tokens"] += int(n_new)
        if int(n_new) > 1:
            d["prefill_steps"] += 1
    n_steps = steps[-1] - s0 + 1
    free_from = [0] * n_slots  # first step at which each slot is free
    bars = []
    for key in sorted(seqs, key=lambda k: (seqs[k]["start"], seqs[k]["request"], k[1])):
        d = seqs[key]
        slot = next((i for i in range(len(free_from)) if free_from[i] <= d["start"]), None)
        if slot is None:  # more at once than n_slots: should not happen, but stay honest
            free_from.append(0)
            slot = len(free_from) - 1
        free_from[slot] = d["end"] + 1
        d["slot"] = slot
        bars.append(d)
    n_rows = len(free_from)
    grid = [[-1] * n_steps for _ in range(n_rows)]
    for b in bars:
        for t in range(b["start"], b["end"] + 1):
            grid[b["slot"]][t] = b["request"]
    starts = sorted(b["start"] for b in bars)
    idle = idle_waiting = 0
    idle_cells = []
    for t in range(n_steps):
        free = sum(1 for r in range(n_rows) if grid[r][t] < 0)
        waiting = sum(1 for s in starts if s > t)
        idle += free
        w = min(free, waiting)
        idle_waiting += w
        if w:
            idle_cells.append([t, w])
    busy = sum(b["end"] - b["start"] + 1 for b in bars)
    return {"n_steps": n_steps, "n_slots": n_rows, "bars": bars, "grid": grid,
            "idle_slot_steps": idle, "idle_while_waiting": idle_waiting,
            "idle_while_waiting_steps": idle_cells,
            "utilization": busy / max(1, n_rows * n_steps)}


def record(model: str, scheduling: str, wl: common.Workload, n_slots: int, **engine) -> Dict[str, Any]:
    """Runs the workload with the step trace on and returns the slot timeline."""
    llm = common.make_llm(model, scheduling=scheduling, max_num_seqs=n_slots, workload=wl, **engine)
    try:
        res = common.run_offline(llm, wl, trace=True, sample_stats=False)
    finally:
        llm.close()
    order = {int(o.request_id): i for i, o in enumerate(res["outputs"])}
    tl = slots_from_trace(res["trace"], n_slots, order)
    tl.update(scheduling=scheduling, steps=res["steps"], wall_s=res["throughput"]["wall_s"],
              output_lens=[len(o.outputs[0].token_ids) for o in res["outputs"]])
    return tl


def run(model: Optional[str] = None, *, n_slots: int = 4, output_lens: Sequence[int] = DEFAULT_OUTPUT_LENS,
        prompt_len: int = 8, seed: int = 0, **engine) -> Dict[str, Any]:
    """Static and continuous timelines of the same requests (JSON-ready)."""
    if model is None:
        p = common.stories_path()
        model = str(p) if p is not None else common.resolve_model("tiny")
    cfg = common.checkpoint_config(model)
    wl = common.make_workload(n=len(output_lens), vocab_size=cfg["vocab_size"], prompt_len=prompt_len,
                              output_lens=list(output_lens), seed=seed)
    out = {"benchmark": "timeline", "machine": common.machine_info(),
           "model": {"path": str(model), "name": str(model).rstrip("/").split("/")[-1]},
           "knobs": {"n_slots": n_slots, "prompt_len": prompt_len, "output_lens": list(output_lens),
                     "seed": seed, **engine}}
    for sched in ("static", "continuous"):
        out[sched] = record(model, sched, wl, n_slots, **engine)
    return out


def plot(r: Dict[str, Any], fig=None):
    """Static and continuous slot timelines side by side."""
    from matplotlib.patches import Patch

    fig = fig or common.new_figure(11.0, 3.4)
    axes = fig.subplots(1, 2, sharey=True)
    x_max = max(r["static"]["n_steps"], r["continuous"]["n_steps"])
    n_req = len(r["knobs"]["output_lens"])
    cmap = _colors(n_req)
    for ax, sched in zip(axes, ("static", "continuous")):
        tl = r[sched]
        # idle slots while requests wait: grey cells
        for t, row in ((t, row) for row in range(tl["n_slots"]) for t in range(tl["n_steps"])
                       if tl["grid"][row][t] < 0):
            waiting_any = any(b["start"] > t for b in tl["bars"])
            ax.add_patch(_rect(t - 0.5, row - 0.4, 1.0, 0.8, "#d9d9d9" if waiting_any else "#f4f4f4",
                               None, edge="none"))
        for b in tl["bars"]:
            c = cmap[b["request"] % len(cmap)]
            ax.add_patch(_rect(b["start"] - 0.5, b["slot"] - 0.4, b["end"] - b["start"] + 1, 0.8, c, None))
            if b["prefill_steps"]:
                ax.add_patch(_rect(b["start"] - 0.5, b["slot"] - 0.4, b["prefill_steps"], 0.8, c, "////"))
            ax.text((b["start"] + b["end"]) / 2, b["slot"], f"R{b['request']}", ha="center",
                    va="center", fontsize=7, color="black")
        ax.set_xlim(-0.5, x_max - 0.5)
        ax.set_ylim(tl["n_slots"] - 0.5, -0.5)
        ax.set_yticks(range(tl["n_slots"]))
        ax.set_yticklabels([f"slot {i}" for i in range(tl["n_slots"])])
        ax.set_xlabel("engine step")
        ax.set_title(f"{sched} batching: {tl['n_steps']} steps, slots busy {100 * tl['utilization']:.0f}%, "
                     f"{tl['idle_while_waiting']} idle slot-steps while requests wait", fontsize=8.5)
        ax.grid(True, axis="x", alpha=0.25)
    handles = [Patch(facecolor="#d9d9d9", label="idle slot, requests waiting"),
               Patch(facecolor="#f4f4f4", edgecolor="#cccccc", label="idle slot, queue empty"),
               Patch(facecolor="white", edgecolor="black", hatch="////", label="prefill step")]
    axes[1].legend(handles=handles, fontsize=7, loc="lower right")
    lens = ", ".join(str(n) for n in r["knobs"]["output_lens"])
    fig.suptitle(f"{r['knobs']['n_slots']} slots, {n_req} requests R0..R{n_req - 1} with output lengths "
                 f"{lens} ({r['model']['name']})", fontsize=9)
    return fig


def _colors(n: int):
    from matplotlib import colormaps

    cm = colormaps["tab20"] if n > 10 else colormaps["tab10"]
    return [cm(i % cm.N) for i in range(max(n, 1))]


def _rect(x, y, w, h, color, hatch, edge="black"):
    """A filled cell, or (hatch given) an unfilled hatched overlay."""
    from matplotlib.patches import Rectangle

    if hatch is not None:
        return Rectangle((x, y), w, h, fill=False, hatch=hatch, edgecolor="black", linewidth=0.0)
    return Rectangle((x, y), w, h, facecolor=color, edgecolor=edge,
                     linewidth=0.0 if edge == "none" else 0.6)


def format_result(r: Dict[str, Any]) -> str:
    lines = []
    for sched in ("static", "continuous"):
        tl = r[sched]
        lines.append(f"{sched:<11} {tl['n_steps']:>4} steps, slots busy {100 * tl['utilization']:5.1f}%, "
                     f"idle slot-steps {tl['idle_slot_steps']}, of them while requests waited "
                     f"{tl['idle_while_waiting']}")
        for row in range(tl["n_slots"]):
            cells = "".join("." if v < 0 else _sym(v) for v in tl["grid"][row])
            lines.append(f"  slot {row}: {cells}")
    lines.append("  (one character per step: the request number 0-9/a-z, '.' = idle)")
    return "\n".join(lines)


def _sym(v: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyz"[v] if 0 <= v < 36 else "#"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench timeline", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    common.add_engine_args(ap)
    ap.add_argument("--slots", type=int, default=4, help="max_num_seqs = static batch size (default 4)")
    ap.add_argument("--output-lens", default=",".join(map(str, DEFAULT_OUTPUT_LENS)),
                    help="output length of each request (default 10,2,4,7,3,12,2,5,8,3)")
    ap.add_argument("--prompt-len", type=count, default=8, help="tokens per prompt")
    ap.add_argument("--json", default=None, help="write the timelines as JSON to this file (default: none)")
    ap.add_argument("--plot", default=None,
                    help="draw the timelines into this PNG file (needs matplotlib; default: none)")
    args = ap.parse_args(argv)
    if args.plot:
        from ..extras import require

        require("matplotlib", f"{ap.prog} --plot")  # before the run, not after it
    if args.model is None:
        p = common.stories_path()
        model = str(p) if p is not None else common.resolve_model("tiny")
    else:
        model = common.resolve_model(args.model)
    r = run(model, n_slots=args.slots, output_lens=common.parse_int_list(args.output_lens),
            prompt_len=args.prompt_len, seed=args.seed, **common.engine_kwargs(args))
    print("conveyor bench timeline")
    print(f"model {r['model']['name']}, {args.slots} slots, output lengths {args.output_lens}, "
          f"prompt {args.prompt_len} tokens, all requests at once")
    print(format_result(r), flush=True)
    common.write_outputs(r, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
