"""`conveyor bench start`: how long `LLM(model)` takes and how much memory it leaves
resident, against the size of the KV cache.

The KV pool and the step scratch are anonymous mappings committed as blocks are used, so
engine start should not grow with kv_cache_memory, and the resident memory after start
should be about the weights plus the scratch. Each run is a fresh process (so RSS is that
engine's alone); the sizes alternate within each pair, and the ratio of every size's start
time to the first size's is printed pair by pair (the machine is noisy: compare ratios, not
seconds across runs). RSS comes from /proc/self/statm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import common

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import conveyor
t1 = time.perf_counter()
kw = json.loads(sys.argv[2])
llm = conveyor.LLM(sys.argv[1], **kw)
t2 = time.perf_counter()
page = os.sysconf("SC_PAGE_SIZE")
rss = int(open("/proc/self/statm").read().split()[1]) * page
stats = llm.stats()
llm.close()
print(json.dumps({"import_s": t1 - t0, "start_s": t2 - t1, "rss_bytes": rss,
                  "kv_cache_bytes": stats.get("kv_cache_bytes")}))
"""


def run_one(model: str, kv: str, threads: Optional[int]) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"kv_cache_memory": kv}
    if threads:
        kw["num_threads"] = threads
    out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(kw)], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"LLM({model!r}, kv_cache_memory={kv}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench start", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a model path or a random shape name; default: the built-in SmolLM-135M-shaped "
                         "random checkpoint")
    ap.add_argument("--kv", default="4GiB,256MiB", help="comma-separated kv_cache_memory sizes; the "
                                                         "first is the one the others are compared to")
    ap.add_argument("--pairs", type=int, default=2, help="rounds over all sizes")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--json", default=None, help="write the runs as JSON to this file (default: none)")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.kv.split(",") if s.strip()]
    if len(sizes) < 2:
        ap.error("--kv needs at least two sizes")
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    model = common.resolve_model(args.model)
    print(f"model: {model}")
    try:
        load = os.getloadavg()[0]
        print(f"load average at start: {load:.2f}")
    except OSError:
        pass
    runs: List[Dict[str, Any]] = []
    for p in range(args.pairs):
        row = {}
        for kv in sizes:
            r = run_one(model, kv, args.num_threads)
            r.update(pair=p, kv=kv)
            runs.append(r)
            row[kv] = r
            print(f"pair {p}  kv_cache_memory={kv:>8}  start {r['start_s']:7.3f} s  "
                  f"RSS {r['rss_bytes'] / 2**20:8.1f} MiB  (pool {r['kv_cache_bytes'] / 2**20:.0f} MiB)")
        base = row[sizes[0]]["start_s"]
        ratios = "  ".join(f"{kv}/{sizes[0]} {row[kv]['start_s'] / base:.2f}x" for kv in sizes[1:])
        print(f"pair {p}  start-time ratios: {sizes[0]}/{sizes[0]} 1.00x  {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
